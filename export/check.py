"""Does an exported model compute what the AdapEmu computes? Logits and greedy agreement.

The same fixed chats (prompt and answer, teacher-forced) run through both models; the export
records the result, the tests and the SmolLM2 benchmark assert on it.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

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
    out = []
    for question, answer in CHECK_CHATS:
        chat = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        ids = tokenizer.apply_chat_template(chat, return_tensors="pt")
        out.append(ids["input_ids"] if hasattr(ids, "input_ids") else ids)
    return out


@torch.no_grad()
def all_logits(model, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Float32 logits (T, V) of every position of every input (torch or ONNX Runtime model)."""
    return [model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].float() for ids in inputs]


def compare_logits(reference: list[torch.Tensor], other: list[torch.Tensor]) -> dict:
    """Largest absolute logit difference and the share of positions with the same greedy token."""
    same = sum(int((r.argmax(-1) == o.argmax(-1)).sum()) for r, o in zip(reference, other, strict=True))
    positions = sum(r.shape[0] for r in reference)
    return {
        "max_abs_logit_diff": max(float((r - o).abs().max()) for r, o in zip(reference, other, strict=True)),
        "greedy_agreement": same / positions,
        "positions": positions,
    }
