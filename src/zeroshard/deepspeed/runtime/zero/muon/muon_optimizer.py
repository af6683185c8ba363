"""`deepspeed.runtime.zero.muon.muon_optimizer.MuonWithAuxAdam`: the class DeepSpeed's engine
builds for `"type": "Muon"`, over zeroshard's Muon (optim/muon.py). Param groups carry
`use_muon`; `adam_w_mode` as DeepSpeed's. `adam_optimizer` / `adam_optimizer_kwargs` (DeepSpeed's
FusedAdam for the Adam half) are accepted: zeroshard's Adam half is the same AdamW update.
"""

from __future__ import annotations

from zeroshard.optim.muon import Muon

__all__ = ["MuonWithAuxAdam"]


class MuonWithAuxAdam(Muon):
    def __init__(self, param_groups, adam_optimizer=None, adam_optimizer_kwargs=None, adam_w_mode: bool = True,
                 fallback_to_inline: bool = False) -> None:
        super().__init__(param_groups, adam_w_mode=adam_w_mode)
