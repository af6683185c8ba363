"""bench/gpu_check.py (issue 25): the CPU form runs in the default suite, the CUDA form where a GPU is.

The CPU form (`--device cpu --quick`) is the same script, sections and verdicts as the CUDA one on
tiny models: a 1-rank gloo process (the CUDA form's NCCL rank) and 2 gloo ranks, spawned by the
script with a timeout. It must exit 0 with every section's rows present and none failed. The
verdict functions are also fed wrong answers here (a state dict off by 1e-4 of its largest entry,
an AdamW run with most entries off, a bf16 drift over 3 %), and the profile parser a synthetic
CUDA trace, so the parts that only run on a GPU have their logic checked on the CPU too.
No timings are asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import gpu_check  # noqa: E402

pytestmark = pytest.mark.timeout(900)  # two spawned forms; a minute or more on a shared 2-core machine

SECTIONS_1 = {"oracle", "nccl", "offload", "nvme", "actoffload", "memory", "speed", "compile", "zeropp"}


def _run(tmp_path, device: str, *extra: str, timeout: float = 840):
    out = tmp_path / f"gpu_check-{device}.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--device", device,
                           "--json", str(out), "--nvme-dir", str(tmp_path / "nvme"), *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    data = json.loads(out.read_text()) if out.exists() else None
    return proc, data


def _check_report(proc, data):
    assert data is not None, f"no JSON written\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    failed = [f"{r['section']} / {r['name']} ({r['form']}): {r['value']} {r['detail']}"
              for r in data["rows"] if r["verdict"] == "FAIL"]
    assert not failed and proc.returncode == 0, "\n".join(failed) + "\n" + proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "section" in proc.stdout and "pass," in proc.stdout  # the table was printed
    rows = data["rows"]
    one = [r for r in rows if r["form"].startswith("1 rank")]
    two = [r for r in rows if r["form"].startswith("2 ranks")]
    assert {r["section"] for r in one} == SECTIONS_1
    assert {r["section"] for r in two} == {"oracle", "gloo", "zeropp"}
    return rows, one, two


def test_cpu_form_passes_with_every_section(tmp_path):
    proc, data = _run(tmp_path, "cpu", "--quick")
    rows, one, two = _check_report(proc, data)
    oracle1 = {r["name"] for r in one if r["section"] == "oracle"}
    assert {f"gpt z{s} fp32 sgd" for s in range(4)} <= oracle1
    assert {"gpt z2 fp32 adamw", "gpt z3 bf16 sgd", "llama z3 fp32 sgd"} <= oracle1
    assert {r["name"] for r in two if r["section"] == "oracle"} == {"gpt z2 fp32 sgd", "gpt z3 fp32 sgd"}
    assert [r["name"] for r in two if r["section"] == "zeropp"] == ["gpt z3 qwZ+qgZ sgd"]  # needs peers
    # on CPU every collective zeroshard calls works under gloo (on CUDA some are reported unsupported)
    gloo = [r for r in two if r["section"] == "gloo"]
    assert len(gloo) == 7 and all(r["verdict"] == "PASS" for r in gloo)
    speed = {r["name"]: r for r in one if r["section"] == "speed"}
    assert {n for n, r in speed.items() if r["verdict"] == "PASS"} == {"ddp", "fsdp2", "zs2", "zs3"}
    assert speed["deepspeed"]["verdict"] == "SKIP"
    compiled = {r["name"]: r for r in one if r["section"] == "compile"}
    assert set(compiled) == {"zs3 eager", "zs3 + compile (aot_eager)"}
    assert compiled["zs3 + compile (aot_eager)"]["verdict"] == "PASS"
    assert "shown, not judged" in compiled["zs3 + compile (aot_eager)"]["detail"]
    # on CPU the copy profile's trace is exported and parsed, and holds no copies
    profiles = [r for r in one if r["name"].endswith("copy profile")]
    assert len(profiles) == 2 and all(r["verdict"] == "PASS" and r["value"] == "0 copies" for r in profiles)
    assert {r["name"] for r in rows if r["verdict"] == "SKIP"} == {"deepspeed", "Handle.wait does not block the host"}
    assert all(r["form"].endswith("on cpu") or r["section"] == "gloo" for r in rows)
    assert data["env"]["device"] == "cpu" and data["env"]["quick"] is True


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(50, 20, generator=g), "b": torch.randn(30, generator=g)}


def test_verdicts_fail_on_wrong_answers():
    init, ref = _state(0), _state(1)
    assert gpu_check.judge({k: v.clone() for k, v in ref.items()}, init, ref, "sgd", "fp32")[0] == "PASS"
    off = {k: v.clone() for k, v in ref.items()}
    off["b"][3] += 1e-4 * float(ref["b"].abs().max())  # one entry off by 1e-4 of the largest
    assert gpu_check.judge(off, init, ref, "sgd", "fp32")[0] == "FAIL"
    noisy = {k: v * (1 + 1e-2) for k, v in ref.items()}  # AdamW: every entry 1 % off
    assert gpu_check.judge(noisy, init, ref, "adamw", "fp32")[0] == "FAIL"
    few = {k: v.clone() for k, v in ref.items()}
    few["a"].view(-1)[:10] *= 1.01  # 10 of 1,030 entries: within the 2 % rule
    assert gpu_check.judge(few, init, ref, "adamw", "fp32")[0] == "PASS"
    drift = {k: ref[k] + 0.05 * (ref[k] - init[k]) for k in ref}  # bf16: 5 % of the distance moved
    assert gpu_check.judge(drift, init, ref, "sgd", "bf16")[0] == "FAIL"
    nan = {k: v.clone() for k, v in ref.items()}
    nan["a"][0, 0] = float("nan")
    assert gpu_check.judge(nan, init, ref, "sgd", "bf16")[0] == "FAIL"


def test_compile_verdict_fails_a_recompile_a_break_and_a_slower_compiled_step():
    eager = {"losses": [2.0, 1.9], "median": 0.10}
    good = {"losses": [2.001, 1.9], "median": 0.08, "graphs_first": 4, "graphs_end": 4, "breaks": 0, "noted": {}}
    assert gpu_check.compile_verdict(good, eager, True, judged_speed=True)[0] == "PASS"
    for bad in ({"graphs_end": 6}, {"breaks": 1}, {"noted": {"h.0": "a print"}}, {"graphs_first": 0, "graphs_end": 0},
                {"losses": [2.1, 1.9]}, {"losses": [2.0, float("nan")]}, {"median": 0.11}):
        assert gpu_check.compile_verdict({**good, **bad}, eager, True, judged_speed=True)[0] == "FAIL", bad
    slower = {**good, "median": 0.11}
    assert gpu_check.compile_verdict(slower, eager, True, judged_speed=False)[0] == "PASS"  # a CPU: shown
    assert gpu_check.compile_verdict({**good, "breaks": 2}, eager, False, judged_speed=True)[0] == "PASS"  # plain


def _trace(copy_stream):
    """A chrome trace as torch.profiler writes it on CUDA: kernels on stream 7, copies elsewhere."""
    return [
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 100, "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 120, "dur": 30, "args": {"stream": 7}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 50, "dur": 100,
         "args": {"stream": copy_stream}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 200, "dur": 10,
         "args": {"stream": 7}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500},
    ]


def test_copy_profile_counts_hidden_and_exposed_and_needs_the_side_stream():
    s = gpu_check.copy_overlap(_trace(copy_stream=20))
    # DtoH 50..150 on stream 20: kernels of stream 7 cover 50..100 and 120..150 (80 us hidden);
    # the HtoD on stream 7 itself overlaps nothing of another stream (10 us exposed)
    assert s["events"] == 5 and s["copies"] == 2 and s["compute_stream"] == 7
    assert (s["hidden_us"], s["exposed_us"]) == (80.0, 30.0)
    assert s["by_kind"]["DtoH"] == {"count": 1, "us": 100.0, "streams": ["20"], "pageable": 0}
    ctx = {"form": "1 rank nccl"}
    cuda = torch.device("cuda", 0)
    assert gpu_check.profile_row("z2 optimizer cpu", ctx, cuda, {"summary": s}, True)["verdict"] == "PASS"
    same = gpu_check.copy_overlap(_trace(copy_stream=7))  # gradient copies on the compute stream: no overlap
    assert same["hidden_us"] == 0.0
    assert gpu_check.profile_row("z2 optimizer cpu", ctx, cuda, {"summary": same}, True)["verdict"] == "FAIL"
    assert gpu_check.profile_row("z3 param cpu", ctx, cuda, {"summary": same}, False)["verdict"] == "PASS"
    assert gpu_check.profile_row("x", ctx, cuda, {}, True)["verdict"] == "FAIL"  # no trace is a failure
    pageable = _trace(copy_stream=20)
    pageable[2]["name"] = "Memcpy DtoH (Device -> Pageable)"  # the host buffer was not pinned
    summary = gpu_check.copy_overlap(pageable)
    assert gpu_check.profile_row("z2 optimizer cpu", ctx, cuda, {"summary": summary}, True)["verdict"] == "FAIL"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA form needs a GPU")
def test_cuda_form(tmp_path):
    proc, data = _run(tmp_path, "cuda", timeout=900)
    rows, one, two = _check_report(proc, data)
    assert all("nccl" in r["form"] for r in one)
    assert any(r["form"].endswith("on cuda:0") for r in one if r["section"] == "oracle")
    print(proc.stdout)  # the table, for bench/RESULTS.md


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the CUDA form runs instead")
def test_cuda_form_without_a_gpu_is_one_line_and_exit_2(tmp_path):
    proc, data = _run(tmp_path, "cuda", timeout=300)
    assert proc.returncode == 2 and data is None
    assert "torch.cuda.is_available() is False" in proc.stderr and "--device cpu" in proc.stderr
