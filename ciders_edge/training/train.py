"""``ciders-edge train`` from Python: one round on files, the only public entry to edge training.

:func:`train` reads the bundle, the data and the state folder, runs the round
(:func:`ciders_edge.training.round.train_round`) and writes the Δc packet, the state and the metrics
log, each atomically. The packet's bytes are on disk before the state is saved but it is published
(renamed into place) after, so a failure between (a full disk) leaves neither. ``simulate`` and the
CLI call it; the Flower edge calls ``train_round`` directly, since its packet goes to the network.
:func:`probe` is the extra exchange a bilevel strategy asks for before training.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

from rich.markup import escape

from ciders_edge.errors import ConfigError
from ciders_edge.faults import crash_point
from ciders_edge.formats.atomic import append_jsonl, pending_bytes, write_bytes
from ciders_edge.formats.bundle import Bundle
from ciders_edge.formats.client_state import METRICS_LOG, ClientState
from ciders_edge.formats.lock import folder_lock
from ciders_edge.formats.packet import PROBE_KIND, Packet
from ciders_edge.hyperparams import RoundHyperparams
from ciders_edge.progress import console
from ciders_edge.training.bilevel import client_gradients
from ciders_edge.training.local_steps import LocalResult
from ciders_edge.training.round import RoundOptions, RoundOutput, check_state, load_round, round_seed, train_round

__all__ = ["train", "probe", "RoundOptions", "UNSENT_PACKET"]

UNSENT_PACKET = "unsent.pkt"  # in the state folder: the committed round's packet until it is published


def train(
    bundle: str | Path, data: str | Path, state_dir: str | Path, out: str | Path, options: RoundOptions | None = None
) -> RoundOutput:
    """Train one round and write the packet to ``out`` and the advanced state to ``state_dir``.

    ``options`` (:class:`~ciders_edge.training.round.RoundOptions`) name the client (on first use; by
    default the host name), the device profile, the packet's codec and key, and hyperparameter
    overrides. Returns the round's output; ``.summary`` is what ``ciders-edge train --json`` prints.
    """
    options = options or RoundOptions()
    b = Bundle.load(bundle)
    Path(state_dir).mkdir(parents=True, exist_ok=True)
    with folder_lock(state_dir, "ciders-edge train"):  # one round at a time on a state; cleans up a killed one
        state = ClientState.load(state_dir)
        sync_log(Path(state_dir), state)  # a train killed after its commit may not have logged its round
        resent = _publish_unsent(Path(state_dir), state, b, Path(out), options.key)
        if resent is not None:
            return resent
        if state is not None and options.client_id not in (None, state.client_id):
            raise ConfigError(f"--client-id {options.client_id!r} differs from the state's {state.client_id!r}")
        cid = state.client_id if state is not None else options.client_id or os.uname().nodename
        output = train_round(b, data, state, replace(options, client_id=cid))
        output.state.round_log = [{"round": b.round, **s} for s in output.result.steps]
        unsent = Path(state_dir) / UNSENT_PACKET
        with pending_bytes(out, output.packet_bytes):  # no packet without its state: published last
            write_bytes(unsent, output.packet_bytes)  # kept with the state until it is published
            output.state.save(state_dir)  # the commit point
            crash_point(f"committed:{Path(state_dir).name}")
        unsent.unlink()
        crash_point(f"published:{Path(state_dir).name}")
        sync_log(Path(state_dir), output.state)
    output.summary.update(packet=str(out), state=str(state_dir))
    return output


def _publish_unsent(
    state_dir: Path, state: ClientState | None, bundle: Bundle, out: Path, key: bytes | None
) -> RoundOutput | None:
    """After a crash between the state's commit and the packet's publication, the state holds a round
    the cloud never received: publish that round's packet (kept beside the state) instead of
    refusing the round as trained. An unsent packet of a round the state never committed is dropped."""
    unsent = state_dir / UNSENT_PACKET
    if not unsent.is_file():
        return None
    data = unsent.read_bytes()
    packet = Packet.from_bytes(data, key, where=str(unsent))
    committed = state is not None and (state.round, state.bundle_id) == (packet.round, packet.bundle_id)
    if not committed or bundle.bundle_id != packet.bundle_id:
        unsent.unlink()
        return None
    write_bytes(out, data)
    unsent.unlink()
    console.print(f"[yellow]notice:[/] round {packet.round} was trained but its packet never left; sent it to {out}")
    result = LocalResult(state.personalized, {}, state.c_i, dict(packet.tensors))
    summary = {"client_id": state.client_id, "round": packet.round, "resent": True, "packet": str(out)}
    summary["packet_bytes"] = len(data)
    return RoundOutput(packet, data, state, result, {}, {**summary, "state": str(state_dir)})


def sync_log(state_dir: Path, state: ClientState | None) -> None:
    """Make the metrics log end with exactly the committed round's lines (kept in the state until then):
    a train killed after its commit, or mid-append, left them out or cut. The packet and state are out
    by now, so a log that cannot be written (a full disk) is a notice, not a failed round."""
    if state is None or not state.round_log:
        return
    path = state_dir / METRICS_LOG
    try:
        tail, start = _round_tail(path, state.round)
        if tail == state.round_log:
            return
        if path.exists():
            os.truncate(path, start)  # a cut line, or the round's lines in part
        append_jsonl(path, state.round_log)
    except OSError as err:
        console.print(f"[yellow]notice:[/] {escape(str(err))}; the round's steps are not in the log", soft_wrap=True)


def _round_tail(path: Path, round_: int) -> tuple[list[dict], int]:
    """The log's last whole lines of round ``round_`` and the byte offset where they (or a cut last line) start."""
    data = path.read_bytes() if path.exists() else b""
    end = data.rfind(b"\n") + 1  # whatever follows the last newline is a cut line
    lines, start = data[:end].splitlines(keepends=True), end
    rows = []
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except ValueError:
            break
        if not isinstance(row, dict) or row.get("round") != round_:
            break
        rows.insert(0, row)
        start -= len(line)
    return rows, start


def probe(
    bundle: str | Path,
    data: str | Path,
    state_dir: str | Path,
    out: str | Path,
    *,
    client_id: str,
    profile: str | None = None,
    key: bytes | None = None,
    frozen_weights: str | None = None,
) -> dict:
    """A round's first exchange (its probe): ``grad_x f_i`` and ``grad_y f_i`` at the bundle's point
    (:mod:`ciders_edge.training.bilevel`), written as an fp32 packet (the cloud takes them exactly); the state
    is unchanged.
    ``frozen_weights`` as :class:`RoundOptions`' (None: the profile's)."""
    b = Bundle.load(bundle)
    check_state(ClientState.load(state_dir), b)
    ask = RoundHyperparams.from_dict(b.manifest["hyperparameters"]).ask  # before the model loads
    if ask is None:
        raise ConfigError(f"{bundle}: round {b.round} asks for no gradients (only bilevel rounds are probed)")
    memory = RoundOptions(frozen_weights=frozen_weights)
    hp, edge, examples = load_round(b, data, profile, {}, live_backbone=True, memory=memory)
    loss, grad_x, grad_y = client_gradients(
        edge, examples, hp, ask.probe_batches, round_seed(0, f"probe:{client_id}", b.round)
    )
    metrics = {"kind": PROBE_KIND, "loss": loss}
    packet = Packet(client_id, b.round, b.bundle_id, "fp32", len(examples), {**grad_x, **grad_y}, metrics)
    size = packet.save(out, key)
    return {"client_id": client_id, "round": b.round, "loss": loss, "packet": str(out), "packet_bytes": size}
