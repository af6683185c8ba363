"""The commands shown in README.md and docs/*.md with their output, so a change that moves a
figure fails a test until the page is updated (tests/test_docs.py).

A shown command is a line `$ zeroshard ...` inside a fenced block (a trailing backslash
continues it); its output is every following line of the block up to the next `$ ` line.
Files a command names (`--hf-config llama-2-7b.json`) are looked up in docs/configs/.

    python tests/doc_examples.py            # list the examples and whether each still matches
    python tests/doc_examples.py --update   # rewrite the shown output from a fresh run
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import sys
import tempfile
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", *sorted(os.path.join("docs", n) for n in os.listdir(os.path.join(ROOT, "docs"))
                             if n.endswith(".md"))]
CONFIGS = os.path.join(ROOT, "docs", "configs")
RUN_IN_PROCESS = ("estimate", "plan")  # deterministic, no ranks: compared exactly


@dataclass
class Example:
    page: str
    line: int  # 1-based line of the `$ ` command
    argv: list[str]
    shown: list[str]  # output lines as written in the page
    span: tuple[int, int]  # 0-based [start, end) of the output lines in the page

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def examples(pages=PAGES) -> list[Example]:
    found = []
    for page in pages:
        lines = open(os.path.join(ROOT, page), encoding="utf-8").read().split("\n")
        in_block, i = False, 0
        while i < len(lines):
            if lines[i].startswith("```"):
                in_block = not in_block
                i += 1
                continue
            if in_block and lines[i].startswith("$ zeroshard "):
                start, command = i, lines[i][2:]
                while command.endswith("\\"):
                    i += 1
                    command = command[:-1] + " " + lines[i].strip()
                j = i + 1
                while j < len(lines) and not lines[j].startswith(("```", "$ ")):
                    j += 1
                argv = shlex.split(command, comments=True)[1:]
                found.append(Example(page, start + 1, argv, lines[i + 1:j], (i + 1, j)))
                i = j
                continue
            i += 1
    return found


def runnable(ex: Example) -> bool:
    return bool(ex.argv) and ex.argv[0] in RUN_IN_PROCESS


def run(ex: Example) -> list[str]:
    """The command's stdout then stderr, as the page would show them (configs by their short name)."""
    from zeroshard.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    here, code = os.getcwd(), 0
    with tempfile.TemporaryDirectory() as tmp:
        for name in os.listdir(CONFIGS):  # the pages name them as if they were here
            os.symlink(os.path.join(CONFIGS, name), os.path.join(tmp, name))
        os.chdir(tmp)  # `--out ds_config.json` lands here
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    code = main(list(ex.argv))
                except SystemExit as exc:
                    code = exc.code
        finally:
            os.chdir(here)
    text = out.getvalue() + err.getvalue()
    lines = [line.rstrip() for line in text.rstrip("\n").split("\n")]
    shows_status = bool(ex.shown) and ex.shown[-1].startswith("(exit ")
    return lines + ([f"(exit {code or 0})"] if code or shows_status else [])  # as the pages show it


def normalized(lines: list[str]) -> list[str]:
    return [line.rstrip() for line in lines]


def _is_cut(line: str) -> bool:
    """A line where the page leaves output out: `...` or `  ... (16 lines cut: ...)`."""
    return line.strip().startswith("...")


def matches(shown: list[str], fresh: list[str]) -> bool:
    """Shown equals fresh line for line, where a cut line stands for any number of lines and
    a shown line that ends in `...` for any line that starts the same way."""
    shown = normalized(shown)

    def match(i: int, j: int) -> bool:
        if i == len(shown):
            return j == len(fresh)
        if _is_cut(shown[i]):
            return any(match(i + 1, k) for k in range(j, len(fresh) + 1))
        if j == len(fresh):
            return False
        line = shown[i]
        same = fresh[j].startswith(line[:-3]) if line.endswith("...") else fresh[j] == line
        return same and match(i + 1, j + 1)

    return match(0, 0)


def update(pages=PAGES) -> int:
    changed = 0
    for page in pages:
        path = os.path.join(ROOT, page)
        lines = open(path, encoding="utf-8").read().split("\n")
        for ex in reversed([e for e in examples([page]) if runnable(e)]):
            fresh = run(ex)
            if not matches(ex.shown, fresh):
                lines[ex.span[0]:ex.span[1]] = fresh
                changed += 1
                print(f"updated {ex.name}: {' '.join(ex.argv)}")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write("\n".join(lines))
    return changed


def main(argv: list[str]) -> int:
    if "--update" in argv:
        print(f"{update()} example(s) rewritten")
        return 0
    for ex in examples():
        state = ("matches" if matches(ex.shown, run(ex)) else "DIFFERS") if runnable(ex) else "not run"
        print(f"{ex.name:32} {state:8} zeroshard {' '.join(ex.argv)}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main(sys.argv[1:]))
