"""Intra-host transfers for the direct gloo collectives: the receiver copies each message out of
the sender's memory itself (Linux cross-memory attach, `process_vm_readv`), as MPI libraries do
for large messages between ranks of one machine.

Over gloo's TCP every byte between two ranks of one host is copied into the kernel by the
sender and out of it by the receiver, with the protocol's own work on top, all on the cores the
ranks compute on. Here gloo carries only each message's address and size (a few bytes) and an
acknowledgement; the receiver copies the bytes once, straight into place. Measured on this
project's 2-core machine: 143 MiB between two ranks in 0.036 s against 0.07 s over TCP.

Semantics are gloo's: a collective's `wait()` returns once this rank's receives have landed and
every peer has copied what this rank sent, so its buffers may then be reused. The copies are done
by one thread per channel, in the order the collectives were issued (the same on every rank, as
the tags of comm/direct.py already require), so no rank depends on the order in which its
peers wait. A collective this rank leaves early (a stop signal or an error out of `wait()`) keeps
what it sent alive until the peers have copied it, so none of them reads reused memory.

A pair of ranks uses it only where both read each other in a probe at the group's first direct
collective (same host, the same user, ptrace allowed: no Yama, or its `ptrace_scope` 0, or 1,
where each rank lets any process of its user read it, `PR_SET_PTRACER_ANY`, as Open MPI does
for the same copies); other pairs keep TCP. `ZEROSHARD_CMA=0` turns it off (and leaves the
ptrace setting alone).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
import queue
import socket
import sys
import threading
import zlib

import torch
import torch.distributed as dist

PR_SET_PTRACER, PR_SET_PTRACER_ANY = 0x59616D61, ctypes.c_ulong(-1).value
IDLE_S = 5.0  # a channel's thread ends after this long with nothing to copy (a new one starts on demand)


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_LIBC = None


def _load() -> bool:
    """Whether this process can use cross-memory attach (Linux, libc has it, not turned off);
    under Yama's ptrace_scope 1 it lets processes of its user read it."""
    global _LIBC
    if not sys.platform.startswith("linux") or os.environ.get("ZEROSHARD_CMA", "1") == "0":
        return False
    if _LIBC is None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fn = libc.process_vm_readv
        except (OSError, AttributeError):
            return False
        fn.restype = ctypes.c_ssize_t
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                       ctypes.c_ulong]
        _LIBC = libc
    if _yama_scope() == 1:  # per process (a forked rank sets its own), and only where Yama asks for it
        _LIBC.prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0)
    return True


def _yama_scope() -> int:
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return 0


def read_from(pid: int, address: int, into: torch.Tensor) -> None:
    """Copy `into.nbytes` bytes at `address` in process `pid` into `into` (contiguous, CPU)."""
    done, total = 0, into.nbytes
    while done < total:
        local, remote = _Iovec(into.data_ptr() + done, total - done), _Iovec(address + done, total - done)
        got = _LIBC.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got <= 0:
            err = ctypes.get_errno()
            raise OSError(err, f"process_vm_readv from rank process {pid}: {os.strerror(err)}")
        done += got


def _desc_tag(tag: int, count: int) -> int:
    """The descriptor message's tag: ranks that disagree on how many tensors pass between them
    post different tags and time out (a CommError), where equal tags would make gloo abort the
    process on the size mismatch."""
    return zlib.crc32(f"{tag}:{count}".encode()) & 0x7FFFFFFF


def _host_id() -> int:
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
    except OSError:
        boot = ""
    return zlib.crc32(f"{socket.gethostname()}:{boot}".encode())


class _Job:
    def __init__(self, recvs: dict[int, tuple[list[torch.Tensor], object, torch.Tensor]], ack_tag: int):
        self.recvs, self.ack_tag = recvs, ack_tag
        self.done, self.error = threading.Event(), None
        self.acks: list = []  # the acknowledgement sends, with their tensors


class _Abandoned:
    """A collective this rank left before every peer had copied what it sent (a stop signal or an
    error raised out of wait(), a handle dropped unwaited). Its tensors and works stay alive until
    the peers acknowledge, in the channel's thread: freed at once, their memory would be reused
    and a peer would copy whatever was written there next (a torn record, a wrong gradient)."""

    def __init__(self, keep: list, ack_recvs: list) -> None:
        self.keep, self.ack_recvs = keep, ack_recvs


_KEPT_AT_EXIT: list[list] = []  # abandoned at interpreter shutdown, when no thread can start


class CmaWork:
    """What `Handle.wait()` waits on for one collective's intra-host part (gloo's work interface)."""

    def __init__(self, job: _Job, ack_recvs: list, keep: list, channel: "CmaChannel") -> None:
        self._job, self._ack_recvs, self._keep, self._channel = job, ack_recvs, keep, channel

    def wait(self, timeout=None) -> bool:
        try:
            seconds = None if timeout is None else timeout.total_seconds()
            if not self._job.done.wait(seconds):
                raise RuntimeError("intra-host copy timed out waiting for a peer's message")
            if self._job.error is not None:
                raise self._job.error
            for work in self._ack_recvs:  # every peer has copied what this rank sent
                work.wait(timeout) if timeout is not None else work.wait()
        except BaseException:
            self._abandon()
            raise
        self._keep.clear()
        return True

    def _abandon(self) -> None:
        if self._keep:
            keep, self._keep = self._keep, []
            try:
                self._channel._submit(_Abandoned(keep, self._ack_recvs))
            except RuntimeError:  # interpreter shutdown: no new thread; keep them to the end
                _KEPT_AT_EXIT.append(keep)

    def __del__(self) -> None:
        self._abandon()  # dropped without a successful wait()


class CmaChannel:
    """The intra-host transfers of one group, for the peers (group ranks) in `peers`. It keeps the
    group's `Group` (comm/topology.py), never its process group: a group zeroshard destroys is
    freed, its gloo threads with it, even while a channel is alive."""

    def __init__(self, group, peers: dict[int, int], timeout_s: float) -> None:
        self._group, self.peers, self.timeout_s = group, peers, timeout_s  # peers: group rank -> pid
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._broken: BaseException | None = None

    @staticmethod
    def probe(on_group, tag: int, timeout_s: float) -> "CmaChannel | None":
        """Every rank of `on_group` (a comm/topology.py Group) calls this at the same point (its
        first direct collective): the channel over the peers it and they can read of each other,
        or None."""
        group, rank, size = on_group.handle, on_group.rank, on_group.size
        if size < 2:
            return None
        enabled = _load()  # a rank where it is off still answers the probe (no peer waits on it)
        mark = torch.arange(8, dtype=torch.int64) + 1000 * (rank + 1)
        me = torch.tensor([os.getpid() if enabled else 0, _host_id(), mark.data_ptr()], dtype=torch.int64)
        others = list(range(size))
        others.remove(rank)
        info = {p: torch.zeros(3, dtype=torch.int64) for p in others}
        works = [dist.irecv(info[p], group=group, group_src=p, tag=tag) for p in others]
        works += [dist.isend(me, group=group, group_dst=p, tag=tag) for p in others]
        limit = datetime.timedelta(seconds=timeout_s)
        for w in works:
            w.wait(limit)
        can = {}
        for p in others:
            pid, host, address = info[p].tolist()
            seen = torch.zeros(8, dtype=torch.int64)
            try:
                if enabled and pid and host == me[1].item():
                    read_from(pid, address, seen)
            except OSError:
                pass
            can[p] = torch.tensor([int(torch.equal(seen, torch.arange(8, dtype=torch.int64) + 1000 * (p + 1)))])
        theirs = {p: torch.zeros(1, dtype=torch.int64) for p in others}
        works = [dist.irecv(theirs[p], group=group, group_src=p, tag=tag ^ 1) for p in others]
        works += [dist.isend(can[p], group=group, group_dst=p, tag=tag ^ 1) for p in others]
        for w in works:
            w.wait(limit)
        peers = {p: int(info[p][0]) for p in others if can[p].item() and theirs[p].item()}
        return CmaChannel(on_group, peers, timeout_s) if peers else None

    @property
    def group(self):
        return self._group.handle

    def transfer(self, tag: int, sends: dict[int, list[torch.Tensor]],
                 recvs: dict[int, list[torch.Tensor]]) -> CmaWork:
        """Post this collective's messages with the peers of this channel: to each peer, one
        message with the (address, bytes) of every tensor for it; from each, one such message,
        copied from by the channel's thread into `recvs[peer]` (contiguous CPU tensors)."""
        every = [t for ts in (*sends.values(), *recvs.values()) for t in ts]
        if any(not t.is_contiguous() or t.device.type != "cpu" for t in every):  # bytes are read by address
            raise RuntimeError("an intra-host transfer of a non-contiguous or non-CPU tensor; this is a zeroshard "
                               "bug, please report it")
        ack_tag = zlib.crc32(f"{tag}:ack".encode()) & 0x7FFFFFFF
        keep, ack_recvs = [], []
        for peer, tensors in sends.items():
            desc = torch.tensor([v for t in tensors for v in (t.data_ptr(), t.nbytes)], dtype=torch.int64)
            ack = torch.zeros(1, dtype=torch.int64)
            ack_recvs.append(dist.irecv(ack, group=self.group, group_src=peer, tag=ack_tag))
            at = _desc_tag(tag, len(tensors))
            keep += [*tensors, desc, ack, dist.isend(desc, group=self.group, group_dst=peer, tag=at)]  # until acked
        posted = {}
        for peer, tensors in recvs.items():
            desc = torch.zeros(2 * len(tensors), dtype=torch.int64)
            posted[peer] = (tensors, dist.irecv(desc, group=self.group, group_src=peer,
                                                tag=_desc_tag(tag, len(tensors))), desc)
        job = _Job(posted, ack_tag)
        if posted:
            self._submit(job)
        else:
            job.done.set()
        return CmaWork(job, ack_recvs, keep, self)

    def _submit(self, job: _Job) -> None:
        with self._lock:
            self._queue.put(job)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="zeroshard-cma", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                job = self._queue.get(timeout=IDLE_S)
            except queue.Empty:
                with self._lock:
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            if job is None:
                return
            if isinstance(job, _Abandoned):
                for work in job.ack_recvs:  # the peers copied what it sent, or gave up: then let go
                    with contextlib.suppress(Exception):
                        work.wait(datetime.timedelta(seconds=self.timeout_s))
                job = None
                continue
            try:
                if self._broken is not None:
                    raise self._broken
                self._copy(job)
            except BaseException as exc:  # handed to the rank's wait(), which names the collective
                self._broken = self._broken or exc
                job.error = exc
            job.done.set()
            job = None  # an idle thread keeps nothing of the group alive

    def _copy(self, job: _Job) -> None:
        for peer, (tensors, work, desc) in job.recvs.items():
            work.wait(datetime.timedelta(seconds=self.timeout_s))
            sizes = desc.view(-1, 2).tolist()
            if [n for _, n in sizes] != [t.nbytes for t in tensors]:
                raise RuntimeError(f"rank {peer} sent {[n for _, n in sizes]} bytes where "
                                   f"{[t.nbytes for t in tensors]} were expected (the ranks issued different collectives)")
            for (address, _), into in zip(sizes, tensors):
                read_from(self.peers[peer], address, into)
            ack = torch.ones(1, dtype=torch.int64)
            job.acks.append((ack, dist.isend(ack, group=self.group, group_dst=peer, tag=job.ack_tag)))
        for _, work in job.acks:
            work.wait(datetime.timedelta(seconds=self.timeout_s))
        job.recvs, job.acks = {}, []  # no gloo work outlives its collective (they keep the group alive)

    def close(self) -> None:
        """End the thread (after the copies already queued)."""
        with self._lock:
            thread, self._thread = self._thread, None
            if thread is not None and thread.is_alive():
                self._queue.put(None)
        if thread is not None:
            thread.join(timeout=10)
