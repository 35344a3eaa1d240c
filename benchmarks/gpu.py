"""Issue 19 on a GPU box with no network, in minutes: edge steps, torch decode, TAKD on CPU vs GPU.

    python benchmarks/gpu.py                          # SmolLM2-135M's shape, random weights, on the GPU
    python benchmarks/gpu.py --device cpu --quick     # a smoke test anywhere (tiny shapes)
    python benchmarks/gpu.py --privacy                # issue 61's DP study at 1,000 clients, on the GPU instead

Nothing is downloaded: the model is built from a config (speed does not depend on the weights), the
tokenizer is SmolLM2's (``$CIDERS_HOME/models/smollm2-tokenizer`` or ``--tokenizer``), and the bundle is
written by ``prepare`` with no distillation steps. Times are taken between ``torch.cuda.synchronize``
calls; each is a median over ``--repeats`` after ``--warmup`` untimed ones.
- edge steps at batch 8x1024 and 2x256 on synthetic full-length batches (half prompt, half response):
  CIDERS-FO and -FD (one K=1 ``local_update``), naive FO and plain LoRA (as ``edge_step.py``);
- torch decode at batch 1 (``open_runtime``, as ``infer``): tok/s and first-token latency, eager
  against compiled (static KV cache, CUDA graphs); the compiling first call is reported apart;
- TAKD (eq. 2) steps/s of ``Distiller``, CPU against GPU.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
import common  # noqa: E402
from edge_step import METHODS, lora_baseline_step  # noqa: E402

SMOLLM2 = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
}
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
}
FULL = {"model": SMOLLM2, "depth": 6, "drop": 0.2, "shapes": [(8, 1024), (2, 256)], "new_tokens": 64, "takd": (4, 256)}
QUICK = {"model": TINY, "depth": 2, "drop": 0.5, "shapes": [(2, 64), (1, 32)], "new_tokens": 8, "takd": (2, 64)}
# privacy.py's population study with the CPU run's population and messenger (RESULTS.md), its clients on the GPU
# (Flower's engine, 4 a GPU); rounds and the bootstrap at privacy.py's defaults, which the CPU run shrank
PRIVACY = [
    "--clients", "1000", "--participation", "0.1", "--records", "3", "--messenger-depth", "2", "--local-steps", "2",
    "--domains", "medical,customer_support,code,general", "--algorithms", "ciders-fo", "--engine", "flower",
    "--gpus-per-client", "0.25", "--device", "cuda", "--profile", "cuda-24gb", "--name", "privacy_population_cuda",
]  # fmt: skip
TARGETS = {"fo_over_naive": 0.65, "fo_over_plain": 1.3, "decode_tokens_per_s": 300.0, "first_token_s": 0.030}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, warmup: int, repeats: int) -> tuple[float, float]:
    """Median seconds of ``fn`` over ``repeats`` calls after ``warmup`` ones, and the first call's."""
    times = []
    for _ in range(warmup + repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return common.median(times[warmup:]), times[0]


def peak_mib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def synthetic(vocab: int, n: int, seq_len: int, seed: int = 0) -> list:
    """Full-length examples of random tokens, the second half the response (as ``bench``'s step)."""
    from ciders_edge.data.records import IGNORE, Example

    rng, half = random.Random(seed), seq_len // 2
    rows = [[rng.randrange(vocab) for _ in range(seq_len)] for _ in range(n)]
    return [Example(ids, [IGNORE] * half + ids[half:]) for ids in rows]


def build_model(folder: Path, shape: dict, tokenizer_dir: Path) -> Path:
    """A Llama of ``shape`` with random (seeded) weights and SmolLM2's tokenizer, as a model folder."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = {k: getattr(tok, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    config = LlamaConfig(vocab_size=len(tok), tie_word_embeddings=True, **shape, **ids)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


def build_bundle(work: Path, model: Path, profile: str, size: dict) -> tuple[Path, Path]:
    """``prepare`` with no distillation steps (the project's own bundle writer): run folder and bundle."""
    from ciders_cloud import RunConfig, prepare
    from ciders_edge.data.demo import write_demo_data

    write_demo_data(work / "data", n_train=4, n_public=20, n_eval=2)
    batch, seq = size["takd"]
    run = RunConfig(
        model=str(model),
        profiles=[profile],
        messenger_depth=size["depth"],
        drop_ratio=size["drop"],
        public_data=str(work / "data" / "public.jsonl"),
        layer_steps=0,
        align_steps=0,
        lora={"rank": 8, "alpha": 16.0, "dropout": 0.05},
        takd={"batch_size": batch, "seq_len": seq},
        storage="bf16",
    )
    summary = prepare(run, work / "run")
    return work / "run", Path(summary["bundles"][profile])


def edge_step(bundle: Path, dtype: torch.dtype, device: torch.device, method: str, shape, args) -> dict:
    """One method's step at ``shape`` (batch, seq_len): the same four methods as ``edge_step.py``."""
    from ciders_edge.formats.bundle import Bundle
    from ciders_edge.hyperparams import RoundHyperparams
    from ciders_edge.model.adapemu import load_edge_model
    from ciders_edge.training.local_steps import local_update
    from ciders_edge.training.objective import MessengerObjective

    batch, seq = shape
    edge = load_edge_model(Bundle.load(bundle), dtype)
    edge.model.to(device)
    examples = synthetic(edge.model.config.vocab_size, batch * 4, seq)
    release(device)
    if method.startswith("ciders"):
        v = {k: t.float().to(device) for k, t in edge.bundle.messenger_lora().items()}
        zeros = {k: torch.zeros_like(t) for k, t in v.items()}
        solver = method.split("-")[1]
        hp = RoundHyperparams(local_steps=1, eta=1e-4, batch_size=batch, seq_len=seq, solver=solver, warmup_steps=0)
        obj = MessengerObjective(edge, examples, batch, 1, seed=0)
        step = lambda: local_update(v, zeros, zeros, obj, hp)  # noqa: E731
    else:
        calls = iter(range(10**9))
        baseline = lora_baseline_step(edge, examples, batch, 2 if method == "naive-fo" else 1)
        step = lambda: baseline(next(calls))  # noqa: E731
    step_s, _ = timed(step, device, args.warmup, args.repeats)
    out = {"method": method, "batch": batch, "seq_len": seq, "step_s": step_s, "peak_mib": peak_mib(device)}
    del edge, step
    release(device)
    return out


def decode(bundle: Path, profile, requested: str, args, size: dict) -> dict:
    """Batch-1 decode through ``open_runtime`` and ``generate`` (what ``infer`` and ``bench`` run)."""
    from ciders_edge.inference.compiled_decode import use_compiled_decode
    from ciders_edge.inference.generation import GenerationSettings, encode_prompt, generate
    from ciders_edge.inference.runtime import open_runtime
    from export.bench import PROMPT

    rt = open_runtime("torch", bundle=bundle, messenger="global", profile=profile, decode=requested)
    if rt.decode == "compiled" and args.compile_backend != "inductor":
        use_compiled_decode(rt.model, args.compile_backend)
    n = size["new_tokens"]
    gen = GenerationSettings(max_new_tokens=n, min_new_tokens=n)
    ids = encode_prompt(rt.tokenizer, [{"role": "user", "content": PROMPT}], rt.context, n)
    device = rt.model.device
    t0 = time.perf_counter()
    generate(rt.model, rt.tokenizer, ids, gen)  # compiles, when compiled
    sync(device)
    first_call_s = time.perf_counter() - t0
    gens = [generate(rt.model, rt.tokenizer, ids, gen) for _ in range(max(args.repeats, 3))]
    out = {
        "requested": requested,
        "decode": rt.decode,  # eager after a failed compile
        "device": str(device),
        "new_tokens": n,
        "prompt_tokens": int(ids.shape[1]),
        "first_call_s": first_call_s,
        "first_token_s": common.median([g.first_token_s for g in gens]),
        "decode_tokens_per_s": common.median([g.decode_tokens_per_s for g in gens]),
    }
    del rt
    release(device)
    return out


def takd(run_dir: Path, device: torch.device, args) -> dict:
    """Steps/s of the cloud's TAKD (eq. 2: teacher, AdapEmu, backbone LoRA) with both models on ``device``."""
    from ciders_cloud.models.takd import Distiller
    from ciders_cloud.models.teacher import load_cloud_models
    from ciders_cloud.run.config import load_run
    from ciders_cloud.run.folder import RunFolder
    from ciders_cloud.run.server_state import ServerState

    run = load_run(run_dir)
    [models] = load_cloud_models(run_dir, run, ServerState.load(RunFolder(run_dir).server_state)).values()
    models.teacher.to(device)
    models.emu.to(device)
    cfg = run.takd_config
    distiller = Distiller(models, synthetic(models.teacher.config.vocab_size, cfg.batch_size * 4, cfg.seq_len), cfg)
    on_cpu = distiller.batches
    distiller.batches = ({k: t.to(device) for k, t in b.items()} for b in on_cpu)
    step_s, _ = timed(distiller.step, device, args.warmup, args.repeats)
    out = {
        "device": str(device),
        "batch": cfg.batch_size,
        "seq_len": cfg.seq_len,
        "step_s": step_s,
        "steps_per_s": 1 / step_s,
        "peak_mib": peak_mib(device),
    }
    del models, distiller
    release(device)
    return out


def ratios(rows: list[dict]) -> dict:
    """CIDERS-FO's step over each other method's, per shape."""
    out = {}
    for batch, seq in sorted({(r["batch"], r["seq_len"]) for r in rows}, reverse=True):
        by = {r["method"]: r["step_s"] for r in rows if (r["batch"], r["seq_len"]) == (batch, seq)}
        out[f"{batch}x{seq}"] = {f"ciders-fo/{m}": by["ciders-fo"] / s for m, s in by.items() if m != "ciders-fo"}
    return out


def targets(result: dict, device: torch.device) -> dict:
    """Issue 19's GPU targets (None off a GPU: CPU numbers say nothing about them)."""
    if device.type != "cuda":
        return {k: None for k in TARGETS}
    big = next(iter(result["ratios"].values()))
    compiled = next(r for r in result["decode"] if r["requested"] == "auto")
    return {
        "fo_over_naive": big["ciders-fo/naive-fo"] <= TARGETS["fo_over_naive"],
        "fo_over_plain": big["ciders-fo/plain-lora"] <= TARGETS["fo_over_plain"],
        "decode_tokens_per_s": compiled["decode_tokens_per_s"] >= TARGETS["decode_tokens_per_s"],
        "first_token_s": compiled["first_token_s"] <= TARGETS["first_token_s"],
    }


def table(result: dict) -> list[list[str]]:
    rows = [
        [
            f"edge step {r['method']}",
            f"{r['batch']}x{r['seq_len']}",
            f"{r['step_s'] * 1000:.1f} ms",
            f"peak {r['peak_mib']:.0f} MiB" if r["peak_mib"] is not None else "",
        ]
        for r in result["edge_steps"]
    ]
    for shape, rs in result["ratios"].items():
        rows += [[f"ratio {k}", shape, f"{v:.2f}x", ""] for k, v in rs.items()]
    for r in result["decode"]:
        rows.append(
            [
                f"decode {r['requested']} ({r['decode']})",
                f"batch 1, {r['new_tokens']} new tokens, {r['device']}",
                f"{r['decode_tokens_per_s']:.1f} tok/s, first token {r['first_token_s'] * 1000:.1f} ms",
                f"first call {r['first_call_s']:.1f} s" + (" (compiling)" if r["decode"] == "compiled" else ""),
            ]
        )
    for r in result["takd"]:
        rows.append(
            [
                f"TAKD {r['device']}",
                f"{r['batch']}x{r['seq_len']}",
                f"{r['steps_per_s']:.2f} steps/s",
                f"{r['step_s'] * 1000:.0f} ms/step",
            ]
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CUDA when present")
    ap.add_argument("--quick", action="store_true", help="tiny shapes: a smoke test of every measurement")
    ap.add_argument("--tokenizer", type=Path, default=None, help="SmolLM2 tokenizer folder (default: the cache's)")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats (default 5; --quick 2)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed calls before the timed ones")
    ap.add_argument(
        "--compile-backend",
        choices=("inductor", "eager"),
        default="inductor",
        help="eager: dynamo without inductor (seconds to compile, no speed-up): a check of the path",
    )
    ap.add_argument("--results", type=Path, default=common.RESULTS, help="folder for NAME.json and NAME.md")
    ap.add_argument("--work", type=Path, default=None, help="keep the model, data and run here (default: a temp dir)")
    ap.add_argument(
        "--privacy", action="store_true", help="run privacy.py's 1,000-client DP study on the GPU instead (resumable)"
    )
    args, rest = ap.parse_known_args()
    if args.privacy:  # its own arguments after ours: --rounds, --out, --actors ...
        sys.exit(subprocess.call([sys.executable, str(Path(__file__).with_name("privacy.py")), *PRIVACY, *rest]))
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    args.repeats = args.repeats or (2 if args.quick else 5)

    from ciders_edge.cli_utils import quiet_libraries
    from ciders_edge.model.sources import ciders_home
    from ciders_edge.profiles import load_profile

    quiet_libraries()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no GPU here")
    device = torch.device("cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu")
    tok_dir = args.tokenizer or ciders_home() / "models" / "smollm2-tokenizer"
    if not (tok_dir / "tokenizer_config.json").is_file():
        sys.exit(f"{tok_dir}: no SmolLM2 tokenizer there; copy one in (README, Benchmarks) or pass --tokenizer")
    size = QUICK if args.quick else FULL
    profile = load_profile("cuda-24gb" if device.type == "cuda" else "cpu-laptop")
    with tempfile.TemporaryDirectory(prefix="ciders-gpu-bench-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        os.environ["CIDERS_HOME"] = str(work / "home")  # prepare's bootstrap cache: the user's stays untouched
        model = build_model(work / "model", size["model"], tok_dir)
        run_dir, bundle = build_bundle(work, model, profile.name, size)
        result = {
            "device": str(device),
            "profile": profile.name,
            "quick": args.quick,
            "model": size["model"],
            "messenger_depth": size["depth"],
            "drop_ratio": size["drop"],
            "repeats": args.repeats,
            "warmup": args.warmup,
            "compile_backend": args.compile_backend,
        }
        result["edge_steps"] = [
            edge_step(bundle, profile.torch_dtype, device, m, shape, args) for shape in size["shapes"] for m in METHODS
        ]
        result["ratios"] = ratios(result["edge_steps"])
        # "auto" is what infer runs: compiled on a GPU; forced compiled on a CPU so the smoke test covers it
        result["decode"] = [decode(bundle, profile, m, args, size) for m in ("eager", "auto")]
        if device.type == "cpu":
            result["decode"].append(decode(bundle, profile, "compiled", args, size))
        devices = [torch.device("cpu")] + ([device] if device.type == "cuda" else [])
        result["takd"] = [takd(run_dir, d, args) for d in devices]
    result["targets"] = targets(result, device)
    notes = (
        f"Model: {size['model']}, random weights, LoRA r8, messenger depth {size['depth']}, drop {size['drop']}, "
        f"profile {profile.name} ({profile.dtype}). Targets (issue 19, GPU): ciders-fo/naive-fo <= 0.65 and "
        f"ciders-fo/plain-lora <= 1.3 at 8x1024; compiled decode >= 300 tok/s with first token <= 30 ms. "
        f"Met: {result['targets']}"
    )
    name = "gpu_quick" if args.quick else "gpu"
    common.RESULTS = args.results
    path = common.write_results(name, result, table(result), ["what", "shape", "measured", "note"], notes)
    print(path.read_text())


if __name__ == "__main__":
    main()
