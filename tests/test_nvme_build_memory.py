"""ZeRO-Infinity's build (issue 11): a 16-bit model whose fp32 masters go to NVMe files must
not hold every master in memory while `initialize` builds it. Each unit's masters are taken,
written to the optimizer's file and dropped before the next unit is built, so the build's
peak is one unit's masters (plus the gradient shards training needs anyway), not the model's.

Measured as the real thing: resident memory (VmHWM) of one real rank, with glibc told to
return large freed blocks at once so resident memory is what is held.
"""

from __future__ import annotations

import pytest
import torch

from distributed import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _rss(field: str) -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(field))


def _build_worker(rank, world_size, nvme_path):
    import torch.distributed as dist

    import zeroshard
    from zeroshard.models.gpt import GPT, GPTConfig

    dist.init_process_group("gloo")
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=8, n_head=8, n_embd=512)  # 25.3M parameters
    with torch.device("meta"):
        model = GPT(cfg)
    n = sum(p.numel() for p in model.parameters())
    where = {"device": "nvme", "nvme_path": nvme_path}
    config = {
        "train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "offload_optimizer": where, "offload_param": {**where, "buffer_count": 2}},
        "zeroshard": {"stage3_unit_classes": ["Block"]},
    }
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # the peak (VmHWM) starts from what the process holds now
    before = _rss("VmRSS:")
    engine = zeroshard.initialize(model, config)
    growth = _rss("VmHWM:") - before
    masters_on_disk = all(m.untyped_storage().nbytes() <= 4 for m in engine.optimizer.masters)
    engine.close()
    return {"growth": growth, "params": n, "masters_on_disk": masters_on_disk}


def test_nvme_build_never_holds_every_fp32_master(tmp_path, monkeypatch):
    # glibc reads MALLOC_* only when a process starts: a fresh interpreter, not a fork of the
    # suite's forkserver (started earlier without it; CI measured 221 MiB there)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    (out,) = run_ranks(_build_worker, 1, str(tmp_path), timeout=240, start="spawn")
    n = out["params"]
    masters = 4 * n  # every fp32 master at once: what the build held before this was fixed
    grads = 2 * n  # bf16 gradient shards, allocated for training
    print(f"build peak growth {out['growth'] / 2**20:.0f} MiB for {n:,} parameters "
          f"(all fp32 masters would be {masters / 2**20:.0f} MiB, bf16 gradients {grads / 2**20:.0f} MiB)")
    assert out["masters_on_disk"]
    # gradients + one unit's masters (1/8 of the model here) + allocator and torch slack
    assert out["growth"] < grads + 0.5 * masters, out


def _bf16_nvme_config(path: str) -> dict:
    where = {"device": "nvme", "nvme_path": path}
    return {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": 3, "offload_optimizer": where, "offload_param": where}}


def test_space_for_masters_and_parameters_together_is_checked_before_writing(tmp_path, monkeypatch):
    """Both files are checked before the build writes either: a disk with room for the
    masters and states (12 bytes per parameter) or the bf16 shards (2) but not both is refused
    at once, and nothing was written."""
    import os
    import shutil as sh

    import zeroshard
    from zeroshard.models.gpt import GPT, GPTConfig
    from zeroshard.policies import NvmeSpaceError

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=256))
    n = sum(p.numel() for p in model.parameters())
    real = sh.disk_usage
    monkeypatch.setattr(sh, "disk_usage", lambda p: real(p)._replace(free=(1 << 30) + 13 * n))
    with pytest.raises(NvmeSpaceError, match="needs"):
        zeroshard.initialize(model, _bf16_nvme_config(str(tmp_path)))
    assert not any(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(tmp_path) for f in fs
                   if f == "shards.bin")
