"""``ciders-edge profiles`` and ``verify``: what this device is and what a bundle holds."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ciders_edge.cli_utils import JsonOpt, key_table, print_table, run_command
from ciders_edge.formats.bundle import Bundle
from ciders_edge.profiles import GIB, detect_profile, list_profiles, load_profile
from ciders_edge.progress import console

__all__ = ["profiles", "verify"]


def profiles(
    name: Annotated[str | None, typer.Argument(help="Show one profile (a name, `auto`, or a .toml path).")] = None,
    detect: Annotated[
        bool,
        typer.Option(help="Show the profile `auto` picks on this device and the largest models it trains and runs."),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """List the device profiles, show one, or detect this device's."""

    def body() -> dict:
        if detect:
            return {"detected": detect_profile().to_dict(), **_fits(detect_profile())}
        if name is not None:
            return {"profile": load_profile(name).to_dict(), **_fits(load_profile(name))}
        return {"profiles": [{**p.to_dict(), **_largest(p)} for p in list_profiles()]}

    run_command(body, as_json, _render_profiles)


def _fits(profile) -> dict:
    """The model classes against ``profile`` (memory model: ``ciders_edge/memory.py``), and the largest of
    them it trains and runs (``None``: not even the smallest)."""
    from ciders_edge.memory import class_fits

    fits = class_fits(profile)
    largest = lambda ok: next((f.name for f in reversed(fits) if ok(f)), None)  # noqa: E731
    return {
        "classes": [f.to_dict() for f in fits],
        "largest_train": largest(lambda f: f.train.fits),
        "largest_run": largest(lambda f: f.run.fits),
    }


def _largest(profile) -> dict:
    """The largest model class ``profile`` trains, by name and size (for the list's narrow column)."""
    fits = _fits(profile)
    size = next((c["parameters"] for c in fits["classes"] if c["name"] == fits["largest_train"]), None)
    return {"trains_up_to": fits["largest_train"], "trains_up_to_parameters": size}


def _render_profiles(s: dict) -> None:
    if "profiles" in s:
        header = (
            "name",
            "target",
            "dtype/store",
            "mem",
            "depth",
            "drop",
            "seq×batch",
            "runtime",
            "max",
        )  # max: the largest model class it trains
        print_table(key_table(header, [_profile_row(p) for p in s["profiles"]]))
        return
    p = s.get("profile") or s["detected"]
    title = p["name"] + (" (detected)" if "detected" in s else "")
    print_table(key_table(("key", "value"), [(k, str(v)) for k, v in p.items()], show_header=False, title=title))
    rows = [
        (c["name"], f"{c['parameters'] / 1e6:,.0f}M", f"{c['train_gib']:.2f}", _yes(c["trains"]), f"{c['run_gib']:.2f}",
         _yes(c["runs"]))
        for c in s["classes"]
    ]  # fmt: skip
    print_table(key_table(("model class", "params", "train GiB", "trains", "run GiB", "runs"), rows))
    console.print(
        f"largest model class to train: {s['largest_train'] or 'none'}; to run: {s['largest_run'] or 'none'} "
        f"(within {p['memory_budget_gb']:g} GB; estimates, ciders_edge/memory.py)",
        highlight=False,
    )


def _yes(ok: bool) -> str:
    return "yes" if ok else "no"


_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _profile_row(p: dict) -> tuple[str, ...]:
    return (
        p["name"],
        p["target"],
        f"{_SHORT.get(p['dtype'], p['dtype'])}/{p['storage']}",  # compute dtype / how bundles store frozen weights
        f"{p['memory_budget_gb']:g}G",
        str(p["messenger_depth"]),
        f"{p['drop_ratio']:g}",
        f"{p['seq_len']}×{p['batch_size']}",
        f"{p['runtime']}/{p['quantization']}",
        _size(p["trains_up_to_parameters"]),
    )


def _size(parameters: int | None) -> str:
    if parameters is None:
        return "-"
    return f"{parameters / 1e9:.1f}B" if parameters >= 1e9 else f"{parameters / 1e6:.0f}M"


def verify(
    bundle: Annotated[Path, typer.Option(help="Bundle folder.")],
    as_json: JsonOpt = False,
) -> None:
    """Check every checksum of a bundle and that its weights are what loading expects; show what it holds."""

    def body() -> dict:
        b = Bundle.load(bundle)
        m = b.manifest
        size = sum((b.path / f).stat().st_size for f in m["files"])
        return {
            "bundle": str(b.path),
            "bundle_id": b.bundle_id,
            "round": b.round,
            "model": m["base_model"]["id"],
            "kept_layers": m["split"]["kept"],
            "messenger_depth": m["split"]["a"],
            "trained_layers": m["split"].get("trained", m["split"]["a"]),  # the top ones; the rest stay at v
            "profile": m["profile"]["name"],
            "files": len(m["files"]),
            "bytes": size,
            "storage": m.get("storage", {}).get("format", m["dtype"]),  # format 1: the compute dtype
        }

    def render(s: dict) -> None:
        console.print(
            f"[green]✓[/] {s['bundle']}: {s['files']} files verified ({s['bytes'] / GIB * 1024:.1f} MiB), "
            f"round {s['round']}, {s['model']}, {len(s['kept_layers'])} kept layers, "
            f"messenger depth {s['messenger_depth']} (trains the top {s['trained_layers']}), profile {s['profile']}, "
            f"frozen weights stored {s['storage']}"
        )

    run_command(body, as_json, render)
