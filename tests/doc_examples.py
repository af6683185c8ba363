"""The commands shown in README.md and docs/*.md with their output, so a change that moves a
figure fails a test until the page is updated (tests/test_docs.py).

A shown command is a line `$ zeroshard ...` inside a fenced block (a trailing backslash
continues it); its output is every following line of the block up to the next `$ ` line.
Files a command names (`--hf-config llama-2-7b.json`, `examples/...`) are looked up in
docs/configs/ and the repository. A page's commands run in order in one scratch folder.

HTML comments on a page, invisible when it is rendered, prepare the next command shown:

    <!-- doc-test: setup zeroshard train --model mini --steps 5 --save ckpt -->   (a shell command, run once)
    <!-- doc-test: slow -->          (a long block: its commands run by `pytest -m slow` only)

Figures are compared exactly, except (stated tolerances):
- a number followed by a unit of time or rate (`s`, `ms`, `tokens/s`, `tok/s`, `it/s`) is a
  timing: it matches any value within a factor of 4 either way (machines differ that much);
- a number written `~N` on the page matches within 5 % (e.g. a loss over the embedded corpus,
  which is the installed Python's own standard library, so it moves a little between builds);
- a line that ends in `...` matches any line that starts the same way; a line that is only
  `...` (or `... (16 lines cut)`) stands for any number of lines.

    python tests/doc_examples.py            # list the examples and whether each still matches
    python tests/doc_examples.py --update   # rewrite the shown output from a fresh run
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", *sorted(os.path.join("docs", n) for n in os.listdir(os.path.join(ROOT, "docs"))
                             if n.endswith(".md"))]
CONFIGS = os.path.join(ROOT, "docs", "configs")
RUN_IN_PROCESS = ("estimate", "plan", "inspect", "export")  # no ranks: run inside this process
RUN_AS_PROCESS = ("train",)  # starts ranks: run as the user would, `zeroshard ...`
DIRECTIVE = re.compile(r"<!--\s*doc-test:\s*(setup|slow)\b\s*(.*?)\s*-->")
COMMAND_TIMEOUT_S = 900


@dataclass
class Example:
    page: str
    line: int  # 1-based line of the `$ ` command
    argv: list[str]
    shown: list[str]  # output lines as written in the page
    span: tuple[int, int]  # 0-based [start, end) of the output lines in the page
    setup: list[str] = field(default_factory=list)  # shell commands the page runs before this one
    slow: bool = False

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def examples(pages=PAGES) -> list[Example]:
    found = []
    for page in pages:
        lines = open(os.path.join(ROOT, page), encoding="utf-8").read().split("\n")
        in_block, i, setup, slow = False, 0, [], False
        while i < len(lines):
            if lines[i].startswith("```"):
                in_block = not in_block
                if not in_block:
                    slow = False  # `slow` marks every command of the block it precedes
                i += 1
                continue
            directive = None if in_block else DIRECTIVE.search(lines[i])
            if directive:
                if directive.group(1) == "setup":
                    setup.append(directive.group(2))
                else:
                    slow = True
            if in_block and lines[i].startswith("$ zeroshard "):
                start, command = i, lines[i][2:]
                while command.endswith("\\"):
                    i += 1
                    command = command[:-1] + " " + lines[i].strip()
                j = i + 1
                while j < len(lines) and not lines[j].startswith(("```", "$ ")):
                    j += 1
                argv = shlex.split(command, comments=True)[1:]
                end = j
                while end > i + 1 and not lines[end - 1].strip():  # blank lines between two commands
                    end -= 1
                found.append(Example(page, start + 1, argv, lines[i + 1:end], (i + 1, end), setup, slow))
                setup = []
                i = j
                continue
            i += 1
    return found


def runnable(ex: Example) -> bool:
    return bool(ex.argv) and ex.argv[0] in RUN_IN_PROCESS + RUN_AS_PROCESS


class _Scratch:
    """One scratch folder per page; a page's setups run there once, in page order."""

    def __init__(self):
        self.dirs: dict[str, str] = {}
        self.done: set[tuple[str, int, int]] = set()

    def folder(self, page: str) -> str:
        if page not in self.dirs:
            tmp = tempfile.mkdtemp(prefix="zeroshard-docs-")
            for name in os.listdir(CONFIGS):  # the pages name them as if they were here
                os.symlink(os.path.join(CONFIGS, name), os.path.join(tmp, name))
            os.symlink(os.path.join(ROOT, "examples"), os.path.join(tmp, "examples"))
            self.dirs[page] = tmp
        return self.dirs[page]

    def prepare(self, ex: Example) -> str:
        """The page's folder with every setup up to and including `ex`'s run."""
        folder = self.folder(ex.page)
        for earlier in examples([ex.page]):
            if earlier.line > ex.line:
                break
            for k, command in enumerate(earlier.setup):
                if (ex.page, earlier.line, k) in self.done:
                    continue
                done = subprocess.run(command, shell=True, cwd=folder, capture_output=True, text=True,
                                      timeout=COMMAND_TIMEOUT_S, env=_env())
                if done.returncode != 0:
                    raise RuntimeError(f"{ex.page}:{earlier.line}: setup `{command}` exited {done.returncode}:\n"
                                       f"{(done.stdout + done.stderr)[-3000:]}")
                self.done.add((ex.page, earlier.line, k))
        return folder

    def clean(self):
        for folder in self.dirs.values():
            shutil.rmtree(folder, ignore_errors=True)
        self.dirs.clear()
        self.done.clear()


SCRATCH = _Scratch()


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.join(ROOT, "src"), env.get("PYTHONPATH")) if p)
    return env


def _in_process(argv: list[str], folder: str) -> tuple[str, int]:
    from zeroshard.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    here, code = os.getcwd(), 0
    os.chdir(folder)  # `--out ds_config.json` lands here
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(argv))
            except SystemExit as exc:
                code = exc.code
    finally:
        os.chdir(here)
    return out.getvalue() + err.getvalue(), code


def _as_process(argv: list[str], folder: str) -> tuple[str, int]:
    command = [sys.executable, "-m", "zeroshard.cli.main", *argv]
    done = subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, env=_env())
    return done.stdout + done.stderr, done.returncode


def run(ex: Example) -> list[str]:
    """The command's stdout then stderr, as the page would show them (configs by their short name)."""
    folder = SCRATCH.prepare(ex)
    runner = _in_process if ex.argv[0] in RUN_IN_PROCESS else _as_process
    text, code = runner(ex.argv, folder)
    lines = [line.rstrip() for line in text.rstrip("\n").split("\n")]
    shows_status = bool(ex.shown) and ex.shown[-1].startswith("(exit ")
    return lines + ([f"(exit {code or 0})"] if code or shows_status else [])  # as the pages show it


def normalized(lines: list[str]) -> list[str]:
    return [line.rstrip() for line in lines]


def _is_cut(line: str) -> bool:
    """A line where the page leaves output out: `...` or `  ... (16 lines cut: ...)`."""
    return line.strip().startswith("...")


NUMBER = re.compile(r"(~?)(-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?)")
TIMING_UNIT = re.compile(r"^ ?(?:s|ms|tokens/s|tok/s|it/s|s/step)\b")
APPROX_REL = 0.05  # `~N` on a page
TIMING_FACTOR = 4.0  # a timing on a page


def _text(part: str) -> str:
    """Text between numbers, with column padding and table rules of any width made equal."""
    return re.sub(r"([─━═])[─━═]*", r"\1", re.sub(r"\s+", " ", part))


def _value(number: str) -> float:
    return float(number.replace(",", ""))


def line_matches(shown: str, fresh: str) -> bool:
    """One shown line against one fresh line, with the tolerances in this module's docstring."""
    if shown.endswith("..."):
        return fresh.startswith(shown[:-3])
    if shown == fresh:
        return True
    a, b = NUMBER.split(shown), NUMBER.split(fresh)  # text, tilde, number, text, tilde, number, ...
    if len(a) != len(b):
        return False
    for k in range(0, len(a), 3):
        if _text(a[k]) != _text(b[k]):
            return False
        if k + 2 >= len(a):
            break
        tilde, want, got = a[k + 1], a[k + 2], b[k + 2]
        if b[k + 1]:  # the fresh output has a `~` of its own: compare it as text
            return False
        if TIMING_UNIT.match(a[k + 3]):
            lo, hi = sorted((abs(_value(want)), abs(_value(got))))
            if hi > TIMING_FACTOR * max(lo, 1e-12):
                return False
        elif tilde:
            if abs(_value(got) - _value(want)) > APPROX_REL * abs(_value(want)):
                return False
        elif want != got:
            return False
    return True


def matches(shown: list[str], fresh: list[str]) -> bool:
    """Shown equals fresh line for line (`line_matches`), where a cut line stands for any
    number of lines."""
    shown = normalized(shown)

    def match(i: int, j: int) -> bool:
        if i == len(shown):
            return j == len(fresh)
        if _is_cut(shown[i]):
            return any(match(i + 1, k) for k in range(j, len(fresh) + 1))
        if j == len(fresh):
            return False
        return line_matches(shown[i], fresh[j]) and match(i + 1, j + 1)

    return match(0, 0)


def update(pages=PAGES) -> int:
    """Rewrite the output of every example that no longer matches (in page order, since a
    page's commands share one folder); `~` marks and cut lines are the author's to put back."""
    changed = 0
    for page in pages:
        path = os.path.join(ROOT, page)
        lines = open(path, encoding="utf-8").read().split("\n")
        stale = [(ex, fresh) for ex in examples([page]) if runnable(ex)
                 for fresh in [run(ex)] if not matches(ex.shown, fresh)]
        for ex, fresh in reversed(stale):
            lines[ex.span[0]:ex.span[1]] = fresh
            changed += 1
            print(f"updated {ex.name}: {' '.join(ex.argv)}")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write("\n".join(lines))
    return changed


def main(argv: list[str]) -> int:
    if "--update" in argv:
        try:
            print(f"{update()} example(s) rewritten")
        finally:
            SCRATCH.clean()
        return 0
    try:
        for ex in examples():
            state = ("matches" if matches(ex.shown, run(ex)) else "DIFFERS") if runnable(ex) else "not run"
            print(f"{ex.name:32} {state:8} zeroshard {' '.join(ex.argv)}")
    finally:
        SCRATCH.clean()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main(sys.argv[1:]))
