"""The memory-first profiles have glibc give freed blocks back (``ciders_edge/allocator.py``), read from
glibc's own counters: after a freed 16 MiB block raised its dynamic mmap threshold, an 8 MiB block comes
from the heap, unless the threshold was fixed."""

import json
import subprocess
import sys

import pytest

from ciders_edge.profiles import load_profile

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")

PROBE = """
import ctypes, json, sys
from ciders_edge.allocator import return_freed_memory
libc = ctypes.CDLL("libc.so.6")
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
fixed = return_freed_memory() if sys.argv[1] == "fixed" else None
libc.free(libc.malloc(16 << 20))
before = libc.mallinfo2().hblks
block = libc.malloc(8 << 20)
print(json.dumps({"fixed": fixed, "mapped": libc.mallinfo2().hblks - before}))
"""


def _probe(mode: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_a_freed_block_goes_back_only_with_the_threshold_fixed():
    assert _probe("dynamic") == {"fixed": None, "mapped": 0}  # glibc's default: the heap keeps it
    assert _probe("fixed") == {"fixed": True, "mapped": 1}  # mapped, so unmapped when freed


def test_the_memory_first_profiles_give_freed_memory_back():
    assert {name: load_profile(name).return_freed_memory for name in ("rpi5-8gb", "jetson-orin-nano-8gb")} == {
        "rpi5-8gb": True,
        "jetson-orin-nano-8gb": True,
    }
    assert not load_profile("cpu-laptop").return_freed_memory  # speed first there
