"""Crash-safe writes: temp file + fsync + rename, so readers see the old file or the new one."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save

from ciders_edge.errors import CidersError
from ciders_edge.faults import crash_point

__all__ = [
    "write_bytes",
    "pending_bytes",
    "named_errors",
    "os_error_in",
    "write_json",
    "write_jsonl",
    "append_jsonl",
    "write_safetensors",
    "replace_dir",
    "recover_dir",
    "staging_dir",
    "remove_stale_staging",
    "sweep_dead_staging",
    "owner_alive",
    "fsync_dir",
    "fsync_tree",
]


def fsync_dir(path: Path) -> None:
    """Flush a directory entry so a rename inside it survives a power cut."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """Flush every file and folder under ``path``: for folders a library wrote (``save_pretrained``,
    an ONNX exporter) before they are swapped into place."""
    for p in sorted(path.rglob("*"), reverse=True):
        if p.is_file():
            with p.open("rb") as f:
                os.fsync(f.fileno())
        else:
            fsync_dir(p)
    fsync_dir(path)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _owner() -> str:
    """This process as a staging name records it: PID and start time (a PID alone is reused)."""
    return f"{os.getpid()}-{_start_time(os.getpid())}"


def _start_time(pid: int) -> int:
    """A process's start, in clock ticks since boot (``/proc/PID/stat``, field 22); 0 where there is no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat.rpartition(")")[2].split()[19])  # the name in parentheses may hold spaces


def owner_alive(owner: str) -> bool:
    """Is the process that wrote ``PID-START`` still running (the same process, not a reused PID)?"""
    pid, _, start = owner.partition("-")
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return _start_time(int(pid)) in (int(start), 0)


def staging_dir(target: Path) -> Path:
    """A fresh hidden folder beside ``target`` with normal permissions (mkdtemp's 0700 would
    otherwise stick to the published folder), named for its owner: :func:`sweep_dead_staging`
    removes it once that process is gone (here: every write sweeps its folder first)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    sweep_dead_staging(target.parent)
    path = Path(tempfile.mkdtemp(prefix=f".{target.name}.{_owner()}.", dir=target.parent))
    path.chmod(0o777 & ~_umask())
    return path


def write_bytes(path: str | Path, data: bytes, mode: int | None = None) -> None:
    """Write ``data`` to ``path`` atomically, with the permissions of a normally created file
    (or ``mode``, set before any byte is written: private keys are never readable by others)."""
    with pending_bytes(path, data, mode):
        pass


@contextmanager
def pending_bytes(path: str | Path, data: bytes, mode: int | None = None) -> Iterator[None]:
    """Write ``data`` to a hidden temp file beside ``path`` now; rename it to ``path`` only when the
    block succeeds, remove it when the block fails. For a file that must not appear without what the
    block writes (the edge's packet without its state): the bytes are on disk before the block runs,
    so publishing them is one rename."""
    path = Path(path)
    with named_errors(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        sweep_dead_staging(path.parent)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{_owner()}.", suffix=".tmp", dir=path.parent)
    try:
        with named_errors(path):
            os.fchmod(fd, mode if mode is not None else 0o666 & ~_umask())
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        yield
        with named_errors(path):
            os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


@contextmanager
def named_errors(path: str | Path) -> Iterator[None]:
    """A file system error without a file name (``write`` on a full disk says only "No space left on
    device"; a library's writer may wrap it, as safetensors' "I/O error: ... (os error 28)") becomes
    an OSError naming ``path``, so the CLI's one line says which file could not be written."""
    try:
        yield
    except Exception as err:
        found = None if isinstance(err, CidersError) else os_error_in(err)  # ours say what they mean
        if found is None or (isinstance(err, OSError) and err.filename is not None):
            raise
        raise OSError(found.errno, found.strerror, found.filename or str(path)) from err


_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how Rust's std::io::Error shows an errno


def os_error_in(err: BaseException) -> OSError | None:
    """The OSError behind ``err``: itself, its cause or context, or an errno in a Rust library's message."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno is not None:
            return err
        if match := _RUST_OS_ERROR.search(str(err)):
            code = int(match.group(1))
            return OSError(code, os.strerror(code))
        err = err.__cause__ or err.__context__
    return None


def write_json(path: str | Path, obj: object) -> None:
    """Write ``obj`` as indented, key-sorted JSON atomically."""
    write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def write_jsonl(path: str | Path, rows: list[dict]) -> None:
    """Write ``rows`` as a JSON Lines file atomically (one object per line)."""
    write_bytes(path, "".join(json.dumps(r) + "\n" for r in rows).encode())


def append_jsonl(path: str | Path, records: list[dict]) -> None:
    """Append ``records`` to a JSON Lines log and fsync it: logs are the record of a run, so a line
    the caller saw written survives a power cut. Creates the folder."""
    path = Path(path)
    with named_errors(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in records))
            f.flush()
            os.fsync(f.fileno())


def write_safetensors(
    path: str | Path, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    """Write tensors in safetensors format atomically (contiguous CPU copies, inputs untouched). A view of
    a larger buffer (the edge's flat LoRA) is cloned first: safetensors refuses tensors that share memory."""
    flat = {k: _own(v.detach().to("cpu").contiguous()) for k, v in tensors.items()}
    write_bytes(path, save(flat, metadata=metadata))


def _own(t: torch.Tensor) -> torch.Tensor:
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()


def replace_dir(staging: Path, target: Path) -> None:
    """Move a fully written ``staging`` directory into place as ``target``.

    An existing ``target`` is renamed aside (``.NAME.old``) first and removed only after the swap, so
    a crash leaves the old directory or the new one, and at worst the aside copy, which the next
    :func:`recover_dir` (every reader calls it) puts back or removes.
    """
    recover_dir(target)
    old = _aside(target)
    crash_point(f"staged:{target.name}")
    if target.exists():
        os.replace(target, old)
        crash_point(f"aside:{target.name}")
    os.replace(staging, target)
    fsync_dir(target.parent)
    crash_point(f"swapped:{target.name}")
    shutil.rmtree(old, ignore_errors=True)  # a reader's recover_dir may be removing it too


def _aside(target: Path) -> Path:
    return target.with_name(f".{target.name}.old")


_STAGING = re.compile(r"\..+\.[A-Za-z0-9_]{8}(\.tmp)?")  # staging_dir's folders, write_bytes' temp files


def remove_stale_staging(root: Path) -> list[Path]:
    """Clean up after writers killed under ``root``: finish each interrupted :func:`replace_dir` and
    delete staging folders and temp files; returns what was removed.

    Only safe while no writer can be running there (the run's or the state's lock is held).
    """
    for old in root.rglob(".*.old"):
        if old.is_dir() and not old.is_symlink():
            recover_dir(old.with_name(old.name[1 : -len(".old")]))
    stale = [p for p in root.rglob(".*") if _STAGING.fullmatch(p.name)]
    for path in stale:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return stale


_OWNED = re.compile(r"\..+\.(\d+-\d+)\.[A-Za-z0-9_]{8}(\.tmp)?")  # .NAME.PID-START.XXXXXXXX[.tmp]


def sweep_dead_staging(folder: Path) -> list[Path]:
    """Remove the staging folders and temp files in ``folder`` whose owner process is gone: a command
    killed mid-write (``kill -9``) cannot clean up after itself, and the next one that writes there
    does. A live owner's are never touched; files from before owners were recorded neither, as
    nothing says whether their writer is alive (a folder's lock holder removes those)."""
    removed = []
    for path in folder.iterdir() if folder.is_dir() else ():
        match = _OWNED.fullmatch(path.name)
        if match is None or owner_alive(match.group(1)):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def recover_dir(target: Path) -> None:
    """Finish an interrupted :func:`replace_dir`. A crash between its two renames left the previous
    folder whole under its aside name and no ``target``: put it back. A crash after the swap left
    the new ``target`` and the old copy (perhaps half removed): remove the copy."""
    old = _aside(target)
    if not old.exists():
        return
    if target.exists():
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(old, target)
    fsync_dir(target.parent)
