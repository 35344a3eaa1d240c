"""Does an exported model compute what the AdapEmu computes? Logits and greedy agreement.

The same fixed chats (prompt and answer, teacher-forced) run through both models; the export
records the result, the tests and the SmolLM2 benchmark assert on it.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

from ciders_edge.inference.generation import chat_ids

__all__ = ["CHECK_CHATS", "check_inputs", "all_logits", "compare_logits"]

CHECK_CHATS = [
    ("What is 17 + 25?", "17 + 25 = 42. The answer is 42."),
    ("Convert 3 kilometres to metres.", "One kilometre is 1000 metres, so 3 km is 3000 metres."),
    ("Name the capital of France and one famous landmark there.", "Paris; the Eiffel Tower is there."),
    ("Reverse the word 'edge'.", "Reversed, 'edge' reads 'egde'."),
    ("Write a Python function that returns the square of x.", "def square(x):\n    return x * x"),
    ("Which day follows Friday?", "Saturday follows Friday."),
    (
        "Summarize: the cloud distills a compact backbone; edges train a small messenger.",
        "Cloud distills, edges adapt.",
    ),
    ("Give two uses of a thermometer.", "Measuring body temperature and checking the oven."),
]


def check_inputs(tokenizer: PreTrainedTokenizerBase) -> list[torch.Tensor]:
    """Token ids (1, T) of each check chat with its answer, in the model's chat template."""
    return [
        chat_ids(tokenizer, [{"role": "user", "content": q}, {"role": "assistant", "content": a}], False)
        for q, a in CHECK_CHATS
    ]


@torch.no_grad()
def all_logits(model, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Float32 logits (T, V) of every position of every input (torch, ONNX Runtime or GenAI model)."""
    if hasattr(model, "stream_tokens"):  # a TokenDecoder (GenAI): no transformers forward
        return [model.logits(ids[0].tolist()) for ids in inputs]
    return [model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].float() for ids in inputs]


def compare_logits(inputs: list[torch.Tensor], reference: list[torch.Tensor], other: list[torch.Tensor]) -> dict:
    """Largest absolute logit difference and the share of positions with the same greedy token.

    Positions inside the prefix every chat shares (a template's default system prompt) see the same
    context in each chat; they count once, not once per chat.
    """
    shared = _shared_prefix([ids[0] for ids in inputs])
    same = positions = 0
    for k, (r, o) in enumerate(zip(reference, other, strict=True)):
        start = 0 if k == 0 else shared
        same += int((r[start:].argmax(-1) == o[start:].argmax(-1)).sum())
        positions += r.shape[0] - start
    return {
        "max_abs_logit_diff": max(float((r - o).abs().max()) for r, o in zip(reference, other, strict=True)),
        "greedy_agreement": same / positions,
        "positions": positions,
    }


def _shared_prefix(rows: list[torch.Tensor]) -> int:
    """Length of the token prefix all ``rows`` share."""
    n, shortest = 0, min(len(r) for r in rows)
    while n < shortest and all(r[n] == rows[0][n] for r in rows):
        n += 1
    return n
