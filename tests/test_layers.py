"""The layers of the tidemark package (tidemark/__init__.py): no module imports from a layer
above its own, siblings do not import each other, and the runtime never imports the dev
stack. Pure source analysis (ast), so a violation names the file and line."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import tidemark

PACKAGE = Path(tidemark.__file__).resolve().parent
LAYERS = tidemark.LAYERS  # bottom first; a tuple holds siblings


def _layer(module: str) -> int:
    top = module.split(".")[1] if module.count(".") else "__init__"
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    if top in ("__init__", "__main__"):
        return len(LAYERS)
    raise AssertionError(f"{module}: in no layer of tidemark.LAYERS")


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(path: Path, module: str) -> list[tuple[int, str]]:
    out = []
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base == "tidemark":  # from tidemark import sub, sub
                out += [(node.lineno, f"tidemark.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, base))
    return [(n, m) for n, m in out if m == "tidemark" or m.startswith("tidemark.")]


def test_every_module_belongs_to_a_layer():
    for module in _modules():
        _layer(module)


def test_no_import_reaches_up_or_sideways():
    problems = []
    for module, path in _modules().items():
        mine = _layer(module)
        for line, target in _imports(path, module):
            if target == "tidemark":
                continue
            theirs = _layer(target)
            same_top = target.split(".")[1] == (module.split(".") + [""])[1]
            if theirs > mine or (theirs == mine and not same_top):
                problems.append(
                    f"{path.relative_to(PACKAGE.parent)}:{line}: {module} "
                    f"imports {target} (layer {LAYERS[min(theirs, len(LAYERS) - 1)]})"
                )
    assert not problems, "\n".join(problems)


def test_the_checker_sees_a_violation(tmp_path):
    # The check itself must be able to fail: a ledger module importing the driver.
    bad = tmp_path / "bad.py"
    bad.write_text("from tidemark.driver.run import Run\n")
    ((line, target),) = _imports(bad, "tidemark.ledger.bad")
    assert _layer(target) > _layer("tidemark.ledger.bad")


def test_runtime_never_imports_the_dev_stack():
    # What Airflow and spark-submit load: the DAG factory, its tasks, the web app, the job.
    probe = (
        "import sys, tidemark.cli.main, tidemark.airflow.dags, tidemark.airflow.tasks, "
        "tidemark.web.app, tidemark.driver.redrive\n"
        "print(sorted(m for m in sys.modules if m.startswith('tidemark.devstack')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "[]"


def _tops() -> list[str]:
    return [name for names in LAYERS for name in names]


def _may_import(package: str, doc: str) -> set[str]:
    """The layers a package's docstring says it may import ("May import: a, b (why), c."),
    itself aside. Also "nothing of tidemark", "every layer", "any layer below X"."""
    m = re.search(r"May import:\s*(.+?)(?:\n\s*\n|\Z)", doc, re.S)
    assert m, f"tidemark/{package}/__init__.py: docstring lacks 'May import'"
    text = " ".join(m.group(1).split())
    tops = _tops()
    if text.startswith("nothing of tidemark"):
        return set()
    if text.startswith("every layer"):
        return set(tops) - {package}
    below = re.match(r"any layer below (\w+)", text)
    if below:
        return set(tops[: tops.index(below.group(1))]) - {package}
    named = set()
    for item in re.sub(r"\([^)]*\)", "", text).rstrip(".").split(","):
        word = item.split()[0] if item.split() else ""
        assert word in tops, f"tidemark/{package}/__init__.py: May import names {word!r}, no layer"
        named.add(word)
    return named


def _disallowed(package: str, allowed: set[str]) -> list[str]:
    modules = _modules()
    problems = []
    for module, path in modules.items():
        if module.split(".")[1:2] != [package]:
            continue
        for line, target in _imports(path, module):
            top = target.split(".")[1] if target.count(".") else None
            if top is not None and top != package and top not in allowed:
                problems.append(f"{path.relative_to(PACKAGE.parent)}:{line}: imports {target}")
    return problems


def test_every_package_imports_only_what_it_says_it_may():
    problems = []
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        package = init.parent.name
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        allowed = _may_import(package, doc)
        problems += [
            f"{p} (May import: {', '.join(sorted(allowed)) or 'nothing'})"
            for p in _disallowed(package, allowed)
        ]
    assert not problems, "imports beyond a package's 'May import' list:\n" + "\n".join(problems)


def test_the_may_import_check_can_fail():
    assert _may_import("render", "x.\n\nMay import: core.") == {"core"}
    assert _may_import("web", "May import: render, core (not airflow: siblings).") == {
        "render",
        "core",
    }
    assert _may_import("core", "May import: nothing of tidemark.") == set()
    assert "cli" not in _may_import("devstack", "May import: any layer below cli.")
    # quality's modules import core: with nothing allowed, they are flagged
    assert _disallowed("quality", set())


def _module_imports(path: Path, module: str, modules: dict[str, Path]) -> set[str]:
    """The tidemark modules ``module`` imports, anywhere in it (at the top, inside a
    function, under TYPE_CHECKING: each is a dependency), by their own name: ``from
    tidemark.cli import dlq`` imports tidemark.cli.dlq."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names
            ]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name.startswith("tidemark.") and name != module:
                found.add(name)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_inside_a_package():
    """Modules of one package never import each other round: each is understood, tested and
    moved with what it imports only (across packages the layers forbid cycles already)."""
    modules = _modules()
    graph = {
        m: {t for t in _module_imports(p, m, modules) if t.split(".")[:2] == m.split(".")[:2]}
        for m, p in modules.items()
    }
    cycles = _cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_check_can_fail(tmp_path):
    a = tmp_path / "main.py"
    a.write_text("from tidemark.cli import dlq\n")
    modules = {"tidemark.cli.main": a, "tidemark.cli.dlq": a}
    assert _module_imports(a, "tidemark.cli.main", modules) == {"tidemark.cli.dlq"}
    graph = {"x.a": {"x.b"}, "x.b": {"x.c"}, "x.c": {"x.a"}, "x.d": {"x.a"}}
    assert _cycles(graph) == [["x.a", "x.b", "x.c"]]


# SQL naming a tidemark.* table or function, outside the ledger.
_LEDGER_SQL = re.compile(
    r"\b(FROM|INTO|UPDATE|JOIN|TABLE|EXISTS)\s+tidemark\.\w+|"
    r"tidemark\.\w+\s*\("
)
# The chaos checker and its oracle read the databases on their own on purpose: they must not
# trust the code they check (tidemark/devstack/chaos/__init__.py).
_INDEPENDENT = {"tidemark.devstack.chaos.checker", "tidemark.devstack.chaos.oracle"}
_STATES = re.compile(r"'(planned|writing|prepared|committing|committed|aborted|dq_failed)'")


def _strings(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    docs = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
    }
    return [
        (n.lineno, n.value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
    ]


def test_only_the_ledger_speaks_sql_to_tidemark_tables():
    problems = []
    for module, path in _modules().items():
        if module.startswith("tidemark.ledger") or module in _INDEPENDENT:
            continue
        for line, text in _strings(path):
            if _LEDGER_SQL.search(text):
                problems.append(
                    f"{path.relative_to(PACKAGE.parent)}:{line}: {' '.join(text.split())[:80]}"
                )
    assert not problems, "SQL on tidemark.* outside tidemark/ledger:\n" + "\n".join(problems)


def test_run_states_come_from_the_enum_in_sql_too():
    problems = []
    for module, path in _modules().items():
        if module in _INDEPENDENT:
            continue
        for line, text in _strings(path):
            if _STATES.search(text) and "outcome" not in text:
                problems.append(
                    f"{path.relative_to(PACKAGE.parent)}:{line}: {' '.join(text.split())[:80]}"
                )
    assert not problems, "run states as SQL literals (pass RunState):\n" + "\n".join(problems)


def test_the_sql_checks_can_fail():
    assert _LEDGER_SQL.search("SELECT 1 FROM tidemark.dlq WHERE x")
    assert _LEDGER_SQL.search("ELSE tidemark.version_conflict(k, 1, 2)")
    assert not _LEDGER_SQL.search("from tidemark.ledger import dlq")
    assert _STATES.search("WHERE state = 'committing'")


def test_the_benchmarks_import_what_the_package_has():
    """`make bench` runs rarely: a name it imports that a refactoring moved must fail here."""
    import importlib.util

    for script in sorted((PACKAGE.parent / "bench").glob("*.py")):
        spec = importlib.util.spec_from_file_location(f"bench_{script.stem}", script)
        assert spec is not None and spec.loader is not None
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
