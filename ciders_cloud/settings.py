"""``--config FILE.toml``: keys mirror the command's flags; shipped presets are found by name."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

import tomllib

from ciders_edge.errors import ConfigError

__all__ = ["load_toml_config"]


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
