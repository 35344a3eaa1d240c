"""The Flower ClientApp of a CIDERS edge: unwraps the cloud's messages and calls :mod:`.edge`.

Its SuperNode (``ciders-edge join``) passes the device's settings as node config; a
:class:`~ciders_edge.errors.CidersError` raised here reaches the cloud as the reply's error.
"""

from __future__ import annotations

import json
from logging import INFO

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.logger import log

from ciders_edge.fleet import edge
from ciders_edge.fleet.protocol import FILES, PACKET, ROUND, SUMMARY, SYNC, bytes_record, record_bytes

app = ClientApp()


@app.query()
def sync(msg: Message, context: Context) -> Message:
    ask = msg.content.config_records[SYNC]
    cfg = edge.EdgeConfig.from_node_config(context.node_config)
    digest, elsewhere = edge.cloud_digest(ask, cfg.profile), edge.other_profiles(ask, cfg.profile)
    answer = edge.sync(cfg, str(ask["client_id"]), digest, int(ask["round"]), elsewhere)
    return Message(RecordDict({SYNC: ConfigRecord({"json": json.dumps(answer)})}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    r = msg.content.config_records[ROUND]
    files = record_bytes(msg.content.array_records[FILES])
    cfg = edge.EdgeConfig.from_node_config(context.node_config)
    digest, elsewhere = edge.cloud_digest(r, cfg.profile), edge.other_profiles(r, cfg.profile)
    packet, summary = edge.train_pending(
        cfg, str(r["client_id"]), digest, int(r["round"]), bytes(r["manifest"]), files, elsewhere
    )
    s = summary
    log(
        INFO,
        f"CIDERS round {s['round']}: {len(files)} bundle files received; loss {s['loss_first']:.4f} -> "
        f"{s['loss_last']:.4f} in {s['steps']} steps; Δc packet {len(packet):,} bytes",
    )
    content = RecordDict(
        {PACKET: bytes_record({"packet": packet}), SUMMARY: ConfigRecord({"json": json.dumps(summary)})}
    )
    return Message(content, reply_to=msg)
