"""The Flower ServerApp of a CIDERS fleet: ``ciders-cloud serve`` submits it to the SuperLink.

Each round: wait for the run's edges, sync them (each settles its last round against the
cloud's c_i and says which bundle files it holds), send each the round's bundle delta, collect
Δc packets until the round timeout, and close the round with the packets that pass the checks.
With ``serve --rechoose`` every online edge then gets the new bundle and chooses its deployed
messenger again (Flower's evaluate messages).
The run folder is the only state: a restarted cloud resumes at its last completed round.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from logging import INFO, WARNING
from pathlib import Path

from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from ciders_cloud.fleet.coordinator import Coordinator, Edge, refusal, validation_line
from ciders_cloud.fleet.secure import MIN_EDGES, CountingGrid, fit_ins, secure_sum
from ciders_cloud.fleet.serve import ServeSettings
from ciders_cloud.round.reports import edge_report
from ciders_cloud.run.folder import RunFolder
from ciders_edge.errors import CidersError, StateError
from ciders_edge.fleet.lifetime import end_with_parent
from ciders_edge.fleet.protocol import FILES, PACKET, ROUND, SUMMARY, SYNC, bytes_record, record_bytes

app = ServerApp()
MAX_EMPTY_ROUNDS = 3  # rounds in a row without an accepted packet before the run gives up


@contextmanager
def serverapp_lock(run_dir: Path) -> Iterator[None]:
    """One ServerApp per run folder: a second one (a second `serve --connect`) is refused."""
    path = RunFolder(run_dir).serverapp_lock
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StateError(f"{run_dir}: another ServerApp is running this run") from None
        yield


def _end_with_superexec() -> None:
    """In ``flwr-serverapp`` (Flower's SuperExec started it): die the moment the SuperExec dies, which it
    does when its SuperLink, and so ``serve``, are gone. Flower's own exit on a lost parent retries the
    dead SuperLink for half a minute; the run folder is safe against a kill at any step."""
    if sys.platform.startswith("linux") and Path(sys.argv[0]).name == "flwr-serverapp":
        end_with_parent(os.getppid(), signal.SIGKILL)


_end_with_superexec()  # at import, not in main(): the app takes seconds to load before main runs


@app.main()
def main(grid: Grid, context: Context) -> None:
    s = ServeSettings.from_run_config(context.run_config)
    with serverapp_lock(s.run_dir):
        co = Coordinator(s.run_dir, secure=s.secure_aggregation)
        log(INFO, "CIDERS fleet: %s at round %d of %d, %d edge keys", s.run_dir, co.round, s.rounds, len(co.keys))
        empty = 0
        while co.round < s.rounds:
            closed = run_round(grid, context, co, s, patient=empty == 0 and co.round == co.started)
            if closed and s.rechoose:
                rechoose_round(grid, co, s)
            empty = 0 if closed else empty + 1
            if empty == MAX_EMPTY_ROUNDS:
                raise ReplyError(
                    f"round {co.round}: no packet accepted {empty} times in a row; see RUN/fleet/log.jsonl"
                )
        edges = co.edges(grid.get_nodes())  # whoever is online now: they commit the last round
        exchange(grid, {e: _sync_message(co, e, s) for e in edges}, s.round_timeout)
        log(INFO, "CIDERS fleet: done, %d rounds", co.round)


def run_round(grid: Grid, context: Context, co: Coordinator, s: ServeSettings, patient: bool) -> bool:
    """One round; False when no packet was accepted (the round is then run again)."""
    t, started = co.round, time.monotonic()
    edges, offline = co.sample(wait_for_edges(grid, co, s, patient))
    log(INFO, "round %d: syncing %s", t, ", ".join(e.client_id for e in edges) or "no sampled edge")
    answers = exchange(grid, {e: _sync_message(co, e, s) for e in edges}, s.round_timeout)
    records = {e: {"type": "client", "round": t, "client": e.client_id, "bytes_down": 0, "bytes_up": 0} for e in edges}
    records |= {cid: {"type": "client", "round": t, "client": cid, "bytes_down": 0, "bytes_up": 0,
                      "status": "sampled, not online"} for cid in offline}  # fmt: skip
    requests = {}
    for e in edges:
        try:
            answer = json.loads(_content(answers.get(e), "sync", s).config_records[SYNC]["json"])
            requests[e] = co.train_request(e, answer)
        except Exception as err:  # noqa: BLE001  one edge's bad answer must not stop the round
            records[e]["status"] = refusal(err)
            continue
        config, files = requests[e]
        records[e].update(bytes_down=len(config["manifest"]) + sum(map(len, files.values())), files_down=sorted(files))
    train = secure_train if s.secure_aggregation else plain_train
    summary = train(grid, context, co, s, requests, records)
    for r in records.values():
        if r.get("status", "aggregated") != "aggregated":
            log(WARNING, "round %d: %s left out: %s", t, r["client"], r["status"])
    if summary is None:
        co.log(list(records.values()))
        log(WARNING, "round %d: no packet accepted; the round starts again", t)
        return False
    wall = time.monotonic() - started
    co.log([*records.values(), _round_record(t, summary, records, wall)])
    log(
        INFO,
        "round %d closed in %.1f s: %s aggregated; %s bytes up, %s down",
        t,
        wall,
        ", ".join(summary["clients"]),
        f"{sum(r['bytes_up'] for r in records.values()):,}",
        f"{sum(r['bytes_down'] for r in records.values()):,}",
    )
    for r in records.values():
        if (line := validation_line(r.get("edge", {}))) is not None:
            log(INFO, "round %d: %s %s", t, r["client"], line)
    return True


def rechoose_round(grid: Grid, co: Coordinator, s: ServeSettings) -> None:
    """Federated evaluation after a round closes: every online edge gets the new bundle (the files it lacks) and
    chooses its deployed messenger again on it, as ``ciders-edge validate`` does; the log says what each deploys.
    Edges sampled for the next round choose again when they train; the others would keep a stale choice."""
    t = co.round - 1
    edges = co.edges(grid.get_nodes())
    answers = exchange(grid, {e: _sync_message(co, e, s) for e in edges}, s.round_timeout)
    records = {e: {"type": "rechoice", "round": t, "client": e.client_id, "bundle_round": co.round} for e in edges}
    asks = {}
    for e in edges:
        try:
            answer = json.loads(_content(answers.get(e), "sync", s).config_records[SYNC]["json"])
            config, files = co.train_request(e, answer)
        except Exception as err:  # noqa: BLE001  one edge's bad answer must not stop the others
            records[e]["status"] = refusal(err)
            continue
        records[e]["bytes_down"] = len(config["manifest"]) + sum(map(len, files.values()))
        content = RecordDict({ROUND: ConfigRecord(config), FILES: bytes_record(files)})
        asks[e] = Message(content, e.node_id, MessageType.EVALUATE, ttl=s.round_timeout, group_id=str(co.round))
    replies = exchange(grid, asks, s.round_timeout)
    for e in asks:
        try:
            report = edge_report(_content(replies.get(e), "re-choice", s).config_records[SUMMARY]["json"])
        except Exception as err:  # noqa: BLE001  a bad reply is logged; the round stands
            records[e]["status"] = refusal(err)
            continue
        records[e].update(edge=report, status=str(report.get("skipped", "chosen")))
        if (line := validation_line(report)) is not None:
            log(INFO, "round %d: %s (not trained) %s", co.round, e.client_id, line)
    co.log(list(records.values()))


def plain_train(grid, context, co: Coordinator, s: ServeSettings, requests: dict, records: dict) -> dict | None:
    """Each edge trains and answers with its Δc packet; the round closes with the packets that pass the checks
    (``None``: none did, and the run is not private)."""
    t = co.round
    train = {
        e: Message(
            RecordDict({ROUND: ConfigRecord(config), FILES: bytes_record(files)}),
            e.node_id,
            MessageType.TRAIN,
            ttl=s.round_timeout,
            group_id=str(t),
        )
        for e, (config, files) in requests.items()
    }
    accepted = {}
    for e, reply in exchange(grid, train, s.round_timeout).items():
        try:
            content = _content(reply, "training", s)
            packet = record_bytes(content.array_records[PACKET])["packet"]
            records[e]["bytes_up"] = len(packet)
            records[e]["edge"] = edge_report(content.config_records[SUMMARY]["json"])  # what the edge reports
            co.check(e, packet)
            accepted[e] = packet
        except Exception as err:  # noqa: BLE001  one edge's bad reply must not stop the round
            records[e]["status"] = refusal(err)
    for e in train.keys() - accepted.keys():
        records[e].setdefault("status", f"no reply to training within {s.round_timeout:g} s")
    if not accepted and not co.private:  # a private round releases its noise whoever answered (its sample stands)
        return None
    summary = co.close_round(accepted, {e.client_id: records[e]["edge"] for e in accepted})
    for e in accepted:
        records[e]["status"] = summary["dropped"].get(e.client_id, "aggregated")
    return summary


def secure_train(grid, context, co: Coordinator, s: ServeSettings, requests: dict, records: dict) -> dict | None:
    """Flower's SecAgg+ stages over the edges: each trains in the third and answers with its masked
    displacement; the cloud unmasks only their mean (``None``: the protocol stopped, too few edges left)."""
    if len(requests) < MIN_EDGES:  # a sum of fewer would tell an edge the others' displacements
        for e in requests:
            records[e].update(status=f"not summed: {len(requests)} edges answered, a secure sum needs {MIN_EDGES}")
            records[e].update(bytes_down=0, files_down=[])  # nothing was sent
        return co.close_secure_round(_zeros(co), []) if co.private else None
    by_node = {e.node_id: e for e in requests}
    fits = {e.node_id: fit_ins(config, files) for e, (config, files) in requests.items()}
    counted = CountingGrid(grid)
    result = secure_sum(counted, context, co.round, fits, co.state.messenger, co.secure_range, s.round_timeout)
    summed = [by_node[nid] for nid in result.summed]
    for e in requests:
        records[e]["status"] = "aggregated" if e in summed else "not in the secure sum (no reply in time)"
    for nid, text in result.summaries.items():
        try:
            records[by_node[nid]]["edge"] = edge_report(text)
        except Exception as err:  # noqa: BLE001  a malformed report is logged, the sum stands
            records[by_node[nid]]["edge"] = {"report": refusal(err)}
    for e in requests:  # the protocol's bytes, all stages and the bundle, shared evenly (SecAgg+ sends alike)
        records[e]["bytes_down"] = counted.sent // max(1, len(requests))
        records[e]["bytes_up"] = counted.received // max(1, len(requests))
    if result.mean is None and not co.private:
        return None
    return co.close_secure_round(result.mean if result.mean is not None else _zeros(co), summed)


def _zeros(co: Coordinator) -> dict:
    """The mean of no displacement: what a private round that summed no edge releases its noise around."""
    return {k: t * 0 for k, t in co.state.messenger.items()}


def wait_for_edges(grid: Grid, co: Coordinator, s: ServeSettings, patient: bool) -> list[Edge]:
    """The run's online edges once ``min_clients`` are there. The first round waits for them; a later
    one goes on after the round timeout with whoever is there, so a dead edge does not stop the run."""
    deadline, said = time.monotonic() + s.round_timeout, 0.0
    while True:
        edges = co.edges(grid.get_nodes())  # the SuperLink lists online nodes only
        if len(edges) >= s.min_clients or (edges and not patient and time.monotonic() > deadline):
            return edges
        if time.monotonic() - said > 30:
            log(INFO, "round %d: %d of %d edges online; waiting", co.round, len(edges), s.min_clients)
            said = time.monotonic()
        time.sleep(1.0)


def exchange(grid: Grid, messages: dict[Edge, Message], timeout: float) -> dict[Edge, Message]:
    """Send, and collect the replies that arrive within ``timeout``, by edge (matched on the message
    they answer, so an error the SuperLink returns for a node is that node's)."""
    if not messages:
        return {}
    replies = list(grid.send_and_receive(list(messages.values()), timeout=timeout))
    by_id = {m.metadata.message_id: e for e, m in messages.items()}  # ids are set when pushed
    return {by_id[r.metadata.reply_to_message_id]: r for r in replies if r.metadata.reply_to_message_id in by_id}


def _sync_message(co: Coordinator, e: Edge, s: ServeSettings) -> Message:
    content = RecordDict({SYNC: ConfigRecord(co.sync_request(e))})
    return Message(content, e.node_id, MessageType.QUERY, ttl=s.round_timeout, group_id=str(co.round))


class ReplyError(CidersError):
    """An edge did not answer in time, or answered with an error."""


def _content(reply: Message | None, what: str, s: ServeSettings) -> RecordDict:
    if reply is None:
        raise ReplyError(f"no reply to {what} within {s.round_timeout:g} s")
    if reply.has_error():
        raise ReplyError(f"the edge failed in {what}: {reply.error.reason}")
    return reply.content


def _round_record(t: int, summary: dict, records: dict, wall: float) -> dict:
    return {
        "type": "round",
        "round": t,
        "clients": summary["clients"],
        "left_out": sorted(r["client"] for r in records.values() if r.get("status") != "aggregated"),
        "bytes_up": sum(r["bytes_up"] for r in records.values()),
        "bytes_down": sum(r["bytes_down"] for r in records.values()),
        "v_change": summary["v_change"],
        "wall_s": wall,
        **(
            {"epsilon": summary["privacy"]["epsilon"], "delta": summary["privacy"]["delta"]}
            if "privacy" in summary
            else {}
        ),
    }
