"""A full disk, a read-only mount, a file or /proc in the way: one line naming the path, and no packet
without its state. Full and read-only disks are faults injected into the real writers (no mounts)."""

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import fast_run_config
from safetensors import SafetensorError
from typer.testing import CliRunner

from ciders_cloud.cli import app as cloud
from ciders_cloud.run.folder import RunFolder
from ciders_edge.cli import app as edge
from ciders_edge.formats.client_state import ClientState
from ciders_edge.training.train import RoundOptions, train

runner = CliRunner()


def _inside(path: str | os.PathLike, root: Path) -> bool:
    return Path(os.path.abspath(path)).is_relative_to(root.resolve())


def full_disk(monkeypatch, root: Path) -> None:
    """Files under ``root`` cannot be flushed: ``fsync`` says ENOSPC, as the kernel does when delayed
    allocation finds no room (a ``write`` on a full disk fails the same way, with no file name)."""
    real = os.fsync

    def fsync(fd):
        if _inside(os.readlink(f"/proc/self/fd/{fd if isinstance(fd, int) else fd.fileno()}"), root):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def read_only(monkeypatch, root: Path) -> None:
    """``root`` is a read-only mount: creating a file or folder under it is EROFS (chmod does not stop root)."""
    real_mkdir, real_open = os.mkdir, os.open

    def mkdir(path, *a, **k):
        if _inside(path, root) and not os.path.isdir(path):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_mkdir(path, *a, **k)

    def open_(path, flags, *a, **k):
        if flags & os.O_CREAT and _inside(path, root):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(os, "open", open_)


def _one_line(r, *fragments):
    """Exit 1 and, after any progress, one line: the error naming what and where."""
    assert r.exit_code == 1 and not isinstance(r.exception, OSError), r.exception
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert lines[-1].startswith("error: ") and sum(x.startswith("error") for x in lines) == 1, r.stderr
    assert "Traceback" not in r.output and all(f in lines[-1] for f in fragments), lines[-1]
    return lines[-1]


@pytest.fixture(scope="module")
def run0(tmp_path_factory, demo_dir):
    """A fast tiny run and client a's round-0 packet."""
    from ciders_cloud import prepare

    root = tmp_path_factory.mktemp("disk")
    prepare(fast_run_config(demo_dir, client_ids=["a"]), root / "run")
    bundle = root / "run" / "bundles" / "cpu-laptop" / "round-0000"
    train(bundle, demo_dir / "dates" / "train.jsonl", root / "state", root / "a.pkt", RoundOptions(client_id="a"))
    return root, bundle


def _train(bundle, demo_dir, state, out):
    data = str(demo_dir / "dates" / "train.jsonl")
    args = ["train", "--bundle", str(bundle), "--data", data, "--state", str(state), "--out", str(out)]
    return runner.invoke(edge, [*args, "--client-id", "a", "--steps", "1"])


def test_a_full_disk_under_the_state_writes_no_packet(run0, demo_dir, tmp_path, monkeypatch):
    """The packet used to be written first: the cloud aggregated it, and the edge, whose state had not
    advanced, was refused next round ("not the cloud's copy")."""
    _, bundle = run0
    disk = tmp_path / "disk"
    full_disk(monkeypatch, disk)
    line = _one_line(_train(bundle, demo_dir, disk / "state", tmp_path / "p.pkt"), "No space left on device (ENOSPC)")
    assert str(disk / "state") in line
    assert ClientState.load(disk / "state") is None
    assert list(tmp_path.glob("*.pkt")) == [] and [p.name for p in tmp_path.iterdir()] == ["disk"]  # no temp left
    monkeypatch.undo()
    assert _train(bundle, demo_dir, disk / "state", tmp_path / "p.pkt").exit_code == 0  # room again: the round runs
    assert ClientState.load(disk / "state").round == 0 and (tmp_path / "p.pkt").is_file()


def test_a_full_disk_under_the_packet_leaves_the_state(run0, demo_dir, tmp_path, monkeypatch):
    _, bundle = run0
    full_disk(monkeypatch, tmp_path / "disk")
    _one_line(_train(bundle, demo_dir, tmp_path / "state", tmp_path / "disk" / "p.pkt"), f"{tmp_path}/disk/p.pkt: No")
    assert ClientState.load(tmp_path / "state") is None and list((tmp_path / "disk").iterdir()) == []


def test_a_full_metrics_log_is_a_notice_after_the_round(run0, demo_dir, tmp_path, monkeypatch):
    _, bundle = run0
    full_disk(monkeypatch, tmp_path / "state" / "metrics.jsonl")  # the log alone: packet and state are out
    r = _train(bundle, demo_dir, tmp_path / "state", tmp_path / "p.pkt")
    assert r.exit_code == 0 and "the round's steps are not in the log" in r.stderr, r.output
    assert ClientState.load(tmp_path / "state").round == 0 and (tmp_path / "p.pkt").is_file()


def test_aggregate_on_a_full_disk_is_one_line_and_changes_nothing(run0, tmp_path, monkeypatch):
    root, _ = run0
    run = tmp_path / "run"
    shutil.copytree(root / "run", run)
    before = (RunFolder(run).server_state / "state.json").read_bytes()
    full_disk(monkeypatch, run)
    args = ["aggregate", "--run", str(run), "--packets", str(root / "a.pkt")]
    _one_line(runner.invoke(cloud, args), str(run), "No space left on device (ENOSPC)")
    assert (RunFolder(run).server_state / "state.json").read_bytes() == before
    monkeypatch.undo()
    r = runner.invoke(cloud, [*args, "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout.strip().splitlines()[-1])["next_round"] == 1


def _export(bundle, state, out, *extra):
    args = ["export", "--bundle", str(bundle), "--state", str(state), "--out", str(out), "--backbone", "emu"]
    return runner.invoke(edge, [*args, *extra])


@pytest.mark.parametrize("where", ["read-only", "full", "under a file", "under /proc", "is /proc"])
def test_export_to_a_place_it_cannot_write_is_one_line(run0, tmp_path, monkeypatch, where):
    root, bundle = run0
    out = {"under a file": tmp_path / "f" / "x", "under /proc": Path("/proc/x/y"), "is /proc": Path("/proc/x")}
    out = out.get(where, tmp_path / "mnt" / "x")
    (tmp_path / "f").write_text("a file")
    (tmp_path / "mnt").mkdir()
    if where == "read-only":
        read_only(monkeypatch, tmp_path / "mnt")
    elif where == "full":
        full_disk(monkeypatch, tmp_path / "mnt")
    expected = {
        "read-only": ("Read-only file system (EROFS)", str(tmp_path / "mnt")),
        "full": ("No space left on device (ENOSPC)", str(tmp_path / "mnt")),
        "under a file": (f"{tmp_path / 'f'}: is a file, not a folder",),
        "under /proc": ("/proc/x: No such file or directory (ENOENT)",),
        "is /proc": ("/proc/", "(ENOENT)"),
    }[where]
    _one_line(_export(bundle, root / "state", out), *expected)
    if where in ("read-only", "full"):
        assert list((tmp_path / "mnt").iterdir()) == []


def test_a_library_writer_on_a_full_disk_names_the_path(tmp_path):
    """safetensors' Rust writer wraps the errno in its own error; save_pretrained raises that."""
    from ciders_edge.formats.atomic import named_errors

    with pytest.raises(OSError) as err, named_errors(tmp_path / "out"):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert (err.value.errno, err.value.filename) == (errno.ENOSPC, str(tmp_path / "out"))
