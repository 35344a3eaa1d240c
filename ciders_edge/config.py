"""Configuration dataclasses shared by edge and cloud: typed keys, allowed ranges, TOML reading.

TOML and JSON keys equal the field names. :meth:`ConfigMixin.from_dict` checks every value against
its field's type hint, so a wrong type is a one-line :class:`ConfigError` naming the file and key,
not a ``TypeError`` rounds later. Unknown keys are errors in files a user writes (``strict``) and
are warned about and dropped in saved JSON (a newer version's keys must not break an older reader).
"""

from __future__ import annotations

import difflib
import functools
import math
import tomllib
import types
import warnings
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, ClassVar, TypeVar, Union, get_args, get_origin, get_type_hints

from ciders_edge.errors import ConfigError

__all__ = [
    "ConfigMixin",
    "check_value",
    "check_limit",
    "limit_error",
    "LIMITS",
    "read_toml",
]

T = TypeVar("T", bound="ConfigMixin")

# The allowed range of every count a user, a config file or a bundle sets, by key (a field of any config
# dataclass, or a CLI option of the same meaning): checked where the value is read (ConfigMixin.check
# names the file and table) and where a config is made (ConfigMixin.__post_init__), so no count is
# ever unbounded (`local_steps = 10**20` in a bundle looped forever; `--clients 10**11` ran out of memory).
LIMITS: dict[str, tuple[int, int]] = {
    # steps and rounds
    "local_steps": (1, 100_000),
    "warmup_steps": (0, 100_000),
    "takd_steps": (0, 100_000),
    "steps": (0, 100_000),  # distill's added TAKD steps
    "layer_steps": (0, 1_000_000),
    "align_steps": (0, 1_000_000),
    "train_steps": (0, 10_000),  # bench's timed training steps
    "rounds": (1, 100_000),
    "eval_every": (1, 100_000),
    # batch shapes
    "batch_size": (1, 4096),
    "hvp_batch_size": (1, 4096),  # with probe_batches and neumann_terms: a bilevel strategy's (the cloud's)
    "grad_accum": (1, 1024),
    "seq_len": (1, 131_072),
    "probe_batches": (1, 10_000),
    "neumann_terms": (1, 1000),
    # model shapes
    "rank": (1, 1024),
    "lora_rank": (1, 1024),
    "messenger_depth": (1, 1024),
    # fleets: simulate keeps every client in one process
    "clients": (1, 1000),
    "min_clients": (1, 100_000),
    # data, evaluation and generation
    "max_records": (0, 1_000_000_000),
    "holdout": (0, 1_000_000),
    "eval_examples": (0, 1_000_000),
    "eval_generate": (0, 1_000_000),
    "limit": (1, 1_000_000_000),
    "max_new_tokens": (1, 32_768),
    "min_new_tokens": (0, 32_768),
    "new_tokens": (1, 32_768),
    "repeats": (1, 1000),
    "n_train": (0, 1_000_000),
    "n_public": (0, 1_000_000),
    "n_eval": (0, 1_000_000),
    "seed": (0, 2**63 - 1),
    "days": (1, 36_500),
}

_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false", dict: "a table"}
_PLURALS = {int: "integers", float: "numbers", str: "strings", bool: "booleans", dict: "tables"}


def _members(hint: Any) -> tuple:
    """The alternatives of ``X | Y`` (or ``hint`` alone)."""
    return get_args(hint) if get_origin(hint) in (Union, types.UnionType) else (hint,)


def check_value(value: Any, hint: Any) -> bool:
    """Whether ``value`` (as TOML or JSON gives it) fits ``hint``: an int passes for a float, a bool
    never passes for a number (``True`` is an ``int`` to Python, not to a config)."""
    if len(alts := _members(hint)) > 1:
        return any(check_value(value, a) for a in alts)
    origin, args = get_origin(hint) or hint, get_args(hint)
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if isinstance(value, bool):
        return hint is bool
    if hint is float:
        return isinstance(value, int | float) and _finite(value)
    if origin is list:
        return isinstance(value, list) and (not args or all(check_value(v, args[0]) for v in value))
    if origin is dict:
        return isinstance(value, dict) and (not args or all(check_value(v, args[1]) for v in value.values()))
    return isinstance(value, origin)


def _finite(value: int | float) -> bool:
    """NaN and infinity are no setting; nor is an integer too large for a float."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def limit_error(key: str, value: Any, name: str = "") -> str | None:
    """Why the integer ``value`` of ``key`` is out of :data:`LIMITS` (``None``: it is in range, or
    ``key`` has none); ``name`` is how the message names the key (default `` `key` ``)."""
    low, high = LIMITS.get(key, (None, None))
    if low is None or not isinstance(value, int) or isinstance(value, bool) or low <= value <= high:
        return None
    return f"{name or f'`{key}`'} must be an integer from {low:,} to {high:,}; got {value}"


def check_limit(key: str, value: Any, name: str = "") -> None:
    """Raise the :class:`ConfigError` of :func:`limit_error` (for a CLI option: ``name="--rounds"``)."""
    if (message := limit_error(key, value, name)) is not None:
        raise ConfigError(message)


def read_toml(path: Path) -> dict:
    """A TOML file a user wrote (a config, a device profile); anything unreadable is one line naming it."""
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        before = err.object[: err.start]
        line, column = before.count(b"\n") + 1, err.start - before.rfind(b"\n")
        byte = f"byte {err.object[err.start]:#04x} at line {line}, column {column}"
        raise ConfigError(f"{path}: not UTF-8 text ({byte})") from None
    except ValueError as err:  # TOMLDecodeError, or an integer of over 4,300 digits
        raise ConfigError(f"{path}: invalid TOML ({err})") from None


def _describe(hint: Any) -> str:
    """``hint`` in a config writer's words: "a list of strings", "a number" (TOML has no None)."""
    alts = [a for a in _members(hint) if a is not type(None)]
    if len(alts) > 1:
        return " or ".join(_describe(a) for a in alts)
    hint = alts[0]
    origin, args = get_origin(hint) or hint, get_args(hint)
    if origin is list:
        return f"a list of {_PLURALS.get(args[0], getattr(args[0], '__name__', str(args[0])))}" if args else "a list"
    return _NAMES.get(origin, getattr(origin, "__name__", str(origin)))


class ConfigMixin:
    """``to_dict`` / ``from_dict`` for config dataclasses (after PEFT's ``PeftConfigMixin``).

    ``CHOICES`` names the fields with a fixed set of values, ``TABLES`` the ``dict`` fields that hold
    another config's keys (a TOML table), so both are checked where the file is read.
    """

    CHOICES: ClassVar[dict[str, tuple]] = {}
    TABLES: ClassVar[dict[str, type[ConfigMixin]]] = {}

    def __post_init__(self) -> None:
        """Every integer field within :data:`LIMITS` and every ``CHOICES`` field one of its values
        (subclasses call this first)."""
        for key, hint in self.field_types().items():
            if int in _members(hint):
                check_limit(key, getattr(self, key))
        for key, choices in self.CHOICES.items():
            if (value := getattr(self, key)) not in choices:
                spelled = ", ".join(str(c) if c != "" else '""' for c in choices)
                raise ConfigError(f"`{key}` must be one of {spelled}, got {value!r}.")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]

    @classmethod
    @functools.cache
    def field_types(cls) -> dict[str, Any]:
        """Each field's resolved type hint, by name (read-only: it is cached)."""
        hints = get_type_hints(cls)
        return {f.name: hints[f.name] for f in fields(cls)}  # type: ignore[arg-type]

    @classmethod
    def check(cls, d: dict[str, Any], where: str = "", table: str = "", strict: bool = True) -> dict[str, Any]:
        """``d``'s known keys, each checked against its field's type, allowed values and (for a table)
        the table's own keys; ``where`` (a file) and ``table.key`` name the culprit in the error."""
        types_ = cls.field_types()
        where = where or cls.__name__
        unknown = sorted(set(d) - set(types_))
        if unknown and strict:
            raise ConfigError(_unknown(where, table, unknown[0], types_))
        if unknown:
            names = ", ".join(dotted(table, k) for k in unknown)
            warnings.warn(f"{where}: unknown keys ignored: {names}", stacklevel=3)
        out = {}
        for key, value in d.items():
            if key not in types_:
                continue
            name, choices = dotted(table, key), cls.CHOICES.get(key)
            if not check_value(value, types_[key]) or (choices and value not in choices):
                expected = _describe(types_[key]) + (f", one of {', '.join(map(repr, choices))}" if choices else "")
                raise ConfigError(f"{where}: `{name}` must be {expected}; got {value!r}")
            if int in _members(types_[key]) and (message := limit_error(key, value, f"`{name}`")):
                raise ConfigError(f"{where}: {message}")
            sub = cls.TABLES.get(key)
            out[key] = sub.check(value, where, name, strict) if sub and isinstance(value, dict) else value
        return out

    @classmethod
    def from_dict(cls: type[T], d: dict[str, Any], where: str = "", strict: bool = False) -> T:
        """An instance from TOML or JSON keys, checked by :meth:`check` (``where``: the file)."""
        return cls(**cls.check(d, where, strict=strict))

    def replace(self: T, **changes: Any) -> T:
        """A copy with ``changes`` applied (``None`` values are ignored, as unset CLI flags)."""
        return type(self).from_dict({**self.to_dict(), **{k: v for k, v in changes.items() if v is not None}})


def dotted(table: str, key: str) -> str:
    return f"{table}.{key}" if table else key


def _unknown(where: str, table: str, key: str, known: dict) -> str:
    """One line for an unknown key, with the nearest known one (a typo such as ``local_step``)."""
    near = difflib.get_close_matches(key, list(known), n=1)
    hint = f"; did you mean `{dotted(table, near[0])}`?" if near else f" (known: {', '.join(known)})"
    return f"{where}: unknown key `{dotted(table, key)}`{hint}"
