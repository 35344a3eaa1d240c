"""How faithful the SmolLM2 AdapEmu is to the full model, against prepare's bootstrap steps.

    python benchmarks/emulator_fidelity.py --out runs/emulator-fidelity

SmolLM2-135M, messenger depth 6, drop ratio 0.2 and 0.5; TAKD on the five ``five_domain`` public
files together, fidelity (``ciders_cloud.models.fidelity``) on the 40 public records ``prepare`` holds out.
Each drop ratio runs the default recipe (stage 1: layer fits of the layers after each gap; stage 2:
end-to-end TAKD on their weights) with the fidelity measured at checkpoints. Then the stage-2
alternatives the default was chosen over, each from the same stage-1 layers at drop 0.2 with the
same number of steps: the paper's loss (raw hidden MSE, lambda_out 0.5, lambda_task 1), the relative
hidden term without the task CE, and training the backbone LoRA instead of the layers' weights.
Writes results/emulator_fidelity.{json,md} and results/emulator_fidelity.png.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, data_dir, write_results  # noqa: E402

DOMAINS = ("medical", "finance", "customer_support", "code", "general")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/emulator-fidelity"))
    ap.add_argument("--drops", default="0.2,0.5")
    ap.add_argument("--layer-checkpoints", default="50,100,200", help="stage-1 steps at which to measure")
    ap.add_argument("--align-checkpoints", default="20,40,60", help="stage-2 steps at which to measure")
    ap.add_argument("--variants", default="paper,no-task-ce,lora", help="stage-2 alternatives at drop 0.2")
    args = ap.parse_args()
    from ciders_edge.cli_utils import quiet_libraries
    from ciders_edge.formats.atomic import write_bytes

    quiet_libraries()
    five = data_dir("five_domain")
    public = args.out / "public.jsonl"
    if not public.is_file():
        write_bytes(public, b"".join((five / d / "public.jsonl").read_bytes() for d in DOMAINS))
    layer_marks = [int(x) for x in args.layer_checkpoints.split(",")]
    align_marks = [int(x) for x in args.align_checkpoints.split(",")]
    curves, stage1 = {}, {}
    for d in args.drops.split(","):
        curves[d], stage1[float(d)] = recipe_curve(float(d), public, layer_marks, align_marks)
    variants = {v: variant(v, public, align_marks[-1], stage1[0.2]) for v in args.variants.split(",") if v}
    _plot(curves, RESULTS / "emulator_fidelity.png")
    _write(args, curves, variants)


def _models(drop: float, public: Path, **takd):
    from ciders_cloud.models.takd import public_split
    from ciders_cloud.models.teacher import build_cloud_models
    from ciders_cloud.run.config import RunConfig, TakdConfig
    from ciders_edge.model.sources import model_revision, resolve_model

    path = resolve_model("smollm2-135m")
    run = RunConfig(model="smollm2-135m", model_path=str(path), model_revision=model_revision(path),
                    messenger_depth=6, drop_ratio=drop, public_data=str(public),
                    takd=TakdConfig().replace(**takd).to_dict())  # fmt: skip
    models = build_cloud_models(run)
    train, held = public_split(run, models.tokenizer)
    return run, models, train, held


def _point(stage: str, steps: int, seconds: float, models, held) -> dict:
    from ciders_cloud.models.fidelity import measure_fidelity

    f = measure_fidelity(models, held)
    print(f"  {stage} {steps}: {f.describe()} ({seconds:.0f} s)", flush=True)
    return {"stage": stage, "steps": steps, "seconds": seconds, **f.to_dict()}


def recipe_curve(drop: float, public: Path, layer_marks: list[int], align_marks: list[int]) -> tuple[list, dict]:
    """The default recipe, measured at the checkpoints (the clock excludes the measurements);
    also returns the layers after stage 1, where the stage-2 alternatives start."""
    from ciders_cloud.models.bootstrap import LayerAligner, gap_parameters
    from ciders_cloud.models.takd import Distiller

    print(f"drop {drop}", flush=True)
    run, models, train, held = _models(drop, public)
    cfg, clock = run.takd_config, 0.0
    points = [_point("none", 0, 0.0, models, held)]
    aligner = LayerAligner(models, train, cfg, layer_marks[-1], run.seed)
    done = 0
    for mark in layer_marks:
        start = time.perf_counter()
        for _ in range(mark - done):
            aligner.step()
        clock += time.perf_counter() - start
        done = mark
        points.append(_point("layers", mark, clock, models, held))
    stage1 = {k: v.detach().clone() for k, v in gap_parameters(models).items()}
    distiller = Distiller(models, train, cfg, seed=run.seed, params=list(gap_parameters(models).values()),
                          lr=cfg.align_lr)  # fmt: skip
    done = 0
    for mark in align_marks:
        start = time.perf_counter()
        distiller.run(mark - done, label=f"stage 2 to {mark}", kind="align")
        clock += time.perf_counter() - start
        done = mark
        points.append(_point("align", layer_marks[-1] + mark, clock, models, held))
    return points, stage1


VARIANTS = {  # the stage-2 alternatives, as TakdConfig overrides
    "paper": {"hidden_loss": "mse", "lambda_out": 0.5, "lambda_task": 1.0},
    "no-task-ce": {"lambda_task": 0.0},
    "lora": {"align_params": "lora"},
}


def variant(name: str, public: Path, steps: int, stage1: dict) -> dict:
    import torch

    from ciders_cloud.models.bootstrap import gap_parameters
    from ciders_cloud.models.takd import Distiller

    print(f"variant {name}", flush=True)
    run, models, train, held = _models(0.2, public, **VARIANTS[name])
    with torch.no_grad():
        for key, param in gap_parameters(models).items():
            param.copy_(stage1[key])
    cfg = run.takd_config
    lora = cfg.align_params == "lora"
    params = None if lora else list(gap_parameters(models).values())
    start = time.perf_counter()
    Distiller(models, train, cfg, seed=run.seed, params=params, lr=cfg.lr if lora else cfg.align_lr).run(steps)
    return _point(name, steps, time.perf_counter() - start, models, held)


def _plot(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for drop, points in curves.items():
        x = [p["steps"] for p in points]
        a.plot(x, [p["nll_ratio"] for p in points], marker="o", label=f"drop {drop}")
        b.plot(x, [100 * p["top1_agreement"] for p in points], marker="o", label=f"drop {drop}")
    layer_end = max(p["steps"] for pts in curves.values() for p in pts if p["stage"] == "layers")
    for ax in (a, b):
        ax.axvline(layer_end, color="grey", lw=0.8, ls=":")
        ax.set_xlabel("bootstrap steps (stage 1 layer fits, then stage 2 TAKD)")
        ax.legend()
    a.axhline(1.15, color="red", lw=0.8, ls="--", label="target")
    b.axhline(65, color="red", lw=0.8, ls="--")
    a.set(title="AdapEmu / full-model response NLL", ylabel="NLL ratio")
    b.set(title="greedy next-token agreement with the full model", ylabel="%")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _write(args, curves: dict, variants: dict) -> None:
    header = ["drop", "stage", "steps", "minutes", "NLL AdapEmu", "NLL full", "ratio", "top-1 agreement", "KL"]
    table = [
        [d, p["stage"], str(p["steps"]), f"{p['seconds'] / 60:.1f}", f"{p['nll_emu']:.3f}", f"{p['nll_full']:.3f}",
         f"{p['nll_ratio']:.3f}", f"{p['top1_agreement']:.1%}", f"{p['kl']:.3f}"]
        for d, points in curves.items() for p in points
    ]  # fmt: skip
    notes = []
    if variants:
        notes += ["Stage-2 alternatives at drop 0.2, each from the same stage-1 layers as the default:", ""]
        notes += ["| variant | steps | minutes | ratio | top-1 agreement | KL |", "|---|---|---|---|---|---|"]
    notes += [
        f"| {name} | {p['steps']} | {p['seconds'] / 60:.1f} | {p['nll_ratio']:.3f} | {p['top1_agreement']:.1%} | "
        f"{p['kl']:.3f} |"
        for name, p in variants.items()
    ]
    notes += ["", "Plot: results/emulator_fidelity.png"]
    write_results("emulator_fidelity", {"curves": curves, "variants": variants}, table, header, "\n".join(notes))


if __name__ == "__main__":
    main()
