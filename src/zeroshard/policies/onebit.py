"""DeepSpeed's parameters of the 1-bit optimizer family (DeepSpeed <= 0.18's
runtime/fp16/onebit/{adam,zoadam,lamb}.py; 0.19 removed the family), and what zeroshard does
with each one that is not an update rule's hyperparameter. Plain data: the config layer reads it.

- `cuda_aware`, `comm_backend_name` pick DeepSpeed's MPI / NCCL / HCCL backend for the
  compressed exchange: accepted with a note, zeroshard's runs on the process group's backend.
- `max_grad_norm`, `bias_correction`: DeepSpeed's 1-bit optimizers accept and never read them
  (no bias correction is applied; clipping is the top-level `gradient_clipping`): accepted with
  a note, and zeroshard does as DeepSpeed does.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BACKEND_ONLY", "ONEBIT_ADAM_KEYS", "ONEBIT_KINDS", "ONEBIT_LAMB_KEYS", "ONEBIT_SHARDED", "ZERO_ONE_ADAM_KEYS", "onebit_kwargs",
           "onebit_notes"]

ONEBIT_SHARDED = ("the 1-bit optimizers (OneBitAdam, ZeroOneAdam, OneBitLamb) are not compatible with ZeRO stages "
                  "1-3 (DeepSpeed refuses them too): their compressed all-reduce replaces stage 0's gradient "
                  "all-reduce and needs every tensor whole on every rank; set zero_optimization.stage 0, or use "
                  "Adam/AdamW at stages 1-3")
ONEBIT_KINDS = ("onebitadam", "zerooneadam", "onebitlamb")
BACKEND_ONLY = frozenset({"cuda_aware", "comm_backend_name"})
NEVER_READ = frozenset({"max_grad_norm", "bias_correction"})
_COMMON = frozenset({"lr", "betas", "eps", "eps_inside_sqrt", "weight_decay", "amsgrad"}) | BACKEND_ONLY | NEVER_READ
ONEBIT_ADAM_KEYS = _COMMON | {"freeze_step"}
ZERO_ONE_ADAM_KEYS = _COMMON | {"var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper"}
ONEBIT_LAMB_KEYS = _COMMON | {"freeze_step", "max_coeff", "min_coeff", "coeff_beta", "factor_max", "factor_min",
                              "factor_threshold"}


def onebit_kwargs(params: dict[str, Any]) -> dict[str, Any]:
    """The constructor's keyword arguments: the backend selectors and `max_grad_norm` dropped."""
    return {k: v for k, v in params.items() if k not in BACKEND_ONLY and k != "max_grad_norm"}


def onebit_notes(kind: str, params: dict[str, Any]) -> list[str]:
    """One note per key a 1-bit optimizer section sets that has no effect here, saying why."""
    notes = []
    backend = sorted(BACKEND_ONLY & set(params))
    if backend:
        notes.append(f"optimizer {kind}: {', '.join(backend)} ignored (they pick DeepSpeed's MPI/NCCL backend for "
                     "the compressed exchange; zeroshard's runs on the process group's own backend)")
    unread = sorted(NEVER_READ & set(params))
    if unread:
        notes.append(f"optimizer {kind}: {', '.join(unread)} ignored (DeepSpeed's 1-bit optimizers never apply "
                     "them either: no bias correction; clip with the top-level gradient_clipping)")
    return notes
