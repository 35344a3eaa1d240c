"""The bench picture: decode speed and peak memory per runtime, side by side."""

from __future__ import annotations

import io
from pathlib import Path

__all__ = ["plot_bench"]


def plot_bench(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ciders_edge.formats.atomic import write_bytes

    rows = result["runtimes"]
    names = [r["runtime"] for r in rows]
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(9, 3.5))
    speed.bar(names, [r["decode_tokens_per_s"] for r in rows], color="tab:blue")
    speed.set_ylabel("decode tokens/s (median)")
    memory.bar(names, [r["peak_rss_mib"] for r in rows], color="tab:orange")
    memory.set_ylabel("peak RSS (MiB)")
    for ax in (speed, memory):
        ax.tick_params(axis="x", rotation=20)
    fig.suptitle(f"{Path(result['bundle']).name}: {result['new_tokens']} new tokens, profile {result['profile']}")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    write_bytes(path, buf.getvalue())
