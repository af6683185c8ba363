"""The docs cannot go stale (issue 29, item 6): every `$ zeroshard estimate|plan ...` shown
in README.md and docs/ is run and its output compared with the page, exactly (these commands
are deterministic; `...` lines on the page stand for output it leaves out). When a change
moves a figure, `python tests/doc_examples.py --update` rewrites the shown output, and the
prose around it is the author's to check."""

from __future__ import annotations

import difflib

import pytest

import doc_examples

EXAMPLES = [ex for ex in doc_examples.examples() if doc_examples.runnable(ex)]


def test_the_pages_show_examples():
    assert len(EXAMPLES) >= 10, [ex.name for ex in EXAMPLES]


@pytest.mark.parametrize("ex", EXAMPLES, ids=[ex.name for ex in EXAMPLES])
def test_a_shown_command_prints_what_the_page_shows(ex):
    fresh = doc_examples.run(ex)
    if not doc_examples.matches(ex.shown, fresh):
        diff = "\n".join(difflib.unified_diff(doc_examples.normalized(ex.shown), fresh, "page", "now", lineterm="", n=1))
        pytest.fail(f"{ex.name}: `zeroshard {' '.join(ex.argv)}` no longer prints what the page shows "
                    f"(python tests/doc_examples.py --update):\n{diff[:4000]}")


def test_the_readme_is_a_front_door_whose_links_resolve():
    import os
    import re

    root = doc_examples.ROOT
    text = open(os.path.join(root, "README.md"), encoding="utf-8").read()
    assert len(text.splitlines()) <= 120
    pages = {"README.md": text}
    for name in os.listdir(os.path.join(root, "docs")):
        if name.endswith(".md"):
            pages[f"docs/{name}"] = open(os.path.join(root, "docs", name), encoding="utf-8").read()
    for page, body in pages.items():
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", body):
            if "://" in target:
                continue
            path = os.path.normpath(os.path.join(root, os.path.dirname(page), target))
            assert os.path.exists(path), f"{page} links to {target}, which does not exist"
