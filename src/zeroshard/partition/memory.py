"""MemoryLedger: bytes this rank holds, by category and tier, now and at peak.

Owners of storage call `hold(category, key, nbytes)` when they allocate (or resize)
and `release(category, key)` when they free; the ledger keeps per-category totals
and their peaks since `reset_peaks()`. Numbers are exact tensor sizes, not
allocator readings, so tests can assert them.
"""

from __future__ import annotations

from collections import defaultdict

# "activations": the inputs of checkpointed segments zeroshard's checkpoint function keeps for
# backward, on the tier where they wait (device, host, or nvme files)
CATEGORIES = ("params", "grads", "optimizer_states", "comm_buffers", "activations")
MODEL_STATES = ("params", "grads", "optimizer_states")
TIERS = ("device", "host", "nvme")


class MemoryLedger:
    def __init__(self) -> None:
        self._held: dict[tuple[str, str], tuple[int, str]] = {}
        self._now: dict[str, int] = defaultdict(int)
        self._peak: dict[str, int] = defaultdict(int)
        self._tier_now: dict[str, int] = defaultdict(int)
        self._split_now: dict[tuple[str, str], int] = defaultdict(int)  # (category, tier) -> bytes
        self._split_peak: dict[tuple[str, str], int] = defaultdict(int)
        self._peak_states = 0  # params + grads + optimizer states held at the same moment

    def hold(self, category: str, key: str, nbytes: int, tier: str = "device") -> None:
        if category not in CATEGORIES or tier not in TIERS:
            raise ValueError(f"unknown memory category/tier {category!r}/{tier!r}")
        self.release(category, key)
        self._held[(category, key)] = (nbytes, tier)
        self._now[category] += nbytes
        self._tier_now[tier] += nbytes
        self._split_now[(category, tier)] += nbytes
        self._split_peak[(category, tier)] = max(self._split_peak[(category, tier)], self._split_now[(category, tier)])
        self._peak[category] = max(self._peak[category], self._now[category])
        self._peak_states = max(self._peak_states, self._states_now())

    def _states_now(self) -> int:
        return sum(self._now[c] for c in MODEL_STATES)

    def release(self, category: str, key: str) -> None:
        entry = self._held.pop((category, key), None)
        if entry is not None:
            nbytes, tier = entry
            self._now[category] -= nbytes
            self._tier_now[tier] -= nbytes
            self._split_now[(category, tier)] -= nbytes

    def held(self, category: str, prefix: str = "") -> int:
        """Bytes of `category` held now under keys that start with `prefix` (all, without one)."""
        return sum(n for (c, k), (n, _) in self._held.items() if c == category and k.startswith(prefix))

    def reset_peaks(self) -> None:
        self._peak = defaultdict(int, {c: self._now[c] for c in CATEGORIES})
        self._peak_states = self._states_now()
        self._split_peak = defaultdict(int, self._split_now)

    def by_tier(self, category: str) -> dict[str, int]:
        """{tier: bytes of `category` there now, peak_<tier>: its peak since reset_peaks()}."""
        out = {t: self._split_now[(category, t)] for t in TIERS}
        out.update({f"peak_{t}": self._split_peak[(category, t)] for t in TIERS})
        return out

    def stats(self) -> dict[str, int]:
        out = {c: self._now[c] for c in CATEGORIES}
        out.update({f"peak_{c}": self._peak[c] for c in CATEGORIES})
        out["model_states"] = self._states_now()
        out["peak_model_states"] = self._peak_states  # simultaneous, not the sum of the peaks above
        out.update({f"tier_{t}": self._tier_now[t] for t in TIERS})
        return out
