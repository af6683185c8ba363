"""`deepspeed.runtime.zero.muon.original_muon`: Keller Jordan's `MuonWithAuxAdam` and
`SingleDeviceMuonWithAuxAdam` (param groups with `use_muon`; AdamW for the rest), both over
zeroshard's Muon (optim/muon.py), which zeroshard shards itself."""

from __future__ import annotations

from zeroshard.optim.muon import Muon

__all__ = ["MuonWithAuxAdam", "SingleDeviceMuonWithAuxAdam"]


class MuonWithAuxAdam(Muon):
    def __init__(self, param_groups) -> None:
        super().__init__(param_groups)


SingleDeviceMuonWithAuxAdam = MuonWithAuxAdam
