"""The genai export and runtime (ONNX Runtime GenAI's own decode loop) on `tiny`: the same greedy tokens
as torch, stopping at the end of turn, min_new_tokens, seeded sampling, and bad input as one line."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from tiny_runs import train_once
from typer.testing import CliRunner

from ciders_edge.cli import app as edge_app
from ciders_edge.errors import ConfigError, ExportError
from ciders_edge.formats.export_folder import GENAI_CONFIG, MANIFEST, ONNX_FILE, Export
from ciders_edge.inference.exported import load_exported_tokenizer
from ciders_edge.inference.genai import GenAIDecoder
from ciders_edge.inference.generation import GenerationSettings, TokenDecoder, encode_prompt, generate
from ciders_edge.inference.runtime import open_runtime
from export import export_model

pytest.importorskip("onnxruntime_genai", reason="the genai runtime needs onnxruntime-genai")

runner = CliRunner()
PROMPT = [{"role": "user", "content": "Rewrite the date March 14, 2021 in ISO format"}]
FIXED = GenerationSettings(max_new_tokens=12, min_new_tokens=12)


@pytest.fixture(scope="module")
def trained(tiny_run, demo_dir, tmp_path_factory):
    bundle = tiny_run[0] / "bundles" / "cpu-laptop" / "round-0000"
    root = tmp_path_factory.mktemp("edge-genai")
    return bundle, train_once(bundle, demo_dir / "units" / "train.jsonl", root, "g1", local_steps=3)


@pytest.fixture(scope="module")
def genai(trained, tmp_path_factory):
    bundle, state = trained
    root = tmp_path_factory.mktemp("genai-exports")
    return {q: export_model(bundle, state, "genai", root / q, q, backbone="emu") for q in ("none", "int8", "int4")}


@pytest.fixture(scope="module")
def torch_rt(trained):
    bundle, state = trained
    return open_runtime("torch", bundle=bundle, state=state, backbone="emu")


def _tokens(rt, settings: GenerationSettings) -> list[int]:
    ids = encode_prompt(rt.tokenizer, PROMPT, rt.context, settings.max_new_tokens)
    if isinstance(rt.model, TokenDecoder):
        return list(rt.model.stream_tokens(ids[0].tolist(), settings))
    out = rt.model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), pad_token_id=rt.tokenizer.pad_token_id, do_sample=False,
        max_new_tokens=settings.max_new_tokens, min_new_tokens=settings.min_new_tokens,
    )  # fmt: skip
    return out[0, ids.shape[1] :].tolist()


def test_fp32_greedy_tokens_equal_torch(genai, torch_rt):
    rt = open_runtime(None, export=genai["none"]["out"])  # a genai export runs in genai by default
    assert rt.name == "genai" and isinstance(rt.model, GenAIDecoder)
    assert _tokens(rt, FIXED) == _tokens(torch_rt, FIXED)
    g = generate(rt.model, rt.tokenizer, encode_prompt(rt.tokenizer, PROMPT, rt.context, 12), FIXED)
    assert g.new_tokens == 12 and g.text == torch_rt.tokenizer.decode(
        _tokens(torch_rt, FIXED), skip_special_tokens=True
    )
    assert genai["none"]["check"]["max_abs_logit_diff"] < 1e-3


def test_int8_quantizes_every_linear_and_agrees(genai, torch_rt):
    import onnx

    exp = Export.load(genai["int8"]["out"])
    assert exp.runtime == "genai-int8"
    nodes = onnx.load(exp.path / ONNX_FILE, load_external_data=False).graph.node
    ops = [n.op_type for n in nodes]
    assert "MatMul" not in ops and "GroupQueryAttention" in ops
    assert any(n.op_type == "MatMulNBits" and n.name.startswith("/lm_head/") for n in nodes)
    # teacher-forced on the check chats, against the unmerged AdapEmu (documented: >= 95% on SmolLM2)
    assert genai["int8"]["check"]["greedy_agreement"] >= 0.9
    rt = open_runtime("genai", export=exp.path)
    ours, ref = _tokens(rt, FIXED), _tokens(torch_rt, FIXED)
    assert sum(a == b for a, b in zip(ours, ref, strict=True)) >= 6


def test_int4_quantizes_the_tied_embedding_once_and_agrees(genai, torch_rt):
    """int4: 4-bit blocks of 32 for every linear, and the tied embedding and LM head as one 4-bit table
    (GatherBlockQuantized reads it, MatMulNBits multiplies by it); int4's agreement is looser than int8's."""
    import onnx

    exp = Export.load(genai["int4"]["out"])
    assert exp.runtime == "genai-int4"
    graph = onnx.load(exp.path / ONNX_FILE, load_external_data=False).graph
    ops = [n.op_type for n in graph.node]
    assert "MatMul" not in ops and ops.count("Gather") == 1  # the one Gather left reads a shape, not a table
    (embed,) = [n for n in graph.node if n.op_type == "GatherBlockQuantized"]
    assert embed.name.startswith("/model/embed_tokens/") and embed.input[2] == "lm_head.MatMul.weight_scales"
    nbits = [n for n in graph.node if n.op_type == "MatMulNBits"]
    assert nbits and all({a.name: a.i for a in n.attribute}["bits"] == 4 for n in nbits)
    assert {a.name: a.i for a in nbits[0].attribute}["block_size"] == 32
    assert genai["int4"]["bytes"] < genai["int8"]["bytes"]
    assert genai["int4"]["check"]["greedy_agreement"] >= 0.5  # documented: about 70% on SmolLM2
    rt = open_runtime(None, export=exp.path)
    assert len(_tokens(rt, FIXED)) == 12


def test_infer_from_a_bundle_runs_a_genai_int8_export_made_once(trained, demo_dir, tmp_path, monkeypatch):
    """Said nothing, `infer --bundle --state` answers in the fastest runtime installed: it exports the
    model for GenAI (int8) on first use, reuses it while the messenger is the same, and --runtime torch
    still answers in torch without an export."""
    from export import cache

    monkeypatch.setattr(cache, "exports_root", lambda: tmp_path / "exports")
    bundle, state = trained
    args = ["infer", "--bundle", str(bundle), "--state", str(state), "--backbone", "emu", "--prompt", "hi"]
    args += ["--max-new-tokens", "3", "--json"]
    first, again = (json.loads(runner.invoke(edge_app, args).stdout.strip().splitlines()[-1]) for _ in range(2))
    assert first["runtime"] == again["runtime"] == "genai-int8"
    assert first["export"]["made_now"] and not again["export"]["made_now"]
    folder = first["export"]["path"]
    assert again["export"]["path"] == folder and [p.name for p in (tmp_path / "exports").iterdir()] == [
        folder.rsplit("/", 1)[-1]
    ]
    assert Export.load(folder).source["client_id"] == "g1" and first["text"] == again["text"]
    r = runner.invoke(edge_app, [*args, "--runtime", "torch"])
    assert r.exit_code == 0 and json.loads(r.stdout.strip().splitlines()[-1])["runtime"] == "torch"
    r = runner.invoke(edge_app, [*args, "--runtime", "genai"])  # named, as said nothing: the same export
    assert r.exit_code == 0, r.output
    named = json.loads(r.stdout.strip().splitlines()[-1])
    assert named["runtime"] == "genai-int8" and named["export"] == {"path": folder, "made_now": False}
    glob = runner.invoke(edge_app, [a for a in args if a != str(state) and a != "--state"] + ["--global"])
    assert json.loads(glob.stdout.strip().splitlines()[-1])["export"]["path"] != folder  # another messenger

    data = str(demo_dir / "units" / "eval.jsonl")
    scored = ["evaluate", "--bundle", str(bundle), "--state", str(state), "--data", data, "--backbone", "emu"]
    r = runner.invoke(edge_app, [*scored, "--limit", "2", "--max-new-tokens", "3", "--runtime", "genai", "--json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout.strip().splitlines()[-1])["results"]
    assert [row.get("runtime") for row in rows] == [None, "genai-int8"]  # torch's row, then the export's
    assert len(list((tmp_path / "exports").iterdir())) == 2  # the same export as infer's, none made again
    r = runner.invoke(edge_app, [*scored, "--runtime", "llamacpp"])
    assert r.exit_code == 1 and "--runtime for evaluate is genai" in r.output


def test_a_damaged_cache_entry_is_made_again_not_failed_for_good(trained, tmp_path, monkeypatch):
    """A flipped byte in a cached export, or its manifest deleted: the next infer says so in one notice,
    exports again and answers; the one after finds the entry whole."""
    from export import cache

    monkeypatch.setattr(cache, "exports_root", lambda: tmp_path / "exports")
    bundle, state = trained
    args = ["infer", "--bundle", str(bundle), "--state", str(state), "--backbone", "emu", "--prompt", "hi"]
    args += ["--max-new-tokens", "3", "--json"]
    first = json.loads(runner.invoke(edge_app, args).stdout.strip().splitlines()[-1])
    folder = Path(first["export"]["path"])
    for harm, said in (
        (_flip_a_byte, "the cached export is made again"),
        (_drop_manifest, "without its manifest.json"),
    ):
        harm(folder)
        r = runner.invoke(edge_app, args)
        notice = " ".join(r.stderr.split())
        assert r.exit_code == 0 and said in notice and "Traceback" not in r.output, (said, r.output)
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["export"] == {"path": str(folder), "made_now": True} and out["text"] == first["text"]
    again = json.loads(runner.invoke(edge_app, args).stdout.strip().splitlines()[-1])
    assert again["export"]["made_now"] is False


def _flip_a_byte(folder: Path) -> None:
    weights = max((p for p in folder.iterdir() if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))


def _drop_manifest(folder: Path) -> None:
    (folder / MANIFEST).unlink()


def test_stops_at_the_end_of_turn_and_honours_min_new_tokens(genai, tmp_path):
    """The export stops where the tokenizer ends a turn; a copy whose config names the last distinct
    greedy token as end of turn stops right after it, unless min_new_tokens asks for more."""
    src = genai["none"]["out"]
    exp = Export.load(src)
    cfg = json.loads((exp.path / GENAI_CONFIG).read_text())
    assert load_exported_tokenizer(exp).eos_token_id in cfg["model"]["eos_token_id"]
    free = GenerationSettings(max_new_tokens=12)
    tokens = list(GenAIDecoder.open(exp.path, exp.manifest["files"]).stream_tokens(_prompt_ids(exp), free))
    k = max(i for i, t in enumerate(tokens) if t not in tokens[:i])  # its first occurrence
    stop = tokens[k]
    copy = tmp_path / "copy"
    shutil.copytree(src, copy)
    cfg["model"]["eos_token_id"] = [stop]
    (copy / GENAI_CONFIG).write_text(json.dumps(cfg))
    decoder = GenAIDecoder.open(copy, exp.manifest["files"])
    assert list(decoder.stream_tokens(_prompt_ids(exp), free)) == tokens[: k + 1]  # the end of turn is yielded
    longer = list(decoder.stream_tokens(_prompt_ids(exp), free.replace(min_new_tokens=k + 3)))
    assert len(longer) >= k + 3 and stop not in longer[: k + 2]


def test_seeded_sampling_is_reproducible(genai):
    rt = open_runtime(None, export=genai["none"]["out"])
    sample = GenerationSettings(max_new_tokens=12, min_new_tokens=12, temperature=1.0, top_p=0.95, seed=1)
    first, again = _tokens(rt, sample), _tokens(rt, sample)
    other = _tokens(rt, sample.replace(seed=2))
    assert first == again and first != other
    assert first != _tokens(rt, FIXED)  # it did sample


def test_bad_genai_input_is_refused(genai, trained, tmp_path):
    src = genai["int8"]["out"]
    with pytest.raises(ExportError, match="not an export folder"):
        open_runtime("genai", export=tmp_path)
    with pytest.raises(ConfigError, match="a genai export runs with --runtime genai"):
        open_runtime("onnx", export=src)
    with pytest.raises(ConfigError, match="runs an export"):
        open_runtime("genai", bundle=trained[0], messenger="global")
    with pytest.raises(ConfigError, match="--quantize for --format genai"):
        export_model(trained[0], trained[1], "genai", tmp_path / "x", "int8-dynamic")
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    with open(bad / f"{ONNX_FILE}.data", "r+b") as f:
        f.seek(1000)
        f.write(b"\0" * 64)
    with pytest.raises(ExportError, match=f"{ONNX_FILE}.data: checksum mismatch"):
        open_runtime(None, export=bad)
    manifest = json.loads((bad / MANIFEST).read_text())
    manifest["quantize"] = "int8-dynamic"
    (bad / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ExportError, match="unknown quantize 'int8-dynamic' for a genai export"):
        Export.load(bad)


def test_cli_infer_runs_a_genai_export_as_one_line_on_damage(genai, tmp_path):
    out = genai["int8"]["out"]
    res = runner.invoke(edge_app, ["infer", "--export", str(out), "--prompt", "hi", "--max-new-tokens", "3", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output.strip().splitlines()[-1])["runtime"] == "genai-int8"
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    (bad / GENAI_CONFIG).write_text("{}")
    res = runner.invoke(edge_app, ["infer", "--export", str(bad), "--prompt", "hi"])
    assert res.exit_code != 0 and "Traceback" not in res.output
    assert f"{GENAI_CONFIG}: checksum mismatch" in res.output and len(res.output.strip().splitlines()) == 1


def _prompt_ids(exp: Export) -> list[int]:
    return encode_prompt(load_exported_tokenizer(exp), PROMPT, 1024, 12)[0].tolist()
