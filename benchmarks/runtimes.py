"""On-device runtimes of a personalized model, side by side, with the export correctness checks.

    python benchmarks/runtimes.py --bundle RUN/bundles/cpu-laptop/round-0002 --state CLIENT_STATE

Runs ``ciders-edge bench``'s code (every runtime in its own process, same prompt, same number of
decoded tokens, medians) and checks, on the real model, what the tests check on `tiny`:
ONNX fp32 logits within 1e-3 of the AdapEmu, int8 greedy agreement >= 95% (optimum ONNX and
GenAI), and the target ONNX int8 decode >= 2.5x torch eager fp32 tokens/s. ``genai-int8`` is the
default on-device runtime (GenAI's own decode loop); issue 28 compares it with llama.cpp's Q8_0.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import write_results  # noqa: E402

TARGET_SPEEDUP = 2.5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--state", default=None, help="client state (default: the global messenger)")
    ap.add_argument("--runtimes", default="torch,onnx,onnx-int8,onnx-int8-dynamic,genai-int8")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--exports", default=None, help="keep/reuse the exports here")
    args = ap.parse_args()

    from ciders_edge.cli_utils import quiet_libraries
    from ciders_edge.progress import status
    from export.bench import BenchSettings, bench

    quiet_libraries()
    settings = BenchSettings(tuple(args.runtimes.split(",")), args.new_tokens, args.repeats, train_steps=3)
    result = bench(args.bundle, args.state, None, settings, args.exports, stage=status)
    rows = {r["runtime"]: r for r in result["runtimes"]}
    onnx, int8, base, genai = rows.get("onnx"), rows.get("onnx-int8"), rows.get("torch"), rows.get("genai-int8")
    checks = {
        "onnx_max_abs_logit_diff_below_1e-3": onnx["check"]["max_abs_logit_diff"] < 1e-3 if onnx else None,
        "int8_greedy_agreement_at_least_95pct": int8["check"]["greedy_agreement"] >= 0.95 if int8 else None,
        "genai_int8_greedy_agreement_at_least_95pct": genai["check"]["greedy_agreement"] >= 0.95 if genai else None,
        f"int8_decode_at_least_{TARGET_SPEEDUP}x_torch": int8["speedup_vs_torch"] >= TARGET_SPEEDUP
        if int8 and base
        else None,
    }
    table = [
        [
            r["runtime"],
            f"{r['files_bytes'] / 2**20:.0f}",
            f"{r['first_token_s'] * 1000:.0f}",
            f"{r['decode_tokens_per_s']:.1f}",
            f"{r['speedup_vs_torch']:.2f}x" if r["speedup_vs_torch"] is not None else "-",
            f"{r['peak_rss_mib']:.0f}",
            f"{r['check']['max_abs_logit_diff']:.2e}" if r.get("check") else "reference",
            f"{r['check']['greedy_agreement']:.1%}" if r.get("check") else "reference",
        ]
        for r in result["runtimes"]
    ]
    t = result["train_step"]
    notes = (
        f"Decode: {result['new_tokens']} new tokens, median of {result['repeats']} generations, each runtime in its "
        f"own process. Training step ({t['solver']}, batch {t['batch_size']}x{t['seq_len']}): "
        f"{t['step_s']:.2f} s median.\n\nChecks: " + ", ".join(f"{k}: {v}" for k, v in checks.items())
    )
    header = ["runtime", "MiB", "first token ms", "decode tok/s", "vs torch", "peak RSS MiB", "max |dlogit|", "agree"]
    path = write_results("runtimes", {**result, "checks": checks}, table, header, notes)
    print(path.read_text())
    if any(v is False for v in checks.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
