"""`zeroshard estimate` and `zeroshard plan`: output, JSON, --out, and bad input (exit 2,
one clear line, no traceback). The parser is built here from the commands' `register`, so
the tests do not depend on the other sub-commands."""

import argparse
import json

import pytest

from zeroshard.cli import estimate_cmd, plan_cmd


def run(argv):
    parser = argparse.ArgumentParser(prog="zeroshard")
    sub = parser.add_subparsers(dest="command")
    estimate_cmd.register(sub)
    plan_cmd.register(sub)
    args = parser.parse_args(argv)
    return args.func(args)


def test_estimate_table(capsys):
    assert run(["estimate", "--params", "7B", "--gpus-per-node", "8"]) == 0
    out = capsys.readouterr().out
    for text in ("stage 0", "stage 3 qwZ+qgZ", "opt→cpu", "reduce_scatter", "2.00 Φ", "3.00 Φ", "not sharded"):
        assert text in out


def test_estimate_json_bytes_are_integers(capsys):
    assert run(["estimate", "--params", "7.5B", "--nodes", "8", "--gpus-per-node", "8", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    by_label = {c["label"]: c for c in d["candidates"]}
    s1 = by_label["stage 1"]["memory"]
    assert isinstance(s1["model_states"], int)
    assert s1["model_states"] == 30_000_000_000 + 1_406_250_000  # paper Table 1, stage 1
    # 3 and 2 x Phi, plus the 1-element gradient-norm all-reduce (2 paper units)
    assert by_label["stage 3"]["comm"]["totals"]["paper_elements"] == 3 * 7_500_000_000 + 2
    assert by_label["stage 2"]["comm"]["totals"]["paper_elements"] == 2 * 7_500_000_000 + 2
    assert by_label["stage 2"]["comm"]["paper_units_of_params"] == pytest.approx(2.0, abs=1e-6)
    assert by_label["stage 3"]["comm"]["totals"]["inter_bytes"] > 0


def test_plan_writes_deepspeed_config(tmp_path, capsys):
    out = tmp_path / "ds.json"
    assert run(["plan", "--params", "13B", "--gpus-per-node", "8", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    stage = int(text.split("recommended: stage ")[1][0])
    assert stage in (2, 3) and "decision route" in text  # 13B on 8 x 80 GB: stage 0/1 do not fit
    cfg = json.loads(out.read_text())
    assert cfg["zero_optimization"]["stage"] == stage and cfg["train_micro_batch_size_per_gpu"] == 1


def test_plan_json(capsys):
    assert run(["plan", "--params", "7B", "--gpu", "rtx4090", "--cpu-mem", "128GiB", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["winner"]["offload_optimizer"] == "cpu" and d["deepspeed_config"]["zero_optimization"]["stage"] >= 1


@pytest.mark.filterwarnings("ignore:enable_nested_tensor")
def test_hf_config_and_callable_sources(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12,
                               "vocab_size": 50257, "n_positions": 1024}))
    assert run(["estimate", "--hf-config", str(cfg), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["params"] == 124_439_808
    assert run(["estimate", "--model", "torch.nn:Transformer", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["params"] == 44_140_544


@pytest.mark.parametrize("argv,message", [
    (["estimate", "--params", "7B", "--gpu", "tpu-v9"], "unknown GPU 'tpu-v9'; known: v100-32gb, a100-40gb"),
    (["estimate", "--params=-7B"], "must not be negative"),
    (["plan", "--params", "7B", "--gpu-mem=-24GB"], "must not be negative"),
    (["estimate", "--params", "7B", "--nodes", "0"], "nodes must be >= 1"),
    (["estimate", "--params", "7B", "--inter-node", "carrier-pigeon"], "known: ib-ndr-8x"),
    (["plan", "--params", "70B", "--gpu", "rtx4090", "--cpu-mem", "64GiB"],
     "fits nowhere on 1 x 1 rtx4090; the smallest cluster that fits is"),
])
def test_bad_input_exit_2_without_traceback(argv, message, capsys):
    assert run(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_not_a_model_config(tmp_path, capsys):
    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps({"train_batch_size": 8, "zero_optimization": {"stage": 3}}))
    assert run(["estimate", "--hf-config", str(ds)]) == 2
    assert "not a Hugging Face model config" in capsys.readouterr().err


def test_cli_surface_is_frozen():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    estimate_cmd.register(sub)
    plan_cmd.register(sub)
    opts = {name: sorted(o for a in p._actions for o in a.option_strings if o.startswith("--"))
            for name, p in sub.choices.items()}
    common = ["--activation-checkpointing", "--cpu-mem", "--flops", "--gpu", "--gpu-mem", "--gpus-per-node",
              "--grad-accum", "--heads", "--help", "--hf-config", "--hidden", "--inter-node", "--inter-node-bw",
              "--json", "--layers", "--micro-batch", "--model", "--no-flash-attention", "--nodes", "--nvme",
              "--optimizer", "--optimizer-bytes", "--params", "--precision", "--seq-len", "--vocab",
              "--lora", "--lora-targets", "--trainable-params",  # issue 14: adapters on a frozen base
              "--cpu-only", "--grads-to-host"]  # issue 10: the offload model
    common = sorted(common)
    assert opts["estimate"] == sorted(common + ["--offload-ratio"])
    assert opts["plan"] == sorted(common + ["--out", "--nvme-path"])
