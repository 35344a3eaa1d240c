"""Text generation for any runtime: ``generate`` and ``generate_batch`` take either kind of model.

A torch model and optimum's ONNX Runtime model are transformers ``GenerationMixin``s: sampling,
stopping and streaming are the library's. A runtime with a decode loop of its own (llama.cpp, ONNX
Runtime GenAI) is a :class:`TokenDecoder` that yields token ids; this module turns them into text.
Either way it adds the chat template, the context check and the timings ``infer`` and ``bench`` report.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from transformers import PreTrainedTokenizerBase, TextStreamer

from ciders_edge.config import ConfigMixin
from ciders_edge.errors import ConfigError, DataError
from ciders_edge.inference.compiled_decode import decodes_compiled, fall_back, static_cache

__all__ = [
    "GenerationSettings",
    "Generation",
    "TokenDecoder",
    "chat_ids",
    "encode_prompt",
    "generate",
    "generate_batch",
    "context_length",
]

ANSWER_BATCH = 16  # prompts answered together when scoring a file


@dataclass
class GenerationSettings(ConfigMixin):
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: greedy decoding
    top_p: float = 1.0
    seed: int = 0
    min_new_tokens: int = 0  # > 0 makes a benchmark decode a fixed length

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.temperature < 0:
            raise ConfigError(f"`temperature` must be >= 0, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"`top_p` must be in (0, 1], got {self.top_p}.")

    def generate_kwargs(self) -> dict:
        kw = {"max_new_tokens": self.max_new_tokens, "min_new_tokens": self.min_new_tokens}
        if self.temperature == 0:
            return {**kw, "do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        return {**kw, "do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": None}


@dataclass
class Generation:
    text: str
    prompt_tokens: int
    new_tokens: int
    first_token_s: float  # prompt prefill and the first token: what a user waits before text appears
    total_s: float

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens per second after the first one (the steady decode rate); None below two tokens."""
        rest = self.total_s - self.first_token_s
        return (self.new_tokens - 1) / rest if self.new_tokens > 1 and rest > 0 else None

    def to_dict(self) -> dict:
        return {**self.__dict__, "decode_tokens_per_s": self.decode_tokens_per_s}


@runtime_checkable
class TokenDecoder(Protocol):
    """A runtime that runs its own decode loop: no transformers ``generate`` per token.

    ``stream_tokens`` yields the new token ids for one prompt (batch 1) and stops after an end-of-turn
    token (which it yields) or ``settings.max_new_tokens``, honouring ``min_new_tokens``, greedy at
    temperature 0 and seeded sampling (``temperature``, ``top_p``, ``seed``) otherwise."""

    context: int  # tokens the model can attend to

    def stream_tokens(self, prompt_ids: list[int], settings: GenerationSettings) -> Iterator[int]: ...


def context_length(config) -> int:
    return int(getattr(config, "max_position_embeddings", 0) or 2048)


def chat_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict], add_generation_prompt: bool) -> torch.Tensor:
    """Token ids (1, T) of ``messages`` in the model's chat template."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, return_tensors="pt")
    return ids["input_ids"] if hasattr(ids, "input_ids") else ids  # some tokenizers return a BatchEncoding


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], context: int, max_new_tokens: int, where: str = "prompt"
) -> torch.Tensor:
    """Token ids of the chat prompt (1, T); refuses one that leaves no room for the answer."""
    ids = chat_ids(tokenizer, messages, add_generation_prompt=True)
    if ids.shape[1] + max_new_tokens > context:
        raise DataError(
            f"{where}: {ids.shape[1]} prompt tokens + {max_new_tokens} new tokens exceed the model's context "
            f"of {context} tokens; shorten the prompt or lower --max-new-tokens"
        )
    return ids


class _TimedStreamer(TextStreamer):
    """Passes finished text pieces to a callback and notes when the first new token arrived."""

    def __init__(self, tokenizer, on_text: Callable[[str], None] | None) -> None:
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.on_text = on_text
        self.first_token_at: float | None = None
        self._seen_prompt = False
        self._sent = 0  # characters passed to on_text
        self._skip = 0  # characters of a replayed generation already passed on

    def put(self, value) -> None:
        if self._seen_prompt and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self._seen_prompt = True
        super().put(value)

    def rewind(self) -> None:
        """Start over for a replay of the same generation, passing on only the text not yet sent."""
        self.token_cache, self.print_len, self.next_tokens_are_prompt = [], 0, True
        self.first_token_at, self._seen_prompt, self._skip = None, False, self._sent

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        drop = min(self._skip, len(text))
        text, self._skip = text[drop:], self._skip - drop
        if self.on_text is not None and text:
            self._sent += len(text)
            self.on_text(text)


@torch.no_grad()
def generate(
    model,
    tokenizer: PreTrainedTokenizerBase,
    input_ids: torch.Tensor,
    settings: GenerationSettings,
    on_text: Callable[[str], None] | None = None,
) -> Generation:
    """Generate one answer (batch 1, as on a device); ``on_text`` receives it as it is decoded."""
    if isinstance(model, TokenDecoder):
        return _generate_tokens(model, tokenizer, input_ids[0].tolist(), settings, on_text)
    streamer = _TimedStreamer(tokenizer, on_text)
    start = time.perf_counter()
    out = _generate(model, tokenizer, input_ids, torch.ones_like(input_ids), settings, streamer)
    total = time.perf_counter() - start
    new = out[0, input_ids.shape[1] :]
    first = (streamer.first_token_at or start + total) - start
    return Generation(
        tokenizer.decode(new, skip_special_tokens=True), input_ids.shape[1], int(new.numel()), first, total
    )


@torch.no_grad()
def generate_batch(
    model,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[dict]],
    settings: GenerationSettings,
    batch_size: int = ANSWER_BATCH,
) -> list[str]:
    """Answers to chat prompts, ``batch_size`` at a time (left-padded): scoring a file is offline
    work, and a batch decodes several times faster than one prompt after another on a CPU."""
    if isinstance(model, TokenDecoder):  # batch 1: these runtimes are built for one stream
        return [
            generate(
                model, tokenizer, encode_prompt(tokenizer, p, model.context, settings.max_new_tokens), settings
            ).text
            for p in prompts
        ]
    model.eval()
    context = context_length(model.config)
    out = []
    for i in range(0, len(prompts), batch_size):
        rows = [encode_prompt(tokenizer, p, context, settings.max_new_tokens)[0] for p in prompts[i : i + batch_size]]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, r in enumerate(rows):
            ids[j, width - len(r) :], mask[j, width - len(r) :] = r, 1
        gen = _generate(model, tokenizer, ids, mask, settings)
        out += [tokenizer.decode(g[width:], skip_special_tokens=True) for g in gen]
    return out


def _generate(model, tokenizer, ids: torch.Tensor, mask: torch.Tensor, settings: GenerationSettings, streamer=None):
    """The one call into transformers' ``generate``, for every runtime and batch size.

    A model set to compiled decode gets a static KV cache; if compiling fails, it says so once and
    the same generation runs again eagerly (same seed, so the same answer; the streamer skips what
    it already showed)."""
    kwargs = {
        "input_ids": ids.to(model.device),
        "attention_mask": mask.to(model.device),
        "pad_token_id": tokenizer.pad_token_id,
        **settings.generate_kwargs(),
    }
    if decodes_compiled(model):
        cache = static_cache(model, ids.shape[0], ids.shape[1] + settings.max_new_tokens, context_length(model.config))
        torch.manual_seed(settings.seed)
        try:
            return model.generate(**kwargs, streamer=streamer, past_key_values=cache)
        except Exception as err:  # inductor, triton or CUDA graphs: any of them may fail on a device
            fall_back(model, err)
            if streamer is not None:
                streamer.rewind()
    torch.manual_seed(settings.seed)
    return model.generate(**kwargs, streamer=streamer)


def _generate_tokens(
    decoder: TokenDecoder,
    tokenizer: PreTrainedTokenizerBase,
    prompt: list[int],
    settings: GenerationSettings,
    on_text: Callable[[str], None] | None,
) -> Generation:
    """Drive a :class:`TokenDecoder`, passing on text as whole characters arrive (a multi-byte
    character split over tokens decodes to U+FFFD until its last byte is in)."""
    start, first, new, sent = time.perf_counter(), None, [], ""
    for token in decoder.stream_tokens(prompt, settings):
        first = first if first is not None else time.perf_counter() - start
        new.append(token)
        if on_text is not None:
            text = tokenizer.decode(new, skip_special_tokens=True)
            if not text.endswith("\ufffd") and len(text) > len(sent):
                on_text(text[len(sent) :])
                sent = text
    total = time.perf_counter() - start
    text = tokenizer.decode(new, skip_special_tokens=True)
    if on_text is not None and len(text) > len(sent):
        on_text(text[len(sent) :])
    return Generation(text, len(prompt), len(new), first or total, total)
