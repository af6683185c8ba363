"""Planted bugs the default test run must catch (issue 28): a kept list, and the runner.

Each mutant is one small textual edit to one line of src/ (file, old text, new text), a
one-line reason (what a user would see), and the test files most likely to catch it. The
runner never touches the repository's own src/: it extracts a commit (`git archive`, HEAD by
default) into a scratch folder, and for each mutant

  1. asserts the old text occurs exactly once in its file (a stale mutant is reported as
     STALE, never silently skipped),
  2. writes the mutated file, runs `python -m pytest -q -x -n 0 <its test files>` (one test at a time) in the scratch
     folder with PYTHONPATH=<scratch>/src (so the copy shadows the editable install) under
     the default markers (`not slow`, from pyproject.toml),
  3. restores the file (and checks it is byte-identical again),
  4. checks that every process that imported zeroshard imported the scratch copy: a
     sitecustomize on PYTHONPATH records `zeroshard.__spec__.origin` of every Python process
     (pytest, multiprocessing-spawned ranks, torchrun's workers, CLI subprocesses); a run in
     which any process imported another copy is reported as SHADOW-FAIL, not as a result,
  5. records caught (pytest failed) / missed (pytest passed) and the seconds it took.

It prints a markdown table. A benchmark, not a CI job: run it on a quiet machine, one mutant
at a time; `nice -n 10 python bench/mutants.py` for the whole list, `--only NAME[,NAME]` for some,
`--apply NAME --scratch DIR` to leave one mutated copy for a look by hand, `--list` for the list.
Its latest table goes in bench/RESULTS.md with the commit it ran on.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Mutant:
    name: str
    area: str
    file: str  # relative to src/zeroshard/
    old: str  # must occur exactly once in the file
    new: str
    reason: str  # the bug, in a line
    tests: tuple[str, ...]  # test files (or node ids) that should catch it


S = "stages/"
O = "optim/"
C = "comm/"
F = "offload/"
K = "checkpoint/"
G = "config/"
D = "deepspeed/"
L = "cli/"

MUTANTS: list[Mutant] = [
    # ---------------------------------------------------------------- stages
    Mutant("stage0-not-averaged", "stages (0-2)", "policies/settings.py",
           "        return (1.0, 1.0, True) if collective_can_average else (1.0 / n, 1.0, False)",
           "        return (1.0, 1.0, False)",
           "stage 0 (all-reduce) sums gradients over ranks instead of averaging",
           ("tests/test_stages_oracle.py",)),
    Mutant("qgz-sums", "stages (qgZ)", S + "gradients.py",
           "return not self.use_all_reduce and self.reducer is None",
           "return not self.use_all_reduce",
           "qgZ gradients summed over ranks, not averaged (issue 28 miss 1)",
           ("tests/test_zeropp.py",)),
    Mutant("stage3-evicts-in-use", "stages (stage 3)", S + "stage3.py",
           "if unit.users == 0 and unit.state is not UnitState.RELEASED:",
           "if unit.state is not UnitState.RELEASED:",
           "stage 3 max_live_parameters evicts a unit still in use: re-gathered, order re-recorded (issue 28 miss 3)",
           ("tests/test_stage3_ledgers.py",)),
    Mutant("stage3-reuse-ignores-cap", "stages (stage 3)", S + "stage3.py",
           "                return distance < self.policy.max_reuse_distance and \\\n",
           "                return distance <= self.policy.max_reuse_distance and \\\n",
           "stage 3 keeps a unit at reuse distance 0 (max_reuse_distance 0 no longer releases): 2 x Phi gathers become fewer",
           ("tests/test_stage3_ledgers.py",)),
    Mutant("stage3-linear-saves-view", "stages (stage 3)", S + "outside_reads.py",
           "        if func is F.linear and self.runtime.policy.memory_efficient_linear:",
           "        if False:",
           "stage 3 keeps torch's linear: its saved weight views hold every released unit's full buffer until backward",
           ("tests/test_zero_linear.py",)),
    Mutant("stage3-linear-backward-not-gathered", "stages (stage 3)", S + "zero_linear.py",
           "        ctx.gathered(weight)",
           "        pass",
           "stage 3's linear reads a weight released early (max_live_parameters) in backward: NaN/placeholder values",
           ("tests/test_zero_linear.py",)),
    # ---------------------------------------------------------------- optim
    Mutant("clip-ignored", "optim (sharded step)", O + "sharded.py",
           "self.masters[b].grad = g.mul_(scale) if scale != 1.0 else g",
           "self.masters[b].grad = g",
           "fp32 gradients stepped without the clip coefficient (gradient_clipping has no effect)",
           ("tests/test_stages_oracle.py",)),
    Mutant("norm-not-all-reduced", "optim (clipping)", O + "clipping.py",
           "    if partitioned and comm.world_size > 1:",
           "    if False and partitioned and comm.world_size > 1:",
           "global gradient norm is this rank's shard's (no all-reduce): clipping and overflow per rank (issue 28 weak spot)",
           ("tests/test_oracle_sharp.py",)),
    Mutant("scaler-never-halves", "optim (fp16 loss scale)", O + "loss_scaler.py",
           "self.scale = max(self.scale / 2.0, self.min_loss_scale)",
           "self.scale = max(self.scale, self.min_loss_scale)",
           "fp16 dynamic loss scale never halves after hysteresis runs out",
           ("tests/test_oracle_sharp.py",)),
    Mutant("scheduler-steps-on-skip", "optim (lr schedule)", "api/engine.py",
           "        self.loss_scaler.update(overflow)\n",
           "        self.loss_scaler.update(overflow); overflow and self.lr_scheduler and self.lr_scheduler.step()\n",
           "the LR scheduler also steps on fp16 steps skipped for overflow (issue 28 weak spot)",
           ("tests/test_precision.py",)),
    Mutant("nvme-swap-slots-overlap", "optim (NVMe swap)", O + "nvme_swap.py",
           "            if not self.swapped[b]:\n",
           "            if not self.swapped[b] or (offset := 0):  # offset restarts at every bucket\n",
           "NVMe swap: every bucket of a sub-group starts at offset 0 of the buffer, so they overlap (issue 28 miss 2)",
           ("tests/test_nvme.py",)),
    # ---------------------------------------------------------------- comm: plain, qwZ, hpZ, qgZ
    Mutant("rs-direct-wrong-own-chunk", "comm (plain)", C + "direct.py",
           "                if c == me:",
           "                if c == 0:",
           "gloo reduce-scatter keeps chunk 0 of the gradient on every rank instead of chunk r on rank r",
           ("tests/test_stages_oracle.py",)),
    Mutant("rs-pieces-no-average", "comm (plain)", C + "direct.py",
           "                if average:\n                    out.mul_(scale)",
           "                if average:\n                    out.mul_(1.0)",
           "gloo reduce-scatter with average=True returns the sum (stages 1-3 gradients N x too large)",
           ("tests/test_stages_oracle.py",)),
    Mutant("rs-pieces-accumulate-own-only", "comm (plain)", C + "direct.py",
           "                    for term in [part] + [got[at : at + part.numel()] for got in received]:",
           "                    for term in [part]:",
           "stages 2-3 with gradient accumulation add only their own gradient on a window's later micro-steps",
           ("tests/test_stages_oracle.py",)),
    Mutant("cma-sent-tensors-not-kept", "comm (intra-host)", C + "cma.py",
           "            keep += [*tensors, desc, ack,",
           "            keep += [desc, ack,",
           "intra-host transfers do not keep what they send alive until the peer copied it: a freed buffer is read",
           ("tests/test_cma.py",)),
    Mutant("cma-abandoned-freed", "comm (intra-host)", C + "cma.py",
           "                self._channel._submit(_Abandoned(keep, self._ack_recvs))",
           "                keep.clear()",
           "a collective a rank leaves early (a stop signal out of wait()) frees what it sent: a peer copies reused memory",
           ("tests/test_cma.py",)),
    Mutant("cma-no-size-check", "comm (intra-host)", C + "cma.py",
           "            if [n for _, n in sizes] != [t.nbytes for t in tensors]:",
           "            if False:",
           "a peer's message of other sizes than the receiver posted is copied anyway (reads past what was sent)",
           ("tests/test_cma.py",)),
    Mutant("ledger-ring-bytes", "comm (ledger)", C + "ledger.py",
           "    return (world_size - 1) * nbytes // world_size\n",
           "    return nbytes\n",
           "the ledger counts a whole tensor as sent per all-gather / reduce-scatter, not (N-1)/N of it",
           ("tests/test_zeropp.py",)),
    Mutant("qwz-int4", "comm (qwZ)", C + "zeropp.py",
           "    bits = QWZ_BITS\n",
           "    bits = 4\n",
           "qwZ sends int4 weights, not int8 (twice the rounding, half the payload)",
           ("tests/test_zeropp.py",)),
    Mutant("quant-scale-off", "comm (qwZ/qgZ quantizer)", C + "quantization.py",
           "    scales.div_(qmax)\n",
           "    scales.div_(qmax + 1)\n",
           "block scale absmax / (qmax + 1): the block's largest values are clamped",
           # the torch path: on CPU the C kernel serves the collectives, the torch path is its reference
           ("tests/test_quantize.py", "tests/test_quantize_native.py", "tests/test_zeropp.py")),
    Mutant("qgz-chunk-order", "comm (qgZ)", C + "zeropp.py",
           "parts = input.reshape(nodes, local, s).transpose(0, 1).reshape(local, nodes * s)",
           "parts = input.reshape(local, nodes * s)",
           "qgZ hop 1 sends chunks in node-major order: rank r ends with another rank's chunk",
           ("tests/test_zeropp.py",)),
    Mutant("hpz-wrong-secondary", "comm (hpZ)", "partition/unit_bucket.py",
           "self.secondary = full[index * size : (index + 1) * size].clone()",
           "self.secondary = full[:size].clone()",
           "hpZ keeps slice 0 as every rank's secondary: the backward gathers wrong parameters",
           ("tests/test_zeropp.py",)),
    # ---------------------------------------------------------------- offload: host, NVMe, activations
    Mutant("host-tier-is-device", "offload (host)", F + "tiers.py",
           "        return HostTier(policy.pin_memory)",
           "        return DeviceTier(device)",
           "offload_*.device cpu silently keeps the shards on the device tier",
           ("tests/test_offload.py",)),
    Mutant("nvme-regions-overlap", "offload (NVMe)", F + "nvme.py",
           "            self._end += region.nbytes\n",
           "            self._end += region.nbytes // 2\n",
           "NVMe tier allocates each region half its size past the last: regions overlap in the file",
           ("tests/test_nvme.py",)),
    Mutant("nvme-read-ahead-stale", "offload (NVMe params)", F + "read_ahead.py",
           "            out = buf[:nbytes].view(home.dtype).view(home.shape).clone()",
           "            out = buf[:nbytes].view(home.dtype).view(home.shape)",
           "NVMe parameter read-ahead hands out its buffer itself, which the next read-ahead overwrites",
           ("tests/test_nvme.py",)),
    Mutant("act-files-collide", "offload (activations)", F + "activations.py",
           'entry.path = self.io.open(f"act-{entry.seq:08d}.bin")',
           'entry.path = self.io.open(f"act-{entry.seq % 2:08d}.bin")',
           "activation offload to NVMe reuses two file names: later segments overwrite earlier ones",
           ("tests/test_activation_offload.py",)),
    Mutant("act-no-read-ahead", "offload (activations)", F + "activations.py",
           "ahead, seq = self.policy.buffer_count - 1, entry.seq",
           "ahead, seq = 0, entry.seq",
           "activation offload reads nothing ahead in backward (a speed bug: its hit/miss counters see it)",
           ("tests/test_activation_offload.py",)),
    # ---------------------------------------------------------------- checkpoint: save, load, reshard, export
    Mutant("ckpt-no-sha-check", "checkpoint (load)", K + "reader.py",
           'if hash_it and sha256_of(path) != info["sha256"]:',
           'if False and hash_it and sha256_of(path) != info["sha256"]:',
           "an altered rank file loads: its sha256 is never compared with meta.json's",
           ("tests/test_checkpoint_errors.py",)),
    Mutant("ckpt-steps-not-restored", "checkpoint (load)", K + "load.py",
           "                setattr(ts.counters, counter, int(reader.meta[counter]))",
           '                setattr(ts.counters, counter, 0 if counter == "global_steps" else int(reader.meta[counter]))',
           "load_checkpoint leaves global_steps at 0 (the LR schedule and tags restart)",
           ("tests/test_checkpoint_resume.py",)),
    Mutant("reshard-wrong-offset", "checkpoint (reshard)", K + "load.py",
           "target[a - lo : b - lo].copy_(reader.read(slot.name, field, a - slot.offset, b - slot.offset))",
           "target[a - lo : b - lo].copy_(reader.read(slot.name, field, a - lo, b - lo))",
           "resharding reads a parameter's elements relative to the shard's start, not the parameter's",
           ("tests/test_checkpoint_resume.py",)),
    Mutant("save-wrong-step", "checkpoint (save)", K + "save.py",
           '"global_steps": ts.counters.global_steps, "micro_steps": ts.counters.micro_steps,',
           '"global_steps": ts.counters.global_steps + 1, "micro_steps": ts.counters.micro_steps,',
           "meta.json records one global step more than was taken",
           ("tests/test_checkpoint_resume.py",)),
    Mutant("export-ignores-dtype", "checkpoint (export)", K + "export.py",
           "out = target if saved.is_floating_point else saved",
           "out = saved",
           "zeroshard export --dtype bf16 writes the saved fp32 tensors",
           ("tests/test_checkpoint_export.py",)),
    Mutant("export-index-one-file", "checkpoint (export)", K + "export.py",
           '"weight_map": {e.key: name for name, group in zip(names, groups) for e in group}}',
           '"weight_map": {e.key: names[0] for name, group in zip(names, groups) for e in group}}',
           "the sharded export's index maps every tensor to the first file",
           ("tests/test_checkpoint_export.py",)),
    # ---------------------------------------------------------------- config
    Mutant("batch-check-one-sided", "config (batch)", G + "batch.py",
           "        if tbs != micro * gas * world:",
           "        if tbs < micro * gas * world:",
           "a train_batch_size larger than micro x accumulation x ranks is accepted",
           ("tests/test_config.py",)),
    Mutant("fp16-hysteresis-dropped", "config (fp16)", G + "build.py",
           "scale = _same_named(LossScalePolicy, config.fp16, static_scale=config.fp16.loss_scale)",
           "scale = _same_named(LossScalePolicy, config.fp16, static_scale=config.fp16.loss_scale, hysteresis=1)",
           "fp16.hysteresis from the config is ignored (1: the scale halves at the first overflow)",
           ("tests/test_oracle_sharp.py",)),
    Mutant("fp16-and-bf16-accepted", "config (precision)", G + "build.py",
           "    if fp16 and bf16:",
           "    if False:",
           "fp16 and bf16 both enabled is accepted (fp16 wins silently)",
           ("tests/test_config.py",)),
    # ---------------------------------------------------------------- the DeepSpeed drop-in
    Mutant("ds-step-applied-mid-accumulation", "deepspeed drop-in", D + "engine.py",
           "applied = boundary and engine.skipped_steps == skipped",
           "applied = engine.skipped_steps == skipped",
           "was_step_applied() is true after a step() inside gradient accumulation",
           ("tests/test_deepspeed_dropin.py::test_engine_accessors_and_was_step_applied",)),
    Mutant("ds-global-samples", "deepspeed drop-in", D + "engine.py",
           "return self.zeroshard.global_steps * self.zeroshard.train_batch_size()",
           "return self.zeroshard.global_steps * self.zeroshard.train_micro_batch_size_per_gpu()",
           "engine.global_samples counts micro-batches, not global batches",
           ("tests/test_deepspeed_dropin.py::test_engine_accessors_and_was_step_applied",)),
    # ---------------------------------------------------------------- the CLI's error paths
    Mutant("cli-export-exit-1", "cli (errors)", L + "export_cmd.py",
           '        print(f"zeroshard export: {exc}", file=sys.stderr)\n        return 2',
           '        print(f"zeroshard export: {exc}", file=sys.stderr)\n        return 1',
           "zeroshard export exits 1, not 2, on a bad checkpoint directory",
           ("tests/test_checkpoint_export.py::test_cli_errors_are_one_line_exit_2",)),
    Mutant("cli-inspect-error-to-stdout", "cli (errors)", L + "inspect_cmd.py",
           'print(f"zeroshard inspect: {exc}", file=sys.stderr)',
           'print(f"zeroshard inspect: {exc}")',
           "zeroshard inspect prints its error on stdout, not stderr",
           ("tests/test_checkpoint_export.py::test_cli_errors_are_one_line_exit_2",)),
    Mutant("cli-estimate-exit-1", "cli (errors)", L + "estimate_cmd.py",
           "            return 2\n    return run",
           "            return 1\n    return run",
           "zeroshard estimate/plan exit 1, not 2, on bad input (replaces an equivalent mutant: narrowing the "
           "except to ZeroShardError changes nothing, ConfigError is a ValueError and no input raises a plain one)",
           ("tests/test_cli_estimate.py",)),
    # ---------------------------------------------------------------- the 1-bit optimizers (issue 42)
    Mutant("onebit-no-error-feedback", "comm (1-bit)", C + "onebit.py",
           "        x = torch.cat([flat, flat.new_zeros(1)])[self.src].add_(self.worker_error)",
           "        self.reset_errors()\n        x = torch.cat([flat, flat.new_zeros(1)])[self.src].add_(self.worker_error)",
           "the 1-bit all-reduce drops its worker and server error feedback", ("tests/test_onebit.py",)),
    Mutant("onebit-full-allreduce-after-freeze", "optim (1-bit)", O + "onebit.py",
           "        return self.steps_done < self.freeze_step",
           "        return True",
           "OneBitAdam keeps stage 0's full gradient all-reduce after freeze_step", ("tests/test_onebit.py",)),
    Mutant("onebit-any-stage", "config (1-bit)", G + "support.py",
           "    if config.stage != 0:",
           "    if False:",
           "the 1-bit optimizers load at ZeRO stages 1-3, which DeepSpeed refuses", ("tests/test_onebit.py",)),
    Mutant("zeroone-sync-keeps-local-steps", "optim (1-bit)", O + "zeroone.py",
           "            p.sub_(u)\n",
           "            pass\n",
           "0/1 Adam's synchronisation does not undo the ranks' local steps", ("tests/test_onebit.py",)),
    Mutant("onebit-lamb-scale-per-tensor", "optim (1-bit)", O + "onebit_lamb.py",
           "    one_scale = True",
           "    one_scale = False",
           "1-bit Lamb exchanges with a scale per tensor, not one over its flat momentum", ("tests/test_onebit.py",)),
    Mutant("onebit-lamb-no-factor", "optim (1-bit)", O + "onebit_lamb.py",
           '            state["last_factor"][k] = factor\n',
           '            state["last_factor"][k] = factor\n            factor = 1.0\n',
           "1-bit Lamb's frozen trust ratio is not corrected by the fresh variance", ("tests/test_onebit.py",)),
]

SHADOW_PROBE = '''\
"""Written by bench/mutants.py: record which zeroshard every Python process imports."""
import os, sys


class _ZeroshardWitness:
    def find_spec(self, fullname, path=None, target=None):
        if fullname != "zeroshard":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                with open(os.path.join(os.environ["ZEROSHARD_WITNESS_DIR"], f"{os.getpid()}.txt"), "a") as f:
                    f.write(f"{spec.origin}\\t{' '.join(sys.argv)[:200]}\\n")
                return spec
        return None


if os.environ.get("ZEROSHARD_WITNESS_DIR"):
    sys.meta_path.insert(0, _ZeroshardWitness())
'''


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", REPO, *args], check=True, capture_output=True, text=True).stdout.strip()


def make_scratch(commit: str, root: str | None) -> str:
    """The commit's tree in a scratch folder (never the repository's working tree)."""
    scratch = root or tempfile.mkdtemp(prefix="zeroshard-mutants-")
    os.makedirs(scratch, exist_ok=True)
    archive = subprocess.run(["git", "-C", REPO, "archive", "--format=tar", commit], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", scratch], input=archive.stdout, check=True)
    probe = os.path.join(scratch, "_witness")
    os.makedirs(probe, exist_ok=True)
    with open(os.path.join(probe, "sitecustomize.py"), "w") as f:
        f.write(SHADOW_PROBE)
    return scratch


def apply(scratch: str, m: Mutant) -> tuple[str, str]:
    """Write the mutant into the scratch copy; return (path, original text). Raises on a stale one."""
    path = os.path.join(scratch, "src", "zeroshard", m.file)
    with open(path) as f:
        original = f.read()
    count = original.count(m.old)
    if count != 1:
        raise LookupError(f"{m.name}: old text occurs {count} times in src/zeroshard/{m.file} (stale mutant)")
    with open(path, "w") as f:
        f.write(original.replace(m.old, m.new))
    return path, original


def restore(path: str, original: str) -> None:
    with open(path, "w") as f:
        f.write(original)
    with open(path) as f:
        assert f.read() == original, f"{path} not restored"


def witness_env(scratch: str, witness: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                             "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(scratch, "_witness"), os.path.join(scratch, "src"),
                                         *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    env["ZEROSHARD_WITNESS_DIR"] = witness
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # no .pyc of a mutated file outlives its run
    return env


def read_witness(witness: str, scratch: str) -> tuple[int, list[str]]:
    """(processes that imported zeroshard, the origins that were not the scratch copy)."""
    want = os.path.realpath(os.path.join(scratch, "src", "zeroshard"))
    procs, foreign = 0, []
    for name in os.listdir(witness):
        with open(os.path.join(witness, name)) as f:
            for line in f:
                origin, argv = line.rstrip("\n").split("\t", 1)
                procs += 1
                if not os.path.realpath(origin).startswith(want + os.sep):
                    foreign.append(f"{origin} ({argv})")
    return procs, foreign


def run_tests(scratch: str, tests: tuple[str, ...], timeout: float, extra: list[str]) -> dict:
    witness = tempfile.mkdtemp(prefix="witness-", dir=scratch)
    # -n 0: one test at a time (the default run takes two files at once, pytest-xdist), so -x
    # stops at the first failure and the exit code is pytest's own (xdist's stop after -x is 2)
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider", *extra, *tests]
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=scratch, env=witness_env(scratch, witness), capture_output=True, text=True,
                              timeout=timeout)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out = -1, f"timed out after {timeout:.0f}s\n{exc.stdout or ''}"
    seconds = time.perf_counter() - started
    procs, foreign = read_witness(witness, scratch)
    shutil.rmtree(witness, ignore_errors=True)
    tail = [line for line in out.splitlines() if line.strip()]
    # pytest's closing line ("1 failed, 3 passed in 9.1s"), not a plugin's warning printed after it
    summary = next((line for line in reversed(tail) if re.search(r"\d+ (passed|failed|errors?|skipped|deselected)|no tests ran", line)),
                   tail[-1] if tail else "")
    return {"rc": rc, "seconds": seconds, "procs": procs, "foreign": foreign, "summary": summary,
            "first_failure": next((line for line in tail if line.startswith(("FAILED", "ERROR"))), ""), "out": out}


def run_one(scratch: str, m: Mutant, timeout: float, extra: list[str]) -> dict:
    try:
        path, original = apply(scratch, m)
    except LookupError as exc:
        return {"name": m.name, "verdict": "STALE", "seconds": 0.0, "detail": str(exc)}
    try:
        r = run_tests(scratch, m.tests, timeout, extra)
    finally:
        restore(path, original)
    if r["foreign"] or not r["procs"]:
        verdict = "SHADOW-FAIL"
        detail = f"{len(r['foreign'])} of {r['procs']} processes imported another zeroshard: {r['foreign'][:2]}"
    elif r["rc"] == -1:
        verdict, detail = "TIMEOUT", r["summary"]
    elif r["rc"] == 0:
        verdict, detail = "missed", r["summary"]
    elif r["rc"] == 1 or (r["rc"] == 2 and "error" in r["summary"]):  # 2: a collection error (import broke)
        verdict, detail = "caught", r["first_failure"] or r["summary"]
    else:  # killed by a signal (< 0), interrupted, pytest's own error, no tests collected: no verdict
        verdict, detail = "ERROR", f"pytest exit {r['rc']}: {r['summary']} (rerun it)"
    return {"name": m.name, "verdict": verdict, "seconds": r["seconds"], "procs": r["procs"], "detail": detail,
            "out": r["out"]}


def table(results: list[dict]) -> str:
    by_name = {m.name: m for m in MUTANTS}
    lines = ["| # | mutant | area | file | verdict | s | tests run | what failed / reason |",
             "|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(results, 1):
        m = by_name[r["name"]]
        detail = r["detail"].replace("|", "\\|")[:160]
        tests = ", ".join(t.replace("tests/", "") for t in m.tests)
        lines.append(f"| {i} | `{m.name}` | {m.area} | {m.file} | {r['verdict']} | {r['seconds']:.0f} | {tests} | "
                     f"{m.reason}; **{detail}** |")
    caught = sum(r["verdict"] == "caught" for r in results)
    lines.append("")
    lines.append(f"{caught} of {len(results)} caught ({100 * caught / max(1, len(results)):.0f} %), "
                 f"{sum(r['seconds'] for r in results):.0f} s in all.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--commit", default="HEAD", help="the commit to extract (default HEAD)")
    ap.add_argument("--only", default="", help="comma-separated mutant names")
    ap.add_argument("--skip", default="", help="comma-separated mutant names to leave out")
    ap.add_argument("--list", action="store_true", help="print the mutants and exit")
    ap.add_argument("--check", action="store_true",
                    help="only check that every mutant's old text occurs exactly once at the commit")
    ap.add_argument("--clean", action="store_true", help="also run each distinct test set on the unmutated copy")
    ap.add_argument("--apply", metavar="NAME", help="leave the scratch copy with mutant NAME applied, run nothing")
    ap.add_argument("--scratch", help="scratch folder (default: a new temporary one, removed at the end)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per mutant's pytest run")
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--pytest-args", default="", help="extra pytest arguments, as a shell would split them "
                    "(e.g. \"-k 'cap_below or sub3000'\" to run only the tests that should catch the mutants)")
    args = ap.parse_args(argv)

    names = [n for n in args.only.split(",") if n]
    unknown = set(names) - {m.name for m in MUTANTS}
    if unknown:
        ap.error(f"unknown mutants: {sorted(unknown)}")
    skip = {n for n in args.skip.split(",") if n}
    chosen = [m for m in MUTANTS if (not names or m.name in names) and m.name not in skip]
    assert len({m.name for m in MUTANTS}) == len(MUTANTS), "duplicate mutant names"
    if args.list:
        for m in chosen:
            print(f"{m.name:28} {m.area:26} {m.file:28} {m.reason}")
        print(f"{len(chosen)} mutants")
        return 0

    commit = git("rev-parse", args.commit)
    scratch = make_scratch(commit, args.scratch)
    keep = bool(args.scratch) or bool(args.apply)
    try:
        if args.apply:
            (m,) = [m for m in MUTANTS if m.name == args.apply]
            apply(scratch, m)
            print(f"{scratch}: {m.name} applied to src/zeroshard/{m.file}; run with PYTHONPATH={scratch}/src")
            return 0
        stale = []
        for m in chosen:
            try:
                restore(*apply(scratch, m))
            except LookupError as exc:
                stale.append(str(exc))
        if args.check or stale:
            print("\n".join(stale) or f"all {len(chosen)} mutants apply at {commit[:10]}")
            return 1 if stale else 0
        extra = shlex.split(args.pytest_args)
        print(f"commit {commit}, scratch {scratch}, {len(chosen)} mutants", flush=True)
        if args.clean:
            for tests in sorted({m.tests for m in chosen}):
                r = run_tests(scratch, tests, args.timeout, extra)
                print(f"clean {' '.join(tests)}: rc {r['rc']}, {r['seconds']:.0f} s, {r['procs']} processes "
                      f"imported the scratch copy, foreign {r['foreign'][:2]}: {r['summary']}", flush=True)
        results = []
        for m in chosen:
            r = run_one(scratch, m, args.timeout, extra)
            results.append(r)
            print(f"{m.name}: {r['verdict']} in {r['seconds']:.0f} s ({r.get('procs', 0)} processes imported "
                  f"the scratch copy): {r['detail'][:200]}", flush=True)
            if r["verdict"] not in ("caught",):
                tail = r.get("out", "")[-3000:]
                print(tail, flush=True)
        print()
        print(f"Commit `{commit}`; `{shlex.join(['python', 'bench/mutants.py', *(argv or sys.argv[1:])])}`\n")
        print(table(results))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"commit": commit, "results": [{k: v for k, v in r.items() if k != "out"} for r in results]},
                          f, indent=1)
        return 0 if all(r["verdict"] == "caught" for r in results) else 1
    finally:
        if not keep:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
