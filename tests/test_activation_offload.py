"""Activation offload (issue 11): checkpointed segment inputs on the host or in NVMe files.

A real GPT whose blocks run under zeroshard's checkpoint function; real files under tmp_path.
Gradients equal plain torch checkpointing; files exist during backward and are gone after;
the ledger puts the bytes on their tier; the estimator agrees; config errors are clear.
"""

from __future__ import annotations

import copy
import logging
import os

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import zeroshard
import zeroshard.deepspeed as deepspeed
from zeroshard.config import load_config
from zeroshard.estimate.activations import activation_bytes
from zeroshard.estimate.memory import Strategy, estimate_memory
from zeroshard.estimate.model_size import ModelShape
from zeroshard.models.gpt import GPT, GPTConfig
from zeroshard.offload import activations
from zeroshard.partition import MemoryLedger
from zeroshard.policies import ActivationOffloadPolicy, ConfigError, NvmeError, OffloadDevice

PRESET = GPTConfig(vocab_size=64, block_size=32, n_layer=4, n_head=2, n_embd=32)  # 4 blocks, ~57K params
B, T = 2, 32
INPUT_BYTES = B * T * PRESET.n_embd * 4  # one block's kept input, fp32


class CkptGPT(GPT):
    """Every block under activation checkpointing: zeroshard's (`impl="zeroshard"`), DeepSpeed's
    drop-in (`"deepspeed"`) or torch's plain one (`"torch"`, the reference)."""

    def __init__(self, reentrant: bool = True, impl: str = "zeroshard") -> None:
        super().__init__(PRESET)
        self.reentrant, self.impl = reentrant, impl
        self.during_backward: list = []  # what a probe saw while backward ran
        self.probe = None

    def _ckpt(self, block, x):
        if self.impl == "torch":
            return torch_checkpoint(block, x, use_reentrant=self.reentrant)
        if self.impl == "deepspeed":
            ck = deepspeed.checkpointing.checkpoint if self.reentrant else deepspeed.checkpointing.non_reentrant_checkpoint
            return ck(block, x)
        return zeroshard.checkpoint_activations(block, x, use_reentrant=self.reentrant)

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for i, block in enumerate(self.h):
            x = self._ckpt(block, x)
            if self.probe is not None and x.requires_grad:
                x.register_hook(lambda g, i=i: self.during_backward.append((i, self.probe())) or g)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    yield
    activations.reset()


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, PRESET.vocab_size, (B, T), generator=g), torch.randint(0, PRESET.vocab_size, (B, T), generator=g)


def _grads(model, idx, tgt):
    model.zero_grad(set_to_none=True)
    model(idx, tgt)[1].backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _act_files(root) -> list[str]:
    return sorted(f for d, _, files in os.walk(root) for f in files if f.startswith("act-"))


def _store(device: str, tmp_path, ledger=None, buffer_count=2):
    policy = ActivationOffloadPolicy(device=OffloadDevice(device), nvme_path=str(tmp_path), buffer_count=buffer_count)
    return activations.configure(activations.ActivationOffload(policy, ledger=ledger))


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_gradients_equal_plain_checkpointing(device, reentrant, tmp_path):
    torch.manual_seed(0)
    ref = CkptGPT(reentrant, impl="torch")
    model = copy.deepcopy(ref)
    model.impl = "zeroshard"
    idx, tgt = _batch()
    want = _grads(ref, idx, tgt)
    store = _store(device, tmp_path, ledger=MemoryLedger())
    for seed in (0, 1):  # twice: the second pass reuses staging buffers and file names never clash
        idx, tgt = _batch(seed)
        want = _grads(ref, idx, tgt)
        got = _grads(model, idx, tgt)
        worst = max((want[n] - got[n]).abs().max().item() for n in want)
        assert worst <= 1e-6, f"{device} {reentrant}: gradients differ by {worst}"
    assert store.packed == 2 * PRESET.n_layer and store.packed_bytes == 2 * PRESET.n_layer * INPUT_BYTES
    if device == "nvme":  # backward read each one back; all but the first were read ahead
        assert (store.hits, store.misses) == (2 * (PRESET.n_layer - 1), 2)


def test_nvme_files_exist_during_backward_and_are_gone_after(tmp_path):
    torch.manual_seed(0)
    model = CkptGPT()
    ledger = MemoryLedger()
    store = _store("nvme", tmp_path, ledger)
    folder = store.folder
    assert folder.startswith(str(tmp_path)) and os.path.isdir(folder)
    model.probe = lambda: (_act_files(tmp_path), ledger.by_tier("activations")["nvme"])
    idx, tgt = _batch()
    _, loss = model(idx, tgt)
    files = _act_files(tmp_path)
    assert len(files) == PRESET.n_layer  # one file per checkpointed block input
    store.flush()  # the writes run in the background
    assert all(os.path.getsize(os.path.join(folder, f)) >= INPUT_BYTES for f in files)
    loss.backward()
    # the gradient of block i's output arrives before block i is recomputed: blocks > i were
    # consumed (their files deleted), blocks <= i still wait on disk
    seen = dict(model.during_backward)
    for i in range(PRESET.n_layer):
        on_disk, nvme_bytes = seen[i]
        assert len(on_disk) == i + 1, (i, on_disk)
        assert nvme_bytes == (i + 1) * INPUT_BYTES
    assert _act_files(tmp_path) == [] and ledger.by_tier("activations")["nvme"] == 0
    assert ledger.by_tier("activations")["peak_nvme"] == PRESET.n_layer * INPUT_BYTES
    # a graph dropped without backward takes its files with it
    _, loss = model(idx, tgt)
    assert len(_act_files(tmp_path)) == PRESET.n_layer
    del loss, _
    assert _act_files(tmp_path) == [] and store.files == 0
    activations.reset()  # closing the store removes the run folder
    assert not os.path.exists(folder)


@pytest.mark.parametrize("device,tier", [("none", "device"), ("cpu", "host"), ("nvme", "nvme")])
def test_ledger_counts_the_bytes_on_their_tier(device, tier, tmp_path):
    torch.manual_seed(0)
    model = CkptGPT()
    ledger = MemoryLedger()
    _store(device, tmp_path, ledger, buffer_count=2)
    idx, tgt = _batch()
    _, loss = model(idx, tgt)
    split = ledger.by_tier("activations")
    assert split[tier] == PRESET.n_layer * INPUT_BYTES
    assert sum(split[t] for t in ("device", "host", "nvme")) == split[tier]
    staging = ledger.stats()["comm_buffers"]
    if device == "nvme":  # bounded host staging buffers: at most buffer_count of one input each
        assert INPUT_BYTES <= staging <= 2 * INPUT_BYTES
    else:
        assert staging == 0
    loss.backward()
    assert ledger.stats()["activations"] == 0


def _engine_config(**extra):
    cfg = {"train_micro_batch_size_per_gpu": B, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 2}}
    cfg.update(extra)
    return cfg


@pytest.mark.parametrize("impl", ["zeroshard", "deepspeed"])
def test_engine_config_puts_activations_on_their_tier(impl, tmp_path, caplog, monkeypatch):
    """Through initialize(): cpu_checkpointing -> host; zeroshard.activation_offload nvme -> files;
    two SGD steps equal plain checkpointing; the start-up line (ZEROSHARD_VERBOSE) says where they live."""
    monkeypatch.setenv("ZEROSHARD_VERBOSE", "1")
    torch.manual_seed(0)
    base = CkptGPT(impl="torch")
    runs = {}
    for name, extra in (("plain", {}),
                        ("cpu", {"activation_checkpointing": {"cpu_checkpointing": True}}),
                        ("nvme", {"zeroshard": {"activation_offload": {"device": "nvme", "nvme_path": str(tmp_path)}}})):
        model = copy.deepcopy(base)
        model.impl = impl if name != "plain" else "torch"
        with caplog.at_level(logging.INFO, logger="zeroshard"):
            caplog.clear()
            if impl == "deepspeed":
                engine = deepspeed.initialize(model=model, config=_engine_config(**extra))[0].zeroshard
            else:
                engine = zeroshard.initialize(model, _engine_config(**extra))
        line = [r.getMessage() for r in caplog.records if "activations:" in r.getMessage()]
        assert len(line) == 1
        for seed in (0, 1):
            idx, tgt = _batch(seed)
            _, loss = engine(idx, tgt)
            if name != "plain":
                tier = {"cpu": "host", "nvme": "nvme"}[name]
                assert engine.memory.by_tier("activations")[tier] == PRESET.n_layer * INPUT_BYTES
                assert engine.memory_stats()["activations"] == PRESET.n_layer * INPUT_BYTES
            engine.backward(loss)
            engine.step()
        runs[name] = {n: p.detach().clone() for n, p in model.named_parameters()}
        if name == "cpu":
            assert "live on the host (activation_checkpointing.cpu_checkpointing)" in line[0]
        if name == "nvme":
            assert "live in files under " + str(tmp_path) in line[0]
            assert _act_files(tmp_path) == []
        engine.close()
        activations.reset()
    for name in ("cpu", "nvme"):
        worst = max((runs["plain"][n] - runs[name][n]).abs().max().item() for n in runs["plain"])
        assert worst <= 1e-6, f"{name}: parameters differ by {worst} after 2 steps"
    assert os.listdir(tmp_path) == []  # the run folder went with the store


def test_deepspeed_configure_checkpoint_in_cpu():
    deepspeed.checkpointing.configure(None, checkpoint_in_cpu=True)
    assert deepspeed.checkpointing.is_configured() and activations.current().tier == "host"
    with pytest.raises(ConfigError, match="model parallelism"):
        deepspeed.checkpointing.configure(object())
    with pytest.raises(ConfigError, match="partition_activations"):
        deepspeed.checkpointing.configure(None, partition_activations=True)
    deepspeed.checkpointing.configure(None, deepspeed_config={"activation_checkpointing": {"cpu_checkpointing": False}},
                                      checkpoint_in_cpu=False)


@pytest.mark.parametrize("cfg,words", [
    ({"zeroshard": {"activation_offload": {"device": "nvme"}}}, "needs a folder"),
    ({"zeroshard": {"activation_offload": {"device": "cpu", "nvme_path": "/x"}}}, 'set device "nvme"'),
    ({"zeroshard": {"activation_offload": {"nvme_path": "/x"}}}, 'add "device": "nvme"'),
    ({"zeroshard": {"activation_offload": {"device": "none"}}, "activation_checkpointing": {"cpu_checkpointing": True}},
     "contradicts activation_checkpointing.cpu_checkpointing"),
    ({"zeroshard": {"activation_offload": {"device": "disk"}}}, "expected 'none', 'cpu' or 'nvme'"),
    ({"zeroshard": {"activation_offload": {"device": "nvme", "nvme_path": "/x", "buffer_count": 1}}}, "at least 2"),
    ({"zeroshard": {"activation_offload": {"device": "nvme", "nvme_path": "/x", "buffer_count": 0}}}, "buffer_count"),
])
def test_config_errors(cfg, words):
    with pytest.raises(ConfigError) as err:
        load_config(cfg, 1)
    assert words in str(err.value)


def test_config_accepts_and_maps():
    assert load_config({"activation_checkpointing": {"cpu_checkpointing": True}}, 1).activations.device == OffloadDevice.CPU
    assert load_config({}, 1).activations.device == OffloadDevice.NONE
    s = load_config({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/nv"}},
                     "zeroshard": {"activation_offload": {"device": "nvme", "buffer_count": 3}}}, 1).activations
    assert (s.device, s.nvme_path, s.buffer_count) == (OffloadDevice.NVME, "/nv", 3)
    assert "offload_param.nvme_path" in s.why


def test_missing_nvme_path_is_one_clear_error(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(NvmeError, match="does not exist"):
        _store("nvme", missing)


def test_estimator_counts_activations_where_they_live():
    shape = ModelShape(params=7_000_000_000, largest_unit=200_000_000, largest_layer=200_000_000, layers=32,
                       hidden=4096, heads=32, vocab=32000, source="test")
    act = activation_bytes(seq=4096, micro_batch=1, hidden=4096, heads=32, layers=32, vocab=32000,
                           checkpointing=True)
    stored = 2 * 4096 * 4096 * 32
    assert act.stored == stored and act.checkpoint_input == stored // 32
    on_device = estimate_memory(shape, Strategy(stage=3, activation_checkpointing=True), 8, activations=act)
    host = estimate_memory(shape, Strategy(stage=3, activation_checkpointing=True, activation_offload="cpu"), 8,
                           activations=act)
    nvme = estimate_memory(shape, Strategy(stage=3, activation_checkpointing=True, activation_offload="nvme",
                                           activation_buffer_count=3), 8, activations=act)
    assert on_device.activations == act.total
    for est in (host, nvme):  # the recomputed layer's input comes back to the device
        assert est.activations == act.total - stored + act.checkpoint_input
    assert host.host_activations == stored and host.host_per_rank - on_device.host_per_rank == stored
    assert nvme.nvme_activations == stored and nvme.nvme_per_rank - on_device.nvme_per_rank == stored
    assert nvme.host_buffers - on_device.host_buffers == 3 * act.checkpoint_input
    with pytest.raises(ConfigError, match="activation checkpointing"):
        Strategy(stage=3, activation_offload="cpu")


def test_stage3_with_offloaded_activations_equals_plain(tmp_path):
    """Stage 3 (blocks are gather units, re-gathered for the recomputation): host + non-reentrant
    and NVMe + reentrant train two SGD steps exactly as plain torch checkpointing."""
    torch.manual_seed(0)
    base = CkptGPT(impl="torch")
    runs = {}
    for name, reentrant in (("plain", True), ("cpu", False), ("nvme", True)):
        model = copy.deepcopy(base)
        model.impl, model.reentrant = ("torch" if name == "plain" else "zeroshard"), reentrant
        cfg = _engine_config(zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0},
                             zeroshard={"stage3_min_unit_params": 1000})
        if name == "cpu":
            cfg["activation_checkpointing"] = {"cpu_checkpointing": True}
        if name == "nvme":
            cfg["zeroshard"]["activation_offload"] = {"device": "nvme", "nvme_path": str(tmp_path)}
        engine = zeroshard.initialize(model, cfg)
        for seed in (0, 1):
            idx, tgt = _batch(seed)
            _, loss = engine(idx, tgt)
            engine.backward(loss)
            engine.step()
        runs[name] = {n: t.clone() for n, t in engine.full_state_dict().items()}
        assert activations.current().packed == (0 if name == "plain" else 2 * PRESET.n_layer)
        engine.close()
        activations.reset()
    for name in ("cpu", "nvme"):
        worst = max((runs["plain"][n] - runs[name][n]).abs().max().item() for n in runs["plain"])
        assert worst <= 1e-6, f"stage 3 {name}: parameters differ by {worst}"
    assert os.listdir(tmp_path) == []
