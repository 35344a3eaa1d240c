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
from ciders_edge.fleet.secure import is_secure, secure_aggregation_mod, secure_reply, secure_request

app = ClientApp(mods=[secure_aggregation_mod])  # a secure round's messages go through Flower's SecAgg+ mod


@app.query()
def sync(msg: Message, context: Context) -> Message:
    cfg = edge.EdgeConfig.from_node_config(context.node_config)
    answer = edge.sync(cfg, edge.CloudRequest.of(msg.content.config_records[SYNC], cfg.profile))
    return Message(RecordDict({SYNC: ConfigRecord({"json": json.dumps(answer)})}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    secure = is_secure(msg.content)
    if secure:  # SecAgg+'s stage 2: the request rides in FitIns, the displacement goes back masked
        r, files = secure_request(msg.content)
    else:
        r, files = msg.content.config_records[ROUND], record_bytes(msg.content.array_records[FILES])
    cfg = edge.EdgeConfig.from_node_config(context.node_config)
    packet, summary, delta = edge.train_pending(cfg, edge.CloudRequest.of(r, cfg.profile), files)
    s = summary
    log(
        INFO,
        f"CIDERS round {s['round']}: {len(files)} bundle files received; loss {s['loss_first']:.4f} -> "
        f"{s['loss_last']:.4f} in {s['steps']} steps; Δc packet {len(packet):,} bytes",
    )
    if secure:  # in the clear beside the masked vector: only the losses, not the norms or |D_i|
        clear = {k: summary[k] for k in ("round", "steps", "loss_first", "loss_last")}
        return Message(secure_reply(delta, clear), reply_to=msg)
    content = RecordDict(
        {PACKET: bytes_record({"packet": packet}), SUMMARY: ConfigRecord({"json": json.dumps(summary)})}
    )
    return Message(content, reply_to=msg)


@app.evaluate()
def rechoose(msg: Message, context: Context) -> Message:
    """Federated evaluation of a round this edge did not train: it chooses its deployed messenger again on the
    new bundle and reports the scores (numbers only)."""
    r, files = msg.content.config_records[ROUND], record_bytes(msg.content.array_records[FILES])
    cfg = edge.EdgeConfig.from_node_config(context.node_config)
    summary = edge.choose_on(cfg, edge.CloudRequest.of(r, cfg.profile), files)
    if "deployed" in summary:
        log(INFO, f"CIDERS round {summary['round']}: deploys {summary['deployed']} (NLL {summary['deployed_nll']:.4f})")
    return Message(RecordDict({SUMMARY: ConfigRecord({"json": json.dumps(summary)})}), reply_to=msg)
