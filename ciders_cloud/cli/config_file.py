"""``--config FILE.toml``: a run's settings in a file (mostly the flags' names); one file serves two commands.

Every key is checked at load, before anything is written, against the keys of both commands
(:class:`ConfigFile`): a wrong type, a value outside a fixed set or an unknown key is one line naming
the file and ``table.key``. As everywhere in the code, ``clients`` is simulate's client count and
``client_ids`` prepare's accepted ids (RunConfig's field); ``local_steps`` is the edges' K. Shipped
presets are found by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path

from ciders_cloud.run.config import TEACHER_DTYPES, RunConfig
from ciders_cloud.study.config import SimConfig
from ciders_edge.config import read_toml
from ciders_edge.errors import ConfigError
from ciders_edge.model.lora import LoraSettings

__all__ = ["ConfigFile", "load_toml_config", "load_config", "merge_config", "COMMANDS"]

COMMANDS = ("prepare", "simulate")


@dataclass
class ConfigFile(SimConfig):
    """The keys a config file may hold: simulate's and prepare's own (only its field types are read)."""

    TABLES = {**SimConfig.TABLES, "lora": LoraSettings, "backbone_lora": LoraSettings}
    CHOICES = {**SimConfig.CHOICES, "teacher_dtype": TEACHER_DTYPES}

    profiles: list[str] = field(default_factory=list)  # prepare's device profiles (simulate's is `profile`)
    client_ids: list[str] = field(default_factory=list)  # prepare's accepted client ids
    lora: dict = field(default_factory=dict)
    backbone_lora: dict = field(default_factory=dict)
    storage: str = ""  # prepare's bundle storage of frozen weights (empty: each profile's)
    teacher_dtype: str = "auto"  # prepare's dtype of the teacher and the frozen weights on the cloud


PREPARE_ONLY = tuple(k for k in ConfigFile.field_types() if k not in SimConfig.field_types())
RUN_KEYS = set(RunConfig.field_types()) & set(ConfigFile.field_types())  # the file's keys that are the run's too


def config_path(name_or_path: str) -> Path:
    """A shipped preset (``paper``) by name, or a TOML file."""
    preset = files("ciders_cloud.presets").joinpath(f"{name_or_path}.toml")
    path = Path(str(preset)) if preset.is_file() else Path(name_or_path)
    if not path.is_file():
        raise ConfigError(f"{name_or_path}: no such config file or preset (presets: paper)")
    return path


def load_toml_config(name_or_path: str) -> dict:
    """The file's keys as written, unchecked."""
    return read_toml(config_path(name_or_path))


def load_config(name_or_path: str, command: str) -> dict:
    """The file's keys, checked by type and allowed values, as ``command`` reads them."""
    if command not in COMMANDS:
        raise ValueError(f"no config files for {command!r}")
    where = str(config_path(name_or_path))
    data = ConfigFile.check(load_toml_config(name_or_path), where)
    _check_ranges(data, where)
    return _for_prepare(data) if command == "prepare" else _for_simulate(data, where)


def _check_ranges(data: dict, where: str) -> None:
    """A table's own checks (``eta`` positive, ...) with the file named: a table holds every key's default."""
    for name, table in ConfigFile.TABLES.items():
        if name not in data:
            continue
        try:
            table.from_dict(data[name])
        except ConfigError as err:
            raise ConfigError(f"{where}: [{name}] {err}") from None


def _for_simulate(data: dict, where: str) -> dict:
    """Simulate honours every key it knows; prepare's own ones it could not, so they are refused."""
    extra = [k for k in PREPARE_ONLY if k in data]
    if extra:
        raise ConfigError(f"{where}: `{extra[0]}` is a key of `prepare`; `simulate` does not take it")
    return data


def _for_prepare(data: dict) -> dict:
    """Prepare's keys: ``local_steps`` goes to the bundles' hyperparameters, ``profile`` (simulate's one
    profile) stands for ``profiles``; the study's keys (``clients``, ``rounds``, ``data``, ...) describe
    the rounds after prepare, not the run."""
    run = {k: v for k, v in data.items() if k in RUN_KEYS}
    if "local_steps" in data:
        run["hyperparameters"] = {"local_steps": data["local_steps"], **data.get("hyperparameters", {})}
    if "profile" in data and "profiles" not in data:
        run["profiles"] = [data["profile"]]
    return run


def merge_config(
    config: str | None, flags: dict, tables: dict[str, dict] | None = None, command: str = "simulate"
) -> dict:
    """The checked TOML file, then the flags that were given (not ``None``); ``tables`` are flags that
    belong in a table of the file (``[takd]``, ``[hyperparameters]``) and merge into it."""
    merged = load_config(config, command) if config else {}
    merged.update({k: v for k, v in flags.items() if v is not None})
    for table, values in (tables or {}).items():
        merged[table] = {**merged.get(table, {}), **{k: v for k, v in values.items() if v is not None}}
    return merged
