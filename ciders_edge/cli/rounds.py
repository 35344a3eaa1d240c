"""``ciders-edge train``, ``validate``, ``keygen`` and ``join``: take part in rounds, by files or over the network."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ciders_edge.cli_utils import FrozenOpt, JsonOpt, run_command
from ciders_edge.formats.packet import read_key_file
from ciders_edge.progress import LazyBar, console

__all__ = ["train", "validate", "keygen", "join"]

CodecOpt = Annotated[str, typer.Option(help="Packet codec: fp32 (lossless), bf16 or int8.")]
KeyFileOpt = Annotated[Path | None, typer.Option(help="Client key: packets get an HMAC tag.")]
ValFractionOpt = Annotated[
    float,
    typer.Option(
        help="Records held out (by record hash, the same every round; 8 to 128, none below 16) to choose "
        "the messenger this device deploys; 0: none."
    ),
]


def train(
    bundle: Annotated[Path, typer.Option(help="Bundle folder from the cloud.")],
    data: Annotated[Path, typer.Option(help="This device's private JSONL data.")],
    state: Annotated[Path, typer.Option(help="Client state folder (created on first use).")],
    out: Annotated[Path, typer.Option(help="Where to write the Δc packet.")],
    profile: Annotated[str | None, typer.Option(help="Device profile name, `auto`, or a .toml path.")] = None,
    steps: Annotated[int | None, typer.Option(help="Local steps K (default: the bundle's).")] = None,
    solver: Annotated[str | None, typer.Option(help="fo (first order) or fd (finite-difference HVP).")] = None,
    codec: CodecOpt = "fp32",
    lr: Annotated[float | None, typer.Option(help="Base learning rate eta.")] = None,
    eta_in: Annotated[float | None, typer.Option(help="Look-ahead step (default: eta).")] = None,
    gamma: Annotated[float | None, typer.Option(help="Consensus-correction weight gamma_t.")] = None,
    eps_prox: Annotated[float | None, typer.Option(help="Proximal weight.")] = None,
    optimizer: Annotated[str | None, typer.Option(help="adamw or sgd.")] = None,
    batch_size: Annotated[int | None, typer.Option(help="Mini-batch size.")] = None,
    grad_accum: Annotated[int | None, typer.Option(help="Micro-batches per step.")] = None,
    client_id: Annotated[str | None, typer.Option(help="This edge's id (first round only; default: hostname).")] = None,
    frozen_weights: FrozenOpt = None,
    gradient_checkpointing: Annotated[
        bool | None,
        typer.Option(
            "--gradient-checkpointing/--no-gradient-checkpointing",
            help="Recompute the trained messenger layers' activations in backward (default: the profile's).",
            show_default=False,
        ),
    ] = None,
    key_file: KeyFileOpt = None,
    val_fraction: ValFractionOpt = 0.1,
    as_json: JsonOpt = False,
) -> None:
    """Train the messenger for one round (CIDERS update) and write the Δc packet; score the deployable
    messengers on a held-out slice of --data and keep the best."""

    def body() -> dict:
        overrides = {
            "local_steps": steps,
            "solver": solver,
            "eta": lr,
            "eta_in": eta_in,
            "gamma": gamma,
            "eps_prox": eps_prox,
            "optimizer": optimizer,
            "batch_size": batch_size,
            "grad_accum": grad_accum,
        }
        from ciders_edge.training.train import RoundOptions, train  # torch, transformers: when training

        key = read_key_file(key_file) if key_file else None
        with LazyBar("local steps") as bar:

            def on_step(m: dict) -> None:
                extra = f"  r_fd {m['r_fd']:.2e}" if "r_fd" in m else ""
                bar.update(m["steps"], f"loss {m['loss']:.3f}  |g| {m['grad_norm']:.3f}{extra}")

            options = RoundOptions(
                client_id,
                profile,
                codec,
                key,
                overrides=overrides,
                on_step=on_step,
                frozen_weights=frozen_weights,
                gradient_checkpointing=gradient_checkpointing,
                val_fraction=val_fraction,
            )
            return train(bundle, data, state, out, options).summary

    def render(s: dict) -> None:
        if s.get("resent"):  # the notice said it: a committed round's packet, sent again
            console.print(f"[green]✓[/] round {s['round']} client {s['client_id']}: packet {s['packet']}")
            return
        console.print(
            f"[green]✓[/] round {s['round']} client {s['client_id']}: "
            f"loss {s['loss_first']:.4f} → {s['loss_last']:.4f} "
            f"in {s['steps']} {s['solver'].upper()} steps; packet {s['packet']} {s['packet_bytes']:,} bytes "
            f"({s['codec']}, raw {s['raw_bytes']:,}, {s['raw_bytes'] / s['packet_bytes']:.1f}x)"
        )
        if "deployed" in s:
            others = ", ".join(f"{k[8:]} {v:.4f}" for k, v in s.items() if k.startswith("val_nll_"))
            console.print(
                f"  deploys {s['deployed']}: NLL {s['deployed_nll']:.4f} on {s['val_records']} held-out records "
                f"({others}){_fleet(s)}; scoring them took {s['val_seconds']:.0f} s beside training's "
                f"{s['train_seconds']:.0f} s",
                highlight=False,
                soft_wrap=True,
            )

    run_command(body, as_json, render)


def validate(
    bundle: Annotated[Path, typer.Option(help="A bundle newer than the state's last round.")],
    data: Annotated[Path, typer.Option(help="This device's private JSONL data (its held-out slice is scored).")],
    state: Annotated[Path, typer.Option(help="Client state folder of a device that has trained.")],
    profile: Annotated[str | None, typer.Option(help="Device profile name, `auto`, or a .toml path.")] = None,
    frozen_weights: FrozenOpt = None,
    val_fraction: ValFractionOpt = 0.1,
    as_json: JsonOpt = False,
) -> None:
    """Choose the deployed messenger again on a newer bundle, without training (a round this device was not
    sampled for): the kept best against the new global messenger, the latest personalized one and their mixtures."""

    def body() -> dict:
        from ciders_edge.training.rechoice import choose_again  # torch, transformers: when scoring

        return choose_again(bundle, data, state, profile, val_fraction, frozen_weights)

    def render(s: dict) -> None:
        others = ", ".join(f"{k[8:]} {v:.4f}" for k, v in s.items() if k.startswith("val_nll_"))
        console.print(
            f"[green]✓[/] round {s['round']} client {s['client_id']} (last trained round {s['trained_round']}): "
            f"deploys {s['deployed']}: NLL {s['deployed_nll']:.4f} on {s['val_records']} held-out records "
            f"({others}){_fleet(s)} in {s['val_seconds']:.0f} s",
            highlight=False,
            soft_wrap=True,
        )

    run_command(body, as_json, render)


def keygen(
    state: Annotated[Path, typer.Option(help="Client state folder; the key is made there once.")],
    as_json: JsonOpt = False,
) -> None:
    """Make this device's fleet node key (once) and print the public key the cloud registers."""
    from ciders_edge.fleet.keys import ensure_node_key

    def body() -> dict:
        state.mkdir(parents=True, exist_ok=True)
        private, public = ensure_node_key(state)
        return {"private": str(private), "public": str(public), "line": public.read_text().strip()}

    def render(s: dict) -> None:
        console.print(f"[green]✓[/] node key {s['private']}; the cloud registers {s['public']} as RUN/nodes/ID.pub:")
        console.print(s["line"], highlight=False, soft_wrap=True)

    run_command(body, as_json, render)


def join(
    server: Annotated[str, typer.Option(help="The cloud's SuperLink, HOST:PORT.")],
    state: Annotated[Path, typer.Option(help="Client state folder: c_i, personalized messenger, bundle, node key.")],
    data: Annotated[Path, typer.Option(help="This device's private JSONL data.")],
    profile: Annotated[str, typer.Option(help="Device profile name, `auto`, or a .toml path.")] = "auto",
    root_certificates: Annotated[
        Path | None, typer.Option(help="The cloud's CA certificate (ca.crt from `ciders-cloud certs`).")
    ] = None,
    codec: CodecOpt = "fp32",
    key_file: KeyFileOpt = None,
    admit_wait: Annotated[float, typer.Option(help="Seconds to keep asking a SuperLink that does not admit us.")] = 60,
    val_fraction: ValFractionOpt = 0.1,
    as_json: JsonOpt = False,
) -> None:
    """Join a fleet: run this device's Flower SuperNode; each round trains here and sends Δc up."""
    from ciders_edge.fleet.join import join as join_fleet  # Flower loads only for fleet commands

    run_command(
        lambda: join_fleet(
            server,
            state,
            data,
            profile,
            root_certificates=root_certificates,
            codec=codec,
            key=key_file,
            admit_wait=admit_wait,
            val_fraction=val_fraction,
        ),
        as_json,
        lambda s: console.print("[green]✓[/] the SuperNode stopped"),
    )


def _fleet(s: dict) -> str:
    """How the bundle's fleet evidence weighed in the choice (ciders_edge/training/fleet_evidence.py), if it had one."""
    if "val_fleet_round" not in s:
        return ""
    reference = "the global messenger" if s.get("val_fleet_global_first") else "its own"
    return f", weighed with round {s['val_fleet_round']}'s fleet evidence (reference: {reference})"
