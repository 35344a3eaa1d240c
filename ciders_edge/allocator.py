"""glibc's malloc set for a device whose memory is the limit: freed blocks go back to the system.

glibc raises its mmap threshold to the size of each mapped block that is freed (up to 32 MiB), so after
a training step's first activations are freed, the next ones of a few MiB come from the heap, where freed
blocks stay resident. Measured on SmolLM2-1.7B (random weights) with the ``jetson-orin-nano-8gb``
profile, int8 frozen weights, 2 steps: peak RSS 2.72 GiB, where the memory model expects 1.94; with the
threshold fixed at 128 KiB, 1.83 GiB, for about 18% more CPU time (page faults of fresh mappings). So it
is a profile's choice (``return_freed_memory``), on in the memory-first ones.
"""

from __future__ import annotations

import ctypes
import sys

__all__ = ["return_freed_memory", "MMAP_FROM"]

MMAP_FROM = 128 * 1024  # bytes: blocks this large are mapped, and unmapped when freed (glibc's initial value)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)


def return_freed_memory() -> bool:
    """Fix glibc's mmap and trim thresholds at :data:`MMAP_FROM` for this process; whether it could (only
    Linux with glibc has ``mallopt``: elsewhere nothing changes)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # musl and others
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_FROM)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, MMAP_FROM))
