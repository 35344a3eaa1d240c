"""`export --format gguf` on `tiny`: adapter and merged GGUFs read back, agree with the HF export, run in llama.cpp.

The llama.cpp tests need ``llama_cpp`` (the ``llamacpp`` extra) and, for the converter, llama.cpp's source
(``$LLAMA_CPP_SOURCE``, or the sdist's vendor folder that ``make llamacpp`` unpacks in the venv); they skip,
saying why, otherwise.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch
from llamacpp_logits import llama_logits
from typer.testing import CliRunner

import export.gguf
from ciders_edge.cli import app as edge_app
from ciders_edge.formats.bundle import Bundle
from ciders_edge.formats.export_folder import Export
from ciders_edge.inference.personalize import load_personalized
from ciders_edge.model import sources
from ciders_edge.model.lora import MESSENGER_ADAPTER, lora_state
from export import export_model
from export.check import check_inputs
from export.gguf import gguf_torch_model
from export.gguf_tensors import SmolLM2Vocab, permute, unpermute

runner = CliRunner()
PROMPT = [{"role": "user", "content": "What is the date 3 days after 2024-05-17?"}]
LAYERS = 8  # tiny: messenger layers 6 and 7 of the full model


@pytest.fixture(scope="module")
def exports(trained, tmp_path_factory):
    bundle, state = trained
    root = tmp_path_factory.mktemp("gguf")
    out = {"hf": export_model(bundle, state, "hf", root / "hf", backbone="full")}
    # base.gguf in f16: llama.cpp's AMX kernels crash on tiny's 64-wide q8_0 weights (SIGSEGV in decode;
    # fine with use_extra_bufts off); q8_0 is the merged model's
    out["adapter"] = export_model(bundle, state, "gguf", root / "adapter", "f16", backbone="full")
    for q in ("f16", "q8_0"):
        out[q] = export_model(bundle, state, "gguf", root / q, q, backbone="full", merged=True)
    out["emu"] = export_model(bundle, state, "gguf", root / "emu", "q4_0", backbone="emu")  # always merged
    return out


def _model_files(folder: Path) -> list[str]:
    """The folder's files less the Hugging Face tokenizer's (which every export carries)."""
    tokenizer = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt"}
    assert tokenizer - {"vocab.json", "merges.txt"} <= {p.name for p in folder.iterdir()}
    return sorted(p.name for p in folder.iterdir() if p.name not in tokenizer and p.name != "chat_template.jinja")


def _reader(summary: dict, name: str) -> gguf.GGUFReader:
    return gguf.GGUFReader(Path(summary["out"]) / name)


def _field(reader: gguf.GGUFReader, key: str):
    return reader.fields[key].contents()


def test_adapter_gguf_holds_the_messenger_lora_in_llama_cpp_layout(trained, exports):
    bundle, state = trained
    r = _reader(exports["adapter"], "adapter.gguf")
    assert _field(r, "general.type") == "adapter" and _field(r, "adapter.type") == "lora"
    assert _field(r, "general.architecture") == "llama"
    assert _field(r, "adapter.lora.alpha") == Bundle.load(bundle).manifest["lora"]["alpha"]
    assert _field(r, "ciders.client_id") == "e1" and _field(r, "ciders.backbone") == "full"
    base = Export.load(exports["adapter"]["out"]).manifest["gguf"]["base"]
    assert (
        _field(r, "ciders.base_gguf_sha256")
        == base["sha256"]
        == sources.sha256_file(Path(exports["adapter"]["out"]) / "base.gguf")
    )
    tensors = {t.name: t for t in r.tensors}
    blocks = {name.split(".")[1] for name in tensors}
    assert blocks == {"6", "7"}  # the messenger's layers, numbered as in the full model
    assert len(tensors) == 2 * 7 * 2  # 7 targets x (lora_a, lora_b) x 2 layers
    edge, _ = load_personalized(Bundle.load(bundle), state, backbone="full")
    live = lora_state(edge.model, MESSENGER_ADAPTER)
    a = live["base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight"]
    b = live["base_model.model.model.layers.7.self_attn.q_proj.lora_B.weight"]
    ta, tb = tensors["blk.7.attn_q.weight.lora_a"], tensors["blk.7.attn_q.weight.lora_b"]
    assert ta.tensor_type == tb.tensor_type == gguf.GGMLQuantizationType.F32
    assert list(ta.shape) == [64, 4] and list(tb.shape) == [4, 64]  # ggml order: A is (in, r), B is (r, out)
    assert torch.equal(torch.from_numpy(ta.data.copy()), a)
    assert torch.equal(torch.from_numpy(tb.data.copy()), permute(b, 4))  # q rows permuted like the base weight
    kb = live["base_model.model.model.layers.6.self_attn.k_proj.lora_B.weight"]
    got = torch.from_numpy(tensors["blk.6.attn_k.weight.lora_b"].data.copy())
    assert torch.equal(unpermute(got, 2), kb) and not torch.equal(got, kb)  # k over its 2 kv heads


def test_tiny_adapter_comes_with_its_base_and_an_ollama_modelfile(exports):
    folder = Path(exports["adapter"]["out"])
    exp = Export.load(folder)
    g = exp.manifest["gguf"]
    assert exp.runtime == "llamacpp-lora" and g["kind"] == "adapter" and g["base"]["path"] == "base.gguf"
    model, adapter = exp.gguf_files()
    assert model == folder / "base.gguf" and adapter == folder / "adapter.gguf"
    base = gguf.GGUFReader(model)
    assert _field(base, "general.type") == "model" and _field(base, "tokenizer.ggml.pre") == "smollm"
    assert not any(".lora" in t.name for t in base.tensors)
    modelfile = (folder / "Modelfile").read_text()
    assert "FROM ./base.gguf" in modelfile and "ADAPTER ./adapter.gguf" in modelfile
    assert "<|im_start|>{{ .Role }}" in modelfile and 'PARAMETER stop "<|im_end|>"' in modelfile
    readme = (folder / "README.md").read_text()
    assert "ollama create adapter -f Modelfile" in readme and "llama-cli -m ./base.gguf --lora adapter.gguf" in readme
    assert exports["adapter"]["check"]["greedy_agreement"] == 1.0  # an f16 base under the adapter


def test_merged_gguf_tensors_types_and_metadata(exports):
    for q, kind in (("f16", gguf.GGMLQuantizationType.F16), ("q8_0", gguf.GGMLQuantizationType.Q8_0)):
        r = _reader(exports[q], "model.gguf")
        assert _field(r, "general.type") == "model" and _field(r, "llama.block_count") == LAYERS
        assert _field(r, "llama.attention.head_count_kv") == 2 and _field(r, "llama.embedding_length") == 64
        base = SmolLM2Vocab.of(sources.smollm2_gguf()).fields
        for key in ("tokenizer.ggml.pre", "tokenizer.ggml.eos_token_id", "tokenizer.chat_template"):
            assert _field(r, key) == base[key].contents()
        assert len(_field(r, "tokenizer.ggml.tokens")) == 49152
        types = {t.name: t.tensor_type for t in r.tensors}
        assert len(types) == 2 + 9 * LAYERS  # token_embd, output_norm; tied: no output.weight
        assert types["token_embd.weight"] == types["blk.3.ffn_down.weight"] == kind
        assert types["blk.3.attn_norm.weight"] == gguf.GGMLQuantizationType.F32


def test_the_adapemu_exports_as_a_merged_gguf_with_4_bit_weights(exports):
    exp = Export.load(exports["emu"]["out"])
    assert exp.manifest["gguf"]["kind"] == "merged" and exp.source["backbone"] == "emu"
    assert _model_files(exp.path) == ["Modelfile", "README.md", "manifest.json", "model.gguf"]
    r = _reader(exports["emu"], "model.gguf")
    assert _field(r, "llama.block_count") == 5  # 3 kept backbone layers + the 2-layer messenger
    types = {t.name: t.tensor_type for t in r.tensors}
    assert types["blk.4.attn_q.weight"] == gguf.GGMLQuantizationType.Q4_0
    assert types["token_embd.weight"] == gguf.GGMLQuantizationType.Q8_0  # the embedding and tied head keep 8 bits
    assert "FROM ./model.gguf" in (exp.path / "Modelfile").read_text()
    assert "ADAPTER" not in (exp.path / "Modelfile").read_text()
    assert exports["emu"]["check"]["greedy_agreement"] >= 0.75  # measured 0.85: 4 bits on a random 64-wide model


def _greedy(model, tokenizer, n=12) -> list[int]:
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, ids.shape[1] :].tolist()


def test_merged_gguf_in_transformers_answers_like_the_hf_export(exports):
    """f16 gives the HF export's greedy tokens exactly; q8_0 agrees on >= 95% of check positions."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = exports["hf"]["out"]
    tok = AutoTokenizer.from_pretrained(hf)
    ref = _greedy(AutoModelForCausalLM.from_pretrained(hf).eval(), tok)
    f16 = Path(exports["f16"]["out"])
    got = AutoModelForCausalLM.from_pretrained(f16, gguf_file="model.gguf", dtype=torch.float32).eval()
    assert _greedy(got, tok) == ref
    assert exports["f16"]["check"]["greedy_agreement"] == 1.0
    assert exports["q8_0"]["check"]["greedy_agreement"] >= 0.95


def test_hf_export_carries_smollm2s_original_tokenizer(exports):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(exports["hf"]["out"])
    assert type(tok).__name__ == "GPT2TokenizerFast"
    assert tok("2024", add_special_tokens=False)["input_ids"] == [34, 32, 34, 36]  # digits one by one
    assert tok("hi")["input_ids"][0] != tok.bos_token_id  # no BOS: the chat template opens each turn
    cfg = json.loads((Path(exports["hf"]["out"]) / "tokenizer.json").read_text())
    assert [p["type"] for p in cfg["pre_tokenizer"]["pretokenizers"]] == ["Digits", "ByteLevel"]


def _cli(*args: str):
    return runner.invoke(edge_app, ["export", *args])


def test_bad_gguf_input_is_one_line_and_writes_nothing(trained, exports, tmp_path, monkeypatch):
    bundle, state = trained
    common = ["--bundle", str(bundle), "--state", str(state), "--format", "gguf", "--backbone", "full"]
    out = tmp_path / "out"
    r = _cli(*common, "--out", str(out), "--merged", "--quantize", "q3_k")
    assert r.exit_code != 0 and "--quantize for --format gguf must be one of f16, q8_0, q4_0" in r.output
    assert len(r.output.strip().splitlines()) == 1 and not out.exists()
    # a base model that comes from a GGUF: the adapter is refused on any other file
    right = Path(exports["adapter"]["out"]) / "base.gguf"
    monkeypatch.setattr(export.gguf, "base_gguf", lambda m: ("tiny.gguf", sources.sha256_file(right)))
    wrong = Path(exports["q8_0"]["out"]) / "model.gguf"
    r = _cli(*common, "--out", str(out), "--base-gguf", str(wrong))
    assert r.exit_code != 0 and "is not the base GGUF" in r.output and "refusing" in r.output
    assert len(r.output.strip().splitlines()) == 1 and not out.exists()
    r = _cli(*common, "--out", str(out), "--base-gguf", str(right))
    assert r.exit_code == 0, r.output
    g = Export.load(out).manifest["gguf"]
    assert g["base"] == {"name": "tiny.gguf", "sha256": sources.sha256_file(right), "path": str(right.resolve())}
    assert _model_files(out) == ["Modelfile", "README.md", "adapter.gguf", "manifest.json"]
    assert f"FROM {right.resolve()}" in (out / "Modelfile").read_text()
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("mine")
    r = _cli(*common, "--out", str(stranger), "--merged")
    assert r.exit_code != 0 and "is not an export folder" in r.output
    assert sorted(p.name for p in stranger.iterdir()) == ["notes.txt"]


@pytest.fixture(scope="module")
def llama_cpp():
    return pytest.importorskip("llama_cpp", reason="llama-cpp-python (the llamacpp extra) is not installed")


def _llama_logits(ids: list[int], model: Path, adapter: Path | None = None) -> torch.Tensor:
    """llama.cpp's logits, after checking its tokenizer round-trips ``ids``."""
    return llama_logits(ids, model, adapter, round_trip=True)


@pytest.fixture(scope="module")
def check_ids(exports) -> list[int]:
    from transformers import AutoTokenizer

    return check_inputs(AutoTokenizer.from_pretrained(exports["hf"]["out"]))[0][0].tolist()


def test_llama_cpp_runs_the_adapter_on_its_base_as_transformers_does(llama_cpp, exports, check_ids):
    """Base + adapter in llama.cpp computes what transformers computes from the same files (names,
    orientation, q/k permutation, alpha all right); without the adapter it is another model."""
    folder = Path(exports["adapter"]["out"])
    exp = Export.load(folder)
    with torch.no_grad():
        ref = gguf_torch_model(folder, exp.manifest["gguf"])(torch.tensor([check_ids])).logits[0]
    with_adapter = _llama_logits(check_ids, *exp.gguf_files())
    without = _llama_logits(check_ids, exp.gguf_files()[0])
    assert float((with_adapter - ref).abs().max()) < 1e-2  # f16 weights; measured 3.4e-4
    assert torch.equal(with_adapter.argmax(-1), ref.argmax(-1))
    assert float((without - ref).abs().max()) > 0.1  # measured 0.45
    merged = _llama_logits(check_ids, Path(exports["f16"]["out"]) / "model.gguf")
    assert float((merged - with_adapter).abs().max()) < 1e-2


def _llama_source() -> Path | None:
    env = os.environ.get("LLAMA_CPP_SOURCE")
    candidates = [Path(env)] if env else sorted((Path(sys.prefix) / "llama-cpp-src").glob("*/vendor/llama.cpp"))
    return next((c for c in candidates if (c / "convert_hf_to_gguf.py").is_file()), None)


def test_llama_cpps_converter_reads_the_hf_export(llama_cpp, exports, check_ids, tmp_path):
    """convert_hf_to_gguf.py recognizes the tokenizer (pre-tokenizer smollm) and its GGUF answers as ours."""
    src = _llama_source()
    if src is None:
        pytest.skip("llama.cpp's source not found (set LLAMA_CPP_SOURCE to a checkout with convert_hf_to_gguf.py)")
    out = tmp_path / "converted.gguf"
    path = os.pathsep.join(p for p in (str(src / "gguf-py"), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1"}
    if subprocess.run([sys.executable, "-c", "import sentencepiece"], env=env, capture_output=True).returncode:
        pytest.skip("llama.cpp's converter needs sentencepiece (its requirements.txt), not installed")
    cmd = [sys.executable, str(src / "convert_hf_to_gguf.py"), exports["hf"]["out"], "--outfile", str(out)]
    done = subprocess.run([*cmd, "--outtype", "f16"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    r = gguf.GGUFReader(out)
    assert _field(r, "tokenizer.ggml.pre") == "smollm" and _field(r, "tokenizer.ggml.model") == "gpt2"
    ours = _llama_logits(check_ids, Path(exports["f16"]["out"]) / "model.gguf")
    theirs = _llama_logits(check_ids, out)
    assert torch.equal(theirs.argmax(-1), ours.argmax(-1)) and float((theirs - ours).abs().max()) < 1e-3


def _infer(*args: str) -> dict:
    """`ciders-edge infer ... --json` through the real entry point, in its own process."""
    cmd = [sys.executable, "-m", "ciders_edge", "infer", "--prompt", PROMPT[0]["content"], "--json", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_infer_runs_a_gguf_export_in_llama_cpp_and_answers_as_torch(llama_cpp, exports):
    """A gguf export runs in llama.cpp when the user names no runtime; base + adapter (f16) answers
    what the HF export answers in torch, token for token, through the same chat template."""
    torch_run = _infer("--export", exports["hf"]["out"], "--max-new-tokens", "12")
    for name, runtime in (("adapter", "llamacpp-lora"), ("f16", "llamacpp-f16")):
        run = _infer("--export", exports[name]["out"], "--max-new-tokens", "12")
        assert run["runtime"] == runtime and run["source"] == torch_run["source"], name
        assert run["prompt_tokens"] == torch_run["prompt_tokens"] and run["text"] == torch_run["text"], name
    fixed = _infer("--export", exports["q8_0"]["out"], "--max-new-tokens", "9", "--runtime", "llamacpp")
    assert fixed["new_tokens"] <= 9


def test_llama_cpp_runtime_without_a_gguf_export_is_one_line(trained, exports):
    bundle, state = trained
    r = runner.invoke(edge_app, ["infer", "--bundle", str(bundle), "--state", str(state), "--runtime", "llamacpp",
                                 "--prompt", "hi"])  # fmt: skip
    assert r.exit_code == 1 and "make one with `ciders-edge export --format gguf`" in r.stderr, r.output
    r = runner.invoke(edge_app, ["infer", "--export", exports["hf"]["out"], "--runtime", "llamacpp", "--prompt", "hi"])
    assert r.exit_code == 1 and "a hf export runs with --runtime torch" in r.stderr and "Traceback" not in r.output


def test_bench_puts_llama_cpp_beside_torch(llama_cpp, trained, tmp_path):
    """`bench` exports the adapter and the merged q8_0 GGUF and measures them in the same turns as torch."""
    bundle, state = trained
    args = ["bench", "--bundle", bundle, "--state", state, "--backbone", "full", "--new-tokens", "4", "--repeats", "1",
            "--runtimes", "torch,llamacpp-lora,llamacpp-q8_0", "--train-steps", "0", "--exports", tmp_path,
            "--json"]  # fmt: skip
    r = runner.invoke(edge_app, list(map(str, args)))
    assert r.exit_code == 0, r.output
    rows = {row["runtime"]: row for row in json.loads(r.stdout.strip().splitlines()[-1])["runtimes"]}
    assert list(rows) == ["torch", "llamacpp-lora", "llamacpp-q8_0"]
    assert Export.load(tmp_path / "llamacpp-lora").manifest["gguf"]["kind"] == "adapter"
    assert Export.load(tmp_path / "llamacpp-q8_0").manifest["gguf"]["kind"] == "merged"
    for row in rows.values():
        assert row["decode_tokens_per_s"] > 0 and row["peak_rss_mib"] > 0
    assert rows["llamacpp-q8_0"]["check"]["greedy_agreement"] >= 0.9


def test_evaluate_scores_an_export_in_its_runtime_beside_torch(llama_cpp, trained, exports, demo_dir):
    """`evaluate --export` adds the personalized model as exported, answered in llama.cpp: the same
    exact match as torch AdapFu from f16 weights; an export of another state is refused."""
    bundle, state = trained
    data = demo_dir / "units" / "eval.jsonl"
    common = ["evaluate", "--bundle", str(bundle), "--state", str(state), "--data", str(data), "--limit", "4"]
    r = runner.invoke(edge_app, [*common, "--backbone", "full", "--export", exports["adapter"]["out"], "--json"])
    assert r.exit_code == 0, r.output
    torch_row, gguf_row = json.loads(r.stdout.strip().splitlines()[-1])["results"]
    assert "runtime" not in torch_row and gguf_row["runtime"] == "llamacpp-lora" and gguf_row["nll"] is None
    assert gguf_row["exact_match"] == torch_row["exact_match"] and gguf_row["counts"]["exact_match"] == 4
    r = runner.invoke(edge_app, [*common, "--export", exports["adapter"]["out"], "--export", exports["f16"]["out"]])
    assert r.exit_code == 1 and "pass one --export per --state" in r.stderr
