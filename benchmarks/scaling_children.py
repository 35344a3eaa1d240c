"""The measurements ``benchmarks/scaling.py`` runs, each in its own child process (``--child KIND SPEC``).

A child loads what it measures, times it from inside (step times from timestamps taken as each step
ends, so loading is never counted) and writes ``{"result": ...}`` or ``{"refused": MESSAGE}`` to the
spec's ``result`` path; its peak RSS is read by the parent from ``wait4``. The toolkit is driven
through its Python API, as a user's script would: ``prepare``, ``train`` with ``RoundOptions``,
``aggregate_files``, ``export_model`` and ``bench``.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from scaling_report import median  # noqa: E402

PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def setup(spec: dict) -> dict:
    """The model's folder (built once for a random config), its parameters, and the training data:
    records of ``spec['source']`` whose chat fills ``seq_len`` tokens with a response of a quarter at least."""
    from model_configs import CONFIGS, parameter_count, random_model

    from ciders_edge.data.records import IGNORE, encode, to_chat
    from ciders_edge.model.sources import load_tokenizer, resolve_model

    name = spec["model"]
    folder = random_model(name) if name in CONFIGS else resolve_model(name)
    data = Path(spec["data"])
    if not data.is_file():
        tok, seq, kept = load_tokenizer(folder), spec["seq_len"], []
        for line in Path(spec["source"]).read_text().splitlines():
            ids, labels = encode(tok, *to_chat(json.loads(line)), seq)
            if len(ids) == seq and sum(x != IGNORE for x in labels) >= seq // 4:
                kept.append(line)
            if len(kept) == spec["records"]:
                break
        data.parent.mkdir(parents=True, exist_ok=True)
        data.write_text("".join(line + "\n" for line in kept))
    return {"folder": str(folder), "params": parameter_count(folder), "records": len(data.read_text().splitlines())}


def _timed(cls, log: list[float]) -> None:
    """Record how long each ``cls.step`` call takes (the bootstrap's stages step through it)."""
    original = cls.step

    def step(self, *args, **kwargs):
        start = time.perf_counter()
        out = original(self, *args, **kwargs)
        log.append(time.perf_counter() - start)
        return out

    cls.step = step


def prepare(spec: dict) -> dict:
    """``prepare`` with a bounded bootstrap; each stage's step time, and each bundle's bytes."""
    from ciders_cloud import RunConfig
    from ciders_cloud import prepare as prepare_run
    from ciders_cloud.models.bootstrap import LayerAligner
    from ciders_cloud.models.takd import Distiller
    from ciders_cloud.run.config import TakdConfig
    from ciders_cloud.run.splits import fleet_split
    from ciders_edge.hyperparams import RoundHyperparams
    from ciders_edge.model.lora import LoraSettings
    from ciders_edge.profiles import load_profile

    layer, align = [], []
    _timed(LayerAligner, layer)
    _timed(Distiller, align)
    profiles = [load_profile(p) for p in spec["profiles"]]
    run = RunConfig(
        model=spec["model"],
        profiles=spec["profiles"],
        public_data=spec["public_data"],
        layer_steps=spec["layer_steps"],
        align_steps=spec["align_steps"],
        lora=LoraSettings(rank=profiles[0].lora_rank).to_dict(),
        takd=TakdConfig(holdout=spec["holdout"]).to_dict(),
        hyperparameters=RoundHyperparams(takd_steps=spec["takd_steps"]).to_dict(),
        **fleet_split(profiles, None, None),
    )
    start = time.perf_counter()
    summary = prepare_run(run, spec["out"])
    seconds = time.perf_counter() - start
    sizes = {p.storage: _folder_bytes(Path(summary["bundles"][p.name])) for p in profiles}
    return {
        "layer_step_s": median(layer),
        "align_step_s": median(align),
        "layer_steps_timed": len(layer),
        "align_steps_timed": len(align),
        "seconds": seconds,
        "bundle_bytes": sizes,
        "kept_layers": summary["kept_layers"],
        "fidelity": summary["fidelity"],
    }


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def train(spec: dict) -> dict:
    """One ``ciders-edge train`` round of ``steps`` local steps; the median step after the first, and
    the Δc packet's bytes (as sent, fp32 codec, and re-encoded with the int8 codec)."""
    from dataclasses import replace

    from ciders_edge.training.train import RoundOptions, train

    stamps = []
    options = RoundOptions(
        client_id=spec.get("client_id", "scaling"),
        profile=spec["profile"],
        overrides={"local_steps": spec["steps"]},
        on_step=lambda _metrics: stamps.append(time.perf_counter()),
        frozen_weights=spec["frozen_weights"],
        gradient_checkpointing=spec["checkpointing"],
        val_fraction=spec.get("val_fraction", 0.0),  # 0: the local steps alone, as the rows measured before it
    )
    with tempfile.TemporaryDirectory(prefix="ciders-scaling-") as tmp:
        out = train(spec["bundle"], spec["data"], Path(tmp) / "state", spec["packet"], options)
    steps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    packet = out.packet
    return {
        "step_s": median(steps) if steps else None,
        "steps_timed": len(steps),
        "packet_bytes": out.summary["packet_bytes"],
        "packet_int8_bytes": len(replace(packet, codec="int8").to_bytes()),
        "loss_first": out.summary["loss_first"],
        "loss_last": out.summary["loss_last"],
        "val_seconds": out.summary.get("val_seconds"),  # the choice after the steps, where there is a slice
    }


def peft(spec: dict) -> dict:
    """Plain PEFT LoRA on the whole fp32 model, what a user would do instead: r=4 on the seven targets,
    AdamW, Hugging Face's loss, the same records at the same batch and length."""
    import torch
    from peft import LoraConfig, get_peft_model

    from ciders_edge.data.records import collate, load_examples
    from ciders_edge.model.sources import load_model, load_tokenizer

    torch.manual_seed(0)
    folder = Path(spec["model"])
    tok = load_tokenizer(folder)
    model = load_model(folder, torch.float32)
    if spec["checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    config = LoraConfig(r=4, lora_alpha=16, lora_dropout=0.05, target_modules=PEFT_TARGETS, task_type="CAUSAL_LM")
    model = get_peft_model(model, config)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.01)
    examples = load_examples(spec["data"], tok, spec["seq_len"])
    b, stamps = spec["batch_size"], []
    for i in range(spec["steps"]):
        batch = collate([examples[(i * b + j) % len(examples)] for j in range(b)], tok.pad_token_id)
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        stamps.append(time.perf_counter())
    steps = [y - x for x, y in zip(stamps, stamps[1:], strict=False)]
    return {"step_s": median(steps) if steps else None, "steps_timed": len(steps)}


def aggregate(spec: dict) -> dict:
    """``ciders-cloud aggregate`` of the packets on a copy of the run (hard links: the run stays at round 0)."""
    from ciders_cloud.round.aggregate import aggregate_files

    copy = Path(spec["copy"])
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(spec["run"], copy, copy_function=_link_or_copy)
    try:
        start = time.perf_counter()
        summary = aggregate_files(copy, spec["packets"])
        seconds = time.perf_counter() - start
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    out = {k: summary.get(k) for k in ("takd_steps", "bytes_down", "clients")}
    return {"seconds": seconds, **out}


def _link_or_copy(src: str, dst: str) -> None:
    """Hard-link a file (every write of the toolkit replaces files, never edits them in place)."""
    import os

    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def decode(spec: dict) -> dict:
    """AdapFu's decode in each runtime, side by side (``ciders-edge bench``); an export a family cannot
    have is recorded as refused, and the others are measured without it."""
    from ciders_edge.cli_utils import quiet_libraries
    from ciders_edge.errors import CidersError
    from export.api import export_model
    from export.bench import RUNTIME_CHOICES, BenchSettings, bench

    quiet_libraries()
    exports, rows = Path(spec["exports"]), {}
    for name in spec["runtimes"]:
        fmt, quantize, merged = RUNTIME_CHOICES[name]
        kwargs = {"messenger": "global", "backbone": "full", "base_model": spec["base_model"], "merged": merged}
        try:
            made = export_model(spec["bundle"], None, fmt, exports / name, quantize, **kwargs)
            rows[name] = {"export_bytes": made["bytes"], "export_s": made["seconds"]}
        except CidersError as err:
            rows[name] = {"refused": str(err)}
    ready = tuple(n for n in spec["runtimes"] if "refused" not in rows[n])
    if ready:
        settings = BenchSettings(ready, spec["new_tokens"], spec["repeats"], train_steps=0)
        measured = bench(spec["bundle"], None, None, settings, exports, backbone="full", base_model=spec["base_model"])
        for r in measured["runtimes"]:
            keep = ("decode_tokens_per_s", "first_token_s", "peak_rss_mib", "load_s", "prompt_tokens")
            rows[r["runtime"]].update({k: r[k] for k in keep})
    return {"runtimes": rows}


KINDS = {"setup": setup, "prepare": prepare, "train": train, "peft": peft, "aggregate": aggregate, "decode": decode}


def run_child(kind: str, spec_path: str) -> None:
    """Run one measurement and write its outcome; the toolkit's own refusal is a result, anything else a crash."""
    from common import commit, machine

    from ciders_edge.cli_utils import quiet_libraries
    from ciders_edge.errors import CidersError

    quiet_libraries()
    spec = json.loads(Path(spec_path).read_text())
    meta = {"command": spec.get("command"), "commit": commit(), "machine": machine()}
    try:
        outcome = {"result": KINDS[kind](spec)}
    except CidersError as err:
        outcome = {"refused": str(err)}
    outcome["meta"] = meta
    outcome["self_peak_rss_bytes"] = _vm_hwm()
    Path(spec["result"]).write_text(json.dumps(outcome, default=str))


def _vm_hwm() -> int | None:
    """This process's own peak RSS since exec (a cross-check of the parent's wait4 figure)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return None
