"""Connections handed to a spark-submit'd job in a file only its user can read.

The Spark provider turns a task's ``env_vars`` into ``--conf spark.yarn.appMasterEnv.X=...``
(YARN) or ``spark.kubernetes.driverEnv.X=...`` (Kubernetes): on the command line, visible in
``ps`` to every local user and in the logged spark-submit command. So the replay task puts the
ledger's DSN and the pipeline's connections in a 0600 file in a 0700 folder and hands the job
only that file's path (``TIDEMARK_SECRETS_FILE``); the job reads it into its own environment
and deletes it before it connects to anything. The driver must run where the task runs
(client mode): docs/production.md says what to do otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from tidemark.core.dsn import remember
from tidemark.core.errors import BadInput

VAR = "TIDEMARK_SECRETS_FILE"


@contextmanager
def written(values: dict[str, str]) -> Iterator[str]:
    """A file holding ``values`` (variable -> value), readable by this user alone, removed
    on exit whether or not the job read it."""
    folder = tempfile.mkdtemp(prefix="tidemark-job-")  # 0700
    path = os.path.join(folder, "secrets.json")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(values, f)
    try:
        yield path
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def load_into_environ() -> None:
    """Where ``TIDEMARK_SECRETS_FILE`` names a file: its variables into this process's
    environment (the job's connections), then the file deleted."""
    path = os.environ.pop(VAR, None)
    if not path:
        return
    try:
        with open(path) as f:
            values = json.load(f)
        os.unlink(path)
    except (OSError, ValueError) as exc:
        raise BadInput(
            f"{VAR}: cannot read the job's connections from {path} ({type(exc).__name__}); "
            "the job must run on the host of the task that started it (client deploy mode)"
        ) from None
    for k, v in values.items():
        os.environ[k] = str(v)
        remember(str(v))
