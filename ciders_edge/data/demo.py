"""Generated instruction data in five task families with checkable answers.

Each family is its own "domain", so clients built from different families are naturally
non-IID, and every answer can be scored by exact match — with no download.
"""

from __future__ import annotations

import datetime as dt
import json
import random
from collections.abc import Callable
from pathlib import Path

from ciders_edge.formats.atomic import write_bytes

__all__ = ["TASK_FAMILIES", "generate", "write_demo_data"]

_NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jun"]
_ITEMS = ["apples", "books", "coins", "pencils", "stamps", "marbles", "cookies", "tickets"]
_UNITS = [
    ("kilometers", "meters", 1000),
    ("meters", "centimeters", 100),
    ("hours", "minutes", 60),
    ("minutes", "seconds", 60),
    ("kilograms", "grams", 1000),
    ("liters", "milliliters", 1000),
]
_CODE_OPS = {"len": len, "sum": sum, "max": max, "min": min, "sorted": sorted}
_WORDS = ["river", "planet", "garden", "window", "silver", "market", "orange", "bridge", "candle", "forest"]


def _arithmetic(r: random.Random) -> dict:
    name, item = r.choice(_NAMES), r.choice(_ITEMS)
    a, b, c = r.randint(5, 60), r.randint(2, 30), r.randint(1, 20)
    answer = a + b - c
    q = f"{name} has {a} {item}, buys {b} more and gives away {c}. How many {item} does {name} have now?"
    return {"instruction": q, "response": f"{a} + {b} - {c} = {answer}\n#### {answer}", "answer": str(answer)}


def _units(r: random.Random) -> dict:
    big, small, factor = r.choice(_UNITS)
    x = r.randint(2, 90)
    if r.random() < 0.5:
        q, ans = f"Convert {x} {big} to {small}.", x * factor
        return {"instruction": q, "response": f"{x} {big} = {ans} {small}\n#### {ans}", "answer": str(ans)}
    q, ans = f"Convert {x * factor} {small} to {big}.", x
    return {"instruction": q, "response": f"{x * factor} {small} = {ans} {big}\n#### {ans}", "answer": str(ans)}


def _dates(r: random.Random) -> dict:
    d = dt.date(1990, 1, 1) + dt.timedelta(days=r.randint(0, 15000))
    ans = d.isoformat()
    q = f"Rewrite the date {d.strftime('%B')} {d.day}, {d.year} in ISO format (YYYY-MM-DD)."
    return {"instruction": q, "response": ans, "answer": ans}


def _strings(r: random.Random) -> dict:
    word = r.choice(_WORDS)
    op = r.choice(["reverse", "upper", "count"])
    if op == "reverse":
        ans = word[::-1]
        q = f"Reverse the letters of the word '{word}'."
    elif op == "upper":
        ans = word.upper()
        q = f"Write the word '{word}' in capital letters."
    else:
        letter = r.choice(sorted(set(word)))
        ans = str(word.count(letter))
        q = f"How many times does the letter '{letter}' appear in '{word}'?"
    return {"instruction": q, "response": ans, "answer": ans}


def _code(r: random.Random) -> dict:
    xs = [r.randint(0, 9) for _ in range(r.randint(3, 5))]
    op = r.choice(sorted(_CODE_OPS))
    ans = str(_CODE_OPS[op](xs))
    q = f"What does the Python expression `{op}({xs})` evaluate to?"
    return {"instruction": q, "response": ans, "answer": ans}


TASK_FAMILIES: dict[str, Callable[[random.Random], dict]] = {
    "arithmetic": _arithmetic,
    "units": _units,
    "dates": _dates,
    "strings": _strings,
    "code": _code,
}


def generate(family: str, n: int, seed: int = 0) -> list[dict]:
    """``n`` records of one family, deterministic in ``seed``."""
    r = random.Random(f"{family}:{seed}")
    return [{**TASK_FAMILIES[family](r), "input": "", "domain": family} for _ in range(n)]


def write_demo_data(
    out: str | Path, n_train: int = 200, n_public: int = 100, n_eval: int = 50, seed: int = 0
) -> dict[str, Path]:
    """Write ``{family}/{train,public,eval}.jsonl`` under ``out`` (the five_domain layout).

    ``public.jsonl`` at the top mixes every family's public split, for TAKD on the cloud.
    """
    out = Path(out)
    paths, public = {}, []
    for i, family in enumerate(TASK_FAMILIES):
        for j, (split, n) in enumerate((("train", n_train), ("public", n_public), ("eval", n_eval))):
            rows = generate(family, n, seed=seed * 1000 + i * 10 + j)
            paths[f"{family}/{split}"] = _write(out / family / f"{split}.jsonl", rows)
            public += rows if split == "public" else []
    random.Random(seed).shuffle(public)
    paths["public"] = _write(out / "public.jsonl", public)
    return paths


def _write(path: Path, rows: list[dict]) -> Path:
    write_bytes(path, "".join(json.dumps(row) + "\n" for row in rows).encode())
    return path
