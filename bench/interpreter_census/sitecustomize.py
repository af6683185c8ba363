"""Every Python interpreter the test suite starts, with its CPU and what it imported: put this
folder first on PYTHONPATH and each interpreter (a `zeroshard train` rank, a torchrun agent, a
CLI call, pytest and its workers) appends one line at its exit to $CENSUS_LOG (default
/tmp/interpreter_census.tsv):

    CENSUS_LOG=/tmp/census.tsv PYTHONPATH=bench/interpreter_census python -m pytest -q -p no:cacheprovider
    python bench/interpreter_census/summary.py /tmp/census.tsv

Fields: pid, parent pid, wall s, CPU s (user + system, this process's own), the test that
started it ($PYTEST_CURRENT_TEST, inherited), the heavy modules it imported, its command line.
Processes forked without exec (the forkserver's ranks) and processes killed by a signal write
nothing. A benchmark's instrument, not part of zeroshard.
"""

import atexit
import os
import sys
import time

_START = time.time()
_HEAVY = ("torch", "torch._dynamo", "transformers", "trl", "accelerate", "peft", "deepspeed", "zeroshard")


def _report() -> None:
    try:
        t = os.times()
        modules = ",".join(m for m in _HEAVY if m in sys.modules)
        test = os.environ.get("PYTEST_CURRENT_TEST", "")[:200]
        argv = " ".join(sys.argv)[:200].replace("\t", " ").replace("\n", " ")
        line = f"{os.getpid()}\t{os.getppid()}\t{time.time() - _START:.2f}\t{t.user + t.system:.2f}\t{test}\t{modules}\t{argv}\n"
        with open(os.environ.get("CENSUS_LOG", "/tmp/interpreter_census.tsv"), "a") as fh:
            fh.write(line)
    except Exception:  # an instrument never changes how the process exits
        pass


atexit.register(_report)  # registered first, so it runs last: the CPU of every other exit handler counted
