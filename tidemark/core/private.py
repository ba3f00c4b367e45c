"""Files that hold secrets (generated keys, passwords): mode 0600 from the first byte.

``write_text`` then ``chmod`` leaves a window in which the file is readable by everyone (the
umask's 0644). Here the content goes to a new file opened 0600 and is renamed over the path,
so the path only ever names a private file, complete.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def write_private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()  # left by a crashed process of the same pid
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
