"""The engine's objects (tidemark/engine) are built whole by their constructors and talk
through each other's public methods (issue 47, item 4): no attribute appears after
``__init__``, none is set on another object, no private is reached across objects. Pure
source analysis (ast), so a violation names the file and line."""

from __future__ import annotations

import ast
from pathlib import Path

import tidemark

ENGINE = Path(tidemark.__file__).resolve().parent / "engine"
# PySpark's, not the engine's: the gateway and the executors' Python (session.py, cds_dump.py).
THIRD_PARTY = {"SparkContext", "spark"}


def _modules() -> list[tuple[Path, ast.Module]]:
    return [(p, ast.parse(p.read_text(), str(p))) for p in sorted(ENGINE.glob("*.py"))]


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        found = node.targets
    elif isinstance(node, ast.AugAssign | ast.AnnAssign):
        found = [node.target]
    else:
        return []
    return [e for t in found for e in (t.elts if isinstance(t, ast.Tuple) else [t])]


def _root(e: ast.expr) -> str | None:
    while isinstance(e, ast.Attribute):
        e = e.value
    return e.id if isinstance(e, ast.Name) else None


def _self_attr(e: ast.expr) -> str | None:
    if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
        return e.attr
    return None


def attributes_made_late(path: Path, tree: ast.Module) -> list[str]:
    """``self.x = ...`` outside ``__init__`` for an ``x`` neither it nor the class body has."""
    problems = []
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        made = {
            t.id
            for stmt in cls.body
            for t in _targets(stmt)
            if isinstance(t, ast.Name)  # a class-level declaration or default
        }
        methods = [f for f in cls.body if isinstance(f, ast.FunctionDef)]
        for f in methods:
            if f.name == "__init__":
                made |= {a for n in ast.walk(f) for t in _targets(n) if (a := _self_attr(t))}
        for f in methods:
            if f.name == "__init__":
                continue
            for n in ast.walk(f):
                for t in _targets(n):
                    a = _self_attr(t)
                    if a and a not in made:
                        problems.append(f"{path.name}:{n.lineno}: {cls.name}.{a} made in {f.name}")
    return problems


def attributes_set_from_outside(path: Path, tree: ast.Module) -> list[str]:
    """``other.x = ...`` where ``other`` is neither ``self`` nor a value the function made."""
    problems = []
    for f in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        local = {t.id for n in ast.walk(f) for t in _targets(n) if isinstance(t, ast.Name)}
        for n in ast.walk(f):
            for t in _targets(n):
                if not isinstance(t, ast.Attribute) or _self_attr(t):
                    continue
                root = _root(t)
                if root in local or root in THIRD_PARTY:
                    continue
                problems.append(f"{path.name}:{n.lineno}: {ast.unparse(t)} set from outside")
    return problems


def privates_reached(path: Path, tree: ast.Module) -> list[str]:
    """``other._x``: a private of another object (``self._x`` and dunders are fine)."""
    return [
        f"{path.name}:{n.lineno}: {ast.unparse(n)}"
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and n.attr.startswith("_")
        and not n.attr.startswith("__")
        and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"))
        and _root(n) not in THIRD_PARTY
    ]


def test_engine_objects_are_built_by_their_constructors():
    problems = [p for path, tree in _modules() for p in attributes_made_late(path, tree)]
    assert not problems, "\n".join(problems)


def test_engine_objects_set_no_attribute_of_another():
    problems = [p for path, tree in _modules() for p in attributes_set_from_outside(path, tree)]
    assert not problems, "\n".join(problems)


def test_engine_objects_reach_no_private_of_another():
    problems = [p for path, tree in _modules() for p in privates_reached(path, tree)]
    assert not problems, "\n".join(problems)


def test_the_checks_can_fail():
    """What the engine did before (issue 47, item 3), each caught."""
    before = ast.parse(
        "class SinkWriter:\n"
        "    def __init__(self):\n"
        "        self.conn = None\n"
        "    def _open(self):\n"
        "        self.table = 1\n"
        "class Backfill:\n"
        "    def open(self, s):\n"
        "        s.w.redelivery = Redelivery(s.w)\n"
        "class Redelivery:\n"
        "    def remove(self):\n"
        "        self.w.out['removed'] += self.w._open().rowcount\n"
    )
    path = Path("before.py")
    assert attributes_made_late(path, before) == ["before.py:5: SinkWriter.table made in _open"]
    assert attributes_set_from_outside(path, before) == [
        "before.py:8: s.w.redelivery set from outside"
    ]
    assert privates_reached(path, before) == ["before.py:11: self.w._open"]
