"""The import rules of docs/architecture.md, read from the code.

Every ``kvpass/**/*.py`` is parsed with ``ast`` (nothing is imported); each ``import`` of a kvpass module,
at the top of a file or inside a function, is an edge ``module -> module`` (``from kvpass.kernels import
quest`` is an edge to ``kvpass.kernels.quest``). Imports under ``if TYPE_CHECKING:`` are annotations, not
dependencies at run time, and are left out. The rules:

- the library (every layer below the tools) imports no tool;
- no module imports a layer above its own, except the edges of :data:`UPWARD`, each with its reason;
- no import circle among kvpass modules (but through an edge of :data:`UPWARD`);
- kvpass imports inside functions only where :data:`IN_FUNCTION` says why (an optional dependency, a
  side effect kept off ``import kvpass``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvpass"

#: Low to high; a module may import its own layer and those below. A module is in the layer of the
#: longest prefix that names it ("kvpass" alone: the package's own __init__).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # the kernels and the leaves; lowering/dispatch.py picks a kernel's device path (Triton on CUDA, the
    # torch reference elsewhere) and is what the runtime calls: it sits with the kernels
    ("kernels", ("kvpass.kernels", "kvpass.models", "kvpass.watch", "kvpass.lowering.dispatch")),
    ("patterns", ("kvpass.patterns",)),
    ("runtime", ("kvpass.runtime",)),
    ("policies", ("kvpass.policies",)),
    # the compiler: the graph pass rewrites sites into kvpass:: ops, whose kernels call the runtime
    ("lowering", ("kvpass.lowering",)),
    # the public API: kvpass(policy) and TailorKV's calibrate(model, prompts), which runs the model under it
    ("api", ("kvpass.api", "kvpass", "kvpass.tailorkv")),
    ("tools", ("kvpass.tp", "kvpass.check", "kvpass.simcuda", "kvpass.demo", "kvpass.explain",
               "kvpass.coverage", "kvpass.bench", "kvpass.cli")),
]
TOOLS = len(LAYERS) - 1

#: Imports from a lower layer to a higher one that stay, with the reason (at most two).
UPWARD: dict[tuple[str, str], str] = {}

#: kvpass imports inside functions that stay, with the reason. (module, imported module).
IN_FUNCTION: dict[tuple[str, str], str] = {
    ("kvpass.api", "kvpass.lowering.ops"):
        "importing it registers the kvpass:: ops: done by the first backend, not by `import kvpass`",
    ("kvpass.api", "kvpass.lowering.graph_pass"):
        "the graph pass is an Inductor CustomGraphPass: torch._dynamo and Inductor load with the first "
        "backend, not with `import kvpass` (they double its import time)",
    ("kvpass.api", "kvpass.lowering.graph_cache"): "loaded with the graph pass (above)",
    ("kvpass.bench.kernels", "kvpass.lowering.ops"): "registers the kvpass:: ops (see kvpass.api)",
    ("kvpass.bench.syncs", "kvpass.lowering.ops"): "registers the kvpass:: ops (see kvpass.api)",
    ("kvpass.simcuda", "kvpass.lowering.ops"): "registers the kvpass:: ops (see kvpass.api)",
    ("kvpass.bench.cli", "kvpass.bench.lm_eval"): "needs lm-eval, the optional extra kvpass[eval]",
    ("kvpass.bench.cli", "kvpass.bench.ruler"): "needs lm-eval, the optional extra kvpass[eval]",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> int:
    best, depth = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            hit = module == prefix or (prefix != "kvpass" and module.startswith(prefix + "."))
            if hit and len(prefix) > depth:
                best, depth = i, len(prefix)
    assert best is not None, f"{module} is in no layer of tests/test_architecture.py: add it to LAYERS"
    return best


def _type_checking(node: ast.If) -> bool:
    return "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(nodes, in_function: bool = False):
    """``(node, in_function)`` for every Import / ImportFrom among ``nodes`` and inside them, skipping the
    body of ``if TYPE_CHECKING:`` (annotations only)."""
    for node in nodes:
        if isinstance(node, ast.If) and _type_checking(node):
            yield from _imports(node.orelse, in_function)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, in_function
        else:
            inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            yield from _imports(ast.iter_child_nodes(node), inner)


def edges_of(module: str, source: str) -> list[tuple[str, str, int, bool]]:
    """``(module, imported kvpass module, line, in a function)`` for each kvpass import of ``source``."""
    package = module if MODULES.get(module, Path()).name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node, in_function in _imports(ast.parse(source).body):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            # `from kvpass.kernels import quest` imports the module kvpass.kernels.quest
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        for target in dict.fromkeys(targets):
            while target and target not in MODULES and "." in target:
                target = target.rpartition(".")[0]  # `from kvpass.x import Name`: the module kvpass.x
            if target.split(".")[0] == "kvpass" and target in MODULES and target != module:
                out.append((module, target, node.lineno, in_function))
    return out


def all_edges() -> list[tuple[str, str, int, bool]]:
    return [e for m, p in MODULES.items() for e in edges_of(m, p.read_text())]


def cycles(edges) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for a, b, *_ in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _where(e) -> str:
    return f"{MODULES[e[0]].relative_to(ROOT)}:{e[2]} imports {e[1]}"


@pytest.fixture(scope="module")
def edges():
    return all_edges()


def test_the_graph_is_read(edges):
    """The reader sees imports at the top, inside functions and through `from package import module`."""
    seen = {(a, b, f) for a, b, _, f in edges}
    assert ("kvpass.api", "kvpass.lowering.shards", False) in seen
    assert ("kvpass.api", "kvpass.lowering.ops", True) in seen
    assert ("kvpass.lowering.dispatch", "kvpass.kernels.quest", False) in seen
    assert all(layer_of(m) is not None for m in MODULES)


def test_the_library_imports_no_tool(edges):
    bad = [_where(e) for e in edges if layer_of(e[0]) < TOOLS <= layer_of(e[1])]
    assert not bad, "the library imports a tool (move what it needs below the tools):\n" + "\n".join(bad)


def test_no_import_from_a_lower_layer_to_a_higher_one(edges):
    assert len(UPWARD) <= 2
    up = [e for e in edges if layer_of(e[0]) < layer_of(e[1])]
    bad = [f"{_where(e)} ({LAYERS[layer_of(e[0])][0]} -> {LAYERS[layer_of(e[1])][0]})" for e in up
           if (e[0], e[1]) not in UPWARD]
    assert not bad, "imports from a lower layer to a higher one (docs/architecture.md):\n" + "\n".join(bad)
    stale = set(UPWARD) - {(e[0], e[1]) for e in up}
    assert not stale, f"UPWARD names edges the code no longer has: remove them: {sorted(stale)}"


def test_no_import_circle(edges):
    # An upward edge closes a loop by definition (the layer above imports the one below): UPWARD's edges
    # are the named exceptions, and each stays inside a function (IN_FUNCTION) so that no import runs one.
    found = cycles([e for e in edges if (e[0], e[1]) not in UPWARD])
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_kvpass_imports_inside_functions_have_a_reason(edges):
    inside = [e for e in edges if e[3]]
    bad = [_where(e) for e in inside if (e[0], e[1]) not in IN_FUNCTION]
    assert not bad, ("kvpass imports inside functions: move them to the top of the file, or add the reason "
                     "(an optional dependency, a circle that cannot be cut) to IN_FUNCTION:\n"
                     + "\n".join(bad))
    stale = set(IN_FUNCTION) - {(e[0], e[1]) for e in edges if e[3]}
    assert not stale, f"IN_FUNCTION names imports the code no longer has: remove them: {sorted(stale)}"


def test_the_rules_catch_what_they_forbid():
    """Each rule fails on a made-up import that breaks it."""
    lib = edges_of("kvpass.lowering.graph_pass", "def f():\n    from kvpass.tp import launch\n")
    assert lib == [("kvpass.lowering.graph_pass", "kvpass.tp", 2, True)]
    assert layer_of(lib[0][0]) < TOOLS <= layer_of(lib[0][1])
    assert (lib[0][0], lib[0][1]) not in IN_FUNCTION
    typed = edges_of("kvpass.lowering.graph_pass", "from typing import TYPE_CHECKING\n"
                     "if TYPE_CHECKING:\n    from kvpass.api import KVPassBackend\n")
    assert typed == []
    assert cycles([("a", "b", 1, False), ("b", "c", 1, True), ("c", "a", 1, False)]) == [["a", "b", "c"]]
    assert cycles([("a", "b", 1, False), ("b", "c", 1, False)]) == []
