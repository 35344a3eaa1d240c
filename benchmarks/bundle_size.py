"""Bundle storage formats side by side: size, load time, training memory and the AdapEmu's NLL.

    python benchmarks/bundle_size.py --run runs/demo/run

From one prepared SmolLM2 run (``make demo`` makes one: depth 6, drop 0.2), the round-0 AdapEmu bundle
is written once per storage format (fp32, bf16, int8, int4) from the cloud's fp32 weights, and for each:
bytes per AdapEmu parameter, bundle MiB and its ratio to the full model's fp32 weights, the full
backbone's MiB for AdapFu, load time (median of 3), the peak RSS of an edge process that loads the bundle
and runs two training steps, and the AdapEmu's response NLL (global messenger) on held-out records of
the demo's task families. ``int8*`` keeps the messenger layers as fp32 to show what 8-bit messenger
weights cost. Targets (issue 18): int8 <= 1.1 B/param and NLL within 1% of fp32; int4 <= 0.6 B/param.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).parent))
from common import write_results  # noqa: E402

STORAGES = ("fp32", "bf16", "int8", "int4")
FAMILIES = ("arithmetic", "dates", "strings", "code")


def _bundles(run_dir: Path, out: Path) -> dict[str, Path]:
    """The run's round-0 AdapEmu bundle (and, beside it, the AdapFu one) in every storage format."""
    from ciders_cloud.models.teacher import load_cloud_models
    from ciders_cloud.round.bundles import bundle_contents
    from ciders_cloud.run.config import load_run
    from ciders_cloud.run.folder import RunFolder
    from ciders_cloud.run.server_state import ServerState
    from ciders_edge.formats.bundle import Bundle
    from ciders_edge.profiles import load_profile

    run = load_run(run_dir)
    state = ServerState.load(RunFolder(run_dir).server_state)
    [models] = load_cloud_models(run_dir, run, state).values()
    profile = load_profile(run.profiles[0])
    paths = {}
    for storage in STORAGES:
        for backbone in ("emu", "full"):
            p = profile.replace(storage=storage, backbone=backbone)
            path = out / f"{storage}-{backbone}"
            Bundle.save(path, bundle_contents(run.replace(storage=""), models, state, p, None))
            paths[f"{storage}-{backbone}"] = path
    return paths


def _size(path: Path, files: list[str] | None = None) -> int:
    """Bytes of ``files`` (default: every file the manifest lists); sizes need no checksum pass."""
    from ciders_edge.formats.manifest import MANIFEST

    listed = json.loads((path / MANIFEST).read_text())["files"]
    return sum((path / f).stat().st_size for f in (files or listed))


def _emu_params(path: Path) -> int:
    from ciders_edge.formats.bundle import Bundle

    return sum(t.numel() for t in Bundle.load(path).base_weights().values())


def _nll(path: Path, data: Path, records: int, fp32_messenger: Path | None = None) -> float:
    from ciders_edge.data.records import load_examples
    from ciders_edge.formats.bundle import Bundle
    from ciders_edge.formats.manifest import MESSENGER_LAYERS_FILE
    from ciders_edge.inference.evaluate import backbone_batches, messenger_nll
    from ciders_edge.model.adapemu import load_edge_model

    edge = load_edge_model(Bundle.load(path))
    if fp32_messenger is not None:  # the messenger layers back at full precision
        weights = Bundle.load(fp32_messenger).tensors(MESSENGER_LAYERS_FILE)
        params = edge.model.get_base_model().state_dict()
        renamed = {k if k in params else k.replace(".weight", ".base_layer.weight"): v for k, v in weights.items()}
        assert set(renamed) <= set(params), sorted(set(renamed) - set(params))[:3]
        edge.model.get_base_model().load_state_dict(renamed, strict=False)
    examples = [e for f in FAMILIES for e in load_examples(data / f / "eval.jsonl", edge.tokenizer, 256)[:records]]
    return messenger_nll(edge, backbone_batches(edge, examples))


def _load_seconds(path: Path) -> float:
    from ciders_edge.formats.bundle import Bundle
    from ciders_edge.model.adapemu import load_edge_model

    times = []
    for _ in range(3):
        start = time.perf_counter()
        load_edge_model(Bundle.load(path))
        times.append(time.perf_counter() - start)
    return median(times)


def _train_peak_mib(path: Path, data: Path) -> float:
    """Peak RSS of a fresh edge process: load the bundle, two local steps (``ciders-edge train``'s code)."""
    code = (
        "import sys, tempfile\n"
        "from ciders_edge.training.train import RoundOptions, train\n"
        "d = tempfile.mkdtemp()\n"
        "options = RoundOptions(client_id='bench', overrides={'local_steps': 2})\n"
        "train(sys.argv[1], sys.argv[2], d + '/s', d + '/p.pkt', options)\n"
        # VmHWM starts afresh at exec; ru_maxrss would carry this (parent) process's peak over
        "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')][0])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(path), str(data / "dates" / "train.jsonl")],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.strip().splitlines()[-1]) / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, default=Path("runs/demo/run"), help="A prepared SmolLM2 run folder.")
    ap.add_argument("--data", type=Path, default=None, help="Demo data folder (default: RUN/../data).")
    ap.add_argument("--records", type=int, default=16, help="Held-out records per task family.")
    args = ap.parse_args()
    from ciders_edge.formats.manifest import FROZEN_FILES, FULL_WEIGHTS
    from ciders_edge.model.sources import resolve_model

    data = args.data or args.run.parent / "data"
    full_model = sum(f.stat().st_size for f in resolve_model("smollm2-135m").glob("*.safetensors"))
    with tempfile.TemporaryDirectory() as tmp:
        paths = _bundles(args.run, Path(tmp))
        params = _emu_params(paths["fp32-emu"])
        rows, payload = [], {}
        for storage in (*STORAGES, "int8*"):
            fmt = storage.rstrip("*")
            emu = paths[f"{fmt}-emu"]
            frozen = _size(emu, [f for f in FROZEN_FILES if f != FULL_WEIGHTS])
            r = {
                "bytes_per_param": frozen / params,
                "bundle_mib": _size(emu) / 2**20,
                "vs_full_fp32": _size(emu) / full_model,
                "adapfu_extra_mib": _size(paths[f"{fmt}-full"], [FULL_WEIGHTS]) / 2**20,
                "load_s": _load_seconds(emu),
                "train_peak_mib": _train_peak_mib(emu, data),
                "nll": _nll(emu, data, args.records, paths["fp32-emu"] if storage == "int8*" else None),
            }
            payload[storage] = r
        base = payload["fp32"]["nll"]
        for storage, r in payload.items():
            r["nll_vs_fp32"] = r["nll"] / base - 1
            rows.append(
                [storage, f"{r['bytes_per_param']:.3f}", f"{r['bundle_mib']:.1f}", f"{r['vs_full_fp32']:.2f}x",
                 f"{r['adapfu_extra_mib']:.1f}", f"{r['load_s']:.2f}", f"{r['train_peak_mib']:.0f}",
                 f"{r['nll']:.4f}", f"{100 * r['nll_vs_fp32']:+.2f}%"]
            )  # fmt: skip
    header = ["storage", "B/param", "bundle MiB", "vs full fp32", "AdapFu extra MiB", "load s", "train peak MiB",
              "NLL", "NLL vs fp32"]  # fmt: skip
    notes = (
        f"AdapEmu of `{args.run}`: {params / 1e6:.1f} M parameters; held-out: {args.records} records of each of "
        f"{', '.join(FAMILIES)}. `int8*`: int8 bundle with the messenger layers at fp32. B/param counts the frozen "
        "weight files (backbone + messenger layers) with their scales; bundle MiB counts every file."
    )
    path = write_results("bundle_size", {"params": params, "results": payload}, rows, header, notes)
    _plot(payload, path.with_suffix(".png"))
    print(path.read_text())
    print(json.dumps(payload))


def _plot(payload: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(payload)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = [payload[n]["bundle_mib"] for n in names]
    ys = [100 * payload[n]["nll_vs_fp32"] for n in names]
    ax.scatter(xs, ys)
    for n, x, y in zip(names, xs, ys, strict=True):
        ax.annotate(n, (x, y), textcoords="offset points", xytext=(4, -12 if n.endswith("*") else 4))
    ax.axhline(1.0, linestyle="--", linewidth=0.8, color="grey")
    ax.set_xlabel("round-0 AdapEmu bundle (MiB)")
    ax.set_ylabel("AdapEmu NLL vs fp32 storage (%)")
    ax.set_title("Bundle storage: size against fidelity (SmolLM2-135M)")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main()
