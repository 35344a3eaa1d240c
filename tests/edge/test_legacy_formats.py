"""Files written by an earlier release keep loading and score the same.

``tests/fixtures/legacy`` holds a bundle, a client state, a Δc packet and an export written by the code
of e8c23f4 (before the issue-17 layout; ``make_fixture.sh`` says how), with the numbers that code
computed from them in ``expected.json``. Every format here is read by today's code through the CLI.
"""

import json
import math
import shutil
from pathlib import Path

import pytest
import zstandard
from typer.testing import CliRunner

from ciders_edge.cli import app as edge
from ciders_edge.formats.packet import Packet

FIXTURE = Path(__file__).parents[1] / "fixtures" / "legacy"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())
runner = CliRunner()


@pytest.fixture
def legacy(tmp_path) -> Path:
    """A writable copy: nothing a test does may change the committed files. The bundle's and the export's
    tokenizer.json (the same 3.4 MB) are kept once, compressed; the manifests' checksums cover them."""
    out = Path(shutil.copytree(FIXTURE, tmp_path / "legacy"))
    tokenizer = zstandard.ZstdDecompressor().decompress((FIXTURE / "tokenizer.json.zst").read_bytes())
    for folder in ("bundle", "export"):
        (out / folder / "tokenizer.json").write_bytes(tokenizer)
    return out


def _json(args: list[str]) -> dict:
    r = runner.invoke(edge, [*args, "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.output.strip().splitlines()[-1])


def test_an_old_bundle_verifies(legacy):
    out = _json(["verify", "--bundle", str(legacy / "bundle")])
    assert out["bundle_id"] == EXPECTED["packet"]["bundle_id"]


def test_an_old_state_and_bundle_score_as_they_did(legacy):
    out = _json(
        ["evaluate", "--bundle", str(legacy / "bundle"), "--state", str(legacy / "state")]
        + ["--data", str(legacy / "eval.jsonl"), "--backbone", "emu", "--max-new-tokens", "4"]
    )
    (got,), (want,) = out["results"], EXPECTED["evaluate"]["results"]
    assert got["client_id"] == want["client_id"] == "dates"
    assert math.isclose(got["nll"], want["nll"], rel_tol=1e-5), (got["nll"], want["nll"])
    assert got["exact_match"] == want["exact_match"]


def test_an_old_packet_decodes_to_the_same_tensors(legacy):
    p = Packet.load(legacy / "dates.pkt")
    want = EXPECTED["packet"]
    assert (p.client_id, p.round, p.bundle_id, p.codec, p.num_examples) == (
        want["client_id"],
        want["round"],
        want["bundle_id"],
        want["codec"],
        want["num_examples"],
    )
    assert sorted(p.tensors) == want["tensors"]
    assert math.isclose(sum(float(t.double().abs().sum()) for t in p.tensors.values()), want["abs_sum"], rel_tol=1e-9)


def test_an_old_export_answers_as_it_did(legacy):
    want = EXPECTED["infer"]
    out = _json(
        ["infer", "--export", str(legacy / "export"), "--prompt", "Rewrite the date March 14, 2021 in ISO format"]
        + ["--max-new-tokens", "6"]
    )
    assert out["text"] == want["text"] and out["source"] == want["source"]
