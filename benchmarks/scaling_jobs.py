"""``benchmarks/scaling.py``'s bookkeeping: one model's job (what is due, its child processes, their
peak RSS from ``wait4``), the device profiles its runs are prepared for, and each measurement's settings.

Imports no torch, like ``scaling.py``'s whole parent process: a child's ``wait4`` peak RSS is at least what
its parent held when it was started (exec carries it over), so the parent stays small (about 17 MB).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import common
from scaling_report import RUNTIMES, TRAIN, Store

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).with_name("scaling.py")
AGGREGATED = ("train/fp32", "train/int8", "train/int4")  # the rounds whose packets one aggregate takes


class Job:
    """One model's measurements: what is due, where its runs lie, and the child processes that measure."""

    def __init__(self, args: argparse.Namespace, store: Store, name: str) -> None:
        self.args, self.store, self.name = args, store, name
        self.work = args.work / name
        self.measured: set[str] = set()  # measured in this invocation: never twice
        self.folder, self.data = "", Path()  # the model's folder and training records (set by its setup)

    def due(self, key: str, settings: dict) -> bool:
        """Whether ``key`` is asked for (``--only``) and not already stored with these settings."""
        group = {"train": "train", "peft": "peft", "profile": "profiles"}.get(key.split("/")[0], key)
        if group not in self.args.only or key in self.measured:
            return False
        return self.store.needed(self.name, key, settings, self.args.force)

    def child(self, kind: str, spec: dict, log: str) -> dict:
        """Run ``--child KIND`` and return its entry: result (with peak RSS and wall time), refused or failed."""
        logs = self.work / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        result = logs / f"{log}.result.json"
        result.unlink(missing_ok=True)
        spec_path = logs / f"{log}.spec.json"
        spec_path.write_text(json.dumps({**spec, "result": str(result), "command": self.args.command}))
        cmd = [sys.executable, str(SCRIPT), "--child", kind, str(spec_path)]
        home = {} if kind == "setup" else {"CIDERS_HOME": str(self.args.work / "home")}  # the profiles made here
        rc, peak, wall = spawn(cmd, logs / f"{log}.log", home)
        if rc != 0 or not result.is_file():
            return {"failed": failure(logs / f"{log}.log", rc)}
        out = json.loads(result.read_text())
        own = out.pop("self_peak_rss_bytes", None)
        if "result" in out:
            out["result"].update(peak_rss_bytes=peak, self_peak_rss_bytes=own, wall_s=wall)
        return out

    def record(self, key: str, settings: dict, entry: dict) -> dict:
        self.store.save(self.name, key, {"settings": settings, **entry})
        self.measured.add(key)
        print(f"{self.name} {key}: {summary(entry)}", flush=True)
        return entry


def spawn(cmd: list[str], log: Path, env: dict | None = None) -> tuple[int, int, float]:
    """Run ``cmd`` with its output in ``log``; its exit code, peak RSS in bytes (``wait4``) and wall seconds."""
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_maxrss * 1024, time.perf_counter() - start


def failure(log: Path, rc: int) -> str:
    """One line for a crashed child: its last line of output, or the signal that killed it."""
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    why = "killed (out of memory?)" if rc == -9 else lines[-1].strip() if lines else f"exit code {rc}"
    return f"{why[-300:]} (exit {rc}; log {log})"


def summary(entry: dict) -> str:
    if "result" not in entry:
        return next(f"{k}: {entry[k]}" for k in ("refused", "failed") if k in entry)
    r = entry["result"]
    keys = ("step_s", "layer_step_s", "align_step_s", "seconds", "tg_tokens_per_s")
    parts = [f"{k} {r[k]:.3g}" for k in keys if r.get(k)]
    for name, row in r.get("runtimes", {}).items():  # decode: the process's own peak includes the exports
        parts.append(f"{name} refused" if "refused" in row else f"{name} {row.get('decode_tokens_per_s', 0):.1f} tok/s")
    peak = [f"peak {r['peak_rss_bytes'] / 2**30:.2f} GiB"] if "peak_rss_bytes" in r else []
    return ", ".join([*parts, *peak])


def profile_toml(args, name: str, base: str, **changes) -> str:
    """A copy of a shipped profile as the children's own profile ``name`` (``--work/home/profiles``, their
    ``$CIDERS_HOME``): a budget that prepare's estimate never refuses (the benchmark measures what the
    estimate predicts), and the AdapEmu deployed, so a bundle holds it alone. Returns the name."""
    fields = tomllib.loads((ROOT / "device_profiles" / f"{base}.toml").read_text())
    fields.update(name=name, memory_budget_gb=64.0, backbone="emu", **changes)
    path = profile_path(args, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in fields.items()))
    return name


def profile_path(args, name: str) -> Path:
    return args.work / "home" / "profiles" / f"{name}.toml"


def profile_fields(args, name: str) -> dict:
    return tomllib.loads(profile_path(args, name).read_text())


def main_profiles(args) -> dict[str, str]:
    """The main table's split: the base profile's depth at ``--drop-ratio``, batch 1, one TOML per storage."""
    shape = {"drop_ratio": args.drop_ratio, "batch_size": 1, "grad_accum": 1, "seq_len": args.seq_len}
    if args.messenger_depth:
        shape["messenger_depth"] = args.messenger_depth
    return {s: profile_toml(args, f"scaling-{s}", args.base_profile, storage=s, **shape) for s in ("int8", "int4")}


def split_settings(args, profile: str) -> dict:
    f = profile_fields(args, profile)
    keys = ("messenger_depth", "drop_ratio", "seq_len", "batch_size", "grad_accum", "dtype", "lora_rank")
    return {k: f[k] for k in keys}


def prepare_settings(args, profiles: dict[str, str]) -> dict:
    steps = {k: getattr(args, k) for k in ("layer_steps", "align_steps", "takd_steps", "holdout")}
    return {
        **steps,
        "public_data": data_name(args.public_data),
        "split": split_settings(args, next(iter(profiles.values()))),
    }


def data_name(path: Path) -> str:
    """A data file as the results name it: under the benchmark data folder, relative to it."""
    return str(path.relative_to(common.DATA)) if path.is_relative_to(common.DATA) else str(path)


def train_settings(
    args, profile: str, frozen: str | None, checkpointing: bool | None, val_fraction: float = 0.0
) -> dict:
    """What a train measurement depends on; ``None`` frozen weights or checkpointing: the profile's own;
    ``val_fraction`` only where there is a validation slice (the rows measured before it stay as stored)."""
    fields = profile_fields(args, profile)
    frozen = frozen or fields.get("frozen_weights", "quantized")
    checkpointing = fields.get("gradient_checkpointing", False) if checkpointing is None else checkpointing
    data = {"data": data_name(args.data), "records": args.records, "steps": args.steps, "storage": fields["storage"]}
    held = {"val_fraction": val_fraction} if val_fraction else {}
    return {**split_settings(args, profile), **data, "frozen_weights": frozen, "checkpointing": checkpointing, **held}


def packet_path(place: Path, key: str) -> Path:
    return place / "packets" / f"{key.replace('/', '-')}.pkt"


def keep(job: Job, key: str, settings: dict, entry: dict, due: bool) -> None:
    """Record ``entry`` when its measurement was due; a failure of a rerun that was not is only printed."""
    if due:
        job.record(key, settings, entry)
    elif "result" not in entry:
        print(f"{job.name} {key} (rerun for its files): {summary(entry)}", flush=True)


def main_plan(args, profiles: dict[str, str]) -> dict[str, dict]:
    """The main table's measurements of one model after ``prepare``, with their settings."""
    plan = {f"train/{v}": train_settings(args, profiles[s], f, c) for v, (s, f, c) in TRAIN.items()}
    plan["aggregate"] = {"takd_steps": args.takd_steps, "holdout": args.holdout, "packets": list(AGGREGATED)}
    plan["aggregate"]["split"] = split_settings(args, profiles["int8"])  # the run it aggregates
    plan["decode"] = {"runtimes": list(RUNTIMES), "new_tokens": args.new_tokens, "repeats": args.repeats}
    plan["decode"]["backbone"] = "full"
    plan["infer"] = {"runtime": "genai-int8", "max_new_tokens": args.new_tokens, "backbone": "full"}
    if args.llama_bench is not None:
        plan["llama-bench"] = {"new_tokens": args.new_tokens, "repeats": args.repeats}
    return plan
