"""A class-data-sharing archive of the Spark driver's JVM (HotSpot AppCDS).

Every run is a fresh process, and its JVM loads, parses and verifies some ten thousand
classes from Spark's jars before the first job: on 2 cores about 2 s of a run's fixed cost.
``tidemark spark archive`` dumps those classes once into a file the JVM then maps instead
(bench/replay_bench.py, a fresh 10,000-record run). The archive belongs to one JVM and one
set of Spark jars, and its name says which: after an upgrade of either, runs start without it
(as fast as before, never wrong) until the command runs again. The JVM checks the archive
against its class path too, and only a complete archive is ever put under that name (a
truncated one would crash the JVM).

The dumping process is tidemark/engine/cds_dump.py, run in a process of its own.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tidemark.core.errors import TidemarkError
from tidemark.core.settings import get_settings

# JVM warnings (an archive from another class path, say) go to stderr: a run's stdout may be
# its JSON report.
QUIET = ["-Xlog:disable", "-Xlog:all=warning:stderr"]


def folder() -> Path:
    return get_settings().cds_dir()


def _java() -> Path | None:
    """The java that spark-submit starts: JAVA_HOME's, else the first on PATH."""
    home = os.environ.get("JAVA_HOME")
    found = str(Path(home) / "bin" / "java") if home else shutil.which("java")
    return Path(found).resolve() if found and Path(found).exists() else None


def archive() -> Path | None:
    """Where the archive of this JVM and these Spark jars is (None: no java found)."""
    java = _java()
    spec = importlib.util.find_spec("pyspark")
    if java is None or spec is None or not spec.submodule_search_locations:
        return None
    jars = Path(spec.submodule_search_locations[0], "jars").resolve()
    st = java.stat()
    # The JVM maps an archive only for the class path it was dumped with, jar for jar and in
    # the order `jars/*` expanded to: directory order, which a reinstall at the same path
    # changes. So the jars as listed (name, size, time) are part of the key.
    # (Inside a job spark-submit started, pyspark comes from a zip: no jars to list, and its
    # JVM is running already.)
    listed = (
        [f"{e.name}:{e.stat().st_size}:{e.stat().st_mtime_ns}" for e in os.scandir(jars)]
        if jars.is_dir()
        else []
    )
    key = "\0".join(
        [
            importlib.metadata.version("pyspark"),
            str(jars),
            str(java),
            str(st.st_size),
            str(st.st_mtime_ns),
            *listed,
        ]
    )
    return folder() / f"spark-driver-{hashlib.sha256(key.encode()).hexdigest()[:16]}.jsa"


def path_option(flag: str, path: Path) -> str:
    opt = f"{flag}={path}"
    return f'"{opt}"' if " " in opt else opt  # Spark splits the options on blanks


def java_options() -> list[str]:
    """The driver JVM's options that map the archive, if it was built (else none)."""
    path = archive()
    if path is None or not path.is_file():
        return []
    return [path_option("-XX:SharedArchiveFile", path), *QUIET]


def build(force: bool = False, timeout: float = 600) -> tuple[Path, float | None]:
    """Build the archive unless it exists (or ``force``): (its path, seconds taken or None)."""
    target = archive()
    if target is None:
        raise TidemarkError("no java found (JAVA_HOME, PATH): Spark needs Java 17")
    if target.is_file() and not force:
        return target, None
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.stem}.{os.getpid()}.tmp")
    t = time.perf_counter()
    try:
        # A process of its own: the JVM of this one (if any) started without the dump flag.
        done = subprocess.run(
            [sys.executable, "-m", "tidemark.engine.cds_dump", str(tmp)],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if done.returncode != 0 or not tmp.is_file() or tmp.stat().st_size == 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise TidemarkError(
                f"building the Spark class archive failed (exit {done.returncode}): {last}"
            )
        os.replace(tmp, target)  # atomic: a run never maps half an archive
    except subprocess.TimeoutExpired:
        raise TidemarkError(
            f"building the Spark class archive took over {timeout:.0f} s; stopped"
        ) from None
    finally:
        tmp.unlink(missing_ok=True)
    return target, time.perf_counter() - t
