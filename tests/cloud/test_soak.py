"""Soak: 200 concurrent-ish `aggregate`s of valid, replayed and hostile packets against one locked run.

Whatever interleaving the threads get, exactly one valid submission commits round 0, every other
one is refused with a one-line toolkit error (or reports the round as already aggregated), and the
server state ends equal to an uninterrupted reference run's.
"""

import random
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from conftest import fast_run_config
from forgery import claiming_2gib, like
from tiny_runs import state_bytes, two_clients_round0

from ciders_cloud.round.aggregate import aggregate_files
from ciders_cloud.run.lock import run_lock
from ciders_edge.errors import CidersError, PacketError, StateError
from ciders_edge.formats.packet import Packet


def _hostile(valid: Packet, out) -> dict[str, list[str]]:
    """Packet sets a hostile or careless client could submit, each written to ``out``."""
    t = valid.tensors
    bad = {
        "nan": like(valid, tensors={k: v * float("nan") for k, v in t.items()}),
        "huge": like(valid, tensors={k: torch.full_like(v, 3e38) for k, v in t.items()}),
        "outlier": like(valid, tensors={k: v * 1e6 for k, v in t.items()}),
        "round": like(valid, round=1),
        "stranger": like(valid, client_id="mallory"),
        "forged_c_i": like(valid, metrics={**valid.metrics, "c_i_digest": "0" * 64}),
    }
    sets = {}
    for name, packet in bad.items():
        packet.save(out / f"{name}.pkt")
        sets[name] = [str(out / f"{name}.pkt")]
    flipped = bytearray((out / "a.pkt").read_bytes())
    flipped[-40] ^= 1
    (out / "flipped.pkt").write_bytes(bytes(flipped))
    sets["flipped"] = [str(out / "flipped.pkt")]
    sets["replayed"] = [str(out / "a.pkt"), str(out / "a.pkt")]
    sets["claims_2gib"] = [claiming_2gib(str(out / "a.pkt"), out / "claims.pkt", frame=b"\x28\xb5\x2f\xfd" * 4)[0]]
    return sets


def test_soak_of_valid_replayed_and_hostile_packets(tmp_path, demo_dir):
    run = fast_run_config(demo_dir, client_ids=["a", "b"], hyperparameters={"takd_steps": 2})
    two_clients_round0(run, demo_dir, tmp_path)
    shutil.copytree(tmp_path / "run", tmp_path / "ref")
    valid = [str(tmp_path / "a.pkt"), str(tmp_path / "b.pkt")]
    aggregate_files(tmp_path / "ref", valid)
    expected = state_bytes(tmp_path / "ref")

    sets = {"valid": valid, **_hostile(Packet.load(valid[0]), tmp_path)}
    rng = random.Random(0)
    plan = [rng.choice(list(sets)) for _ in range(200)]

    def submit(name: str) -> str:
        """One submission, retried while another holds the run, as a client would."""
        while True:
            try:
                with run_lock(tmp_path / "run", "aggregate"):
                    summary = aggregate_files(tmp_path / "run", sets[name])
                return "again" if summary.get("already_aggregated") else "committed"
            except StateError as err:
                assert "in use by" in str(err), err
                time.sleep(0.01)
            except PacketError as err:
                refusals[name] = str(err)
                return "refused"
            except CidersError as err:
                raise AssertionError(f"{name}: unexpected {err}") from err

    refusals: dict[str, str] = {}
    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(submit, plan))
    committed = [n for n, o in zip(plan, outcomes, strict=True) if o == "committed"]
    assert committed == ["valid"], refusals  # exactly one round, and from the valid set
    assert all(o == "refused" for n, o in zip(plan, outcomes, strict=True) if n != "valid"), refusals
    assert set(refusals) == set(sets) - {"valid"}  # every hostile kind was seen (contention is likely, not required)
    assert state_bytes(tmp_path / "run") == expected
