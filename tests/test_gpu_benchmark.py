"""benchmarks/gpu.py, the offline GPU benchmark, as a smoke test on the CPU: tiny shapes, one repeat,
and the compiled decode through dynamo's eager backend (seconds, not inductor's minute)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_benchmark_quick_on_cpu(tmp_path, tiny_path):
    from ciders_edge.model.sources import ciders_home

    tokenizer = ciders_home() / "models" / "smollm2-tokenizer"  # built with `tiny`
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "gpu.py"),
        "--device",
        "cpu",
        "--quick",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--compile-backend",
        "eager",
        "--tokenizer",
        str(tokenizer),
        "--results",
        str(tmp_path),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=170, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_quick.json").read_text())
    assert (tmp_path / "gpu_quick.md").is_file()

    steps = {(r["method"], r["batch"], r["seq_len"]): r for r in result["edge_steps"]}
    methods = ("ciders-fo", "naive-fo", "plain-lora", "ciders-fd")
    assert set(steps) == {(m, b, t) for m in methods for b, t in ((2, 64), (1, 32))}
    assert all(r["step_s"] > 0 for r in steps.values())
    assert set(result["ratios"]) == {"2x64", "1x32"}
    assert {"ciders-fo/naive-fo", "ciders-fo/plain-lora"} <= set(result["ratios"]["2x64"])

    decode = {r["requested"]: r for r in result["decode"]}
    assert decode["eager"]["decode"] == decode["auto"]["decode"] == "eager"  # a CPU keeps eager decoding
    assert decode["compiled"]["decode"] == "compiled"  # forced: the static-cache path ran without falling back
    for r in decode.values():
        assert r["decode_tokens_per_s"] > 0 and r["first_token_s"] > 0 and r["first_call_s"] > 0

    assert [r["device"] for r in result["takd"]] == ["cpu"] and result["takd"][0]["steps_per_s"] > 0
    assert set(result["targets"]) == {"fo_over_naive", "fo_over_plain", "decode_tokens_per_s", "first_token_s"}
