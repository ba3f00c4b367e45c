"""docs/design.md is the protocol the code and its docstrings cite, and the project's only copy
of it: the rules the data path implements must be stated there."""

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
    ):
        assert rule.lower() in text.lower(), f"docs/design.md no longer states: {rule!r}"
