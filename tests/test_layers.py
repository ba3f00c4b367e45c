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


def test_every_package_says_what_it_owns_and_may_import():
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "May import" in doc, (
            f"{init.relative_to(PACKAGE.parent)}: docstring lacks 'May import'"
        )


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
