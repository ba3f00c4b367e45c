"""How `make test` hands its work units to the two xdist workers (tests/conftest.py): the
longest expected first, so that what is handed out last is short and both workers end
together; a group's tests stay together and in their order."""

from __future__ import annotations

from dataclasses import dataclass, field

from tests.conftest import _longest_first


@dataclass
class Item:
    """What _longest_first reads of a pytest item: its node id (with xdist's "@group") and
    its marks."""

    nodeid: str
    marks: tuple[str, ...] = field(default=())

    def get_closest_marker(self, name: str):
        return name if name in self.marks else None


def test_the_longest_units_go_first_each_groups_tests_together_in_their_order():
    items = [
        Item("tests/test_a.py::test_quick"),
        Item("tests/test_b.py::test_one@test_b.py", ("spark",)),
        Item("tests/test_c.py::test_one@airflow", ("airflow",)),
        Item("tests/test_d.py::test_cluster_1@test_d.py", ("slow", "spark")),
        Item("tests/test_b.py::test_two@test_b.py", ("spark",)),
        Item("tests/test_e.py::test_job", ("slow",)),
        Item("tests/test_c.py::test_two@airflow", ("airflow",)),
        Item("tests/test_d.py::test_cluster_2@test_d.py", ("slow", "spark")),
        Item("tests/test_f.py::test_quick[a@b]"),  # an "@" in a parameter names no group
        Item("tests/test_c.py::test_three@airflow", ("airflow",)),
    ]
    assert [i.nodeid for i in _longest_first(items)] == [
        "tests/test_d.py::test_cluster_1@test_d.py",  # 2 slow tests: 90 s
        "tests/test_d.py::test_cluster_2@test_d.py",
        "tests/test_c.py::test_one@airflow",  # 3 Airflow tests: 45 s
        "tests/test_c.py::test_two@airflow",
        "tests/test_c.py::test_three@airflow",
        "tests/test_e.py::test_job",  # a slow one: 45 s, collected after them
        "tests/test_b.py::test_one@test_b.py",  # 2 on the SparkSession: 20 s
        "tests/test_b.py::test_two@test_b.py",
        "tests/test_a.py::test_quick",
        "tests/test_f.py::test_quick[a@b]",
    ]
