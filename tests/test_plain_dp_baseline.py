"""zeroshard train's summary compares the model states with plain data parallelism's, which in
fp32 keeps no separate fp32 master (the parameter is its own) and in 16 bits keeps one: the
baseline must not copy a master this run keeps apart (an NVMe run's fp32 masters live in files,
beside the device parameters), nor lose the one a 16-bit plain DP needs (issue 29, item 7)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from zeroshard.cli.train.report import _plain_dp_optimizer
from zeroshard.partition.memory import MemoryLedger

T = 834_304  # trainable elements (mini)


@pytest.mark.parametrize("itemsize, separate_master, want", [
    (4, False, 8 * T),  # fp32, masters are the parameters: Adam's two moments
    (4, True, 8 * T),   # fp32 with the masters kept apart (NVMe): still only the moments
    (2, True, 12 * T),  # bf16: fp32 masters and the moments, as a bf16 plain DP holds them
])
def test_plain_dp_holds_the_states_and_a_master_only_in_16_bits(itemsize, separate_master, want):
    shards = 2
    masters = 4 * T // shards if separate_master else 0
    mem = {"optimizer_states": 8 * T // shards + masters, "optimizer_masters": masters}
    assert _plain_dp_optimizer(SimpleNamespace(itemsize=itemsize, trainable=T), mem, shards) == want


def test_the_ledger_sums_what_it_holds_under_a_prefix():
    ledger = MemoryLedger()
    ledger.hold("optimizer_states", "master.nvme", 100, tier="nvme")
    ledger.hold("optimizer_states", "master.device", 20)
    ledger.hold("optimizer_states", "states.nvme", 400, tier="nvme")
    ledger.hold("params", "master.x", 7)
    assert ledger.held("optimizer_states", "master.") == 120
    assert ledger.held("optimizer_states") == 520
    ledger.release("optimizer_states", "master.device")
    assert ledger.held("optimizer_states", "master.") == 100
