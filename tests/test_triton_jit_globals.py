"""Triton's compiler (unlike its CPU interpreter, which the CPU suite runs) refuses a ``@triton.jit`` function that
reads a module-level global unless the global is a ``tl.constexpr(...)``; this finds such reads in the package
without a GPU."""

from __future__ import annotations

import ast
from pathlib import Path

import attnbackends

PACKAGE = Path(attnbackends.__file__).parent


def _is_jit(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
    return name in {"jit", "autotune", "heuristics"}


def _plain_globals(tree: ast.Module) -> set[str]:
    """Module-level names bound to a number (not through ``tl.constexpr(...)``)."""
    names = set()
    for node in tree.body:
        targets, value = ([node.target], node.value) if isinstance(node, ast.AnnAssign) else (
            (node.targets, node.value) if isinstance(node, ast.Assign) else ([], None))
        if value is None:
            continue
        is_constexpr = (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
                        and value.func.attr == "constexpr")
        try:
            plain = not is_constexpr and isinstance(ast.literal_eval(value), (int, float))
        except ValueError:
            plain = False
        if plain:
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def _imported_plain(path: Path, tree: ast.Module, plain_of: dict[Path, set[str]]) -> set[str]:
    """Names a module imports (relative imports within the package) that are plain globals where defined."""
    names = set()
    for node in tree.body:
        if not isinstance(node, ast.ImportFrom) or not node.level:
            continue
        base = path.parent
        for _ in range(node.level - 1):
            base = base.parent
        source = base.joinpath(*(node.module or "").split(".")).with_suffix(".py") if node.module else None
        for alias in node.names:
            if source is not None and alias.name in plain_of.get(source, ()):
                names.add(alias.asname or alias.name)
    return names


def test_jit_functions_read_no_plain_globals():
    offenders = []
    trees = {path: ast.parse(path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))}
    plain_of = {path: _plain_globals(tree) for path, tree in trees.items()}
    for path, tree in trees.items():
        plain = plain_of[path] | _imported_plain(path, tree, plain_of)
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef) or not any(_is_jit(d) for d in fn.decorator_list):
                continue
            local = {a.arg for a in fn.args.args} | {n.id for n in ast.walk(fn)
                                                     if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
            for node in ast.walk(fn):
                if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in plain - local:
                    offenders.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {fn.name} reads {node.id}")
    assert not offenders, "wrap these globals in tl.constexpr(...):\n" + "\n".join(offenders)
