"""Disk full for real during a checkpoint save, and short writes retried, not ignored.

Disk full: a 16 MiB tmpfs is mounted for the test (this needs root, or CAP_SYS_ADMIN). A
checkpoint `a` is saved there on 2 real gloo ranks, then the filesystem is filled with a
filler file until only half of one rank's file fits, and the ranks save `b`: the disk fills up
during engine.save_checkpoint. Every rank must raise one CheckpointError saying the space ran
out (no hang: run_ranks' timeout), `latest` must still name `a`, no partial tag may be left, `a`
must load into fresh engines with every parameter and optimizer state equal, and once space
is freed the same engines save again.

Where mounting is refused (not root), the same scenario runs with RLIMIT_FSIZE set in the
rank processes instead (the kernel then fails the write with EFBIG rather than ENOSPC, and the
error says the file could not be written); the test says which mode ran in its report line.

Short writes: os.write / FileIO.write may write fewer bytes than asked (a non-blocking pipe
does it for real; a full or interrupted device may too). `files._write` must loop until all
bytes are written; a write that makes no progress is an error, never a silent truncation.
"""

from __future__ import annotations

import errno
import io
import os
import shutil
import subprocess
import threading
import time

import pytest
import torch
import torch.distributed as dist

import zeroshard.checkpoint.files as ckpt_files
from distributed import run_ranks
from oracle import MICRO, Case, batch, config_for, loss_of, make_model
from zeroshard.policies import CheckpointError

CASE = Case(model="gpt", optimizer="adamw", stage=2)
FS_BYTES = 16 << 20


# ---------------------------------------------------------------- short writes


class ShortFile(io.FileIO):
    """A real file whose write() writes at most `limit` bytes per call and says so."""

    limit = 4097
    short = 0  # calls that wrote less than asked

    def write(self, data):
        view = memoryview(data).cast("B")
        ShortFile.short += len(view) > self.limit
        return super().write(view[: self.limit])


class StuckFile(io.FileIO):
    """A file whose write() never makes progress (returns 0)."""

    def write(self, data):
        return 0


def _entries(n: int = 3) -> list[ckpt_files.Entry]:
    g = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(5000 + 7 * i, generator=g) for i in range(n)}
    return [ckpt_files.Entry(k, tuple(t.shape), t.dtype, (lambda t=t: t)) for k, t in tensors.items()], tensors


def test_short_writes_to_a_nonblocking_pipe_are_retried():
    """A real short write: a non-blocking pipe takes at most its buffer (64 KiB) per write and
    then refuses (EAGAIN) until the reader drains it. All 3 MB must arrive, in order."""
    data = os.urandom(3 << 20)
    rfd, wfd = os.pipe()
    os.set_blocking(wfd, False)
    received = bytearray()

    def reader():
        while True:
            time.sleep(0.001)  # slower than the writer: the pipe fills, writes come back short
            block = os.read(rfd, 1 << 16)
            if not block:
                return
            received.extend(block)

    thread = threading.Thread(target=reader)
    thread.start()
    calls = []
    with open(wfd, "wb", buffering=0) as f:
        real_write = f.write

        class Counting:
            def write(self, chunk):
                n = real_write(chunk)
                calls.append((len(chunk), n))
                return n

            def fileno(self):
                return f.fileno()

        ckpt_files._write(Counting(), memoryview(data))
    thread.join(timeout=60)
    os.close(rfd)
    assert any(n is None or n < asked for asked, n in calls), "the pipe never wrote short: no test"
    assert len(received) == len(data), f"{len(received)} of {len(data)} bytes arrived"
    assert bytes(received) == data


def test_short_writes_of_a_file_are_retried(tmp_path, monkeypatch):
    """write_safetensors and write_small through a file that writes 4097 bytes per call: the
    files are complete, safetensors reads every tensor back, the sha256 is the file's."""
    from safetensors import safe_open

    monkeypatch.setattr(ckpt_files, "open", lambda path, mode="rb", **kw: ShortFile(path, mode.replace("b", "")),
                        raising=False)
    ShortFile.short = 0
    entries, tensors = _entries()
    path = str(tmp_path / "x.safetensors")
    written = ckpt_files.write_safetensors(path, entries, {"k": "v"})
    assert ShortFile.short >= 3, "no write came back short: no test"
    monkeypatch.undo()
    assert written.bytes == os.path.getsize(path)
    assert written.sha256 == ckpt_files.sha256_of(path)
    with safe_open(path, "pt") as f:
        for key, t in tensors.items():
            assert torch.equal(f.get_tensor(key), t), key
    monkeypatch.setattr(ckpt_files, "open", lambda path, mode="rb", **kw: ShortFile(path, mode.replace("b", "")),
                        raising=False)
    small = bytes(range(256)) * 100
    ckpt_files.write_small(str(tmp_path / "meta.json"), small)
    monkeypatch.undo()
    assert (tmp_path / "meta.json").read_bytes() == small


def _limited_write(rank: int, world_size: int, path: str):
    """In a child process: a file size limit 100 bytes short of the file, so the kernel writes
    the last tensor short (up to the limit, returning the count) and refuses the rest (EFBIG)."""
    import resource
    import signal

    entries, _ = _entries()
    total = ckpt_files.total_bytes(entries) + len(ckpt_files.header_bytes(entries, None))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (total - 100, resource.RLIM_INFINITY))
    try:
        written = ckpt_files.write_safetensors(path, entries)
        return f"returned {written.bytes} bytes written; the file has {os.path.getsize(path)}"
    except CheckpointError as exc:
        return f"CheckpointError: {exc}"


def test_a_short_write_at_the_end_of_a_file_is_not_ignored(tmp_path):
    """A real short write by the kernel (RLIMIT_FSIZE in a child process): the last write of the
    file comes back short and nothing follows it, so only a retry can notice."""
    (result,) = run_ranks(_limited_write, 1, str(tmp_path / "x.safetensors"), timeout=60)
    assert result.startswith("CheckpointError: ") and "File too large" in result, result


def test_a_write_that_makes_no_progress_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt_files, "WRITE_STALL_S", 0.3)
    monkeypatch.setattr(ckpt_files, "open", lambda path, mode="rb", **kw: StuckFile(path, mode.replace("b", "")),
                        raising=False)
    entries, _ = _entries(1)
    with pytest.raises(CheckpointError) as err:
        ckpt_files.write_safetensors(str(tmp_path / "x.safetensors"), entries)
    assert "x.safetensors" in str(err.value) and "cannot write" in str(err.value), err.value


# ---------------------------------------------------------------- disk full, 2 ranks


def _mount_tmpfs(path: str) -> bool:
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES}", "tmpfs", path],
                       check=True, capture_output=True, timeout=30)
        return True
    except (OSError, subprocess.SubprocessError):
        return False


def _fill(root: str, leave: int) -> None:
    """Fill the filesystem of `root` until `leave` bytes (rounded to pages) are free."""
    with open(os.path.join(root, "filler"), "wb", buffering=0) as f:
        block = b"\0" * (1 << 16)
        try:
            while True:
                f.write(block)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
        f.flush()
    size = os.path.getsize(os.path.join(root, "filler"))
    os.truncate(os.path.join(root, "filler"), max(0, size - leave))


def _train(engine, steps, rank):
    for step in steps:
        x, y = batch(CASE, step, 2)
        loss = loss_of(engine, x[rank * MICRO : (rank + 1) * MICRO], y[rank * MICRO : (rank + 1) * MICRO])
        engine.backward(loss)
        engine.step()


def _optim_states(engine) -> dict:
    opt = engine.optimizer
    return {i: {k: v.clone() for k, v in opt.state.get(m, {}).items() if torch.is_tensor(v)}
            for i, m in enumerate(opt.masters)}


def _disk_full_worker(rank: int, world_size: int, root: str, mode: str):
    import resource
    import signal

    import zeroshard

    dist.init_process_group("gloo")
    cfg = config_for(CASE, world_size)
    engine = zeroshard.initialize(make_model(CASE), cfg)
    _train(engine, range(2), rank)
    engine.save_checkpoint(root, tag="a")
    saved = {"params": engine.full_state_dict(), "optim": _optim_states(engine)}
    from zeroshard.checkpoint.format import rank_file

    rank_bytes = os.path.getsize(os.path.join(root, "a", rank_file(rank, "value")))
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(world_size)]
    dist.all_gather(sizes, torch.tensor([rank_bytes]))
    smallest = int(min(s.item() for s in sizes))
    if mode == "tmpfs":
        if rank == 0:
            _fill(root, leave=smallest // 2)
    else:  # RLIMIT_FSIZE: no file of this process may grow past half the smallest rank file
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (smallest // 2, resource.RLIM_INFINITY))
    dist.barrier()
    _train(engine, range(2, 3), rank)
    started = time.monotonic()
    out: dict = {"mode": mode}
    try:
        engine.save_checkpoint(root, tag="b")
        out["error"] = None
    except CheckpointError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    except BaseException as exc:  # anything else is a failure of the test
        out["error"] = f"UNEXPECTED {type(exc).__name__}: {exc}"
    out["seconds"] = time.monotonic() - started
    dist.barrier()
    out["listing"] = sorted(os.listdir(root))
    out["latest"] = open(os.path.join(root, "latest")).read().strip()
    # the previous checkpoint loads, into fresh engines, exactly
    fresh = zeroshard.initialize(make_model(CASE), cfg)
    fresh.load_checkpoint(root)
    out["loaded_equal"] = (all(torch.equal(v, saved["params"][k]) for k, v in fresh.full_state_dict().items())
                           and _optim_states(fresh).keys() == saved["optim"].keys()
                           and all(torch.equal(v, saved["optim"][i][k])
                                   for i, fields in _optim_states(fresh).items() for k, v in fields.items()))
    out["steps"] = fresh.global_steps
    fresh.close()
    # space back: the engine that failed saves again
    if mode == "tmpfs":
        if rank == 0:
            os.remove(os.path.join(root, "filler"))
    else:
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    dist.barrier()
    engine.save_checkpoint(root, tag="c")
    out["latest_after"] = open(os.path.join(root, "latest")).read().strip()
    engine.close()
    return out


@pytest.fixture
def small_fs(tmp_path):
    root = tmp_path / "fs"
    root.mkdir()
    # ZS_DISK_FULL_MODE=rlimit runs the fallback where mounting works too
    mounted = os.environ.get("ZS_DISK_FULL_MODE") != "rlimit" and _mount_tmpfs(str(root))
    yield str(root), ("tmpfs" if mounted else "rlimit")
    if mounted:
        subprocess.run(["umount", "-l", str(root)], check=False, capture_output=True, timeout=30)
    shutil.rmtree(root, ignore_errors=True)


def test_disk_full_during_save_on_two_ranks(small_fs, capsys):
    root, mode = small_fs
    results = run_ranks(_disk_full_worker, 2, root, mode, timeout=120)
    with capsys.disabled():
        print(f"\n[disk full test ran with {mode}] rank 0: {results[0]['error']}")
    for rank, r in enumerate(results):
        err = r["error"]
        assert err is not None, f"rank {rank}: the save on a full disk succeeded"
        assert err.startswith("CheckpointError: "), f"rank {rank}: {err}"
        if mode == "tmpfs":
            assert "no space left" in err, f"rank {rank}: {err}"
        else:
            assert "cannot write" in err or "no space left" in err, f"rank {rank}: {err}"
        assert err.count("\n") == 0, f"rank {rank}: one line, not a traceback: {err}"
        assert r["seconds"] < 60, f"rank {rank}: the failed save took {r['seconds']:.0f} s"
        assert r["latest"] == "a", r
        assert [n for n in r["listing"] if n not in ("filler",)] == ["a", "latest"], r["listing"]
        assert r["loaded_equal"], f"rank {rank}: checkpoint 'a' did not load back exactly"
        assert r["steps"] == 2
        assert r["latest_after"] == "c"
