"""``--config FILE.toml``: keys mirror the command's flags; shipped presets are found by name."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

import tomllib

from ciders_edge.errors import ConfigError

__all__ = ["load_toml_config", "merge_config"]


def load_toml_config(name_or_path: str) -> dict:
    """A TOML file, or a shipped preset (``paper``) by name."""
    preset = files("ciders_cloud.presets").joinpath(f"{name_or_path}.toml")
    path = Path(str(preset)) if preset.is_file() else Path(name_or_path)
    if not path.is_file():
        raise ConfigError(f"{name_or_path}: no such config file or preset (presets: paper)")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: invalid TOML ({err})") from None


def merge_config(config: str | None, flags: dict, tables: dict[str, dict] | None = None) -> dict:
    """The TOML file, then the flags that were given (not ``None``); ``tables`` are flags that
    belong in a table of the file (``[takd]``, ``[hyperparameters]``) and merge into it."""
    merged = load_toml_config(config) if config else {}
    merged.update({k: v for k, v in flags.items() if v is not None})
    for table, values in (tables or {}).items():
        merged[table] = {**merged.get(table, {}), **{k: v for k, v in values.items() if v is not None}}
    return merged
