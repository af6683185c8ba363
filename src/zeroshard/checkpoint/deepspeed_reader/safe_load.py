"""Read one DeepSpeed `.pt` file without running anything from it.

The file is a `torch.save` pickle. It is opened with `torch.load(weights_only=True)`, whose
unpickler builds only tensors, plain containers and the globals explicitly allowed, and
here the only extra globals allowed are the few DeepSpeed classes its checkpoints hold
(ALLOWED). Each is mapped to an inert `Record` that stores the arguments and attributes the
pickle gives it: no DeepSpeed code is imported, no method of the original class runs, and
anything else (a planted `__reduce__` calling `os.system`, an unknown class) stops the
load with one CheckpointError naming the file and the object's type.

Files are memory-mapped (`mmap=True`): a tensor's bytes are read from disk only when
sliced, and leave memory when the file's tensors are dropped.
"""

from __future__ import annotations

import mmap
import os
import re
import warnings
import zipfile
from typing import Any

import torch

from zeroshard.policies import CheckpointError


class Record:
    """An inert stand-in for one object of a DeepSpeed class: `args` (what the pickle passed
    to the class) and `fields` (the attributes it restored). It has no behaviour."""

    type_name = "?"

    def __new__(cls, *args: Any) -> "Record":
        obj = super().__new__(cls)
        obj.args = tuple(args)
        obj.fields = {}
        return obj

    def __init__(self, *args: Any) -> None:  # called by REDUCE (e.g. an Enum member): keep args only
        pass

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict)):
            state = {**(state[0] or {}), **(state[1] or {})}  # (dict, slots)
        self.fields = dict(state) if isinstance(state, dict) else {"state": state}

    def get(self, name: str, default: Any = None) -> Any:
        return self.fields.get(name, default)

    @property
    def value(self) -> Any:
        """An Enum member's value (pickled as `Class(value)`)."""
        return self.args[0] if self.args else None

    def __repr__(self) -> str:
        return f"Record({self.type_name}, args={self.args}, fields={self.fields})"


# The non-tensor objects DeepSpeed 0.1x puts in its checkpoints (stages 0-3, fp16/bf16,
# offload), found by reading deepspeed/runtime/engine.py (_save_checkpoint,
# _save_zero_checkpoint), runtime/zero/stage_1_and_2.py and stage3.py (state_dict),
# runtime/bf16_optimizer.py and runtime/fp16/loss_scaler.py.
ALLOWED = (
    "deepspeed.runtime.zero.config.ZeroStageEnum",  # optimizer_state_dict["zero_stage"]
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",  # ["loss_scaler"]: static scale (bf16, fp32, fp16 fixed)
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",  # ["loss_scaler"]: fp16 dynamic scale
    "deepspeed.utils.tensor_fragment.fragment_address",  # ["param_slice_mappings"] entries
    "deepspeed.runtime.zero.offload_config.OffloadDeviceEnum",  # an offload device inside a saved config
    "deepspeed.runtime.zero.offload_config.OffloadStateTypeEnum",
    "deepspeed.runtime.config.DtypeEnum",
)

_RECORDS = {name: type(name.rsplit(".", 1)[1], (Record,), {"type_name": name, "__module__": __name__})
            for name in ALLOWED}


_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
_FUNC = re.compile(r"unrecognized function (.+?)(?: which belongs|$)")


def load(path: str, mmap: bool = True) -> Any:
    """The object in `path`, built from tensors, containers and inert Records only."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such file")
    globs = [(cls, name) for name, cls in _RECORDS.items()]
    try:
        with torch.serialization.safe_globals(globs):
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
            except RuntimeError as exc:
                if mmap and "mmap" in str(exc):  # the pre-1.6 (non-zip) format cannot be mapped
                    return torch.load(path, map_location="cpu", weights_only=True)
                raise
    except Exception as exc:  # (nothing inside raises CheckpointError: Records only store what they are given)
        raise _explain(path, exc) from None


def _explain(path: str, exc: Exception) -> CheckpointError:
    text = str(exc)
    m = _GLOBAL.search(text)
    if m or "Unsupported global" in text or "unrecognized function" in text or "Can only" in text:
        found = m.group(1) if m else (_FUNC.search(text).group(1) if _FUNC.search(text) else text.splitlines()[0])
        return CheckpointError(
            f"{path}: refused: it holds an object of type {found}, which is not a tensor, a plain container "
            f"or one of the DeepSpeed records zeroshard reads ({', '.join(n.rsplit('.', 1)[1] for n in ALLOWED)}); "
            "nothing from the file was run. DeepSpeed itself writes no such object: the training script put it "
            "in client_state, or the file was altered")
    if isinstance(exc, (EOFError, zipfile.BadZipFile)) or "zip archive" in text or "central directory" in text \
            or "file_size" in text or "truncated" in text.lower() or "unexpected EOF" in text:
        return CheckpointError(f"{path}: truncated or damaged ({text.splitlines()[0] if text else type(exc).__name__}); "
                               "it is not a complete torch.save file: copy the checkpoint again")
    return CheckpointError(f"{path}: cannot be read as a torch.save file ({type(exc).__name__}: "
                           f"{text.splitlines()[0] if text else ''})")


def check_complete(path: str) -> None:
    """Every record of the zip archive present and its CRC-32 right (streamed; nothing is
    unpickled): the file is the one torch.save wrote, not truncated or altered. A file in
    torch's pre-1.6 format (a bare pickle, no zip) has no checksums: loading it checks it."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if head[:1] == b"\x80" and head != b"PK\x03\x04":
        return
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise CheckpointError(f"{path}: truncated or damaged ({exc}); it is not a complete torch.save file: "
                              "copy the checkpoint again") from None
    if bad is not None:
        raise CheckpointError(f"{path}: damaged: record {bad} fails its CRC-32 check; copy the checkpoint again")


# -- reading without touching the mapping ---------------------------------------------------------------
# A memory-mapped file's pages count in the process's resident memory once touched, and stay
# while the file is mapped (the kernel also maps pages around each one read). The reader keeps
# every rank's file open and mapped (one open per file, for the tensors' structure), but takes
# the bytes of a range with pread() at the file offset the mapping gives (from
# /proc/self/maps): only the copy it returns is resident, the mapping is never touched.


def mapped_ranges(path: str) -> list[tuple[int, int, int]]:
    """(start, end, file offset) of each mapping of `path` in this process ([] where unknown)."""
    real = os.path.realpath(path)
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5] == real:
            a, b = parts[0].split("-")
            out.append((int(a, 16), int(b, 16), int(parts[2], 16)))
    return out


def read_into(dst: torch.Tensor, src: torch.Tensor, fd: int | None, ranges: list[tuple[int, int, int]]) -> None:
    """dst[:] = src (same dtype and size, both contiguous), taking src's bytes from the file
    with pread when src lies in a mapping of it; else an ordinary copy."""
    nbytes = src.numel() * src.element_size()
    lo = src.data_ptr()
    where = next((off + lo - a for a, b, off in ranges if a <= lo and lo + nbytes <= b), None)
    if fd is None or where is None or not dst.is_contiguous() or dst.dtype != src.dtype or nbytes == 0:
        dst.copy_(src)
        return
    view = memoryview(dst.view(torch.uint8).numpy()).cast("B") if dst.numel() else memoryview(b"")
    done = 0
    while done < nbytes:
        got = os.preadv(fd, [view[done:nbytes]], where + done)
        if got <= 0:
            raise CheckpointError(f"file descriptor {fd}: short read at byte {where + done} (the file changed?)")
        done += got


def fp32_buffer(n: int) -> torch.Tensor:
    """n fp32 elements for a read's result. From 1 MiB up, in its own anonymous mapping, which
    goes back to the system as soon as the caller drops the tensor: from glibc's heap, a freed
    result would stay resident (heap holes), and a load reads thousands of them."""
    if n * 4 < 1 << 20:
        return torch.empty(n, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.frombuffer(mmap.mmap(-1, n * 4), dtype=torch.float32)
