"""docs/design.md is the protocol the code and its docstrings cite, and the project's only copy
of it: the rules the data path implements must be stated there."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DESIGN = REPO / "docs" / "design.md"


def test_design_doc_states_the_protocol():
    text = DESIGN.read_text()
    for rule in (
        "exactly once",
        "Re-delivery replaces by\n*position*",
        "equal versions are broken by `(partition, offset)`",
        "A redrive is a re-delivery of single records",
        "tells an offset no record holds (a compaction gap) from a segment",
        "No re-delivery reaches below where a sink began",
        # task accounting, per sink: what the engine checks before it prepares
        "the records of its range + the fallback versions it read",
        "+ tombstones applied",
    ):
        assert rule.lower() in text.lower(), f"docs/design.md no longer states: {rule!r}"


def _cited(text: str) -> list[str]:
    """The parts of docs/design.md ``text`` cites by name: ``docs/design.md, "Part"``, across
    a line break and a comment's ``#`` too."""
    return [" ".join(m.split()) for m in re.findall(r'design\.md,\s*(?:#\s*)?"([^"]+)"', text)]


def _parts(text: str) -> list[str]:
    """What a citation may name: a heading, or a bold lead-in (``**Tables.**``)."""
    heads = re.findall(r"^#+ (.+)$", text, re.M)
    leads = re.findall(r"\*\*([^*]+?)\.?\*\*", text)
    return [" ".join(p.split()) for p in heads + leads]


def test_every_cited_part_of_the_design_doc_exists():
    parts = _parts(DESIGN.read_text())
    missing = []
    for path in sorted([*REPO.glob("tidemark/**/*.py"), *REPO.glob("tests/*.py")]):
        if path.name == "test_design_doc.py":
            continue
        for name in _cited(path.read_text()):
            if not any(p == name or p.startswith(f"{name} (") for p in parts):
                missing.append(f"{path.relative_to(REPO)}: {name!r}")
    assert not missing, "docs/design.md has no such part:\n" + "\n".join(missing)
    # the check can fail
    assert _cited('(docs/design.md,\n    # "Markers")') == ["Markers"]
    assert not any(p.startswith("Markers") for p in parts)


def test_the_tables_the_design_doc_names_exist():
    """A ``tidemark.*`` table the protocol names is one the migrations or the markers DDL
    create (the doc once named a ``tidemark_commits`` table the code never had)."""
    created = {
        name
        for path in [*REPO.glob("sql/*.sql"), REPO / "tidemark/ledger/markers.py"]
        for name in re.findall(
            r"CREATE (?:UNLOGGED )?TABLE (?:IF NOT EXISTS )?(tidemark\.\w+)", path.read_text()
        )
    }
    assert "tidemark.commits" in created
    named = set(re.findall(r"`(tidemark[._]\w+)`", DESIGN.read_text()))
    assert named <= created, f"docs/design.md names tables the code lacks: {named - created}"
