"""Every supported family (Llama 3.2, Qwen2, Qwen3, Mistral, Gemma 3) on a tiny random model of its real
config's features (tests/families.py): the two-half forward equals the model's own, and the whole way
through the real entry points, prepare -> train -> aggregate -> export (hf, genai, gguf adapter and merged)
-> infer. Where llama.cpp is installed (the llamacpp extra), its own loader runs the GGUFs."""

import json
import subprocess
import sys

import pytest
import torch
from families import FAMILIES, build_family
from llamacpp_logits import llama_logits

from ciders_cloud import RunConfig, prepare
from ciders_cloud.round.aggregate import aggregate_files
from ciders_edge.data.records import collate, load_examples
from ciders_edge.errors import ExportError
from ciders_edge.formats.bundle import Bundle
from ciders_edge.formats.export_folder import Export
from ciders_edge.inference.exported import load_exported_tokenizer
from ciders_edge.inference.generation import GenerationSettings
from ciders_edge.inference.infer import answer
from ciders_edge.inference.runtime import open_runtime
from ciders_edge.model.forward import backbone_hidden, messenger_logits, messenger_loss, run_backbone
from ciders_edge.model.lora import MESSENGER_ADAPTER, LoraSettings, attach_lora, set_trainable
from ciders_edge.model.sources import load_model, load_tokenizer, smollm2_gguf
from ciders_edge.model.split import SplitSpec, build_adapemu
from ciders_edge.training.train import RoundOptions, train
from export import export_model
from export.check import check_inputs
from export.gguf import gguf_torch_model

NAMES = list(FAMILIES)
WINDOWED = {"mistral", "gemma3"}  # sliding window 16: it matters at the 48 tokens below
PROMPT = "What is the date 3 days after 2024-05-17?"
WIDE_HEADS = {"qwen3", "gemma3"}  # head_dim > hidden / heads: also exported to ONNX (its runtime sizes the cache)


@pytest.fixture(scope="session")
def family_path(tmp_path_factory, tiny_path):
    """``family_path(name)``: the folder of family ``name``'s tiny model, written once per session."""
    root, built = tmp_path_factory.mktemp("families"), {}

    def get(name: str):
        if name not in built:
            built[name] = build_family(name, tiny_path, root / name)
        return built[name]

    return get


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of 48 tokens, the second right-padded after 40."""
    ids = torch.randint(0, vocab, (2, 48), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 40:] = 0
    return ids, mask


def _halves(model, ids, mask, start: int) -> torch.Tensor:
    hidden, ctx = backbone_hidden(model, ids, mask, start)
    return messenger_logits(model, hidden, ctx, start)


@pytest.mark.parametrize("name", NAMES)
@torch.no_grad()
def test_the_two_halves_are_the_models_own_forward(name, family_path):
    """backbone_hidden + messenger_logits is the model's forward to the bit, on the model and on its AdapEmu
    (which keeps each layer's attention kind); a sliding window really masks at this length."""
    model = load_model(family_path(name)).eval()
    ids, mask = _batch(model.config.vocab_size)
    whole = model(input_ids=ids, attention_mask=mask).logits
    for start in (0, 3, 8):
        assert torch.equal(_halves(model, ids, mask, start), whole), (name, start)
    emu = build_adapemu(model, SplitSpec(8, 2, 0.5))
    if name == "gemma3":
        assert emu.config.layer_types == ["sliding_attention", "full_attention", "full_attention",
                                          "sliding_attention", "full_attention"]  # fmt: skip
    assert torch.equal(_halves(emu, ids, mask, 3), emu(input_ids=ids, attention_mask=mask).logits)
    if name in WINDOWED:  # the same weights attending to everything: other logits past the window
        model.config.sliding_window = 1024
        wide = _halves(model, ids, mask, 0)
        assert torch.equal(wide[:, :16], whole[:, :16]) and not torch.allclose(wide[:, 20:], whole[:, 20:])


def test_checkpointed_messenger_gives_the_same_loss_and_gradients(family_path, demo_dir, tokenizer):
    """Activation checkpointing recomputes each messenger layer in backward (its forward runs twice) and
    changes nothing: the loss and every LoRA gradient are identical, LoRA dropout included."""
    emu = build_adapemu(load_model(family_path("gemma3")), SplitSpec(8, 2, 0.5))
    model = attach_lora(emu, SplitSpec(8, 2, 0.5), LoraSettings(dropout=0.2))
    set_trainable(model, MESSENGER_ADAPTER)
    model.train()
    batch = collate(load_examples(demo_dir / "dates" / "train.jsonl", tokenizer, 64)[:4], tokenizer.pad_token_id)
    with torch.no_grad():
        bb = run_backbone(model, batch, 3)
    calls = []
    layer = model.get_base_model().model.layers[4]
    layer.register_forward_pre_hook(lambda *_: calls.append(1))  # recomputation stops early: no post hook
    results = []
    for checkpoint in (False, True):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(7)
        loss = messenger_loss(model, bb, 3, checkpoint=checkpoint)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        results.append((loss.detach(), grads, len(calls)))
        calls.clear()
    (loss0, g0, n0), (loss1, g1, n1) = results
    assert (n0, n1) == (1, 2)
    assert torch.equal(loss0, loss1) and g0.keys() == g1.keys() and len(g0) == 2 * 7 * 2
    assert all(torch.equal(g0[k], g1[k]) for k in g0) and any(g.abs().sum() > 0 for g in g0.values())


@pytest.fixture(scope="module")
def family_run(family_path, demo_dir, tmp_path_factory):
    """``family_run(name)``: family ``name`` prepared, one edge trained on round 0, the round aggregated, and
    the edge's personalized model exported (hf, genai, gguf adapter on AdapFu, merged gguf of the AdapEmu);
    each family once per module."""
    runs = {}

    def get(name: str) -> dict:
        if name not in runs:
            runs[name] = _run_family(name, family_path(name), demo_dir, tmp_path_factory.mktemp(f"run-{name}"))
        return runs[name]

    return get


def _run_family(name: str, model, demo_dir, root) -> dict:
    run = RunConfig(model=str(model), profiles=["cpu-laptop"], messenger_depth=2, drop_ratio=0.5,
                    public_data=str(demo_dir / "public.jsonl"), layer_steps=1, align_steps=1,
                    takd={"seq_len": 64, "batch_size": 2, "holdout": 4},
                    hyperparameters={"takd_steps": 1, "local_steps": 2, "eta": 1e-2})  # fmt: skip
    prepare(run, root / "run")
    bundle = root / "run" / "bundles" / "cpu-laptop" / "round-0000"
    trained = train(bundle, demo_dir / "dates" / "train.jsonl", root / "state", root / "a.pkt", RoundOptions("a"))
    out = {"root": root, "bundle": bundle, "state": root / "state", "train": trained.summary}
    out["aggregate"] = aggregate_files(root / "run", [root / "a.pkt"])
    exports = {"hf": ("hf", "none", "full", False), "genai": ("genai", "none", "full", False),
               "gguf-adapter": ("gguf", "f16", "full", False), "gguf-merged": ("gguf", "f16", "emu", True)}  # fmt: skip
    if name in WIDE_HEADS:
        exports["onnx"] = ("onnx", "none", "emu", False)
    for key, (fmt, quantize, backbone, merged) in exports.items():
        try:
            out[key] = export_model(bundle, root / "state", fmt, root / key, quantize, backbone=backbone, merged=merged)
        except ExportError as err:
            out[key] = err
    return out


@pytest.mark.parametrize("name", NAMES)
def test_a_family_goes_from_prepare_to_infer(name, family_run):
    """prepare -> train -> aggregate -> export -> infer through the public entry points: each export computes
    what the unmerged personalized model computes, and answers as torch does; llama.cpp's architectures
    get GGUFs, a Mistral with a sliding window (which llama.cpp's llama graph ignores) is refused in one line."""
    r = family_run(name)
    assert torch.isfinite(torch.tensor(r["train"]["loss_last"])) and r["aggregate"]["next_round"] == 1
    b0, b1 = Bundle.load(r["bundle"]), Bundle.load(r["bundle"].parent / "round-0001")
    assert b1.manifest["model_type"] == FAMILIES[name][0] and b1.manifest["split"]["kept"] == [0, 2, 5]
    v0, v1 = b0.messenger_lora(), b1.messenger_lora()
    assert v0.keys() == v1.keys() and any(not torch.equal(v0[k], v1[k]) for k in v0)  # eq. (12) moved v
    assert r["hf"]["check"]["max_abs_logit_diff"] < 1e-4
    assert r["genai"]["check"]["max_abs_logit_diff"] < 1e-3 and r["genai"]["check"]["greedy_agreement"] == 1.0
    if name == "mistral":
        for key in ("gguf-adapter", "gguf-merged"):
            assert isinstance(r[key], ExportError) and "16-token sliding window" in str(r[key])
            assert len(str(r[key]).splitlines()) == 1 and not (r["root"] / key).exists()
    else:
        assert Export.load(r["gguf-adapter"]["out"]).manifest["gguf"]["kind"] == "adapter"
        for key in ("gguf-adapter", "gguf-merged"):  # f16 weights
            assert r[key]["check"]["greedy_agreement"] >= 0.95 and r[key]["check"]["max_abs_logit_diff"] < 0.05
    settings = GenerationSettings(max_new_tokens=8, min_new_tokens=8)
    rt = open_runtime("torch", bundle=r["bundle"], state=r["state"], backbone="full")
    text = answer(rt, PROMPT, settings).text
    for key in ("hf", "genai"):
        rt = open_runtime(None, export=r[key]["out"])
        assert (rt.name, answer(rt, PROMPT, settings).text) == ({"hf": "torch", "genai": "genai"}[key], text)
    if name in WIDE_HEADS:  # the AdapEmu in ONNX Runtime, decoding with its KV cache
        assert r["onnx"]["check"]["max_abs_logit_diff"] < 1e-4
        emu = answer(open_runtime("torch", bundle=r["bundle"], state=r["state"], backbone="emu"), PROMPT, settings)
        assert answer(open_runtime(None, export=r["onnx"]["out"]), PROMPT, settings).text == emu.text


@pytest.fixture(scope="module")
def llama_cpp():
    return pytest.importorskip("llama_cpp", reason="llama-cpp-python (the llamacpp extra) is not installed")


@pytest.mark.parametrize("name", [n for n in NAMES if n != "mistral"])
def test_llama_cpp_runs_each_familys_ggufs(name, llama_cpp, family_run):
    """llama.cpp's own loader takes the merged GGUF and the adapter on its base, and computes what
    transformers computes from the same files (metadata, names, norms, rope, window pattern all right)."""
    r = family_run(name)
    ids = check_inputs(load_exported_tokenizer(Export.load(r["hf"]["out"])))[0][0].tolist()
    assert len(ids) > 40  # past the 16-token window
    for key, backbone in (("gguf-adapter", "full"), ("gguf-merged", "emu")):
        exp = Export.load(r[key]["out"])
        config = _config(r["bundle"], backbone)
        with torch.no_grad():
            ref = gguf_torch_model(exp.path, exp.manifest["gguf"], config)(torch.tensor([ids])).logits[0]
        got = llama_logits(ids, *exp.gguf_files())
        assert float((got - ref).abs().max()) < 5e-3, key  # f16 weights; measured 2e-4 to 1.4e-3 (logits ~0.1)
    cmd = [sys.executable, "-m", "ciders_edge", "infer", "--export", r["gguf-merged"]["out"], "--prompt", PROMPT,
           "--max-new-tokens", "4", "--json"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)  # its own process, as test_gguf_export
    assert done.returncode == 0, done.stderr[-2000:]
    run = json.loads(done.stdout.strip().splitlines()[-1])
    assert run["runtime"] == "llamacpp-f16" and 0 < run["new_tokens"] <= 4


def test_llama_cpp_runs_a_mistral_without_a_window(llama_cpp, family_path, tmp_path):
    """A Mistral with no sliding window (as Mistral 7B v0.3) is llama.cpp's llama architecture with an untied
    head: its merged GGUF computes in llama.cpp what transformers computes."""
    from export.gguf_tensors import SmolLM2Vocab, write_model

    model = load_model(family_path("mistral")).eval()
    model.config.sliding_window = None
    assert not model.config.tie_word_embeddings
    write_model(tmp_path / "m.gguf", model.state_dict(), model.config, SmolLM2Vocab.of(smollm2_gguf()), "f16", "m", {})
    ids = check_inputs(load_tokenizer(family_path("mistral")))[0][0].tolist()
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids])).logits[0]
    assert float((llama_logits(ids, tmp_path / "m.gguf") - ref).abs().max()) < 5e-3


def test_llama_cpp_loads_a_model_with_more_embedding_rows_than_tokens(llama_cpp, family_path, tmp_path):
    """Qwen's configs have more rows than their tokenizer has tokens (151,936 for 151,665): the GGUF pads the
    token list with unused [PAD<i>] tokens, as llama.cpp's converter does, or llama.cpp refuses the file."""
    import gguf

    from export.gguf_tensors import SmolLM2Vocab, write_model

    model = load_model(family_path("qwen2")).eval()
    tokens = model.config.vocab_size
    model.resize_token_embeddings(tokens + 64)
    write_model(tmp_path / "q.gguf", model.state_dict(), model.config, SmolLM2Vocab.of(smollm2_gguf()), "f16", "q", {})
    field = gguf.GGUFReader(tmp_path / "q.gguf").fields["tokenizer.ggml.tokens"]
    assert len(field.data) == tokens + 64 and field.contents()[-1] == f"[PAD{tokens + 63}]"
    ids = check_inputs(load_tokenizer(family_path("qwen2")))[0][0].tolist()
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids])).logits[0]
    assert float((llama_logits(ids, tmp_path / "q.gguf") - ref).abs().max()) < 5e-3


def _config(bundle, backbone: str):
    """The transformers config of the exported model: the AdapEmu's, or the full model's."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(bundle / "full_backbone" if backbone == "full" else bundle)


@pytest.mark.parametrize(
    ("model_type", "fields", "gguf_refuses", "genai_refuses"),
    [
        ("mistral", {"sliding_window": None}, None, None),  # Mistral 7B v0.3: llama.cpp's llama graph
        ("mistral", {"sliding_window": 4096}, "a 4096-token sliding window", None),  # v0.1 at 32k
        ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "RoPE scaling 'dynamic'",
         "RoPE scaling 'dynamic'"),
        ("qwen2", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}},
         "RoPE scaling 'yarn'", None),
        ("gemma3_text", {"query_pre_attn_scalar": 224}, "query_pre_attn_scalar 224 != head_dim 256", None),
    ],
)  # fmt: skip
def test_each_exporter_refuses_what_its_runtime_would_compute_otherwise(model_type, fields, gguf_refuses,
                                                                        genai_refuses):  # fmt: skip
    from transformers import AutoConfig

    from export.genai import check_genai
    from export.gguf_arch import gguf_arch

    arch = {"mistral": "MistralForCausalLM", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "gemma3_text": "Gemma3ForCausalLM"}[model_type]  # fmt: skip
    config = AutoConfig.for_model(model_type, architectures=[arch], **fields)
    for check, refuses in ((gguf_arch, gguf_refuses), (check_genai, genai_refuses)):
        if refuses is None:
            check(config, "B")
            continue
        with pytest.raises(ExportError) as err:
            check(config, "B")
        assert str(err.value).startswith("B: ") and refuses in str(err.value) and "\n" not in str(err.value)
