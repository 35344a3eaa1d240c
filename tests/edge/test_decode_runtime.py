"""The torch runtime's decode: eager on a CPU (as before), compiled (static KV cache, CUDA graphs) on a GPU,
and a clean fall back to eager when compiling fails."""

from __future__ import annotations

import pytest
import torch

from ciders_edge.errors import ConfigError
from ciders_edge.inference import compiled_decode
from ciders_edge.inference.compiled_decode import compile_problem, decode_mode
from ciders_edge.inference.generation import GenerationSettings
from ciders_edge.inference.infer import answer
from ciders_edge.inference.runtime import open_runtime

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
PROMPT = "Rewrite the date March 14, 2021 in ISO format"
SETTINGS = GenerationSettings(max_new_tokens=12, min_new_tokens=12)


@pytest.mark.parametrize(
    ("device", "target", "problem", "requested", "mode", "notice"),
    [
        (CPU, None, None, "auto", "eager", False),  # a CPU keeps today's path
        (CPU, "cuda", None, "auto", "eager", False),  # a cuda profile on a machine without a GPU
        (CUDA, "cuda", None, "auto", "compiled", False),
        (CUDA, "jetson", None, "auto", "compiled", False),
        (CUDA, None, None, "auto", "compiled", False),  # a model placed on a GPU without a profile
        (CUDA, "cpu", None, "auto", "eager", False),  # a cpu profile asks for CPU behaviour
        (CUDA, "cuda", "triton is not installed", "auto", "eager", True),
        (CUDA, "cuda", None, "eager", "eager", False),
        (CPU, None, None, "compiled", "compiled", False),  # forced (tests)
        (CPU, None, "no compiler", "compiled", "eager", True),
    ],
)
def test_decode_mode(device, target, problem, requested, mode, notice):
    got, why = decode_mode(device, target, problem, requested)
    assert got == mode
    assert (why is not None) == notice
    if notice:
        assert problem in why


def test_decode_mode_rejects_unknown():
    with pytest.raises(ConfigError, match="decode must be one of"):
        decode_mode(CPU, None, None, "fast")


def test_compile_problem(monkeypatch):
    assert compile_problem(CPU) is None  # CPU inductor needs no triton
    real = compiled_decode.importlib.util.find_spec
    monkeypatch.setattr(compiled_decode.importlib.util, "find_spec", lambda n: None if n == "triton" else real(n))
    assert "triton" in compile_problem(CUDA)
    with torch._dynamo.config.patch(disable=True):
        assert "disabled" in compile_problem(CPU)
    assert compile_problem(CPU) is None


@pytest.fixture(scope="module")
def bundle(tiny_run):
    return tiny_run[0] / "bundles" / "cpu-laptop" / "round-0000"


@pytest.fixture(scope="module")
def eager_answer(bundle):
    """The answer on today's path: transformers' own generate on the merged model, dynamic cache."""
    rt = open_runtime("torch", bundle=bundle, messenger="global")
    g = answer(rt, PROMPT, SETTINGS)
    assert rt.decode == "eager" and rt.model.generation_config.compile_config is None
    assert g.new_tokens == 12
    return g.text


def test_cpu_decodes_eagerly_as_before(bundle, eager_answer):
    from ciders_edge.inference.generation import encode_prompt

    rt = open_runtime("torch", bundle=bundle, messenger="global")
    ids = encode_prompt(rt.tokenizer, [{"role": "user", "content": PROMPT}], rt.context, 12)
    out = rt.model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), pad_token_id=rt.tokenizer.pad_token_id, do_sample=False,
        max_new_tokens=12, min_new_tokens=12, temperature=None, top_p=None, top_k=None,
    )  # fmt: skip
    assert rt.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True) == eager_answer


def test_failing_compile_falls_back_with_one_notice(bundle, eager_answer, monkeypatch, capsys):
    rt = open_runtime("torch", bundle=bundle, messenger="global", decode="compiled")
    assert rt.decode == "compiled"

    def broken_compile(fn, **_):
        def call(*args, **kwargs):
            raise RuntimeError("inductor: no C++ compiler\nmore detail")

        return call

    monkeypatch.setattr(torch, "compile", broken_compile)
    pieces = []
    g = answer(rt, PROMPT, SETTINGS, pieces.append)
    err = capsys.readouterr().err
    assert err.count("notice:") == 1 and "compiled decode failed" in err and "no C++ compiler" in err
    assert "more detail" not in err  # one line
    assert g.text == eager_answer and g.new_tokens == 12
    assert "".join(pieces).strip() == eager_answer.strip()  # streamed once, not twice
    assert rt.decode == "eager"
    assert answer(rt, PROMPT, SETTINGS).text == eager_answer
    assert "notice:" not in capsys.readouterr().err


def test_static_cache_path_matches_eager(bundle, eager_answer):
    """The compiled path itself (static KV cache, dynamo; the eager backend compiles in seconds on a CPU)."""
    rt = open_runtime("torch", bundle=bundle, messenger="global", decode="eager")
    compiled_decode.use_compiled_decode(rt.model, backend="eager")
    assert answer(rt, PROMPT, SETTINGS).text == eager_answer
    cache = compiled_decode._CACHES[rt.model][2]
    assert answer(rt, PROMPT, SETTINGS).text == eager_answer
    assert compiled_decode._CACHES[rt.model][2] is cache  # same shapes: the graph replays
    assert rt.decode == "compiled"


def test_unknown_decode_fails_before_loading(bundle):
    with pytest.raises(ConfigError, match="decode must be one of"):
        open_runtime("torch", bundle=bundle, messenger="global", decode="fast")
