"""The shape of the source tree, read from the AST of src/zeroshard (nothing is imported).

* no module imports a `_private` name (or a `_private` module) from another package;
* no import cycles between files: every import counts, at module level, inside a function
  or under `if TYPE_CHECKING:`, since each is a dependency a reader must follow;
* no file over 400 lines;
* only `comm/` calls `torch.distributed` collectives (DESIGN.md section 2).

Each rule is a pure function of a {module name: source text} map, so the tests below also
run it on small planted trees and see it fail.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import zeroshard

SRC = pathlib.Path(zeroshard.__file__).parent
MAX_LINES = 400
COMM_PACKAGE = "zeroshard.comm"
COLLECTIVES = frozenset({
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_gather_coalesced",
    "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "broadcast",
    "broadcast_object_list", "reduce", "gather", "gather_object", "scatter", "scatter_object_list",
    "barrier", "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv",
    "all_reduce_coalesced", "_all_gather_base", "_reduce_scatter_base",
})


def source_tree(root: pathlib.Path = SRC) -> dict[str, str]:
    """{dotted module name: source} for every .py file under `root` (a package's file is
    its __init__.py)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path.read_text()
    return out


def _is_package(tree: dict[str, str], module: str) -> bool:
    return any(other.startswith(module + ".") for other in tree)


def _package_of(tree: dict[str, str], module: str) -> str:
    return module if _is_package(tree, module) else module.rpartition(".")[0]


def _file_of(tree: dict[str, str], name: str) -> str | None:
    """The file (module) that defines dotted `name`: the longest prefix that is a module."""
    while name and name not in tree:
        name = name.rpartition(".")[0]
    return name or None


def _imports(tree: dict[str, str], module: str) -> list[tuple[str, list[str], int]]:
    """(absolute module, names imported from it ([] for `import x`), line) for every import
    statement of `module`, wherever it stands."""
    out = []
    for node in ast.walk(ast.parse(tree[module])):
        if isinstance(node, ast.Import):
            out += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = _package_of(tree, module)
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            out.append((base, [alias.name for alias in node.names], node.lineno))
    return out


def import_graph(tree: dict[str, str]) -> dict[str, set[str]]:
    """module -> the modules (files) of `tree` it imports. `from pkg import sub` where `sub`
    is a module is an edge to `pkg.sub`, else to `pkg`."""
    graph: dict[str, set[str]] = {m: set() for m in tree}
    for module in tree:
        for base, names, _ in _imports(tree, module):
            targets = [f"{base}.{n}" if f"{base}.{n}" in tree else base for n in names] or [base]
            graph[module] |= {t for t in map(lambda t: _file_of(tree, t), targets) if t and t != module}
    return graph


def import_cycles(tree: dict[str, str]) -> list[list[str]]:
    """The strongly connected components of more than one file (Tarjan), each sorted."""
    graph = import_graph(tree)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_imports(tree: dict[str, str]) -> list[str]:
    """`module:line imports name` for each `_private` name or module a module takes from
    another package of the tree."""
    out = []
    for module in tree:
        own = _package_of(tree, module)
        for base, names, line in _imports(tree, module):
            if _file_of(tree, base) is None:
                continue  # not ours (torch, the standard library)
            for name in [base] + [f"{base}.{n}" for n in names if n != "*"]:
                parts = name.split(".")
                # the first private part, and the package that holds it
                for i, part in enumerate(parts):
                    if _private(part):
                        holder = _package_of(tree, _file_of(tree, ".".join(parts[:i])) or base)
                        if holder != own:
                            out.append(f"{module}:{line} imports {name}")
                        break
    return sorted(set(out))


def long_files(tree: dict[str, str], limit: int = MAX_LINES) -> list[str]:
    return sorted(f"{m}: {len(text.splitlines())} lines" for m, text in tree.items()
                  if len(text.splitlines()) > limit)


def _distributed_names(module_tree: ast.Module) -> tuple[set[str], set[str], set[str]]:
    """Names bound to `torch`, to `torch.distributed` (or a submodule), and to a collective
    imported by name, anywhere in the module."""
    torch_names, dist_names, direct = set(), set(), set()
    for node in ast.walk(module_tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch" or (alias.name.startswith("torch.") and alias.asname is None):
                    torch_names.add(alias.asname or "torch")
                elif alias.name.startswith("torch.distributed"):
                    dist_names.add(alias.asname)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            for alias in node.names:
                bound = alias.asname or alias.name
                if node.module == "torch" and alias.name == "distributed":
                    dist_names.add(bound)
                elif node.module.startswith("torch.distributed"):
                    if alias.name in COLLECTIVES:
                        direct.add(bound)
                    else:
                        dist_names.add(bound)  # a submodule (distributed_c10d, ...) or harmless
    return torch_names, dist_names, direct


def _dotted(node: ast.expr) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id] + parts[::-1]


def collective_calls(tree: dict[str, str], allowed: str = COMM_PACKAGE) -> list[str]:
    """`module:line calls name` for each torch.distributed collective called outside `allowed`."""
    out = []
    for module, text in tree.items():
        if module == allowed or module.startswith(allowed + "."):
            continue
        parsed = ast.parse(text)
        torch_names, dist_names, direct = _distributed_names(parsed)
        for node in ast.walk(parsed):
            if not isinstance(node, ast.Call):
                continue
            path = _dotted(node.func)
            if not path:
                continue
            hit = (len(path) == 1 and path[0] in direct) or (
                path[-1] in COLLECTIVES and len(path) >= 2 and (
                    path[0] in dist_names
                    or (path[0] in torch_names and len(path) >= 3 and path[1] == "distributed")))
            if hit:
                out.append(f"{module}:{node.lineno} calls {'.'.join(path)}")
    return sorted(out)


# --- the rules on the real tree -------------------------------------------------------

def test_no_module_imports_a_private_name_from_another_package():
    found = private_imports(source_tree())
    assert not found, "\n".join(found)


def test_no_import_cycles_between_files():
    found = import_cycles(source_tree())
    assert not found, "\n".join(" <-> ".join(c) for c in found)


def test_no_file_over_400_lines():
    found = long_files(source_tree())
    assert not found, "\n".join(found)


def test_only_comm_calls_torch_distributed_collectives():
    found = collective_calls(source_tree())
    assert not found, "\n".join(found)


# --- each rule sees a planted violation ----------------------------------------------

def _plant(**files: str) -> dict[str, str]:
    return {name.replace("__", "."): text for name, text in files.items()}


def test_the_private_rule_sees_names_and_modules_from_other_packages_only():
    tree = _plant(z="", z__a="", z__a__m="_hidden = 1\n_n = 2\n", z__a___impl="x = 1\n",
                  z__b="", z__b__user="from z.a.m import _hidden\n",
                  z__b__user2="import z.a._impl\n",
                  z__b__user3="from z.a import _impl\n",
                  z__a__friend="from z.a.m import _n\nfrom z.a import _impl\n",
                  z__b__fine="from z.a.m import __doc__\nfrom z.a import m\n")
    assert private_imports(tree) == ["z.b.user2:1 imports z.a._impl", "z.b.user3:1 imports z.a._impl",
                                     "z.b.user:1 imports z.a.m._hidden"]


def test_the_cycle_rule_sees_function_level_type_checking_and_relative_imports():
    tree = _plant(z="", z__p="", z__p__a="from z.p.b import f\n",
                  z__p__b="def g():\n    from . import c\n",
                  z__p__c="from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import z.p.a\n",
                  z__p__d="from z.p import a\n")
    assert import_cycles(tree) == [["z.p.a", "z.p.b", "z.p.c"]]
    del tree["z.p.c"]
    assert import_cycles(tree) == []


def test_the_cycle_rule_sees_a_package_and_its_own_module():
    tree = _plant(z="", z__q="from z.q.m import thing\n", z__q__m="from z.q import other\n")
    assert import_cycles(tree) == [["z.q", "z.q.m"]]


def test_the_length_rule_counts_lines():
    tree = {"z.ok": "x = 1\n" * MAX_LINES, "z.long": "x = 1\n" * (MAX_LINES + 1)}
    assert long_files(tree) == [f"z.long: {MAX_LINES + 1} lines"]


@pytest.mark.parametrize("text", [
    "import torch.distributed as dist\ndist.all_reduce(t)\n",
    "import torch\ntorch.distributed.all_gather_into_tensor(a, b)\n",
    "from torch import distributed as d\nd.broadcast(t, 0)\n",
    "from torch.distributed import reduce_scatter_tensor as rs\nrs(a, b)\n",
    "import torch.distributed\ntorch.distributed.barrier()\n",
    "from torch.distributed import distributed_c10d\ndistributed_c10d.all_to_all_single(a, b)\n",
])
def test_the_collective_rule_sees_each_spelling(text):
    tree = {"z": "", "z.comm": "", "z.comm.ok": text, "z.stages": "", "z.stages.bad": text}
    assert collective_calls(tree, allowed="z.comm") == [f"z.stages.bad:2 calls {text.splitlines()[1].split('(')[0]}"]


def test_the_collective_rule_leaves_other_calls_alone():
    text = ("import torch.distributed as dist\nimport torch\n"
            "dist.get_rank()\ndist.is_initialized()\ntorch.cat([a])\nx.all_reduce(t)\ncomm.all_gather(a, b)\n")
    assert collective_calls({"z": "", "z.stages": "", "z.stages.fine": text}, allowed="z.comm") == []
