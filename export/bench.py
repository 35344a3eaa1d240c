"""``ciders-edge bench``: the personalized model's runtimes measured side by side on this device.

Each runtime runs in its own process (so its peak memory is its own) on the same chat prompt,
decoding the same number of tokens; the processes take turns, one generation each, and figures are
medians over ``repeats`` turns after a warm-up, so the ratios are measured side by side.
ONNX and GenAI runtimes are exported first (or reused from ``exports``) with :func:`export_model`, the same
code as ``ciders-edge export``. The training step is the real edge update (``local_round``) on
synthetic full-length batches of the profile's shape.
"""

from __future__ import annotations

import json
import multiprocessing
import random
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from ciders_edge.config import check_limit
from ciders_edge.errors import CidersError, ConfigError, ExportError
from ciders_edge.formats.bundle import Bundle
from ciders_edge.formats.export_folder import MANIFEST, Export
from ciders_edge.inference.llamacpp import llamacpp_available
from ciders_edge.inference.personalize import Source, personal_messenger, resolve_backbone
from ciders_edge.profiles import DeviceProfile, load_profile, pick_device
from export.api import Stage, export_model

__all__ = ["BenchSettings", "bench", "RUNTIME_CHOICES"]

RUNTIME_CHOICES = {  # runtime name -> the export it runs (format, quantize, merged); torch runs the bundle itself
    "torch": None,
    **{f"onnx{q}": ("onnx", q.lstrip("-") or "none", False) for q in ("", "-int8", "-int8-dynamic")},
    **{f"genai{q}": ("genai", q.lstrip("-") or "none", False) for q in ("", "-int8", "-int4")},
    "llamacpp-lora": ("gguf", "none", False),  # the base GGUF + the messenger's LoRA adapter (AdapFu)
    "llamacpp-q8_0": ("gguf", "q8_0", True),
    "llamacpp-q4_0": ("gguf", "q4_0", True),
}
PROMPT = "Explain in a few sentences why a small language model can run on a phone."


class BenchError(CidersError, RuntimeError):
    """A runtime failed while being measured."""


@dataclass(frozen=True)
class Subject:
    """The model under test, as every worker process loads it."""

    bundle: str
    state: str | None
    backbone: str  # emu | full
    base_model: str | None = None
    messenger: str = "best"  # best | latest | global (without a state: global)


@dataclass
class BenchSettings:
    runtimes: tuple[str, ...] = ("torch", "onnx", "onnx-int8", "genai-int8")
    new_tokens: int = 64
    repeats: int = 3
    train_steps: int = 3  # timed training steps (after one warm-up step); 0 skips training

    def __post_init__(self) -> None:
        unknown = [r for r in self.runtimes if r not in RUNTIME_CHOICES]
        if unknown or not self.runtimes:
            raise ConfigError(f"--runtimes: unknown {unknown}; choose from {', '.join(RUNTIME_CHOICES)}")
        if self.new_tokens < 2:
            raise ConfigError(f"--new-tokens must be at least 2 (a decode rate needs 2), got {self.new_tokens}")
        if (llamacpp := [r for r in self.runtimes if r.startswith("llamacpp")]) and not llamacpp_available():
            raise ConfigError(f"--runtimes {', '.join(llamacpp)} need llama-cpp-python: pip install '.[llamacpp]'")
        for key in ("new_tokens", "repeats", "train_steps"):
            check_limit(key, getattr(self, key), "--" + key.replace("_", "-"))


def bench(
    bundle: str | Path,
    state: str | Path | None,
    profile: str | None,
    settings: BenchSettings,
    exports: str | Path | None = None,
    stage: Stage = lambda _: nullcontext(),
    backbone: str | None = None,
    base_model: str | None = None,
    messenger: str = "best",
) -> dict:
    """Measure every runtime and the training step; returns rows (one per runtime) and the step.

    ``profile`` defaults to the one the bundle was made for; ``backbone`` to what the bundle deploys
    (the training step always runs on the AdapEmu, where edges train).
    """
    b = Bundle.load(bundle)  # verified once here; the workers load it again in their own processes
    messenger = "global" if state is None else messenger
    subject = Subject(str(bundle), str(state) if state else None, resolve_backbone(b, backbone), base_model, messenger)
    prof = load_profile(profile) if profile else DeviceProfile.from_dict(b.manifest["profile"])
    _, source = personal_messenger(b, state, messenger, subject.backbone)
    with tempfile.TemporaryDirectory(prefix="ciders-bench-") as tmp:
        root = Path(exports) if exports is not None else Path(tmp)
        targets = {}
        for name in settings.runtimes:
            targets[name] = None
            if RUNTIME_CHOICES[name] is not None:
                targets[name] = _export_for(name, source, subject, root / name, stage)
        compiles = "torch" in settings.runtimes and pick_device(prof).type == "cuda"
        warm = "; torch compiles its GPU decode during the warm-up" if compiles else ""
        with stage(f"measuring {', '.join(settings.runtimes)} side by side{warm}"):
            rows = _measure_side_by_side(targets, subject, prof, settings)
    train = None
    if settings.train_steps:
        with stage("measuring the training step"):
            train = _in_fresh_process(_measure_train_step, subject.bundle, prof, settings.train_steps)
    base = next((r for r in rows if r["runtime"] == "torch"), None)
    for r in rows:
        r["speedup_vs_torch"] = r["decode_tokens_per_s"] / base["decode_tokens_per_s"] if base else None
    return {
        "bundle": str(bundle),
        "profile": prof.name,
        "messenger": messenger,
        "source": source.to_dict(),  # which messenger that is, and why (best: the state's validation)
        "backbone": subject.backbone,
        "new_tokens": settings.new_tokens,
        "repeats": settings.repeats,
        "runtimes": rows,
        "train_step": train,
    }


def _measure_side_by_side(targets: dict, subject: Subject, prof, settings: BenchSettings) -> list[dict]:
    """One process per runtime, loaded one after another; then generations in turn, round-robin, so
    slow drifts of the machine (other tenants, clocks) hit every runtime alike."""
    ctx = multiprocessing.get_context("spawn")
    workers = []
    try:
        for name, export in targets.items():
            conn, child = ctx.Pipe()
            proc = ctx.Process(
                target=_serve_runtime,
                args=(child, name, subject, export, prof, settings),
                daemon=True,
            )
            proc.start()
            child.close()  # else the parent's recv() never sees a dead worker's end of pipe
            workers.append((name, proc, conn, _reply(name, proc, conn)))
        runs = {name: [] for name in targets}
        for _ in range(settings.repeats):
            for name, proc, conn, _info in workers:
                conn.send("generate")
                runs[name].append(_reply(name, proc, conn))
        rows = []
        for name, proc, conn, info in workers:
            conn.send("stop")
            peak = _reply(name, proc, conn)
            gens = runs[name]
            medians = {k: statistics.median(g[k] for g in gens) for k in ("first_token_s", "decode_tokens_per_s")}
            rows.append({"runtime": name, **info, **medians, "peak_rss_mib": peak})
        return rows
    finally:
        for _name, proc, _conn, _info in workers:
            proc.join(timeout=5)  # after "stop" it exits by itself; after an error it may wait forever
            if proc.is_alive():
                proc.kill()
                proc.join()


def _reply(name: str, proc, conn):
    """The worker's next answer; its error, or its death (out of memory?), as one CidersError."""
    try:
        kind, value = conn.recv()
    except EOFError:
        proc.join(timeout=10)
        raise BenchError(f"the {name} runtime process died (exit code {proc.exitcode}; out of memory?)") from None
    if kind == "error":
        raise BenchError(f"{name}: {value}")
    return value


def _serve_runtime(conn, name, subject: Subject, export, prof: DeviceProfile, settings: BenchSettings) -> None:
    """Worker: load one runtime, then answer ``generate`` (timings) and ``stop`` (peak RSS)."""
    try:
        rt, ids, gen, info = _load_runtime(name, subject, export, prof, settings)
        conn.send(("ok", info))
        from ciders_edge.inference.generation import generate

        while conn.recv() == "generate":
            g = generate(rt.model, rt.tokenizer, ids, gen)
            conn.send(("ok", {"first_token_s": g.first_token_s, "decode_tokens_per_s": g.decode_tokens_per_s}))
        conn.send(("ok", _peak_rss_mib()))
    except Exception as err:  # reported to the parent, which raises it as one line
        conn.send(("error", str(err) if isinstance(err, CidersError) else f"{type(err).__name__}: {err}"))


def _load_runtime(name, subject: Subject, export, prof: DeviceProfile, settings: BenchSettings):
    from ciders_edge.cli_utils import quiet_libraries
    from ciders_edge.inference.generation import GenerationSettings, encode_prompt, generate
    from ciders_edge.inference.runtime import open_runtime

    quiet_libraries()
    rss_imports = _peak_rss_mib()
    start = time.perf_counter()
    if export is None:
        rt = open_runtime(
            "torch",
            bundle=subject.bundle,
            state=subject.state,
            messenger=subject.messenger,
            profile=prof,
            backbone=subject.backbone,
            base_model=subject.base_model,
        )
    else:  # the export was checked against bundle and state when it was made or reused
        rt = open_runtime(None, export=export, profile=prof)
    load_s = time.perf_counter() - start
    gen = GenerationSettings(max_new_tokens=settings.new_tokens, min_new_tokens=settings.new_tokens)
    ids = encode_prompt(rt.tokenizer, [{"role": "user", "content": PROMPT}], rt.context, gen.max_new_tokens)
    start = time.perf_counter()
    # warm-up; a compiled torch decode compiles here, at the timed length, so the timed generations replay
    warm = gen if rt.decode == "compiled" else gen.replace(max_new_tokens=4, min_new_tokens=4)
    generate(rt.model, rt.tokenizer, ids, warm)
    warmup_s = time.perf_counter() - start
    files = Path(export) if export is not None else Path(subject.bundle)
    info = {
        "decode": rt.decode if export is None else None,  # torch: eager, or compiled (static cache, CUDA graphs)
        "warmup_s": warmup_s,  # the first generation, not timed: compiling, if compiled
        "providers": rt.providers,
        "files_bytes": sum(f.stat().st_size for f in files.rglob("*") if f.is_file()),
        "load_s": load_s,
        "prompt_tokens": int(ids.shape[1]),
        "rss_after_imports_mib": rss_imports,
        "check": json.loads((files / MANIFEST).read_text()).get("check") if export is not None else None,
    }
    return rt, ids, gen, info


def _export_for(name: str, source: Source, subject: Subject, folder: Path, stage: Stage) -> Path:
    """Reuse ``folder`` if it already holds this runtime's export of ``source``'s model, else export."""
    try:
        exp = Export.load(folder)
        if exp.runtime == name and source.same_model(exp.source):
            return folder
    except ExportError:
        pass
    fmt, quantize, merged = RUNTIME_CHOICES[name]
    with stage(f"exporting {name}"):
        export_model(
            subject.bundle,
            subject.state,
            fmt,
            folder,
            quantize,
            messenger=subject.messenger,
            backbone=subject.backbone,
            base_model=subject.base_model,
            merged=merged,
        )
    return folder


def _in_fresh_process(fn, *args):
    """Run ``fn`` in a new interpreter: its imports, model and peak RSS are its own."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        try:
            return pool.submit(fn, *args).result()
        except BrokenProcessPool:
            raise BenchError(f"the {fn.__name__.removeprefix('_')} process died (out of memory?)") from None


def _peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    import resource  # not Linux: ru_maxrss (bytes on macOS)

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _measure_train_step(bundle, prof: DeviceProfile, steps: int) -> dict:
    """Median seconds of one real CIDERS edge step (FO or FD as the bundle says) at the profile's shape."""
    import torch

    from ciders_edge.cli_utils import quiet_libraries
    from ciders_edge.data.records import IGNORE, Example
    from ciders_edge.model.adapemu import load_edge_model
    from ciders_edge.training.round import RoundOptions, local_round, round_hyperparams

    quiet_libraries()
    b = Bundle.load(bundle)
    hp = round_hyperparams(b, prof, {"local_steps": steps + 1})
    edge = load_edge_model(b, prof.torch_dtype, quantized=prof.frozen_weights == "quantized")
    edge.checkpoint = prof.gradient_checkpointing
    edge.model.to(pick_device(prof))
    rng = random.Random(0)
    vocab, half = edge.model.config.vocab_size, hp.seq_len // 2
    examples = []
    for _ in range(hp.batch_size * hp.grad_accum * (steps + 1)):
        ids = [rng.randrange(vocab) for _ in range(hp.seq_len)]
        examples.append(Example(ids, [IGNORE] * half + ids[half:]))
    stamps = []
    local_round(edge, examples, None, hp, RoundOptions("bench", on_step=lambda _: stamps.append(time.perf_counter())))
    step_s = statistics.median(b - a for a, b in zip(stamps, stamps[1:], strict=False))
    return {
        "solver": hp.solver,
        "batch_size": hp.batch_size,
        "grad_accum": hp.grad_accum,
        "seq_len": hp.seq_len,
        "step_s": step_s,
        "tokens_per_s": hp.batch_size * hp.grad_accum * hp.seq_len / step_s,
        "device": str(pick_device(prof)),
        "peak_rss_mib": _peak_rss_mib(),
        "peak_cuda_mib": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None,
    }
