"""``export --format peft``: AdapFu's personalized messenger as a standard PEFT LoRA adapter of the base model.

Loaded by PEFT itself over the base Hugging Face model it must give the merged export's logits, merge, and
convert with llama.cpp's own ``convert_lora_to_gguf.py`` into the adapter ``--format gguf`` writes."""

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from ciders_edge.cli import app as edge_app
from ciders_edge.formats.bundle import Bundle
from ciders_edge.formats.export_folder import Export
from ciders_edge.model.split import SplitSpec
from export import export_model

runner = CliRunner()


@pytest.fixture(scope="module")
def exports(trained, tmp_path_factory):
    """The tiny run's personalized messenger as a PEFT adapter (through the CLI) and as a merged hf folder
    (tiny's frozen weights are stored in fp32, so AdapFu's base is tiny itself)."""
    bundle, state = trained
    root = tmp_path_factory.mktemp("peft")
    args = ["export", "--bundle", str(bundle), "--state", str(state), "--out", str(root / "peft")]
    r = runner.invoke(edge_app, [*args, "--format", "peft", "--backbone", "full", "--json"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.output.strip().splitlines()[-1])
    return {"peft": summary, "hf": export_model(bundle, state, "hf", root / "hf", backbone="full")}


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(0))


def test_the_adapter_is_peft_s_own_format_for_the_messenger_layers(trained, exports, tiny_path):
    folder = Path(exports["peft"]["out"])
    config = json.loads((folder / "adapter_config.json").read_text())
    m = Bundle.load(trained[0]).manifest
    split = SplitSpec.from_dict(m["split"])
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert config["layers_to_transform"] == list(range(split.n - split.a, split.n)) == [6, 7]
    assert config["r"] == m["lora"]["rank"] and config["lora_alpha"] == m["lora"]["alpha"]
    assert config["base_model_name_or_path"] == "tiny"
    tensors = load_file(folder / "adapter_model.safetensors")
    layers = {int(k.split(".layers.")[1].split(".")[0]) for k in tensors}
    assert layers == {6, 7} and all(k.startswith("base_model.model.model.layers.") for k in tensors)
    assert all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in tensors)
    assert Export.load(folder).manifest["peft"]["layers"] == [6, 7]
    assert exports["peft"]["check"]["max_abs_logit_diff"] < 1e-5  # read back by PEFT over AdapFu's own base


def test_peft_over_the_base_model_gives_the_merged_export_s_logits(exports, tiny_path):
    merged = AutoModelForCausalLM.from_pretrained(exports["hf"]["out"]).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, exports["peft"]["out"]).eval()
    ids = _ids(base.config.vocab_size)
    want = _logits(merged, ids)
    assert float((_logits(model, ids) - want).abs().max()) <= 1e-4
    plain = _logits(AutoModelForCausalLM.from_pretrained(tiny_path), ids)
    assert float((plain - want).abs().max()) > 1e-3  # the adapter changes the model: the check can fail
    assert float((_logits(model.merge_and_unload(), ids) - want).abs().max()) <= 1e-4


def test_the_adamemu_has_no_base_model_and_is_refused(trained, tmp_path):
    bundle, state = trained
    out = tmp_path / "emu"
    args = ["export", "--bundle", str(bundle), "--state", str(state), "--out", str(out), "--format", "peft"]
    r = runner.invoke(edge_app, [*args, "--backbone", "emu"])
    assert r.exit_code != 0 and "needs --backbone full" in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1 and not out.exists()
    r = runner.invoke(edge_app, [*args, "--backbone", "full", "--quantize", "int8"])
    assert r.exit_code != 0 and "--quantize applies to" in r.output and not out.exists()


def test_infer_explains_how_to_run_a_peft_adapter(exports):
    r = runner.invoke(edge_app, ["infer", "--export", exports["peft"]["out"], "--prompt", "hi"])
    assert r.exit_code != 0 and "PeftModel.from_pretrained" in r.output and "Traceback" not in r.output


def _llama_cpp_source() -> Path | None:
    found = sorted((Path(sys.prefix) / "llama-cpp-src").glob("*/vendor/llama.cpp/convert_lora_to_gguf.py"))
    return found[0].parent if found else None


def test_llama_cpp_converts_it_into_the_adapter_export_writes(trained, exports, tiny_path, tmp_path):
    src = _llama_cpp_source()
    if src is None:
        pytest.skip("llama.cpp's source (make llamacpp) is not installed")
    out = tmp_path / "converted.gguf"
    cmd = [sys.executable, str(src / "convert_lora_to_gguf.py"), exports["peft"]["out"], "--base", str(tiny_path)]
    done = subprocess.run([*cmd, "--outfile", str(out), "--outtype", "f32"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    ours = export_model(*trained, "gguf", tmp_path / "ours", "f16", backbone="full")
    theirs = {t.name: np.array(t.data, dtype=np.float32) for t in gguf.GGUFReader(out).tensors}
    mine = {
        t.name: np.array(t.data, dtype=np.float32) for t in gguf.GGUFReader(Path(ours["out"]) / "adapter.gguf").tensors
    }
    assert sorted(theirs) == sorted(mine) and len(mine) == 2 * 2 * 7  # layers 6, 7: A and B of seven targets
    for name, t in mine.items():
        assert t.shape == theirs[name].shape, name
        np.testing.assert_allclose(theirs[name], t, atol=1e-6, err_msg=name)
