"""Random number generator states as JSON: torch (CPU and every CUDA device), `random`, numpy."""

from __future__ import annotations

import base64
import random
from typing import Any

import torch


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _tensor(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def capture() -> dict[str, Any]:
    version, state, gauss = random.getstate()
    out: dict[str, Any] = {"torch": _b64(torch.get_rng_state()),
                           "python": [version, list(state), gauss]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    try:
        import numpy as np
    except ImportError:
        return out
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    out["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    return out


def restore(states: dict[str, Any]) -> None:
    torch.set_rng_state(_tensor(states["torch"]))
    version, state, gauss = states["python"]
    random.setstate((version, tuple(state), gauss))
    if "cuda" in states and torch.cuda.is_available():
        for device, s in enumerate(states["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(_tensor(s), device)
    if "numpy" in states:
        try:
            import numpy as np
        except ImportError:
            return
        kind, keys, pos, has_gauss, cached = states["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
