"""Great Expectations Data Docs: each gate's validation rendered as HTML into a file-system
GX project rooted at the pipeline's docs folder, and the index page over them.

Each pipeline has its own GX project (``<TIDEMARK_DATA_DOCS_DIR>/<pipeline>``): the Dead letters
page serves a pipeline's site only to those who may read its DAG, and only the rendered site,
never the rest of the project (its config, the stored validation results).
"""

from __future__ import annotations

import datetime
import os
import re
from typing import Any
from urllib.parse import unquote

from tidemark.quality.expectations import _gx
from tidemark.quality.expectations import lock as _lock

_docs_contexts: dict[str, Any] = {}


def _docs_context(docs_dir: str):
    """A file-system GX project rooted at ``docs_dir`` (one per directory per process)."""
    root = os.path.abspath(docs_dir)
    with _lock:
        ctx = _docs_contexts.get(root)
        if ctx is None:
            gx = _gx()
            os.makedirs(root, exist_ok=True)
            ctx = gx.get_context(mode="file", project_root_dir=root)
            _docs_contexts[root] = ctx
        return ctx


def _safe_name(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label).strip("._") or "gate"


def _render_docs(docs_dir: str, label: str, batch_id: str, res) -> str:
    from great_expectations.core.run_identifier import RunIdentifier
    from great_expectations.data_context.types.resource_identifiers import (
        ExpectationSuiteIdentifier,
        ValidationResultIdentifier,
    )

    ctx = _docs_context(docs_dir)
    name = _safe_name(label)
    run_id = RunIdentifier(run_name=name, run_time=datetime.datetime.now(datetime.UTC))
    key = ValidationResultIdentifier(
        expectation_suite_identifier=ExpectationSuiteIdentifier(name=name),
        run_id=run_id,
        batch_identifier=batch_id,
    )
    res.meta["run_id"] = run_id
    with _lock:
        ctx.validation_results_store.set(key, res)
        # Only this run's page: the index lists every stored validation, so rebuilding it in
        # each run would cost more with every run (`tidemark dq docs` rebuilds it).
        ctx.build_data_docs(resource_identifiers=[key], build_index=False)
        urls = ctx.get_docs_sites_urls(resource_identifier=key)
    for site in urls:
        url = site.get("site_url")
        if url:
            page = url.removeprefix("file://")
            _offline(docs_dir, [unquote(page)])
            return page
    return _index_page(docs_dir)


def _offline(docs_dir: str, pages: list[str] | None) -> None:
    """Point the pages at the site's own copies of their CSS and scripts (offline.py)."""
    from tidemark.quality import offline

    with _lock:
        offline.localize(site_dir(docs_dir), pages)


SITE = ("gx", "uncommitted", "data_docs", "local_site")  # the rendered site in a GX project


def site_dir(docs_dir: str) -> str:
    """The rendered Data Docs site of a GX project: what may be served, nothing else."""
    return os.path.join(os.path.abspath(docs_dir), *SITE)


def _index_page(docs_dir: str) -> str:
    return os.path.join(site_dir(docs_dir), "index.html")


def build_docs_index(docs_dir: str) -> tuple[str, int]:
    """Rebuild the Data Docs index page of ``docs_dir``: (its path, validations it lists)."""
    ctx = _docs_context(docs_dir)
    with _lock:
        count = len(ctx.validation_results_store.list_keys())
        ctx.build_data_docs()
    _offline(docs_dir, None)  # every page: ones rendered before assets were shipped too
    return _index_page(docs_dir), count


# -- removal (retention, retiring a pipeline) ------------------------------------------------
RESULTS = ("gx", "uncommitted", "validations")  # the stored validation results in a GX project


def validation_files(docs_dir: str, page: str) -> list[tuple[str, str]] | None:
    """The files of one rendered validation, each with the folder that holds all of its kind:
    its page and the stored result it was rendered from (same relative path, .json). None if
    ``page`` is not a validation page of ``docs_dir``'s site: a path read from the ledger is
    never trusted to point inside it."""
    pages = os.path.realpath(os.path.join(site_dir(docs_dir), "validations"))
    results = os.path.join(os.path.realpath(docs_dir), *RESULTS)
    # The ledger keeps the page as GX's site URL gives it: percent-encoded (web/views.py too).
    path = os.path.realpath(unquote(page))
    rel = os.path.relpath(path, pages)
    if rel.startswith(os.pardir) or not rel.endswith(".html"):
        return None
    return [(path, pages), (os.path.join(results, rel[: -len(".html")] + ".json"), results)]


def remove_files(files: list[tuple[str, str]]) -> tuple[int, int]:
    """Delete each (path, top folder) (missing ones are skipped) and the folders it leaves
    empty below its top folder; returns (files removed, bytes removed)."""
    count = size = 0
    for path, stop in files:
        try:
            n = os.stat(path).st_size
            os.unlink(path)
        except FileNotFoundError:
            continue
        count, size = count + 1, size + n
        folder = os.path.dirname(path)
        while folder.startswith(stop + os.sep):
            try:
                os.rmdir(folder)  # only when empty: another run's page may share it
            except OSError:
                break
            folder = os.path.dirname(folder)
    return count, size


def files_size(files: list[tuple[str, str]]) -> tuple[int, int]:
    """(files, bytes) of those of ``files`` that exist: what :func:`remove_files` would remove
    (a dry run)."""
    count = size = 0
    for path, _ in files:
        try:
            size += os.stat(path).st_size
            count += 1
        except FileNotFoundError:
            continue
    return count, size


def tree_size(root: str) -> tuple[int, int]:
    """(files, bytes) under ``root`` (0, 0 if it does not exist)."""
    files = size = 0
    for folder, _, names in os.walk(root):
        for name in names:
            try:
                size += os.lstat(os.path.join(folder, name)).st_size
                files += 1
            except FileNotFoundError:
                continue
    return files, size


def remove_tree(root: str) -> tuple[int, int]:
    """Delete a pipeline's whole Data Docs project; returns (files, bytes) removed."""
    import shutil

    counted = tree_size(root)
    shutil.rmtree(root, ignore_errors=True)
    return counted
