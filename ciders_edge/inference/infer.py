"""``ciders-edge infer``: answer one prompt (streamed) or a JSONL file of prompts on the device."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from ciders_edge.data.records import to_prompt
from ciders_edge.formats.atomic import write_bytes
from ciders_edge.inference.generation import Generation, GenerationSettings, encode_prompt, generate
from ciders_edge.inference.runtime import Runtime

__all__ = ["answer", "answer_file"]


def answer(
    rt: Runtime, prompt: str, settings: GenerationSettings, on_text: Callable[[str], None] | None = None
) -> Generation:
    """One user prompt through the model's chat template."""
    ids = encode_prompt(rt.tokenizer, [{"role": "user", "content": prompt}], rt.context, settings.max_new_tokens)
    return generate(rt.model, rt.tokenizer, ids, settings, on_text)


def answer_file(
    rt: Runtime,
    records: list[dict],
    dst: str | Path,
    settings: GenerationSettings,
    on_record: Callable[[int, int], None] | None = None,
) -> list[Generation]:
    """Answer every record (from :func:`read_jsonl`); ``dst`` gets each plus ``prediction``, all or nothing.

    Every prompt is encoded (and checked against the context) before the first is answered, so a
    bad record fails the command at once rather than after minutes of generation.
    """
    prompts = [
        encode_prompt(rt.tokenizer, to_prompt(r), rt.context, settings.max_new_tokens, where=r["_where"])
        for r in records
    ]
    results, lines = [], []
    for i, (record, ids) in enumerate(zip(records, prompts, strict=True)):
        g = generate(rt.model, rt.tokenizer, ids, settings)
        results.append(g)
        out = {k: v for k, v in record.items() if k != "_where"}
        out.update(prediction=g.text, new_tokens=g.new_tokens, seconds=round(g.total_s, 4))
        lines.append(json.dumps(out, ensure_ascii=False))
        if on_record is not None:
            on_record(i + 1, len(records))
    write_bytes(dst, ("\n".join(lines) + "\n").encode())
    return results
