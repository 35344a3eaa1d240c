"""Edge training step: CIDERS-FO and -FD against a naive FO step and one plain LoRA step.

    python benchmarks/edge_step.py --bundle RUN/bundles/cpu-laptop/round-0000 --data F.jsonl

Every method runs in its own worker process (so peak RSS is its own), on the same fixed batches,
one after another in one invocation; times are medians over ``--repeats`` steps after warm-up.
- ``ciders-fo``: the real edge update (one K=1 call of ``local_update``): frozen backbone once
  without a graph, the messenger twice (x_k and the look-ahead), LM head on response tokens.
- ``naive-fo``: the same update done the obvious way: two full forward+backward passes of the
  AdapEmu with Hugging Face's loss (LM head on every position).
- ``plain-lora``: one full forward+backward pass and an optimizer step (ordinary LoRA fine-tuning).
- ``ciders-fd``: the FD solver (two more messenger passes).

``--count-ops`` also profiles one step of each method and counts the aten ops it dispatches (each at
least one kernel launch on a GPU: a proxy for launch overhead that needs no GPU) against plain LoRA's.
Issue 19's setup: ``ciders-cloud prepare --model tiny --messenger-depth 6 --drop-ratio 0`` (84 LoRA
tensors), batch 2, ``--count-ops --name edge_step_ops``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import median, write_results  # noqa: E402

METHODS = ("ciders-fo", "naive-fo", "plain-lora", "ciders-fd")


def _setup(args):
    from ciders_edge.cli_utils import quiet_libraries
    from ciders_edge.data.records import load_examples
    from ciders_edge.formats.bundle import Bundle
    from ciders_edge.model.adapemu import load_edge_model

    quiet_libraries()
    torch.manual_seed(0)
    edge = load_edge_model(Bundle.load(args.bundle))
    examples = load_examples(args.data[0], edge.tokenizer, args.seq_len, limit=400)
    # fixed-length batches: the longest examples, cut to seq_len
    examples = sorted(examples, key=lambda e: -len(e.input_ids))[: args.batch_size * 4]
    return edge, examples


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> float:
    """Reset the peak-RSS mark (Linux ``clear_refs``) so it measures the steps, not the model load."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    Path("/proc/self/clear_refs").write_text("5")
    return _status_mib("VmRSS")


def _step_peak(base: float) -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 1024**2
    return _status_mib("VmHWM") - base


def _ciders_step(args, edge, examples, v: dict, zeros: dict):
    from ciders_edge.hyperparams import RoundHyperparams
    from ciders_edge.training.local_steps import local_update
    from ciders_edge.training.objective import MessengerObjective

    hp = RoundHyperparams(
        local_steps=1,
        eta=1e-4,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        solver=args.worker.split("-")[1],
        warmup_steps=0,
    )
    obj = MessengerObjective(edge, examples, args.batch_size, 1, seed=0)
    return lambda _i: local_update(v, zeros, zeros, obj, hp)


def _baseline_step(args, edge, examples):
    """Plain LoRA (one pass and AdamW) or naive FO (two full passes around the look-ahead)."""
    return lora_baseline_step(edge, examples, args.batch_size, 2 if args.worker == "naive-fo" else 1)


def lora_baseline_step(edge, examples, batch_size: int, passes: int):
    """``step(i)`` on batch ``i``: plain LoRA (``passes`` 1: one forward+backward, an AdamW step) or naive FO
    (``passes`` 2: a second full pass at the look-ahead, then back to x_k for the step). Batches sit on
    the model's device; ``gpu.py`` times the same step."""
    from ciders_edge.data.records import collate
    from ciders_edge.model.lora import MESSENGER_ADAPTER, lora_parameters

    model = edge.model
    device = next(model.parameters()).device
    params = list(lora_parameters(model, MESSENGER_ADAPTER).values())
    model.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    model.train()
    opt = torch.optim.AdamW(params, lr=1e-4)
    pad = edge.tokenizer.pad_token_id
    batches = [
        {k: t.to(device) for k, t in collate(examples[i : i + batch_size], pad).items()}
        for i in range(0, len(examples), batch_size)
    ]

    def step(i: int) -> None:
        b = batches[i % len(batches)]
        snapshot = None
        for _ in range(passes):  # naive FO: grad at x_k, step to the look-ahead, grad there
            opt.zero_grad(set_to_none=True)
            model(**b).loss.backward()
            if passes == 2 and snapshot is None:
                with torch.no_grad():
                    snapshot = [p.detach().clone() for p in params]
                    for p in params:
                        p.sub_(1e-4 * p.grad)
        if snapshot is not None:
            with torch.no_grad():
                for p, s in zip(params, snapshot, strict=True):
                    p.copy_(s)
        opt.step()

    return step


def count_ops(step) -> dict:
    """Profile one step and count the aten ops it dispatches, a proxy for GPU kernel launches.

    ``top_level_aten_ops``: aten events with no parent event at all, what Python code dispatches
    directly (issue 19's count). ``aten_ops_outside_aten``: aten events with no aten ancestor, which
    adds the ops autograd's backward and the optimizer dispatch inside their own profiler ranges.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(0)
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    return {
        "top_level_aten_ops": sum(1 for e in events if e.cpu_parent is None),
        "aten_ops_outside_aten": sum(1 for e in events if not _has_aten_ancestor(e)),
        "profiler_events": len(prof.events()),
    }


def _has_aten_ancestor(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False


def worker(args) -> dict:
    edge, examples = _setup(args)
    v = {k: t.float() for k, t in edge.bundle.messenger_lora().items()}
    zeros = {k: torch.zeros_like(t) for k, t in v.items()}
    response = sum(sum(t != -100 for t in e.labels[1:]) for e in examples) / sum(len(e.input_ids) for e in examples)
    base = _reset_peak()
    if args.worker.startswith("ciders"):
        step = _ciders_step(args, edge, examples, v, zeros)
    else:
        step = _baseline_step(args, edge, examples)
    times = []
    for i in range(args.warmup + args.repeats):
        t0 = time.perf_counter()
        step(i)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    row = {
        "method": args.worker,
        "step_s": median(times),
        "steps": len(times),
        "step_peak_mib": _step_peak(base),
        "tokens_per_batch": sum(len(e.input_ids) for e in examples) * args.batch_size // len(examples),
        "response_fraction": response,
        "lora_tensors": len(v),
    }
    if args.count_ops:
        row.update(count_ops(step))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--data", required=True, nargs="+", help="One or more JSONL files, each measured in turn.")
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--count-ops", action="store_true", help="Also profile one step: top-level aten ops dispatched.")
    ap.add_argument("--name", default="edge_step", help="Results file name under benchmarks/results.")
    ap.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    rows = [_run_worker(args, data, method) for data in args.data for method in args.methods.split(",")]
    ratios, table = _summarize(args, rows)
    header = ["data", "response share", "method", "median step (ms)", "ciders-fo / method", "step peak memory (MiB)"]
    if args.count_ops:
        header += ["top-level aten ops", "/ plain-lora", "aten ops outside aten", "/ plain-lora", "profiler events"]
    path = write_results(
        args.name,
        {"batch_size": args.batch_size, "seq_len": args.seq_len, "rows": rows, "ratios": ratios},
        table,
        header,
        "Targets (issue 3): ciders-fo / naive-fo <= 0.65, ciders-fo / plain-lora <= 1.2. Step peak memory is the "
        "rise of peak RSS over the loaded model during the timed steps (CUDA: max allocated). Targets (issue 19): "
        "ciders-fo's top-level aten ops (a proxy for GPU kernel launches) at most 2.5x plain-lora's.",
    )
    for k, r in ratios.items():
        print(f"{k}: {r:.2f}")
    print(f"wrote {path}")


def _run_worker(args, data: str, method: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", method, "--bundle", args.bundle, "--data", data]
    for flag in ("batch_size", "seq_len", "repeats", "warmup"):
        cmd += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    if args.count_ops:
        cmd.append("--count-ops")
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"worker {method} on {data} failed:\n{out.stderr[-2000:]}")
    row = {"data": data, **json.loads(out.stdout.strip().splitlines()[-1])}
    ops = f"  {row['top_level_aten_ops']} top-level aten ops" if args.count_ops else ""
    print(
        f"{Path(data).parent.name}/{Path(data).name} {method:11s} {row['step_s'] * 1000:8.1f} ms/step  "
        f"step peak {row['step_peak_mib']:.0f} MiB{ops}",
        file=sys.stderr,
    )
    return row


def _summarize(args, rows: list[dict]) -> tuple[dict, list[list[str]]]:
    """Ratios of ciders-fo's step time to every other method's and, with ops, every method's ops to plain LoRA's."""
    ratios, table = {}, []
    for data in args.data:
        by = {r["method"]: r for r in rows if r["data"] == data}
        fo, plain = by.get("ciders-fo"), by.get("plain-lora")
        for m, r in by.items():
            ratio = fo["step_s"] / r["step_s"] if fo else float("nan")
            if fo and m != "ciders-fo":
                ratios[f"{data}: ciders-fo / {m}"] = ratio
            line = [
                f"{Path(data).parent.name}/{Path(data).name}",
                f"{r['response_fraction']:.2f}",
                m,
                f"{r['step_s'] * 1000:.1f}",
                f"{ratio:.2f}",
                f"{r['step_peak_mib']:.0f}",
            ]
            if args.count_ops:
                line += _op_columns(r, plain, ratios, f"{data}: ops {m} / plain-lora")
            table.append(line)
    return ratios, table


def _op_columns(r: dict, plain: dict | None, ratios: dict, key: str) -> list[str]:
    """Both op counts of ``r`` and their ratios to plain LoRA's (also stored in ``r`` and ``ratios``)."""
    cols = []
    for what in ("top_level_aten_ops", "aten_ops_outside_aten"):
        ratio = r[what] / plain[what] if plain else float("nan")
        r[f"{what}_over_plain_lora"] = ratio
        if plain and r is not plain:
            ratios[f"{key} ({what})"] = ratio
        cols += [str(r[what]), f"{ratio:.2f}"]
    return cols + [str(r["profiler_events"])]


if __name__ == "__main__":
    main()
