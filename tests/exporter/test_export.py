"""Export, on-device inference and bench on `tiny`: merged/ONNX/int8 agree with the AdapEmu, bad input.

The tiny run's profile deploys AdapFu; these tests export the AdapEmu explicitly (AdapFu: test_adapfu.py).
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from ciders_edge.cli import app as edge_app
from ciders_edge.errors import ConfigError, DataError, ExportError, StateError
from ciders_edge.formats.bundle import Bundle
from ciders_edge.formats.client_state import ClientState
from ciders_edge.formats.export_folder import ONNX_FILE, Export
from ciders_edge.inference.exported import load_exported_model
from ciders_edge.inference.generation import GenerationSettings, encode_prompt, generate
from ciders_edge.inference.personalize import load_personalized, merge_messenger, personal_messenger
from ciders_edge.inference.providers import resolve_providers
from ciders_edge.inference.runtime import open_runtime
from export import export_model
from export.check import all_logits, check_inputs, compare_logits

runner = CliRunner()


@pytest.fixture(scope="module")
def reference(trained):
    """Logits of the unmerged personalized AdapEmu (messenger LoRA live) on the check chats."""
    bundle, state = trained
    edge, _ = load_personalized(Bundle.load(bundle), state)
    inputs = check_inputs(edge.tokenizer)
    return inputs, all_logits(edge.model, inputs)


@pytest.fixture(scope="module")
def exports(trained, tmp_path_factory):
    bundle, state = trained
    root = tmp_path_factory.mktemp("exports")
    out = {}
    for name, fmt, q in (("hf", "hf", "none"), ("onnx", "onnx", "none"), ("onnx-int8", "onnx", "int8")):
        out[name] = export_model(bundle, state, fmt, root / name, q, backbone="emu")
    return out


def test_personalized_messenger_changes_the_model(trained, reference):
    bundle, _ = trained
    edge, source = load_personalized(Bundle.load(bundle), None, "global")
    inputs, personal = reference
    glob = all_logits(edge.model, inputs)
    assert source.messenger == "global"
    assert max(float((a - b).abs().max()) for a, b in zip(glob, personal, strict=True)) > 1e-4


def test_hf_export_loads_in_plain_transformers(exports, reference, tmp_path):
    """A fresh interpreter loads the folder with AutoModelForCausalLM alone; its logits equal the AdapEmu's."""
    inputs, ref = reference
    folder = exports["hf"]["out"]
    ids_file, out_file = tmp_path / "ids.pt.safetensors", tmp_path / "logits.safetensors"
    from safetensors.torch import save_file

    save_file({f"i{k}": t for k, t in enumerate(inputs)}, ids_file)
    code = f"""
import sys, torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained({folder!r}).eval()
ids = load_file({str(ids_file)!r})
with torch.no_grad():
    out = {{k: m(input_ids=v).logits[0].contiguous() for k, v in ids.items()}}
assert not any(n.startswith(("ciders", "peft")) for n in sys.modules), "imported more than transformers"
save_file(out, {str(out_file)!r})
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    got = load_file(out_file)
    diff = max(float((got[f"i{k}"] - r).abs().max()) for k, r in enumerate(ref))
    assert diff < 1e-4
    assert exports["hf"]["check"]["max_abs_logit_diff"] < 1e-4


def test_onnx_logits_match_the_adapemu(exports, reference):
    inputs, ref = reference
    exp = Export.load(exports["onnx"]["out"])
    assert exp.runtime == "onnx" and exp.source["messenger"] == "personalized"
    cmp = compare_logits(inputs, ref, all_logits(load_exported_model(exp), inputs))
    assert cmp["max_abs_logit_diff"] < 1e-3
    assert cmp == pytest.approx(exp.manifest["check"])


def test_onnx_kv_cache_decodes_like_torch(trained, exports):
    """Greedy decoding through the KV-cache graph gives the torch model's tokens."""
    bundle, state = trained
    settings = GenerationSettings(max_new_tokens=12, min_new_tokens=12)
    torch_rt = open_runtime("torch", bundle=bundle, state=state, backbone="emu")
    onnx_rt = open_runtime(None, export=exports["onnx"]["out"], bundle=bundle, state=state)
    assert onnx_rt.name == "onnx"
    ids = encode_prompt(torch_rt.tokenizer, [{"role": "user", "content": "What is 7 + 5?"}], torch_rt.context, 12)
    a = generate(torch_rt.model, torch_rt.tokenizer, ids, settings)
    b = generate(onnx_rt.model, onnx_rt.tokenizer, ids, settings)
    assert a.new_tokens == b.new_tokens == 12
    assert a.text == b.text
    graph_inputs = [i.name for i in onnx_rt.model.model.get_inputs()]  # the onnxruntime session
    assert onnx_rt.model.use_cache and any(n.startswith("past_key_values") for n in graph_inputs)


def test_int8_agrees_with_fp32_and_quantizes_every_linear(exports, reference):
    import onnx

    inputs, ref = reference
    exp = Export.load(exports["onnx-int8"]["out"])
    cmp = compare_logits(inputs, ref, all_logits(load_exported_model(exp), inputs))
    assert cmp["greedy_agreement"] >= 0.95
    ops = [n.op_type for n in onnx.load(exp.path / ONNX_FILE).graph.node]
    layers = 5  # the AdapEmu of the tiny run: 3 kept backbone layers + a 2-layer messenger
    assert ops.count("MatMulNBits") == 7 * layers + 1  # q k v o gate up down per layer, and the LM head


def test_export_folder_damage_is_refused(exports, tmp_path):
    src = exports["onnx-int8"]["out"]
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    raw = bytearray((bad / ONNX_FILE).read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    (bad / ONNX_FILE).write_bytes(bytes(raw))
    with pytest.raises(ExportError, match="checksum mismatch"):
        Export.load(bad)
    (bad / ONNX_FILE).unlink()
    with pytest.raises(ExportError, match="missing from the export"):
        Export.load(bad)
    with pytest.raises(ExportError, match="not an export folder"):
        Export.load(tmp_path)


def test_export_never_replaces_a_foreign_folder(trained, tmp_path):
    bundle, state = trained
    keep = tmp_path / "notes"
    keep.mkdir()
    (keep / "todo.txt").write_text("mine")
    with pytest.raises(ExportError, match="not an export folder"):
        export_model(bundle, state, "hf", keep)
    with pytest.raises(ExportError, match="not an export folder"):
        export_model(bundle, state, "hf", bundle)  # a bundle has a manifest.json too
    assert (keep / "todo.txt").read_text() == "mine"
    with pytest.raises(ConfigError, match="onnx, genai and gguf only"):
        export_model(bundle, state, "hf", tmp_path / "x", quantize="int8")


def test_state_for_another_backbone_is_refused(trained, tmp_path):
    bundle, state = trained
    s = ClientState.load(state)
    s.frozen_digest, s.bundle_id = "0" * 64, "1" * 64
    s.save(tmp_path / "other")
    with pytest.raises(StateError, match="trained on bundle 111111111111 .round 0., whose backbone differs"):
        load_personalized(Bundle.load(bundle), tmp_path / "other")
    s.kept_layers = [0, 1]
    s.save(tmp_path / "model")
    with pytest.raises(StateError, match="another model or split"):
        load_personalized(Bundle.load(bundle), tmp_path / "model")
    with pytest.raises(StateError, match="no such state folder"):
        load_personalized(Bundle.load(bundle), tmp_path / "nowhere")


def test_export_made_from_another_messenger_is_refused(trained, exports):
    bundle, _ = trained
    with pytest.raises(ExportError, match="made from client e1's personalized messenger of round 0 .* global"):
        open_runtime("onnx", export=exports["onnx"]["out"], bundle=bundle, messenger="global")
    with pytest.raises(ConfigError, match="a hf export runs with --runtime torch"):
        open_runtime("onnx", export=exports["hf"]["out"])


def test_prompt_longer_than_the_context_is_refused(exports):
    rt = open_runtime(None, export=exports["hf"]["out"])
    with pytest.raises(DataError, match="exceed the model's context of 1024 tokens"):
        encode_prompt(rt.tokenizer, [{"role": "user", "content": "word " * 1100}], rt.context, 16)


def test_providers_fall_back_to_cpu(capsys):
    wanted = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    assert resolve_providers(wanted, available=["CPUExecutionProvider"]) == ["CPUExecutionProvider"]
    assert resolve_providers(wanted, available=["CUDAExecutionProvider", "CPUExecutionProvider"]) == wanted[1:]
    err = capsys.readouterr().err
    assert err.count("TensorrtExecutionProvider is not in this onnxruntime") == 2


def test_generation_settings_are_checked():
    with pytest.raises(ConfigError, match="top_p"):
        GenerationSettings(top_p=0)
    with pytest.raises(ConfigError, match="temperature"):
        GenerationSettings(temperature=-1)
    assert GenerationSettings().generate_kwargs()["do_sample"] is False


def test_cli_export_then_stream_onnx(trained, tmp_path):
    """The CLI in fresh interpreters (`export` comes in through its entry point): export int8, then answer
    a prompt streamed from ONNX Runtime."""
    bundle, state = trained
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "ex"
    exp = subprocess.run(
        [sys.executable, "-m", "ciders_edge", "export", "--bundle", bundle, "--state", state, "--format", "onnx",
         "--quantize", "int8", "--out", out, "--json"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert exp.returncode == 0, exp.stderr
    summary = json.loads(exp.stdout.strip().splitlines()[-1])
    assert summary["runtime"] == "onnx-int8" and summary["check"]["greedy_agreement"] >= 0.95
    inf = subprocess.run(
        [sys.executable, "-m", "ciders_edge", "infer", "--export", out, "--prompt", "What is 2 + 2?", "--stream",
         "--max-new-tokens", "6", "--temperature", "0.8", "--seed", "3", "--json"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert inf.returncode == 0, inf.stderr
    *streamed, last = inf.stdout.rstrip("\n").split("\n")
    result = json.loads(last)
    assert result["runtime"] == "onnx-int8" and result["new_tokens"] == 6
    assert "\n".join(streamed).strip() == result["text"].strip()


def test_cli_infer_file_and_bad_records(trained, demo_dir, tmp_path):
    bundle, state = trained
    src = tmp_path / "q.jsonl"
    lines = (demo_dir / "dates" / "eval.jsonl").read_text().splitlines()[:2]
    src.write_text("\n".join(lines) + '\n{"prompt": "Say hi."}\n')
    dst = tmp_path / "a.jsonl"
    args = ["infer", "--bundle", bundle, "--state", state, "--max-new-tokens", "4", "--json"]
    r = runner.invoke(edge_app, [*map(str, args), "--input", str(src), "--output", str(dst)])
    assert r.exit_code == 0, r.output
    rows = [json.loads(x) for x in dst.read_text().splitlines()]
    assert len(rows) == 3 and all("prediction" in x for x in rows) and rows[2]["prompt"] == "Say hi."
    src.write_text(lines[0] + '\n{"nothing": 1}\n')
    bad_dst = tmp_path / "b.jsonl"
    r = runner.invoke(edge_app, [*map(str, args), "--input", str(src), "--output", str(bad_dst)])
    assert r.exit_code == 1 and f"{src}:2: unknown record schema" in r.output
    assert not bad_dst.exists()
    r = runner.invoke(edge_app, ["infer", "--bundle", str(bundle), "--prompt", "x"])
    assert r.exit_code == 1 and "no --state given" in r.output


def test_cli_bench_measures_each_runtime(trained, tmp_path):
    bundle, state = trained
    png = tmp_path / "bench.png"
    args = ["bench", "--bundle", bundle, "--state", state, "--runtimes", "torch,onnx-int8", "--new-tokens", "4",
            "--repeats", "1", "--train-steps", "1", "--plot", png, "--json"]  # fmt: skip
    r = runner.invoke(edge_app, list(map(str, args)))
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout.strip().splitlines()[-1])
    torch_row, int8_row = s["runtimes"]
    assert torch_row["runtime"] == "torch" and int8_row["runtime"] == "onnx-int8"
    assert int8_row["check"]["greedy_agreement"] >= 0.95 and int8_row["files_bytes"] > 0
    for row in s["runtimes"]:
        assert row["decode_tokens_per_s"] > 0 and row["peak_rss_mib"] > row["rss_after_imports_mib"] > 0
    assert s["train_step"]["step_s"] > 0 and s["train_step"]["seq_len"] == 256
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = runner.invoke(edge_app, ["bench", "--bundle", str(bundle), "--runtimes", "tensorflow"])
    assert r.exit_code == 1 and "unknown ['tensorflow']" in r.output


def test_bench_says_llama_cpp_is_missing_before_it_exports_anything(trained, monkeypatch, tmp_path):
    import export.bench

    monkeypatch.setattr(export.bench, "llamacpp_available", lambda: False)
    args = ["bench", "--bundle", str(trained[0]), "--runtimes", "torch,llamacpp-q8_0", "--exports", str(tmp_path / "x")]
    r = runner.invoke(edge_app, args)
    assert r.exit_code == 1 and "--runtimes llamacpp-q8_0 need llama-cpp-python" in " ".join(r.stderr.split())
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "x").exists()


def test_merge_messenger_equals_live_lora(trained, reference):
    bundle, state = trained
    edge, _ = load_personalized(Bundle.load(bundle), state)
    inputs, ref = reference
    merged = merge_messenger(edge)
    with torch.no_grad():
        got = [merged(input_ids=i).logits[0] for i in inputs]
    assert max(float((a - b).abs().max()) for a, b in zip(got, ref, strict=True)) < 1e-4


def test_cli_bad_input_is_one_line(trained, exports, tmp_path):
    bundle, state = trained
    bad = tmp_path / "bad"
    shutil.copytree(exports["onnx"]["out"], bad)
    (bad / ONNX_FILE).write_bytes(b"not a graph")
    for args, message in (
        (["--export", str(bad)], f"{bad / ONNX_FILE}: checksum mismatch"),
        (["--bundle", str(bundle), "--state", str(state), "--prompt", "word " * 1100], "exceed the model's context"),
        (["--export", str(exports["onnx"]["out"]), "--state", str(state)], "pass --bundle too"),
    ):
        r = runner.invoke(edge_app, ["infer", "--prompt", "hi", *args] if "--prompt" not in args else ["infer", *args])
        assert r.exit_code == 1, r.output
        assert message in r.output and "Traceback" not in r.output


def test_cli_infer_prints_the_answer(exports):
    r = runner.invoke(
        edge_app, ["infer", "--export", str(exports["hf"]["out"]), "--prompt", "hi", "--max-new-tokens", "3"]
    )
    assert r.exit_code == 0, r.output
    assert "3 tokens, first token" in r.output and "(torch, AdapEmu)" in r.output
    assert "messenger: client e1's personalized messenger of round 0 (latest: round 0 held out no" in r.output


def test_sources_match_only_the_same_messenger(trained):
    b = Bundle.load(trained[0])
    _, personal = personal_messenger(b, trained[1], "personalized")
    _, glob = personal_messenger(b, None, "global")
    assert personal.same_model(personal.to_dict()) and not personal.same_model(glob.to_dict())
    assert not personal.same_model({**personal.to_dict(), "state_round": 1})
    assert not glob.same_model({**glob.to_dict(), "bundle_id": "0" * 64})  # another round's global messenger
    other = Bundle(b.path, {**b.manifest, "lora": {**b.manifest["lora"], "rank": 8}}, b.bundle_id)
    assert other.frozen_digest != b.frozen_digest  # a messenger of another shape cannot run on it
    _, full = personal_messenger(b, trained[1], "personalized", backbone="full")
    assert not personal.same_model(full.to_dict()) and full.same_model(full.to_dict())  # AdapFu is another model
