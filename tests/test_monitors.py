"""DeepSpeed's monitors (issue 45): `csv_monitor`, `tensorboard`, `wandb` and `comet` (offline) sections
turn on writers on rank 0; a 20-step run on 2 ranks writes files that each writer's own reader
parses back (the csv module, TensorBoard's EventAccumulator, W&B's offline run file, Comet's
offline archive), and the
events equal what the engine saw: rank 0's loss averaged over the accumulation window, the lr,
the bytes each collective sent in the step (the traffic ledger) and the memory ledger, keyed by
samples seen. A section enabled without its library: one error when the config loads, and
`zeroshard train` exits 2 with one line before any rank starts."""

from __future__ import annotations

import csv
import glob
import os
import subprocess
import sys

import pytest

from distributed import run_ranks
from oracle import Case, batch, config_for, loss_of, make_model

STEPS, GAS = 20, 2
CASE = Case(model="gpt", stage=3, optimizer="adamw", gas=GAS, steps=STEPS)


def _config(out: str, world: int, sections: tuple[str, ...]) -> dict:
    cfg = config_for(CASE, world)
    cfg["wall_clock_breakdown"] = True
    for name in sections:
        cfg[name] = {"enabled": True, "output_path": out, "job_name": "job"}
    if "wandb" in sections:
        cfg["wandb"] = {"enabled": True, "project": "zs-test"}
    if "comet" in sections:  # every 16 samples: each other step (8 samples a step)
        cfg["comet"] = {"enabled": True, "project": "zs-test", "online": False, "samples_log_interval": 16}
    return cfg


def _train(rank: int, world: int, out: str, sections: tuple[str, ...]) -> dict:
    """20 optimizer steps of 2 micro-steps; what the engine saw at each step."""
    import zeroshard

    os.environ.update(WANDB_MODE="offline", WANDB_DIR=out, WANDB_SILENT="true", COMET_OFFLINE_DIRECTORY=out)
    engine = zeroshard.initialize(make_model(CASE), _config(out, world, sections))
    seen = []
    lo, hi = rank * 2, (rank + 1) * 2  # oracle.MICRO samples per rank
    sent_before: dict[str, int] = {}
    for step in range(STEPS):
        losses = []
        for m in range(GAS):
            x, y = batch(CASE, step * GAS + m, world)
            loss = loss_of(engine, x[lo:hi], y[lo:hi])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        sent = {op: s["sent_bytes"] for op, s in engine.comm_stats().items()}
        seen.append({"samples": engine.global_steps * engine.settings.batch.train_batch_size,
                     "train_loss": sum(losses) / len(losses), "lr": engine.get_lr()[0],
                     "sent": {op: b - sent_before.get(op, 0) for op, b in sent.items() if b != sent_before.get(op, 0)},
                     "memory": engine.memory_stats()})
        sent_before = sent
    engine.close()
    return {"seen": seen, "monitors": bool(engine.monitors.writers) or rank == 0}


def _check(seen: list[dict], series: dict[str, dict[int, float]], rel: float) -> None:
    """`series`: event name (without Train/Samples/) -> {samples: value}, as a writer's reader
    returned them."""
    steps = [s["samples"] for s in seen]
    assert steps == [(i + 1) * 2 * 2 * GAS for i in range(STEPS)]  # batch 8: micro 2 x gas 2 x 2 ranks
    for name, key in (("train_loss", "train_loss"), ("lr", "lr")):
        assert sorted(series[name]) == steps, name
        for s in seen:
            assert series[name][s["samples"]] == pytest.approx(s[key], rel=rel, abs=1e-12), (name, s["samples"])
    for s in seen:
        for op, sent in s["sent"].items():
            assert series[f"comm_sent_bytes/{op}"][s["samples"]] == sent, op
        for category in ("params", "optimizer_states", "peak_grads"):
            assert series[f"memory_bytes/{category}"][s["samples"]] == s["memory"][category], category
    assert any("all_gather" in name for name in series) and any("reduce_scatter" in name for name in series)
    for phase in ("forward", "backward", "step"):
        assert sorted(series[f"elapsed_time_ms_{phase}"]) == steps and all(
            v > 0 for v in series[f"elapsed_time_ms_{phase}"].values())
    reduce = series["elapsed_time_ms_backward_allreduce"]  # the step's reduce-scatter seconds, from the ledger
    assert sorted(reduce) == steps and all(v > 0 for v in reduce.values())
    assert "loss_scale" not in series  # fp32: DeepSpeed logs the loss scale under fp16 only


def _csv_series(folder: str) -> dict[str, dict[int, float]]:
    out = {}
    for path in glob.glob(os.path.join(folder, "*.csv")):
        name = os.path.basename(path)[: -len(".csv")]
        assert name.startswith("Train_Samples_"), name
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
        assert rows[0][0] == "step"  # DeepSpeed's header: step, the event name's last part
        out[name[len("Train_Samples_"):].replace("comm_sent_bytes_", "comm_sent_bytes/").replace(
            "memory_bytes_", "memory_bytes/")] = {int(r[0]): float(r[1]) for r in rows[1:]}
    return out


def test_csv_and_tensorboard_write_what_the_engine_saw(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = str(tmp_path)
    results = run_ranks(_train, 2, out, ("csv_monitor", "tensorboard"), timeout=300)
    seen = results[0]["seen"]
    _check(seen, _csv_series(os.path.join(out, "job")), rel=0)  # CSV holds Python's repr: exact

    acc = EventAccumulator(os.path.join(out, "job"), size_guidance={"scalars": 0})
    acc.Reload()
    prefix = "Train/Samples/"
    series = {tag[len(prefix):]: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    assert all(tag.startswith(prefix) for tag in acc.Tags()["scalars"])
    _check(seen, series, rel=1e-6)  # TensorBoard stores float32 (the tiny model's byte counts are exact in it)
    assert len(os.listdir(out)) == 1  # rank 1 wrote nothing


def _wandb_records(path: str):
    """The records of a W&B run file: LevelDB's log format (32 KiB blocks of records with a
    7-byte header: crc32, length, type FULL/FIRST/MIDDLE/LAST) after a 7-byte ':W&B' header, as
    W&B's datastore writes it (W&B 0.31 reads it from its Go core only)."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", data[:7]
    pos, block, parts = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0:
            break
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            yield parts


def test_wandb_offline_run_holds_the_events(tmp_path):
    pytest.importorskip("wandb")
    from wandb.proto import wandb_internal_pb2

    out = str(tmp_path)
    seen = run_ranks(_train, 2, out, ("wandb",), timeout=300)[0]["seen"]
    runs = glob.glob(os.path.join(out, "wandb", "offline-run-*", "run-*.wandb"))
    assert len(runs) == 1, runs  # one run: rank 0's
    series: dict[str, dict[int, float]] = {}
    for data in _wandb_records(runs[0]):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): i.value_json for i in record.history.item}
            step = int(items.pop("_step"))
            for key, value in items.items():
                if key.startswith("Train/Samples/"):
                    series.setdefault(key[len("Train/Samples/"):], {})[step] = float(value)
    _check(seen, series, rel=1e-12)


def test_comet_offline_experiment_holds_every_other_step(tmp_path):
    """comet (online: false) writes an offline experiment archive; its messages.json (what
    `comet upload` sends) holds each event at the samples_log_interval DeepSpeed's CometMonitor
    keeps: 16 samples, so every other step of 8."""
    pytest.importorskip("comet_ml")
    import json
    import zipfile

    out = str(tmp_path)
    seen = run_ranks(_train, 2, out, ("comet",), timeout=300)[0]["seen"]
    archives = glob.glob(os.path.join(out, "*.zip"))
    assert len(archives) == 1, archives  # rank 0's experiment only
    series: dict[str, dict[int, float]] = {}
    with zipfile.ZipFile(archives[0]) as z:
        for line in z.read("messages.json").decode().splitlines():
            msg = json.loads(line)
            metric = msg["payload"].get("metric") if msg.get("type") == "metric_msg" else None
            if metric and metric["metricName"].startswith("Train/Samples/"):
                series.setdefault(metric["metricName"][len("Train/Samples/"):], {})[metric["step"]] = \
                    float(metric["metricValue"])
    kept = seen[::2]  # samples 8, 24, 40, ...: 16 or more since the event was last sent
    assert sorted(series["train_loss"]) == [s["samples"] for s in kept]
    for s in kept:
        assert series["train_loss"][s["samples"]] == pytest.approx(s["train_loss"], rel=1e-12)
        assert series["lr"][s["samples"]] == pytest.approx(s["lr"], rel=1e-12)


def test_a_monitor_without_its_library_is_one_error_before_any_rank(tmp_path, monkeypatch):
    import json

    from zeroshard.config import load_config
    from zeroshard.policies import ConfigError
    from zeroshard.policies import MONITOR_LIBRARIES

    monkeypatch.setitem(MONITOR_LIBRARIES, "comet", ("zeroshard_no_such_module", "comet_ml"))
    with pytest.raises(ConfigError, match=r"comet\.enabled is true but the 'comet_ml' package is not installed"):
        load_config({"train_micro_batch_size_per_gpu": 1, "comet": {"enabled": True}}, 1)
    monkeypatch.undo()

    # the CLI, in a fresh process: a library that cannot be there (a module name no package has)
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "tensorboard": {"enabled": True}}))
    probe = ("import sys, zeroshard.policies.settings as s; s.MONITOR_LIBRARIES['tensorboard'] = "
             "('zeroshard_no_such_module', 'tensorboard'); from zeroshard.cli.main import main; "
             "sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", probe, "train", "--model", "tiny", "--steps", "2", "--config",
                           str(cfg)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "pip install tensorboard" in lines[0], proc.stderr
    assert "rank" not in proc.stdout.lower() and "step" not in proc.stdout.lower(), proc.stdout


def test_zeroshard_train_flags_turn_the_monitors_on(tmp_path):
    """`zeroshard train --tensorboard DIR --csv DIR`: the main job's curves, one row per step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    proc = subprocess.run([sys.executable, "-m", "zeroshard.cli.main", "train", "--model", "tiny", "--seq-len", "16",
                           "--steps", "12", "--report", "", "--tensorboard", "tb", "--csv", "csv"],
                          capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / "csv" / "zeroshard_train" / "Train_Samples_train_loss.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "train_loss"] and [int(r[0]) for r in rows[1:]] == [16 * (i + 1) for i in range(12)]
    acc = EventAccumulator(str(tmp_path / "tb" / "zeroshard_train"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"Train/Samples/train_loss", "Train/Samples/lr", "Train/Samples/comm_sent_bytes/all_gather",
            "Train/Samples/memory_bytes/params"} <= set(tags)
    assert [e.step for e in acc.Scalars("Train/Samples/train_loss")] == [16 * (i + 1) for i in range(12)]


def test_wall_clock_breakdown_prints_milliseconds_per_step(caplog):
    """wall_clock_breakdown: every steps_per_print steps, forward / backward / reduce / step
    milliseconds per step over those steps (not totals since the start)."""
    import logging

    import zeroshard

    cfg = {**config_for(CASE.with_(stage=2, gas=1), 1), "wall_clock_breakdown": True, "steps_per_print": 2}
    engine = zeroshard.initialize(make_model(CASE), cfg)
    with caplog.at_level(logging.INFO, logger="zeroshard"):
        for step in range(6):
            x, y = batch(CASE, step, 1)
            engine.backward(loss_of(engine, x[:2], y[:2]))
            engine.step()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("time per step (ms")]
    assert len(lines) == 3, lines
    totals, summed = engine.timers(), {"forward": 0.0, "step": 0.0}
    for line in lines:
        ms = {k: float(v) for k, v in (part.split() for part in line.split(": ", 1)[1].split(", "))}
        assert set(ms) == {"forward", "backward", "reduce", "step"} and ms["forward"] > 0 and ms["step"] > 0
        for k in summed:
            summed[k] += 2 * ms[k]
    for k in summed:  # means over each 2 steps add up to the whole run's time (printed to 0.1 ms)
        assert summed[k] == pytest.approx(totals[k] * 1000, abs=0.4), (k, summed[k], totals[k])
    engine.close()
