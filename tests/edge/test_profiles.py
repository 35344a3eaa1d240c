import pytest
from transformers import LlamaConfig

from ciders_edge.errors import ConfigError
from ciders_edge.memory import estimate_memory
from ciders_edge.profiles import DeviceProfile, detect_profile, list_profiles, load_profile

SHIPPED = {"rpi5-8gb", "cpu-laptop", "jetson-orin-nano-8gb", "jetson-agx-orin-64gb", "cuda-24gb"}


def test_shipped_profiles_load():
    assert {p.name for p in list_profiles()} >= SHIPPED
    assert load_profile("jetson-orin-nano-8gb").target == "jetson"


def test_profile_validation(tmp_path):
    with pytest.raises(ConfigError, match="`target` must be one of"):
        DeviceProfile(target="tpu")
    with pytest.raises(ConfigError, match="`drop_ratio` must be in"):
        DeviceProfile(drop_ratio=1.0)
    bad = tmp_path / "bad.toml"
    bad.write_text("name = [")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_profile(str(bad))
    with pytest.raises(ConfigError, match="unknown profile 'nope'"):
        load_profile("nope")


def test_unknown_keys_are_warned_and_dropped(tmp_path):
    f = tmp_path / "p.toml"
    f.write_text('name = "x"\nturbo = true\n')
    with pytest.warns(UserWarning, match="turbo"):
        assert load_profile(str(f)).name == "x"


def test_detect_on_a_cpu_machine(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert detect_profile().target == "cpu"


def test_memory_estimate_grows_with_sequence_and_dtype():
    cfg = LlamaConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        num_hidden_layers=30,
        tie_word_embeddings=True,
    )
    short = estimate_memory(cfg, 25, 6, DeviceProfile(seq_len=128, frozen_weights="dequantized"))
    long = estimate_memory(cfg, 25, 6, DeviceProfile(seq_len=1024, frozen_weights="dequantized"))
    half = estimate_memory(cfg, 25, 6, DeviceProfile(seq_len=128, dtype="bfloat16", frozen_weights="dequantized"))
    assert long.activations > 4 * short.activations
    assert half.weights * 2 == short.weights
    # SmolLM2-135M's AdapEmu: ~25 layers of ~3.5M parameters + 28M embedding, in float32.
    assert 0.3e9 < short.weights < 0.5e9
    assert not estimate_memory(cfg, 25, 6, DeviceProfile(memory_budget_gb=0.1)).fits


def test_profiles_table_shows_every_name_whole_when_piped():
    """Piped output is 80 columns wide: the key column must never be cut (`cpu-l…`), so names can be read."""
    import os
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "ciders_edge", "profiles"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "COLUMNS": "80"},
    )
    table = out.stdout + out.stderr
    assert "…" not in table and max(map(len, table.splitlines())) <= 80
    rows = {line.split()[0] for line in table.splitlines()[1:] if line.strip()}
    assert SHIPPED <= rows


def test_a_gpu_profile_without_cuda_says_it_runs_on_the_cpu(tiny_run, monkeypatch):
    """`--profile cuda-24gb` on a machine without CUDA used to run on the CPU without a word."""
    import torch
    from typer.testing import CliRunner

    from ciders_edge import profiles
    from ciders_edge.cli import app as edge

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(profiles, "_NOTED_CPU", set())
    bundle = tiny_run[0] / "bundles" / "cpu-laptop" / "round-0000"
    args = [
        "infer",
        "--prompt",
        "hi",
        "--bundle",
        str(bundle),
        "--global",
        "--max-new-tokens",
        "1",
        "--runtime",
        "torch",
    ]
    r = CliRunner().invoke(edge, [*args, "--profile", "cuda-24gb"])
    assert r.exit_code == 0, r.output
    notice = "notice: profile cuda-24gb targets cuda, but torch sees no CUDA device here; running on the CPU"
    assert r.stderr.count(notice) == 1, r.stderr
    r = CliRunner().invoke(edge, [*args, "--profile", "cpu-laptop"])
    assert r.exit_code == 0 and "notice: profile" not in r.stderr, r.output
