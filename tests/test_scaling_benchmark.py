"""benchmarks/scaling.py's pure parts on a synthetic results dict: which measurements are due, the table,
the targets, and the report files. No model runs."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import common  # noqa: E402
import scaling  # noqa: E402
import scaling_report as sr  # noqa: E402

GIB = 2**30


def _train(step_s: float, peak_gib: float) -> dict:
    return {"settings": {"steps": 3}, "result": {"step_s": step_s, "peak_rss_bytes": int(peak_gib * GIB)}}


def _profile(depth: int, peak_gb: float) -> dict:
    settings = {"messenger_depth": depth, "drop_ratio": 0.5, "seq_len": 256, "batch_size": 1, "grad_accum": 4}
    settings |= {"dtype": "float32", "checkpointing": True}
    return {"settings": settings, "result": {"step_s": 9.0, "peak_rss_bytes": int(peak_gb * 1e9)}}


def _decode(ours: float, theirs: float) -> dict:
    rows = {"genai-int8": {"decode_tokens_per_s": ours, "first_token_s": 0.05}}
    rows["llamacpp-q8_0"] = {"decode_tokens_per_s": theirs, "first_token_s": 0.1}
    return {"settings": {}, "result": {"runtimes": rows}}


@pytest.fixture
def store(tmp_path) -> sr.Store:
    """Four models' files: Qwen2.5-1.5B's train and PEFT rows, SmolLM2-1.7B's profiles and prepare, a 135M
    decode below target and a Qwen3 one whose llama.cpp export was refused; written as the benchmark writes them."""
    s = sr.Store(tmp_path / "results")
    s.set_info("qwen2.5-1.5b", params=1_543_714_304, weights="random")
    s.save("qwen2.5-1.5b", "train/fp32", _train(2.0, 10.0))
    int8 = _train(2.5, 4.0)  # 0.40x fp32; 0.33x PEFT; step 1.25x
    int8["result"] |= {"packet_bytes": 40 * 1024, "packet_int8_bytes": 12 * 1024}
    s.save("qwen2.5-1.5b", "train/int8", int8)
    s.save("qwen2.5-1.5b", "peft/plain", _train(3.0, 12.0))
    s.save("qwen2.5-1.5b", "decode", _decode(90.0, 100.0))  # 0.9x llama.cpp
    s.set_info("smollm2-1.7b", params=1_711_376_384, weights="random")
    s.save("smollm2-1.7b", "profile/rpi5-8gb/int8", _profile(2, 2.4))
    s.save("smollm2-1.7b", "profile/rpi5-8gb/int4", _profile(2, 1.9))  # above 1.8 GB: fails
    s.save("smollm2-1.7b", "profile/cpu-laptop/int8", {"settings": _profile(6, 0)["settings"], "refused": "too big"})
    prepared = {"peak_rss_bytes": int(9.5e9), "layer_step_s": 1.0, "align_step_s": 2.0, "bundle_bytes": {"int8": 2**30}}
    s.save("smollm2-1.7b", "prepare", {"settings": {}, "result": prepared})
    s.set_info("smollm2-135m", params=134_515_008, weights="real")
    s.save("smollm2-135m", "decode", _decode(70.0, 100.0))  # 0.7x: fails
    s.set_info("qwen3-0.6b", params=596_049_920, weights="random")
    refused = _decode(80.0, 1.0)
    refused["result"]["runtimes"]["llamacpp-q8_0"] = {"refused": "no GGUF for qwen3"}  # the run goes on
    s.save("qwen3-0.6b", "decode", refused)
    return s


def test_targets_are_measured_against_what_each_requires(store):
    checks = {c["target"]: c for c in sr.targets(store.models())}
    qwen = [c for t, c in checks.items() if t.startswith("Qwen2.5-1.5B")]
    assert [round(c["measured"], 3) for c in qwen] == [0.4, 0.333, 1.25] and all(c["pass"] for c in qwen)
    rpi = {t.split("(")[1].split()[0]: c for t, c in checks.items() if "rpi5-8gb" in t}
    assert rpi["int8"]["measured"] == pytest.approx(2.4) and rpi["int8"]["pass"] is True
    assert rpi["int4"]["measured"] == pytest.approx(1.9) and rpi["int4"]["pass"] is False
    jetson = [c for t, c in checks.items() if "jetson" in t]
    laptop = next(c for t, c in checks.items() if "cpu-laptop" in t)
    assert all(c["pass"] is None and c["measured"] is None for c in [*jetson, laptop])  # not measured: no verdict
    prepare = next(c for t, c in checks.items() if "prepare peak" in t and "drop 0.5" in t)
    assert prepare["measured"] == pytest.approx(9.5) and prepare["pass"] is True
    at_laptop = checks["SmolLM2-1.7B, cpu-laptop's split (the issue's 19.2 GB): prepare peak RSS"]
    assert at_laptop["measured"] is None and at_laptop["pass"] is None
    decode = {t.split(":")[0]: c["pass"] for t, c in checks.items() if "decode" in t}
    assert decode == {"qwen2.5-1.5b": True, "smollm2-135m": False, "qwen3-0.6b": None}


def test_the_table_marks_random_weights_and_says_what_was_refused(store):
    models = store.models()
    assert list(models) == ["smollm2-135m", "qwen3-0.6b", "qwen2.5-1.5b", "smollm2-1.7b"]  # by parameters
    rows = {r[0]: dict(zip(sr.MAIN_HEADER, r, strict=True)) for r in sr.main_rows(models)}
    assert set(rows) == {"smollm2-135m", "qwen3-0.6b†", "qwen2.5-1.5b†", "smollm2-1.7b†"}
    assert rows["qwen3-0.6b†"]["AdapFu llama.cpp Q8_0 tok/s (first token)"] == "refused"
    q = rows["qwen2.5-1.5b†"]
    assert q["params"] == "1.54B" and q["train int8"] == "2.50 s · 4.00 GiB" and q["train int4"] == "–"
    assert q["AdapFu GenAI int8 tok/s (first token)"] == "90.0 (50 ms)" and q["packet KiB (fp32 / int8)"] == "40 / 12"
    assert rows["smollm2-1.7b†"]["bundle MiB (int8 / int4)"] == "1024"
    profiles = sr.profile_rows(models)
    assert [r[1:3] for r in profiles] == [["rpi5-8gb", "2, 0.5"]] * 2 + [["cpu-laptop", "6, 0.5"]]
    assert profiles[-1][5] == "refused" and profiles[0][7] == "2.40"
    assert sr.problems(models) == [
        "- qwen3-0.6b, decode llamacpp-q8_0: refused: no GGUF for qwen3",
        "- smollm2-1.7b, profile/cpu-laptop/int8: refused: too big",
    ]


def test_store_redoes_only_what_is_missing_failed_or_made_otherwise(tmp_path):
    s = sr.Store(tmp_path)
    settings = {"steps": 3, "runtimes": ("genai-int8", "llamacpp-q8_0")}  # a tuple: stored as a list, still equal
    assert s.needed("m", "train/int8", settings)
    s.save("m", "train/int8", {"settings": settings, "result": {"step_s": 1.0}})
    assert not s.needed("m", "train/int8", settings)
    assert s.needed("m", "train/int8", {**settings, "steps": 5})  # other settings: measured again
    assert s.needed("m", "train/int8", settings, force=True)
    s.save("m", "decode", {"settings": settings, "refused": "no GGUF for gemma3"})
    assert not s.needed("m", "decode", settings)  # the toolkit's refusal is an outcome, kept
    s.save("m", "aggregate", {"settings": settings, "failed": "killed (out of memory?)"})
    assert s.needed("m", "aggregate", settings)  # a crash is not
    s.set_info("m", params=5)
    assert s.load("m")["params"] == 5 and set(s.load("m")["measurements"]) == {"train/int8", "decode", "aggregate"}
    assert not list(s.root.glob("*.tmp"))


def test_a_job_measures_what_only_asks_for_and_each_thing_once(tmp_path):
    args = argparse.Namespace(only={"train"}, force=True, work=tmp_path)
    job = scaling.Job(args, sr.Store(tmp_path), "m")
    assert not job.due("prepare", {})  # not asked for
    assert job.due("train/int8", {})  # forced
    job.record("train/int8", {}, {"result": {"step_s": 1.0, "peak_rss_bytes": GIB}})
    assert not job.due("train/int8", {})  # forced, but measured in this invocation already
    assert job.due("train/int4", {})
    args.only = {"profiles"}
    assert job.due("profile/rpi5-8gb/int8", {}) and not job.due("peft/plain", {})


def test_report_writes_the_table_targets_and_plot(store, tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path / "out")
    args = argparse.Namespace(results=tmp_path / "out")
    path = scaling.report(args, store)
    md = path.read_text()
    assert "| qwen2.5-1.5b† | 1.54B |" in md and "## Targets (issue 57)" in md and "**fail**" in md
    assert (tmp_path / "out" / "scaling.png").stat().st_size > 0
    payload = json.loads((tmp_path / "out" / "scaling.json").read_text())
    assert set(payload["models"]) == {"smollm2-135m", "qwen3-0.6b", "qwen2.5-1.5b", "smollm2-1.7b"}
    assert len(payload["targets"]) == 10 + 3  # the fixed targets, and one decode ratio per model that has one


def test_the_step_median_leaves_out_the_first_step():
    assert sr.median([9.0, 1.0, 3.0]) == 2.0
    assert sr.median([4.0]) == 4.0 and sr.median([]) is None
