"""docs/design.md is the protocol the code and its docstrings cite; the team's master copy is
../shared/DESIGN.md beside the checkout. The repo's copy must not drift from it."""

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared" / "DESIGN.md"


def test_design_doc_is_in_the_repo():
    text = (REPO / "docs" / "design.md").read_text()
    assert "exactly once" in text.lower() or "exactly-once" in text.lower()


@pytest.mark.skipif(not SHARED.exists(), reason="no ../shared/DESIGN.md beside this checkout")
def test_design_doc_matches_the_shared_master():
    assert (REPO / "docs" / "design.md").read_text() == SHARED.read_text(), (
        "docs/design.md differs from ../shared/DESIGN.md: copy the master over it")
