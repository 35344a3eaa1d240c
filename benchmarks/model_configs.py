"""The model sizes edge users fine-tune, as their real Hugging Face configs, built here with random weights.

Only SmolLM2-135M has real weights on this machine (the Hub is not reachable). Cost and memory do not
depend on the weights, quality does: every figure measured on a model built here says "random weights
of the real config". The configs below are the published ``config.json`` fields that change cost or
the forward pass (sizes, heads, vocabulary, rope, biases, norms, sliding windows); the tokenizer is
SmolLM2's (a model's extra vocabulary rows are simply never looked up).

The configs are the toolkit's model classes (:mod:`ciders_edge.model.classes`, what ``profiles --detect`` sizes
devices by). ``python -m benchmarks.model_configs NAME...`` builds them into ``$CIDERS_HOME/models/random-NAME``.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

from ciders_edge.model.classes import MODEL_CLASSES

__all__ = ["CONFIGS", "random_model", "build_random_model", "parameter_count"]

CONFIGS = {name: fields for name, fields in MODEL_CLASSES.items() if name != "smollm2-135m"}  # the real one is here


def random_model(name: str) -> Path:
    """``$CIDERS_HOME/models/random-NAME``, built once (random weights of the real config)."""
    from ciders_edge.model.sources import ciders_home

    out = ciders_home() / "models" / f"random-{name}"
    if not (out / "model.safetensors").is_file() and not (out / "model.safetensors.index.json").is_file():
        build_random_model(name, out)
    return out


def build_random_model(name: str, out: Path, seed: int = 0) -> Path:
    """Write a Hugging Face folder (safetensors, config, SmolLM2's tokenizer) of ``name``'s config with
    random weights; built in bf16 when large, saved in fp32 as a checkpoint would be converted."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ciders_edge.model.sources import load_tokenizer, resolve_model

    if name not in CONFIGS:
        raise SystemExit(f"unknown model {name!r}; known: {', '.join(CONFIGS)}")
    tok = load_tokenizer(resolve_model("tiny"))  # SmolLM2's tokenizer
    fields = dict(CONFIGS[name])
    model_type = fields.pop("model_type")
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    config = AutoConfig.for_model(model_type, **fields, **ids)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.config.name_or_path = f"random/{name}"
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, safe_serialization=True)
    tok.save_pretrained(staging)
    del model
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return out


def parameter_count(folder: Path) -> int:
    """Parameters of a model folder, from its safetensors headers (a tied head counted once)."""
    from safetensors import safe_open

    total = 0
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, framework="pt") as st:
            for k in st.keys():
                total += _numel(st.get_slice(k).get_shape())
    return total


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="+", choices=sorted(CONFIGS))
    for name in parser.parse_args().names:
        print(name, random_model(name))


if __name__ == "__main__":
    main()
