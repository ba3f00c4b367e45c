"""Segments of a ``file_archive`` source, written in the layout tidemark/sources/file_archive.py
documents: what the tests and the chaos checker archive records with. A real archive is
written by whatever archives the topic; Tidemark only reads it, so this is dev stack."""

from __future__ import annotations

import base64
import contextlib
import json
import uuid
from datetime import UTC, datetime, timedelta

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from tidemark.core.errors import TidemarkError
from tidemark.sources.file_archive import FORMATS, IO_ERRORS, Archive, first_line

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# A parquet segment's columns (headers as JSON text).
ARROW_SCHEMA = pa.schema(
    [
        ("partition", pa.int32()),
        ("offset", pa.int64()),
        ("key", pa.binary()),
        ("payload", pa.binary()),
        ("headers", pa.string()),
        ("ts", pa.timestamp("us", tz="UTC")),
    ]
)


def write_segment(
    uri: str, partition: int, records: list[dict], fmt: str, *, row_group_size: int | None = None
) -> str:
    """Write ``records`` (dicts with partition, offset, key, payload, headers, ts) as one
    segment of ``uri``'s archive, in the source's layout; returns the segment's path.

    ``key``/``payload`` are bytes or None, ``headers`` a dict (or JSON text) or None, ``ts`` a
    datetime (naive means UTC), epoch milliseconds or None. Written under a temporary name then
    renamed, so readers never see a partial segment; an existing segment (of either format)
    is never replaced.
    """
    if fmt not in FORMATS:
        raise TidemarkError(f"unknown archive format {fmt!r}; use one of {', '.join(FORMATS)}")
    if not records:
        raise TidemarkError("a segment needs at least one record (it is named after the first)")
    prev = None
    for rec in records:
        if rec["partition"] != partition:
            raise TidemarkError(
                f"record of partition {rec['partition']} given for partition {partition}"
            )
        if prev is not None and rec["offset"] <= prev:
            raise TidemarkError(
                f"offset {rec['offset']} after {prev}: records must be in "
                f"strictly increasing offset order"
            )
        prev = rec["offset"]
    if partition < 0 or records[0]["offset"] < 0:
        raise TidemarkError("partitions and offsets must be non-negative")
    a = Archive(uri)
    folder = a.part_dir(partition)
    name = f"{records[0]['offset']:020d}.{fmt}"
    final, tmp = f"{folder}/{name}", f"{folder}/.{name}.tmp-{uuid.uuid4().hex}"
    try:
        a.fs.create_dir(folder, recursive=True)
        for other in (f"{folder}/{name.rsplit('.', 1)[0]}.{f}" for f in FORMATS):
            if a.fs.get_file_info(other).type != pafs.FileType.NotFound:
                raise TidemarkError(
                    f"file archive {a.show(other)}: segment exists (segments are immutable)"
                )
        if fmt == "parquet":
            table = pa.Table.from_pylist([arrow_row(rec) for rec in records], ARROW_SCHEMA)
            pq.write_table(table, tmp, filesystem=a.fs, row_group_size=row_group_size)
        else:
            data = b"".join(_jsonl_row(rec) for rec in records)
            with a.fs.open_output_stream(tmp, compression=None) as out:
                out.write(data)
        a.fs.move(tmp, final)
    except IO_ERRORS as exc:
        with contextlib.suppress(*IO_ERRORS):
            a.fs.delete_file(tmp)
        raise TidemarkError(
            f"file archive {a.show(final)}: cannot write: {first_line(exc)}"
        ) from None
    return final


def _headers_json(h) -> str | None:
    if h is None or isinstance(h, str):
        return h
    return json.dumps(h, ensure_ascii=False)


def _ts_value(ts) -> datetime | None:
    if ts is None:
        return None
    if isinstance(ts, int) and not isinstance(ts, bool):
        return EPOCH + timedelta(milliseconds=ts)
    return ts if ts.tzinfo is not None else ts.replace(tzinfo=UTC)


def arrow_row(rec: dict) -> dict:
    return {
        "partition": rec["partition"],
        "offset": rec["offset"],
        "key": rec.get("key"),
        "payload": rec.get("payload"),
        "headers": _headers_json(rec.get("headers")),
        "ts": _ts_value(rec.get("ts")),
    }


def _jsonl_row(rec: dict) -> bytes:
    def b64(v: bytes | None) -> str | None:
        return None if v is None else base64.b64encode(v).decode("ascii")

    h = rec.get("headers")
    ts = _ts_value(rec.get("ts"))
    row = {
        "partition": rec["partition"],
        "offset": rec["offset"],
        "key": b64(rec.get("key")),
        "payload": b64(rec.get("payload")),
        "headers": json.loads(h) if isinstance(h, str) else h,
        "ts": None if ts is None else ts.isoformat(),
    }
    return json.dumps(row, ensure_ascii=False).encode("utf-8") + b"\n"
