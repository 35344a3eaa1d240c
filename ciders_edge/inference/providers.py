"""ONNX Runtime execution providers: the profile asks, the installed onnxruntime decides."""

from __future__ import annotations

from ciders_edge.progress import console

__all__ = ["resolve_providers"]

CPU = "CPUExecutionProvider"


def resolve_providers(requested: list[str], available: list[str] | None = None) -> list[str]:
    """``requested`` in order, without those this onnxruntime lacks (one notice each), CPU last.

    Jetson and CUDA profiles ask for TensorRT/CUDA; a CPU-only onnxruntime (the only aarch64 wheel
    on PyPI) then runs on CPU instead of failing.
    """
    if available is None:
        import onnxruntime

        available = onnxruntime.get_available_providers()
    chosen = []
    for name in requested:
        if name in available:
            chosen.append(name)
        else:
            console.print(
                f"[yellow]notice:[/] {name} is not in this onnxruntime; skipped (CPU is the fallback)", soft_wrap=True
            )
    if CPU not in chosen:
        chosen.append(CPU)
    return chosen
