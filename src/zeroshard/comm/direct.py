"""gloo's all-gather and reduce-scatter as point-to-point messages, for `Comm` (comm/collectives.py).

torch's gloo `reduce_scatter_tensor` clones the whole input on the calling thread and
all-reduces the clone (twice a reduce-scatter's bytes); its `all_gather_into_tensor` gathers
into a new flat tensor and copies every chunk out. Here each rank sends each chunk straight to
the rank that needs it and receives straight into place (bench/RESULTS.md has the timings),
and a reduce-scatter's input may be pieces that are never assembled (`reduce_scatter_pieces`).
Between ranks of one host the bytes go by comm/cma.py instead of gloo's TCP where they can.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from zeroshard.comm.cma import CmaChannel
from zeroshard.policies import CommError


class DirectCollectives:
    """The direct (point-to-point) forms of `Comm`'s all-gather and reduce-scatter on gloo CPU
    tensors; `Comm` provides the group, the ledger (`issue`, which returns the `Handle` of
    comm/collectives.py), the scratch buffers and the tags' sequence."""

    def _direct(self, tensor: torch.Tensor) -> bool:
        """Whether the point-to-point forms below replace gloo's own all-gather and
        reduce-scatter (gloo on CPU tensors, more than one rank)."""
        return self.world_size > 1 and self.topology.backend == "gloo" and tensor.device.type == "cpu"

    def _peers(self) -> list[int]:
        """The other ranks of the group, starting after this one (so the N ranks' first
        messages go to N different peers)."""
        n, me = self.world_size, self.rank
        return [(me + k) % n for k in range(1, n)]

    def _tag(self, op: str, numel: int, dtype: torch.dtype) -> int:
        """The message tag of this group's next direct collective: its position in the group's
        sequence, its kind and its size, hashed. Every rank issues the same sequence, so the
        tags agree and concurrent collectives never take each other's messages. Ranks that
        diverged (one skipped a collective) post different tags: their receives wait and time
        out with a CommError, instead of gloo aborting the process on a size mismatch."""
        root = self._root or self
        key = (self.on_group.name, tuple(self.on_group.ranks))
        seq = root._sequence.get(key, 0)
        root._sequence[key] = seq + 1
        return zlib.crc32(f"{seq}:{op}:{numel}:{dtype}".encode()) & 0x7FFFFFFF

    def _transfer(self, tag: int, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]]) -> list:
        """Post the (peer, tensor) sends and receives of one direct collective; the works to wait
        on. The i-th message between two ranks is the i-th each lists for the other. Peers on this
        host are served by comm/cma.py where it works; the others by gloo's isend / irecv (the
        i-th message tagged `tag` for i = 0, a hash of (tag, i) after)."""
        channel, near = self._channel(), {}
        if channel is not None:
            near = {p: ([t for q, t in sends if q == p], [t for q, t in recvs if q == p]) for p in channel.peers}
        works, count = [], {}
        for (peer, t), receive in [(r, True) for r in recvs] + [(s, False) for s in sends]:
            if peer in near:
                continue
            i = count[(peer, receive)] = count.get((peer, receive), -1) + 1
            at = tag if i == 0 else zlib.crc32(f"{tag}:{i}".encode()) & 0x7FFFFFFF
            works.append(dist.irecv(t, group=self.group, group_src=peer, tag=at) if receive else
                         dist.isend(t, group=self.group, group_dst=peer, tag=at))
        if near:
            works.append(channel.transfer(tag, {p: s for p, (s, _) in near.items() if s},
                                          {p: r for p, (_, r) in near.items() if r}))
        return works

    def _channel(self):
        """This group's intra-host channel (comm/cma.py), probed at its first direct collective."""
        root, key = self._root or self, (self.on_group.name, tuple(self.on_group.ranks))
        if key not in root._channels:
            root._channels[key] = CmaChannel.probe(self.on_group, self._tag("cma_probe", 0, torch.int64),
                                                   self.timeout_s)
        return root._channels[key]

    def close(self) -> None:
        """End the intra-host channels' threads (an engine's close)."""
        root = self._root or self
        for channel in root._channels.values():
            if channel is not None:
                channel.close()
        root._channels.clear()

    def _reduce_scatter_direct(self, output: torch.Tensor, input: torch.Tensor, what: str,
                               average: bool):
        """gloo has no reduce-scatter of its own: torch's gloo `reduce_scatter_tensor` clones
        the whole input on the calling thread, all-reduces the clone (twice a reduce-scatter's
        bytes) and copies one chunk out. Here every rank sends chunk j of `input` to rank j and
        receives the N-1 chunks the peers hold of its own ((N-1)/N of the tensor, what the
        ledger counts); the wait sums them with its own chunk into `output`. Same result, half
        the bytes, no copy of its own chunk. `average` divides the sum (one pass over one
        chunk); fp16 is divided before it is sent instead, as a sum of fp16 may overflow."""
        flat = input.view(-1)
        if average and input.dtype == torch.float16:
            flat.mul_(1.0 / self.world_size)
            average = False
        return self._reduce_pieces(output, [(0, flat)], what, average, accumulate=False)

    def reduces_pieces(self, dtype: torch.dtype, device) -> bool:
        """Whether `reduce_scatter_pieces` serves tensors of `dtype` on `device` here."""
        return self.world_size > 1 and self.topology.backend == "gloo" and torch.device(device).type == "cpu" \
            and dtype != torch.float16

    def reduce_scatter_pieces(self, output: torch.Tensor, pieces: list[tuple[int, torch.Tensor]], what: str = "",
                              average: bool = False, accumulate: bool = False):
        """`reduce_scatter` of a flat input of world_size x output.numel() elements that is never
        assembled: `pieces` are (offset, contiguous tensor) in offset order, not overlapping, at the
        same offsets and sizes on every rank; what they leave uncovered counts as zero. Each piece
        goes to its owners straight from where it lies (a gradient where autograd left it), so no
        bucket is filled: a copy of every gradient saved. Rank r's sum (the mean with `average`)
        lands in `output`, or is added to it with `accumulate`. gloo on CPU only (`reduces_pieces`)."""
        if not self.reduces_pieces(output.dtype, output.device):
            raise CommError(f"reduce_scatter_pieces on {self.topology.backend} with {self.world_size} ranks and "
                            f"{output.dtype}; this is a zeroshard bug, please report it.")
        return self._reduce_pieces(output, pieces, what, average, accumulate)

    def _reduce_pieces(self, output: torch.Tensor, pieces: list[tuple[int, torch.Tensor]], what: str,
                       average: bool, accumulate: bool):
        """`reduce_scatter_pieces` without its check: also the plain direct reduce-scatter, whose
        input is one piece (`output` may then be rank r's chunk of it, in place)."""
        n, size, me = self.world_size, output.numel(), self.rank
        tag = self._tag("reduce_scatter", n * size, output.dtype)
        spare = self.scratch((n - 1) * size, output.dtype, output.device)
        received = [spare[k * size : (k + 1) * size] for k in range(n - 1)]
        peers, own, sends, recvs = self._peers(), [], [], []
        for off, piece in pieces if size else []:
            flat, end = piece.view(-1), off + piece.numel()
            for c in range(off // size, min(n, -(-end // size))):
                lo, hi = max(off, c * size), min(end, (c + 1) * size)
                if lo >= hi:
                    continue
                part, at = flat[lo - off : hi - off], lo - c * size
                if c == me:
                    own.append((at, part))
                    recvs += [(peer, got[at : at + part.numel()]) for peer, got in zip(peers, received)]
                else:
                    sends.append((c, part))

        def finish() -> None:
            out, scale, covered = output.view(-1), (1.0 / n if average else 1.0), 0
            for at, part in own:
                region = out[at : at + part.numel()]
                if accumulate:
                    for term in [part] + [got[at : at + part.numel()] for got in received]:
                        region.add_(term, alpha=scale)
                    continue
                if at > covered:
                    out[covered:at].zero_()  # padding: no rank sends it
                torch.add(part, received[0][at : at + part.numel()], out=region)
                for got in received[1:]:
                    region.add_(got[at : at + part.numel()])
                covered = at + part.numel()
            if not accumulate:
                out[covered:].zero_()
                if average:
                    out.mul_(scale)
            self.give_back(spare)

        return self.issue("reduce_scatter", output, n * size, what,
                          lambda: self._transfer(tag, sends, recvs) if size else [], finish=finish)

    def _all_gather_direct(self, outputs: list[torch.Tensor], input: torch.Tensor, what: str):
        """gloo's `all_gather_into_tensor` gathers into a new flat tensor (its input copied in)
        and then copies every chunk out, on gloo's thread. Here this rank sends its chunk to
        every peer and receives each peer's chunk straight into its place, `outputs[peer]`: the
        bytes of a ring ((N-1)/N of the tensor per rank), no temporary, no copy (bench/RESULTS.md
        has the timings)."""
        size, mine = input.numel(), outputs[self.rank].view(-1)
        if mine.data_ptr() != input.data_ptr():
            mine.copy_(input.view(-1))
        peers = self._peers()
        sends, recvs = [(p, mine) for p in peers], [(p, outputs[p].view(-1)) for p in peers]
        numel, tag = size * self.world_size, self._tag("all_gather", size * self.world_size, input.dtype)
        return self.issue("all_gather", input, numel, what,
                           lambda: self._transfer(tag, sends, recvs) if size else [])
