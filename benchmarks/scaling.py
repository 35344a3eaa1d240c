"""Cost against model size, SmolLM2-135M to SmolLM2-1.7B: prepare, bundle, train, packet, aggregate, decode, infer.

    python benchmarks/scaling.py                                   # every model and measurement (hours on 2 cores)
    python benchmarks/scaling.py --models qwen2.5-1.5b --only prepare,train,peft
    python benchmarks/scaling.py --report                          # table, targets and plot from what is there

SmolLM2-135M has real weights; every other model is its real config with random weights
(``model_configs.py``; cost does not depend on the weights, and every table says so). Per model, each
measurement in its own child process (peak RSS from ``wait4``: the parent imports no torch, so the
figure is the child's), step times from inside the child (medians of the steps after the first):
- ``prepare``: a bounded bootstrap (``--layer-steps`` layer fits, ``--align-steps`` TAKD steps), its
  step time per stage, peak RSS, and the round-0 bundle's bytes in int8 and int4 storage. The main
  split is ``--base-profile``'s depth at ``--drop-ratio``, seq ``--seq-len``, batch 1.
- ``train``: ``ciders-edge train`` of ``--steps`` local steps, frozen weights fp32 (the int8 bundle
  dequantized at load), int8 and int4 kept quantized, each with and without gradient checkpointing;
  ``peft``: plain PEFT LoRA on the full fp32 model (r=4, the seven targets, AdamW), same records and shape.
- ``aggregate``: ``ciders-cloud aggregate`` of three edges' packets, the fp32, int8 and int4 rounds'
  (``--takd-steps`` TAKD steps).
- ``decode``: AdapFu, ``ciders-edge bench`` of the default runtime (GenAI int8) beside llama.cpp on the
  same merged weights (Q8_0); ``infer``: ``ciders-edge infer --export`` of the GenAI export, its peak RSS;
  ``llama-bench``: native llama.cpp on the same GGUF (``--llama-bench BIN`` or ``--build-llama-bench``).
- ``profiles`` (``--profile-models``): rpi5-8gb and jetson-orin-nano-8gb (int8, int4) and cpu-laptop
  (int8) trained at their own depth, drop, seq, batch and checkpointing, computed in ``--profile-dtype``.
Results go to ``RESULTS/scaling/NAME.json`` as each completes; a measurement already there with the
same settings is skipped unless ``--force``; a failed one is measured again. Runs, exports and logs
are kept under ``--work``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402  (imports no torch: this process stays small)
from scaling_jobs import (  # noqa: E402
    AGGREGATED,
    ROOT,
    Job,
    data_name,
    failure,
    keep,
    main_plan,
    main_profiles,
    packet_path,
    prepare_settings,
    profile_toml,
    spawn,
    train_settings,
)
from scaling_report import (  # noqa: E402
    EXTRA_MODELS,
    GROUPS,
    MODELS,
    PEFT,
    PROFILES,
    REAL_WEIGHTS,
    TEST_MODELS,
    TRAIN,
    VALIDATED,
    Store,
)

from ciders_edge.data.holdout import VAL_FRACTION  # noqa: E402  (no torch: train's default slice)

PROMPT = "Explain in a few sentences why a small language model can run on a phone."


# --- the measurements ---------------------------------------------------------------------------------------------


def ensure_run(job: Job, place: Path, key: str, profiles: dict[str, str]) -> bool:
    """``place/run`` prepared for ``profiles`` (again when its settings changed); the preparation is
    recorded as ``key`` when due. Packets and exports beside it go with it. False if it cannot be made."""
    settings = prepare_settings(job.args, profiles)
    stamp = place / "settings.json"
    fresh = (place / "run" / "run.json").is_file() and stamp.is_file() and json.loads(stamp.read_text()) == settings
    if fresh and not job.due(key, settings):
        return True
    shutil.rmtree(place, ignore_errors=True)
    place.mkdir(parents=True)
    shutil.rmtree(job.args.work / "home" / "bootstrap", ignore_errors=True)  # no cached bootstrap: its steps are timed
    spec = {**settings, "model": job.folder, "profiles": list(profiles.values()), "out": str(place / "run")}
    spec["public_data"] = str(job.args.public_data)
    entry = job.child("prepare", spec, key.replace("/", "-"))
    keep(job, key, settings, entry, job.due(key, settings))
    if "result" not in entry:
        return False
    stamp.write_text(json.dumps(settings))
    return True


def measure_train(
    job: Job, place: Path, key: str, profile: str, frozen: str | None, ckpt: bool | None, val_fraction: float = 0.0
) -> None:
    """One ``train`` child on ``place``'s bundle for ``profile``; its packet is kept (``aggregate`` sends it).
    Recorded when due (it also runs to remake a packet for a run prepared again)."""
    settings = train_settings(job.args, profile, frozen, ckpt, val_fraction)
    (place / "packets").mkdir(exist_ok=True)
    spec = {
        "bundle": str(place / "run" / "bundles" / profile / "round-0000"),
        "data": str(job.data),
        "profile": profile,
        "steps": job.args.steps,
        "frozen_weights": frozen,
        "checkpointing": ckpt,
        "val_fraction": val_fraction,
        "packet": str(packet_path(place, key)),
        "client_id": "edge-" + key.split("/", 1)[1].replace("/", "-"),  # one client per variant: one round
    }
    due = job.due(key, settings)
    keep(job, key, settings, job.child("train", spec, key.replace("/", "-")), due)


def main_model(job: Job) -> None:
    """The main table's measurements of one model, in the order their inputs need."""
    args, place, profiles = job.args, job.work / "main", main_profiles(job.args)
    plan = main_plan(args, profiles)
    if not any(job.due(k, v) for k, v in plan.items()) and not job.due("prepare", prepare_settings(args, profiles)):
        return
    if not ensure_run(job, place, "prepare", profiles):
        return
    for variant, (storage, frozen, ckpt) in TRAIN.items():
        if job.due(f"train/{variant}", plan[f"train/{variant}"]):
            measure_train(job, place, f"train/{variant}", profiles[storage], frozen, ckpt)
    measure_aggregate(job, place, profiles, plan["aggregate"])
    measure_decode(job, place, plan["decode"])
    measure_infer(job, place, plan)
    if "llama-bench" in plan:
        measure_llama_bench(job, place, plan)


def measure_peft(job: Job) -> None:
    """Plain PEFT LoRA on the full fp32 model, with and without checkpointing: what a user would do instead."""
    for variant, ckpt in PEFT.items():
        key = f"peft/{variant}"
        settings = {"rank": 4, "seq_len": job.args.seq_len, "batch_size": 1, "data": data_name(job.args.data)}
        settings |= {"records": job.args.records, "steps": job.args.steps, "checkpointing": ckpt}
        if job.due(key, settings):
            spec = {"model": job.folder, "data": str(job.data), "seq_len": job.args.seq_len, "batch_size": 1}
            spec |= {"steps": job.args.steps, "checkpointing": ckpt}
            job.record(key, settings, job.child("peft", spec, key.replace("/", "-")))


def measure_aggregate(job: Job, place: Path, profiles: dict[str, str], settings: dict) -> None:
    """One cloud round of three edges' packets: the fp32, int8 and int4 rounds (two profiles' bundles). Three,
    because a round of fewer is checked against |v|, and a few AdamW steps' displacement is far above it."""
    if not job.due("aggregate", settings):
        return
    for key in AGGREGATED:  # made by those rounds; again if this run's were made elsewhere
        if not packet_path(place, key).is_file():
            storage, frozen, ckpt = TRAIN[key.split("/")[1]]
            measure_train(job, place, key, profiles[storage], frozen, ckpt)
    if missing := [key for key in AGGREGATED if not packet_path(place, key).is_file()]:
        job.record("aggregate", settings, {"failed": f"no packet from {', '.join(missing)} (see there)"})
        return
    spec = {"run": str(place / "run"), "copy": str(place / "aggregate-run")}
    spec["packets"] = [str(packet_path(place, key)) for key in AGGREGATED]
    job.record("aggregate", settings, job.child("aggregate", spec, "aggregate"))


def measure_decode(job: Job, place: Path, settings: dict, rerun: bool = False) -> None:
    """AdapFu decode in each runtime (``rerun``: also when not due, to make the exports ``infer`` opens)."""
    due = job.due("decode", settings)
    if not (due or rerun):
        return
    spec = {"bundle": str(place / "run" / "bundles" / "scaling-int8" / "round-0000"), "base_model": job.folder}
    spec |= {"exports": str(place / "exports"), **settings}
    keep(job, "decode", settings, job.child("decode", spec, "decode"), due)


def decode_export(job: Job, place: Path, plan: dict, runtime: str) -> Path | None:
    """The export ``decode`` made for ``runtime`` (made again if it is not there), or None if it cannot be."""
    export = place / "exports" / runtime
    if not (export / "manifest.json").is_file():
        measure_decode(job, place, plan["decode"], rerun=True)
    return export if (export / "manifest.json").is_file() else None


def measure_infer(job: Job, place: Path, plan: dict) -> None:
    """``ciders-edge infer --export`` of the GenAI int8 export, the steady state of ``infer`` (export made)."""
    settings = plan["infer"]
    if not job.due("infer", settings):
        return
    export = decode_export(job, place, plan, "genai-int8")
    if export is None:
        job.record("infer", settings, {"refused": "no GenAI int8 export (see decode)"})
        return
    cli = Path(sys.executable).with_name("ciders-edge")
    cmd = [str(cli), "infer", "--export", str(export), "--prompt", PROMPT, "--max-new-tokens", str(job.args.new_tokens)]
    (job.work / "logs").mkdir(parents=True, exist_ok=True)
    log = job.work / "logs" / "infer.log"
    rc, peak, wall = spawn(cmd, log, {"CIDERS_HOME": str(job.args.work / "home")})
    meta = {"meta": {"command": job.args.command, "commit": common.commit()}}
    entry = {"failed": failure(log, rc)} if rc else {"result": {"peak_rss_bytes": peak, "wall_s": wall}}
    job.record("infer", settings, {**entry, **meta})


def measure_llama_bench(job: Job, place: Path, plan: dict) -> None:
    """Native ``llama-bench`` on the merged Q8_0 GGUF the decode measured (optional: it needs the binary)."""
    settings = plan["llama-bench"]
    if not job.due("llama-bench", settings):
        return
    folder = decode_export(job, place, plan, "llamacpp-q8_0")
    gguf = next(folder.glob("*.gguf"), None) if folder is not None else None
    if gguf is None:
        job.record("llama-bench", settings, {"refused": "no merged Q8_0 GGUF (see decode)"})
        return
    n, r = str(job.args.new_tokens), str(job.args.repeats)
    cmd = [str(job.args.llama_bench), "-m", str(gguf), "-p", "0", "-n", n, "-r", r]
    out = subprocess.run([*cmd, "-t", str(os.cpu_count()), "-o", "json"], capture_output=True, text=True)
    if out.returncode != 0:
        job.record("llama-bench", settings, {"failed": (out.stderr.strip().splitlines() or ["?"])[-1]})
        return
    tg = next(r for r in json.loads(out.stdout) if r.get("n_gen"))
    meta = {"command": job.args.command, "commit": common.commit(), "llama_bench": shlex.join(cmd)}
    job.record("llama-bench", settings, {"result": {"tg_tokens_per_s": tg["avg_ts"]}, "meta": meta})


def measure_profiles(job: Job) -> None:
    """The device profiles' own splits and shapes, one run per profile (its storages share the split): the
    local steps alone, and (``+val``) the round as ``train`` runs it, its messengers chosen after the steps."""
    if job.name not in job.args.profile_models and "all" not in job.args.profile_models:
        return
    for base, storages in PROFILES.items():
        if base not in job.args.profiles:
            continue
        own = {} if job.args.profile_dtype == "own" else {"dtype": job.args.profile_dtype}
        tomls = {s: profile_toml(job.args, f"{base}-{s}", base, storage=s, **own) for s in storages}
        variants = {
            f"profile/{base}/{s}{v}": (s, f) for s in storages for v, f in (("", 0.0), (VALIDATED, VAL_FRACTION))
        }
        wanted = {
            k: v for k, v in variants.items() if job.due(k, train_settings(job.args, tomls[v[0]], None, None, v[1]))
        }
        if not wanted:
            continue
        place = job.work / f"profile-{base}"
        if not ensure_run(job, place, f"profile/{base}/prepare", tomls):
            continue
        for key, (storage, fraction) in wanted.items():
            measure_train(job, place, key, tomls[storage], None, None, fraction)


def run_model(args, store: Store, name: str) -> None:
    job = Job(args, store, name)
    data = args.work / "data" / f"{args.data.parent.name}-{args.data.stem}-{args.seq_len}.jsonl"
    spec = {"model": name, "data": str(data), "source": str(args.data), "seq_len": args.seq_len}
    info = job.child("setup", {**spec, "records": args.records}, "setup")
    if "result" not in info:
        print(f"{name}: setup failed: {info.get('failed') or info.get('refused')}", flush=True)
        return
    job.folder, job.data = info["result"]["folder"], data
    weights = "real" if name in REAL_WEIGHTS else "test" if name in TEST_MODELS else "random"
    store.set_info(name, params=info["result"]["params"], weights=weights, folder=job.folder)
    main_model(job)
    if "peft" in args.only:
        measure_peft(job)
    if "profiles" in args.only:
        measure_profiles(job)
    if args.clean:
        shutil.rmtree(job.work, ignore_errors=True)


def build_llama_bench(work: Path) -> Path:
    """llama.cpp's ``llama-bench`` from the sources llama-cpp-python was built from (once, never timed)."""
    binary = work / "llama-bench-build" / "bin" / "llama-bench"
    if binary.is_file():
        return binary
    src = next(Path(sys.prefix, "llama-cpp-src").glob("*/vendor/llama.cpp"), None)
    if src is None:
        sys.exit(f"no llama.cpp sources under {sys.prefix}/llama-cpp-src (make llamacpp keeps them)")
    flags = subprocess.run([sys.executable, ROOT / "tools" / "llamacpp_cmake_args.py"], capture_output=True, text=True)
    off = ["-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF"]
    build = binary.parents[1]
    cmake = ["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", *off, *flags.stdout.split()]
    subprocess.run(cmake, check=True)
    subprocess.run(["cmake", "--build", str(build), "--target", "llama-bench", "-j", str(os.cpu_count())], check=True)
    return binary


def report(args, store: Store) -> Path:
    """``RESULTS/scaling.{json,md,png}`` from every model file there."""
    from scaling_report import (
        MAIN_HEADER,
        PROFILE_HEADER,
        TARGET_HEADER,
        commands,
        main_rows,
        plot,
        problems,
        profile_rows,
        settings_lines,
        target_rows,
        targets,
    )

    models = store.models()
    checks = targets(models)
    notes = [
        "† random weights of the real config (cost does not depend on the weights); ‡ the test model. "
        "Cells: median step time after the first · peak RSS of the process (`wait4`). fp32 = the int8 bundle "
        "with `--frozen-weights dequantized` (fp32 floats in memory); int8/int4 = kept quantized; ckpt = gradient "
        "checkpointing. Bootstrap steps: layer fit / TAKD align, seconds. Decode: AdapFu, global messenger.",
        "",
        "Settings (bounded steps), as stored with the measurements:",
        *settings_lines(models),
        "",
        "## Device profiles (their depth, drop, seq, batch; frozen weights kept quantized)",
        "",
        *common.markdown_table(PROFILE_HEADER, profile_rows(models)),
        "",
        "## Targets (issue 57)",
        "",
        *common.markdown_table(TARGET_HEADER, target_rows(checks)),
    ]
    if lines := problems(models):
        notes += ["", "Refused or failed:", *lines]
    notes += ["", "Measured by:", *(f"- {c}" for c in commands(models))]
    common.RESULTS = args.results
    payload = {"models": models, "targets": checks}
    path = common.write_results("scaling", payload, main_rows(models), MAIN_HEADER, "\n".join(notes))
    plot(models, path.with_suffix(".png"))
    return path


def parse() -> argparse.Namespace:
    data = common.DATA / "five_domain" / "general"
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated (also gemma-3-270m, gemma-3-1b, tiny)")
    ap.add_argument("--only", default=",".join(GROUPS), help=f"measurements to take, of {','.join(GROUPS)}")
    ap.add_argument("--force", action="store_true", help="measure again what is stored")
    ap.add_argument("--report", action="store_true", help="only write the table, targets and plot")
    ap.add_argument("--results", type=Path, default=common.RESULTS, help="folder of scaling/ and scaling.{json,md,png}")
    ap.add_argument("--work", type=Path, default=None, help="runs, exports, logs (default $CIDERS_HOME/scaling)")
    ap.add_argument("--data", type=Path, default=data / "train.jsonl", help="records (those filling --seq-len)")
    ap.add_argument("--public-data", type=Path, default=data / "public.jsonl", help="prepare's public data")
    ap.add_argument("--records", type=int, default=64, help="training records kept (each fills --seq-len)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3, help="train and PEFT steps (the first is not timed)")
    ap.add_argument("--layer-steps", type=int, default=2, help="bootstrap layer fits")
    ap.add_argument("--align-steps", type=int, default=2, help="bootstrap TAKD steps")
    ap.add_argument("--takd-steps", type=int, default=2, help="TAKD steps per aggregate (T_L)")
    ap.add_argument("--holdout", type=int, default=8, help="public records the fidelity is measured on")
    ap.add_argument("--base-profile", default="cpu-laptop", help="the main split's profile (its depth)")
    ap.add_argument("--messenger-depth", type=int, default=None, help="instead of the base profile's depth")
    ap.add_argument("--drop-ratio", type=float, default=0.5, help="the main split's drop ratio")
    ap.add_argument("--new-tokens", type=int, default=64, help="decoded tokens per generation")
    ap.add_argument("--repeats", type=int, default=3, help="generations per runtime (medians)")
    ap.add_argument("--profile-models", default="smollm2-1.7b", help="models the profiles run for ('all')")
    ap.add_argument("--profiles", default=",".join(PROFILES), help="the device profiles measured there")
    ap.add_argument(
        "--profile-dtype",
        default="float32",
        help="the profile rows' compute dtype ('own': each profile's; a Jetson's float16 crawls on a CPU)",
    )
    ap.add_argument("--llama-bench", type=Path, default=None, help="a llama-bench binary")
    ap.add_argument("--build-llama-bench", action="store_true", help="build llama-bench once (minutes; untimed)")
    ap.add_argument("--clean", action="store_true", help="delete a model's runs and exports once it is measured")
    ap.add_argument("--child", nargs=2, metavar=("KIND", "SPEC"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.command = " ".join(shlex.quote(a) for a in sys.argv)
    args.only = set(args.only.split(","))
    args.profile_models = set(args.profile_models.split(","))
    args.profiles = set(args.profiles.split(","))
    if unknown := args.profiles - set(PROFILES):
        ap.error(f"--profiles: unknown {sorted(unknown)}; choose from {', '.join(PROFILES)}")
    if unknown := args.only - set(GROUPS):
        ap.error(f"--only: unknown {sorted(unknown)}; choose from {', '.join(GROUPS)}")
    if unknown := set(args.models.split(",")) - {*MODELS, *EXTRA_MODELS}:
        ap.error(f"--models: unknown {sorted(unknown)}; choose from {', '.join((*MODELS, *EXTRA_MODELS))}")
    return args


def main() -> None:
    args = parse()
    if args.child:
        from scaling_children import run_child

        run_child(*args.child)
        return
    store = Store(args.results)
    if not args.report:
        home = os.environ.get("CIDERS_HOME") or Path.home() / ".cache" / "ciders"
        args.work = (args.work or Path(home) / "scaling").resolve()
        for path in (args.data, args.public_data):
            if not path.is_file():
                sys.exit(f"{path}: not there (set CIDERS_DATA, or --data/--public-data)")
        if args.build_llama_bench:
            args.llama_bench = build_llama_bench(args.work)
        for name in args.models.split(","):
            run_model(args, store, name)
    print(report(args, store).read_text())


if __name__ == "__main__":
    main()
