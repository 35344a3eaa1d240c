"""Δc packet size and error per codec, on a real packet.

    python benchmarks/packet_codecs.py PACKET [PACKET ...]

Each packet's decoded increment is re-encoded with every codec in one run; reports bytes, the
ratio to raw float32, and the relative error of the decoded tensors against the fp32 values.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import median, write_results  # noqa: E402

from ciders_edge.formats.packet import CODECS, Packet  # noqa: E402
from ciders_edge.tensors import norm, sub  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("packets", nargs="+")
    args = ap.parse_args()
    rows: dict[str, list[dict]] = {c: [] for c in CODECS}
    for path in args.packets:
        ref = Packet.load(path)
        for codec in CODECS:
            p = Packet(ref.client_id, ref.round, ref.bundle_id, codec, ref.num_examples, ref.tensors, ref.metrics)
            data = p.to_bytes()
            back = Packet.from_bytes(data).tensors
            rows[codec].append(
                {
                    "bytes": len(data),
                    "raw": p.raw_bytes,
                    "tensors": len(p.tensors),
                    "rel_error": norm(sub(back, ref.tensors)) / max(norm(ref.tensors), 1e-30),
                }
            )
    table, out = [], {}
    for codec, rs in rows.items():
        out[codec] = {
            "median_bytes": median([r["bytes"] for r in rs]),
            "raw_bytes": rs[0]["raw"],
            "tensors": rs[0]["tensors"],
            "median_rel_error": median([r["rel_error"] for r in rs]),
        }
        o = out[codec]
        table.append(
            [
                codec,
                str(o["tensors"]),
                f"{o['raw_bytes']:,}",
                f"{o['median_bytes']:,.0f}",
                f"{o['raw_bytes'] / o['median_bytes']:.2f}",
                f"{o['median_rel_error']:.2e}",
            ]
        )
        print(
            f"{codec}: {o['median_bytes']:,.0f} bytes (raw {o['raw_bytes']:,}), rel. error {o['median_rel_error']:.2e}"
        )
    path = write_results(
        "packet_codecs",
        {"packets": args.packets, "codecs": out},
        table,
        ["codec", "tensors", "raw fp32 bytes", "median packet bytes", "raw / packet", "rel. L2 error"],
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
