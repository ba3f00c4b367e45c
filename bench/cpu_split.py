"""Where a fresh run's CPU goes, for bench/replay_bench.py: the CPU-seconds of the run's own
processes (its Python, the driver JVM by thread, Spark's Python workers) and of the
PostgreSQL server's processes (by database), sampled while it runs.

On 2 cores a run is CPU-bound, so this, not the task phases alone, says why one run is
faster than another: every CPU-second one side spends that the other does not is wall time.
Sampled every 0.2 s: a process that ends between two samples loses up to 0.2 s of its last
CPU, which matters only for short-lived server backends."""

from __future__ import annotations

import re
import threading

import psutil

INTERVAL = 0.2
# Spark's driver JVM threads by /proc comm name (truncated to 15 characters there).
JVM_THREADS = (
    ("Executor task", "JVM tasks: Arrow to rows, transform, rows to Arrow"),
    ("C1 CompilerThre", "JVM JIT compilers"),
    ("C2 CompilerThre", "JVM JIT compilers"),
)
JVM_OTHER = "JVM start-up, Py4J, GC, scheduler"
ORDER = (
    "driver Python (CLI, claim, plan, decide)",
    "Spark's Python workers (read, decode, checks, encode, COPY)",
    JVM_THREADS[0][1],
    JVM_THREADS[1][1],
    JVM_OTHER,
)


class CpuSplit:
    """Samples the process tree of ``pid`` and the server's processes until :meth:`stop`.
    ``databases`` names what each database is (e.g. {"warehouse": "sink"})."""

    def __init__(self, pid: int, databases: dict[str, str]) -> None:
        self.root = psutil.Process(pid)
        self.databases = databases
        self.seen: dict[tuple[int, int], tuple[str, float]] = {}  # (pid, tid) -> last
        self.base: dict[int, float] = {}
        for p in psutil.process_iter():
            try:
                if _is_postgres(p):
                    self.base[p.pid] = _cpu(p)
            except psutil.Error:  # gone meanwhile (a backend that ended, on a busy machine)
                continue
        self.postmaster = _postmaster()
        self.reaped = _reaped(self.postmaster)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while not self.done.wait(INTERVAL):
            self._once()

    def _once(self) -> None:
        try:
            tree = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            tree = []
        for p in tree:
            try:
                if p.name() == "java":
                    self._jvm(p)
                    continue
                cmd = " ".join(p.cmdline())
                if "python" not in p.name() and "python" not in cmd:
                    continue
                what = ORDER[0] if p.pid == self.root.pid else ORDER[1]
                self.seen[(p.pid, 0)] = (what, _cpu(p))
            except psutil.Error:
                continue
        for p in psutil.process_iter():
            try:
                if _is_postgres(p):
                    what = self.seen.get((p.pid, 0), (self._server(p), 0.0))[0]
                    self.seen[(p.pid, 0)] = (what, _cpu(p) - self.base.get(p.pid, 0.0))
            except psutil.Error:
                continue

    def _jvm(self, p: psutil.Process) -> None:
        for t in p.threads():
            try:
                with open(f"/proc/{p.pid}/task/{t.id}/comm") as fh:
                    comm = fh.read().strip()
            except OSError:
                continue
            what = next((w for prefix, w in JVM_THREADS if comm.startswith(prefix)), JVM_OTHER)
            self.seen[(p.pid, t.id)] = (what, t.user_time + t.system_time)

    def _server(self, p: psutil.Process) -> str:
        words = " ".join(p.cmdline()).split()
        if len(words) > 2 and words[1] == "parallel":
            return "PostgreSQL parallel workers"
        if len(words) > 3 and words[2] in self.databases:
            return f"PostgreSQL {self.databases[words[2]]}"
        return "PostgreSQL background (WAL, checkpoints, vacuum)"

    def stop(self) -> dict[str, float]:
        """CPU-seconds per category, largest first."""
        self.done.set()
        self.thread.join()
        self._once()
        out: dict[str, float] = {}
        for what, seconds in self.seen.values():
            out[what] = out.get(what, 0.0) + max(seconds, 0.0)
        # A backend that ended is reaped by the postmaster, which then counts its CPU: what
        # of that the samples did not see (the end of each, and backends shorter than a
        # sample) is counted here, by database unknown.
        ended = sum(
            max(sec, 0.0)
            for (pid, _), (what, sec) in self.seen.items()
            if what.startswith("PostgreSQL") and not psutil.pid_exists(pid)
        )
        unseen = _reaped(self.postmaster) - self.reaped - ended
        if unseen > 0.05:
            out["PostgreSQL backends that ended between samples"] = unseen
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def use_server(dsn: str) -> None:
    """Count only the processes of the PostgreSQL server at ``dsn`` (its postmaster and
    that one's children): on a machine shared with other servers (other benches, test
    suites), theirs would otherwise count as this server's background."""
    import psycopg

    global SERVER
    with psycopg.connect(dsn) as c:
        backend = c.execute("SELECT pg_backend_pid()").fetchone()
        assert backend is not None
        # While the connection is open: its backend exits when it closes.
        SERVER = psutil.Process(backend[0]).ppid()


SERVER: int | None = None  # the postmaster's pid, once use_server() has found it


def _postmaster() -> psutil.Process | None:
    if SERVER is not None:
        return psutil.Process(SERVER)
    for p in psutil.process_iter():
        try:
            if _is_postgres(p) and not _is_postgres(psutil.Process(p.ppid())):
                return p
        except psutil.Error:
            continue
    return None


def _reaped(postmaster: psutil.Process | None) -> float:
    if postmaster is None:
        return 0.0
    try:
        t = postmaster.cpu_times()
    except psutil.Error:
        return 0.0
    return t.children_user + t.children_system


def _is_postgres(p: psutil.Process) -> bool:
    if SERVER is not None and SERVER not in (p.pid, p.ppid()):
        return False
    return p.name() == "postgres" or p.name().startswith("postgres:")


def _cpu(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


def short(label: str) -> str:
    """A category's name without its explanation, for a table's header."""
    return re.sub(r" \(.*\)$|:.*$", "", label)
