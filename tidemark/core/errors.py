"""Errors a user sees as one clear line (the CLI prints ``str(exc)`` and exits non-zero)."""

from __future__ import annotations


class TidemarkError(Exception):
    """An error with a message fit for an operator; ``exit_code`` is the CLI's exit status."""

    exit_code = 1


class BadInput(TidemarkError):
    """The user's input (a file, an argument) is wrong; nothing was done."""

    exit_code = 2


class ConfigError(BadInput):
    """A pipeline file or a setting is wrong: names the file, the field and the problem."""

    def __init__(
        self, where: str, problem: str, field: str | None = None, others: list[str] | None = None
    ):
        self.where, self.field, self.problem = where, field, problem
        self.others = others or []  # the rest of the file's problems, "field: problem" each
        loc = f"{where}: {field}" if field else where
        super().__init__(f"{loc}: {problem}")


class LeaseHeld(TidemarkError):
    """Another live run holds the lease of every sink this run wanted."""

    exit_code = 3


class Fenced(TidemarkError):
    """This run lost its lease before the decision; it rolled back."""

    exit_code = 4


class Inconsistency(TidemarkError):
    """A chosen transaction vanished without its marker: the pipeline is halted."""

    exit_code = 5


class Halted(TidemarkError):
    """The pipeline is halted (an earlier Inconsistency or OverCeiling): runs are refused
    until `tidemark resume`. The same exit code, since retrying cannot help either."""

    exit_code = 5


class OverCeiling(TidemarkError):
    """The run would have quarantined more than ``quality.max_quarantined`` of a sink's
    records: it rolled back and halted the pipeline. Not retried: the same records would do
    the same."""

    exit_code = 5


class Terminated(TidemarkError):
    """SIGTERM arrived before the decision: the run rolled back."""

    exit_code = 143


def terminated_in(exc: BaseException) -> Terminated | None:
    """The SIGTERM an error carries. The signal handler raises Terminated wherever the main
    thread is; inside a Py4J call Py4J wraps it in its own network error (the Terminated as
    that error's ``cause`` and context), which must still end the run as terminated."""
    todo: list[BaseException] = [exc]
    seen: set[int] = set()
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, Terminated):
            return e
        linked = (e.__cause__, e.__context__, getattr(e, "cause", None))
        todo.extend(x for x in linked if isinstance(x, BaseException))
    return None


class NotFound(BadInput):
    """What the user named (a dead letter, a file) does not exist."""


class Busy(TidemarkError):
    """Another transaction holds what the user wanted to change; nothing changed, try again."""

    exit_code = 3
