"""The package's shape (docs/DESIGN.md "Layout"), read from the source (nothing is imported).

Import edges. Every import statement counts, at module level, inside a function or under ``if TYPE_CHECKING``. An
edge goes to the module the statement names: ``from .x import y`` and ``import a.x`` to ``x``; ``from . import y``
to the submodule ``y`` where there is one, else to the package's ``__init__`` (``from .. import __version__``
inside the package is an edge into ``attnbackends/__init__.py``, whose re-exports are edges to the modules they
come from). The parent ``__init__`` files Python runs on the way to a submodule are not edges: every submodule would
otherwise form a loop with its own package.

The rules:

1. No import loop of any kind (module-level or function-level, through an ``__init__`` or not).
2. A backend family (``reference/``, ``triton/``, ``flashinfer/``, ``flash_attn/``, ``mla/``) imports only its own
   modules and the shared layers every backend stands on: the root modules (the contracts, spec, metadata,
   platform, validation, compat, compile; not the package's ``__init__``, which is the public API built on top),
   ``ops/`` and ``speculative/``. So no family reaches another family's internals (what two families share moves
   to ``ops/`` or the contracts), and no family reaches ``selection/`` or the layers above it.
3. Nothing outside a backend family imports its modules. ``selection/`` names backends only as the registry's
   ``"module:Class"`` strings and reaches them through their classes (``AttentionBackend.warmup``,
   ``AttentionBackend.environment_facts``); the shared layers serve every backend and name none; the package's own
   users (``engine/``, ``cli/``, ``testing/``, ``integrations/``, ``layer_groups/``, ``parallel/``) go through the
   public API and the registry. Tests, benchmarks and examples, outside the package, may import anything.
4. At most ten modules at the package root, and test support only under ``testing/``.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Optional

PACKAGE = Path(__file__).resolve().parents[1] / "attnbackends"

#: The backend families: one folder each, importing no other (rule 2) and imported by no one else (rule 3).
FAMILIES = ("reference", "triton", "flashinfer", "flash_attn", "mla")
#: The folders every family may import besides its own and the root modules.
SHARED_FOLDERS = ("ops", "speculative")


def _module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(package: Path = PACKAGE) -> dict[str, Path]:
    return {_module_name(p, package): p for p in package.rglob("*.py")}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of the package (an ``__init__`` included) that module ``name`` imports anywhere in its source."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            stem = ".".join(base + ([node.module] if node.module else []))
            # `from stem import y`: the submodule y where there is one, else an attribute of stem's module
            targets = [f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in modules else stem for alias in node.names]
        else:
            continue
        found |= {t for t in targets if t in modules and t != name}
    return found


def _import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    modules = _modules(package)
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
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
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return circles


def _family(module: str) -> Optional[str]:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in FAMILIES else None


def _family_may_import(target: str, packages: set[str]) -> bool:
    """Whether a backend family may import ``target`` from outside itself (rule 2); ``packages``: the modules that
    are a folder's ``__init__``."""
    parts = target.split(".")
    if len(parts) == 1:
        return False  # the package's __init__: the public API, built on the backends' layer
    if parts[1] in SHARED_FOLDERS:
        return True
    return len(parts) == 2 and target not in packages  # a root module


def _layering_violations(graph: dict[str, set[str]], packages: set[str]) -> list[str]:
    """Every edge that breaks rule 2 or 3, as "importer -> imported: why"."""
    found = []
    for name in sorted(graph):
        own = _family(name)
        for target in sorted(graph[name]):
            theirs = _family(target)
            if theirs is not None and theirs != own:
                who = f"backend family {own}" if own else "a module outside the backend families"
                found.append(f"{name} -> {target}: {who} imports backend family {theirs}")
            elif own is not None and theirs is None and not _family_may_import(target, packages):
                found.append(f"{name} -> {target}: backend family {own} imports outside its own modules and the "
                             "shared layers (root modules, ops/, speculative/)")
    return found


def _packages(package: Path = PACKAGE) -> set[str]:
    return {name for name, path in _modules(package).items() if path.name == "__init__.py"}


def test_no_import_circle_in_the_package():
    assert _circles(_import_graph()) == []


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _write(root: Path, files: dict[str, str]) -> None:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_function_level_loop_through_an_init_is_found(tmp_path):
    """A loop closed by a function-level ``from .. import NAME`` (an edge into the package's ``__init__``, which
    re-exports the importer's package): the kind the old finder, which dropped edges into ``__init__``, missed."""
    _write(tmp_path, {
        "fake/__init__.py": "from .sub import helper\nVERSION = '1'\n",
        "fake/sub/__init__.py": "from .tool import helper\n",
        "fake/sub/tool.py": "def helper():\n    from .. import VERSION\n    return VERSION\n",
        "fake/sub/sibling.py": "from . import tool\n",  # the submodule tool: no edge into sub's __init__
    })
    graph = _import_graph(tmp_path / "fake")
    assert graph["fake.sub.sibling"] == {"fake.sub.tool"}
    assert graph["fake.sub.tool"] == {"fake"}
    assert _circles(graph) == [["fake", "fake.sub", "fake.sub.tool"]]


def test_backend_families_import_only_themselves_and_the_shared_layers():
    """Rule 2 (module docstring): no family imports another family's modules, selection or the layers above."""
    found = _layering_violations(_import_graph(), _packages())
    assert [v for v in found if _family(v.split(" -> ")[0])] == []


def test_nothing_outside_a_backend_family_imports_it():
    """Rule 3: selection/ (and every other non-family module) reaches a backend only through its class, named by
    the registry's "module:Class" strings."""
    found = _layering_violations(_import_graph(), _packages())
    assert [v for v in found if not _family(v.split(" -> ")[0])] == []


def test_the_layering_check_reports_each_kind_of_violation():
    packages = {"attnbackends", "attnbackends.ops", "attnbackends.selection", "attnbackends.triton",
                "attnbackends.flashinfer"}
    graph = {
        "attnbackends.mla.backends": {"attnbackends.flashinfer.plan_guard", "attnbackends.ops.launch",
                                      "attnbackends.interface", "attnbackends.selection.registry"},
        "attnbackends.selection.warmup": {"attnbackends.flashinfer", "attnbackends.spec"},
        "attnbackends.triton.backend": {"attnbackends", "attnbackends.triton.launch",
                                        "attnbackends.speculative.tree_mask"},
        "attnbackends.ops.launch": {"attnbackends.triton.launch"},
        "attnbackends.engine.engine": {"attnbackends", "attnbackends.selection.registry"},
    }
    assert _layering_violations(graph, packages) == [
        "attnbackends.mla.backends -> attnbackends.flashinfer.plan_guard: backend family mla imports backend family "
        "flashinfer",
        "attnbackends.mla.backends -> attnbackends.selection.registry: backend family mla imports outside its own "
        "modules and the shared layers (root modules, ops/, speculative/)",
        "attnbackends.ops.launch -> attnbackends.triton.launch: a module outside the backend families imports "
        "backend family triton",
        "attnbackends.selection.warmup -> attnbackends.flashinfer: a module outside the backend families imports "
        "backend family flashinfer",
        "attnbackends.triton.backend -> attnbackends: backend family triton imports outside its own modules and the "
        "shared layers (root modules, ops/, speculative/)",
    ]


def test_the_package_root_holds_at_most_ten_modules():
    root_modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root_modules) <= 10, root_modules


def test_test_support_lives_under_testing():
    outside = [p for p in PACKAGE.rglob("*.py") if "testing" in p.stem and p.parent.name != "testing"]
    assert outside == []
