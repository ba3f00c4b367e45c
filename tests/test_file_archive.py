"""The file_archive source: layout, planning and exact reads, without Spark."""

from __future__ import annotations

import base64
import json
import os
import time
from datetime import UTC, datetime, timedelta, timezone

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import tidemark.sources as sources
from tidemark.config import FileArchiveSource
from tidemark.core.errors import TidemarkError
from tidemark.core.ranges import Range
from tidemark.devstack import archive_writer
from tidemark.sources import file_archive as fa
from tidemark.sources import schema

FORMATS = ["parquet", "jsonl"]
T0 = datetime(2024, 5, 1, 12, 0, 0, 123456, tzinfo=UTC)


def rec(p: int, o: int) -> dict:
    # Invalid UTF-8 (\xff, \xc3\x28), NUL bytes, tombstones and null keys/headers on purpose.
    payload = (
        None if o % 11 == 7 else b"\x00\xff" + bytes([o % 256]) + b"\xc3(" + f"{p}:{o}".encode()
    )
    key = None if o % 3 == 0 else b"k\x00" + o.to_bytes(8, "big")
    headers = None if o % 4 == 0 else {"h": f"v{o}", "n": o, "u": "é"}
    return {
        "partition": p,
        "offset": o,
        "key": key,
        "payload": payload,
        "headers": headers,
        "ts": T0 + timedelta(seconds=o, microseconds=o),
    }


# partition -> segments (lists of offsets). p1 has gaps inside segments and between them.
LAYOUT = {
    0: [list(range(0, 10)), list(range(10, 20)), list(range(20, 25))],
    1: [[100, 101, 102, 105, 107], [110, 111, 112, 113, 114], [120, 125]],
    2: [list(range(0, 5))],
}


def seg_name(base: int, fmt: str) -> str:
    return f"{base:020d}.{fmt}"


@pytest.fixture(params=FORMATS)
def archive(request, tmp_path):
    fmt = request.param
    root = tmp_path / "arch"
    for p, segs in LAYOUT.items():
        for offs in segs:
            archive_writer.write_segment(str(root), p, [rec(p, o) for o in offs], fmt)
    add_noise(root)
    return root, fmt


# Files that are no segment, which the planner and the reader must ignore.
NOISE = [
    "README",
    "notes.txt",
    "_SUCCESS",
    f".{seg_name(0, 'parquet')}.crc",
    f".{seg_name(30, 'jsonl')}.tmp-0a1b",
    f"{seg_name(30, 'parquet')}.tmp",
    f"{seg_name(30, 'parquet')}.crc",
    f"{seg_name(30, 'jsonl')}._COPYING_",
]


def add_noise(root) -> None:
    (root / "README.txt").write_text("not a segment")
    (root / "other").mkdir()
    (root / "partition=0" / "_temporary" / "0").mkdir(parents=True)
    (root / "partition=0" / ".hidden").mkdir()
    for name in NOISE:
        (root / "partition=0" / name).write_bytes(b"garbage")


def planner(root, fmt) -> fa.FileArchivePlanner:
    return fa.FileArchivePlanner(FileArchiveSource(type="file_archive", uri=str(root), format=fmt))


def spec(root, fmt: str | None) -> FileArchiveSource:
    return FileArchiveSource(type="file_archive", uri=str(root), format=fmt)


def read(root, fmt, p, start, end) -> list[pa.RecordBatch]:
    return list(fa.read_range(spec(root, fmt), Range(p, start, end)))


def rows(batches) -> list[dict]:
    out = []
    for b in batches:
        assert b.schema == sources.SCHEMA
        out.extend(b.to_pylist())
    return out


def expected(p: int, offsets) -> list[dict]:
    out = []
    for o in offsets:
        r = rec(p, o)
        out.append(
            {
                "_tm_partition": p,
                "_tm_offset": o,
                "_tm_key": r["key"],
                "_tm_payload": r["payload"],
                "_tm_headers": r["headers"],
                "_tm_ts": r["ts"],
            }
        )
    return out


def normalized(got: list[dict]) -> list[dict]:
    return [
        {**g, "_tm_headers": None if g["_tm_headers"] is None else json.loads(g["_tm_headers"])}
        for g in got
    ]


# --- planning ---------------------------------------------------------------------------------


def test_layout_written_by_write_segment(archive):
    root, fmt = archive
    names = sorted(os.listdir(root / "partition=1"))
    assert [n for n in names if n.endswith(fmt) and not n.startswith(".")] == [
        seg_name(100, fmt),
        seg_name(110, fmt),
        seg_name(120, fmt),
    ]
    assert not [n for n in names if ".tmp-" in n]  # temp names renamed away
    with pytest.raises(TidemarkError, match="immutable"):
        archive_writer.write_segment(str(root), 1, [rec(1, 100)], fmt)


def test_partitions_and_earliest(archive):
    pl = planner(*archive)
    assert pl.partitions() == [0, 1, 2]
    assert [pl.earliest(p) for p in (0, 1, 2)] == [0, 100, 0]
    assert pl.earliest(7) is None  # no folder: nothing archived yet, nothing to start from
    pl.close()


def test_safe_end(archive):
    pl = planner(*archive)
    assert pl.safe_end(0, 0, 1000) == 25
    assert pl.safe_end(0, 0, 7) == 7  # capped by the limit
    assert pl.safe_end(0, 12, 5) == 17
    assert pl.safe_end(0, 25, 10) == 25  # nothing new
    assert pl.safe_end(1, 100, 1000) == 126  # last segment ends at its highest offset + 1
    assert pl.safe_end(1, 103, 2) == 105  # starting inside a compaction gap is fine
    assert pl.safe_end(1, 108, 100) == 126
    assert pl.safe_end(2, 0, 0) == 0
    assert pl.safe_end(7, 0, 100) == 0  # absent partition
    with pytest.raises(TidemarkError, match=r"offsets \[50, 100\) are no longer"):
        pl.safe_end(1, 50, 100)


def test_listing_cached_per_planner(archive):
    root, fmt = archive
    pl = planner(root, fmt)
    assert pl.partitions() == [0, 1, 2]
    assert pl.safe_end(2, 0, 100) == 5
    assert pl.earliest(1) == 100
    archive_writer.write_segment(str(root), 2, [rec(2, o) for o in range(5, 9)], fmt)
    archive_writer.write_segment(str(root), 3, [rec(3, 0)], fmt)
    (root / "partition=1" / seg_name(100, fmt)).unlink()  # retention
    assert pl.safe_end(2, 0, 100) == 5
    assert pl.partitions() == [0, 1, 2]
    assert pl.earliest(1) == 100
    fresh = planner(root, fmt)
    assert fresh.safe_end(2, 0, 100) == 9
    assert fresh.partitions() == [0, 1, 2, 3]
    assert fresh.earliest(1) == 110


def test_planner_reads_only_last_segment(archive):
    root, fmt = archive
    for base in (0, 10):
        (root / "partition=0" / seg_name(base, fmt)).write_bytes(b"\x00corrupt\xff")
    assert planner(root, fmt).safe_end(0, 20, 100) == 25
    (root / "partition=0" / seg_name(20, fmt)).write_bytes(b"\x00corrupt\xff")
    with pytest.raises(TidemarkError, match=seg_name(20, fmt)):
        planner(root, fmt).safe_end(0, 20, 100)


def test_parquet_without_statistics_falls_back_to_offset_column(tmp_path):
    folder = tmp_path / "partition=4"
    folder.mkdir()
    table = pa.Table.from_pylist(
        [archive_writer.arrow_row(rec(4, o)) for o in (3, 4, 9)], archive_writer.ARROW_SCHEMA
    )
    pq.write_table(table, folder / seg_name(3, "parquet"), write_statistics=False)
    assert (
        pq.ParquetFile(folder / seg_name(3, "parquet")).metadata.row_group(0).column(1).statistics
        is None
    )
    assert planner(tmp_path, "parquet").safe_end(4, 3, 100) == 10
    assert normalized(rows(read(tmp_path, "parquet", 4, 4, 10))) == expected(4, [4, 9])


def test_jsonl_tail_read_in_small_chunks(tmp_path, monkeypatch):
    archive_writer.write_segment(str(tmp_path), 0, [rec(0, o) for o in range(40, 60, 3)], "jsonl")
    path = tmp_path / "partition=0" / seg_name(40, "jsonl")
    with open(path, "ab") as f:
        f.write(b"\n  \n")  # trailing blank lines are not records
    monkeypatch.setattr(fa, "_TAIL_CHUNK", 7)  # far shorter than a line
    assert planner(tmp_path, "jsonl").safe_end(0, 40, 100) == 59  # last offset 58


# --- reading ----------------------------------------------------------------------------------


def test_read_range_exact_across_segment_boundary(archive):
    root, fmt = archive
    got = rows(read(root, fmt, 0, 5, 15))
    assert normalized(got) == expected(0, range(5, 15))
    raw = {g["_tm_offset"]: g["_tm_payload"] for g in got}
    assert raw[6] == b"\x00\xff\x06\xc3(0:6"  # bytes survive exactly
    assert raw[7] is None  # tombstone


def test_read_range_with_gaps(archive):
    root, fmt = archive
    got = rows(read(root, fmt, 1, 101, 123))
    assert [g["_tm_offset"] for g in got] == [101, 102, 105, 107, 110, 111, 112, 113, 114, 120]
    assert normalized(got) == expected(1, [101, 102, 105, 107, 110, 111, 112, 113, 114, 120])
    assert read(root, fmt, 1, 103, 105) == []  # a range inside a gap holds no record
    assert normalized(rows(read(root, fmt, 1, 108, 126))) == expected(
        1, [110, 111, 112, 113, 114, 120, 125]
    )


def test_payloads_read_again_by_offset_across_segments_and_gaps(archive, monkeypatch):
    """What a task does for the letters of records the reader left without bytes."""
    root, fmt = archive
    monkeypatch.setattr(sources, "REFETCH_GAP", 4)  # so offsets far apart read as two ranges
    wanted = {0: [14, 6, 7], 1: [120, 101]}
    whole = {
        (p, g["_tm_offset"]): {c: g[c] for c in sources.LEFT_OUT}
        for p, a, b in ((0, 5, 15), (1, 101, 123))
        for g in rows(read(root, fmt, p, a, b))
    }
    assert sources.PayloadReader(spec(root, fmt)).records(wanted) == {
        (p, o): whole[(p, o)] for p, offs in wanted.items() for o in offs
    }
    with pytest.raises(TidemarkError, match=r"source record 1/103 and 1 more is gone"):
        sources.PayloadReader(spec(root, fmt)).records({1: [102, 103, 104]})


def test_batches_hold_at_most_batch_rows(archive, monkeypatch):
    root, fmt = archive
    monkeypatch.setattr(schema, "BATCH_ROWS", 3)  # what the readers read
    batches = read(root, fmt, 0, 2, 22)
    assert [b.num_rows for b in batches] == [3, 3, 3, 3, 3, 3, 2]
    assert [o for b in batches for o in b.column(1).to_pylist()] == list(range(2, 22))


def test_parquet_row_groups_pruned_correctly(tmp_path):
    archive_writer.write_segment(
        str(tmp_path), 0, [rec(0, o) for o in range(0, 20)], "parquet", row_group_size=3
    )
    assert (
        pq.ParquetFile(tmp_path / "partition=0" / seg_name(0, "parquet")).metadata.num_row_groups
        == 7
    )
    for a, b in [(0, 1), (2, 3), (3, 6), (5, 14), (19, 20), (0, 20)]:
        assert normalized(rows(read(tmp_path, "parquet", 0, a, b))) == expected(0, range(a, b))


def test_read_opens_only_needed_segments(archive, monkeypatch):
    root, fmt = archive
    opened: list[str] = []
    name = "_read_parquet" if fmt == "parquet" else "_read_jsonl"
    real = getattr(fa, name)

    def spy(a, path, *args):
        opened.append(os.path.basename(path))
        yield from real(a, path, *args)

    monkeypatch.setattr(fa, name, spy)
    assert len(rows(read(root, fmt, 0, 10, 20))) == 10
    assert opened == [seg_name(10, fmt)]
    opened.clear()
    assert len(rows(read(root, fmt, 1, 110, 113))) == 3
    assert opened == [seg_name(110, fmt)]  # not [100, 110) nor [120, ...)
    opened.clear()
    assert len(rows(read(root, fmt, 1, 108, 112))) == 2
    assert opened == [seg_name(100, fmt), seg_name(110, fmt)]  # [100, 110) may hold 108


def test_corrupt_unrelated_segment_does_not_matter(archive):
    root, fmt = archive
    (root / "partition=0" / seg_name(0, fmt)).write_bytes(b"\x00\xffnot a segment\n")
    assert normalized(rows(read(root, fmt, 0, 10, 25))) == expected(0, range(10, 25))
    with pytest.raises(TidemarkError, match=f"partition=0/{seg_name(0, fmt)}"):
        read(root, fmt, 0, 5, 12)


# --- bad archives -----------------------------------------------------------------------------


def write_lines(root, p: int, base: int, lines: list) -> str:
    folder = root / f"partition={p}"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / seg_name(base, "jsonl")
    path.write_bytes(
        b"".join((ln if isinstance(ln, bytes) else json.dumps(ln).encode()) + b"\n" for ln in lines)
    )
    return seg_name(base, "jsonl")


def jrow(p, o, **kw) -> dict:
    row = {
        "partition": p,
        "offset": o,
        "key": None,
        "payload": base64.b64encode(b"\x00x").decode(),
        "headers": None,
        "ts": 0,
    }
    row.update(kw)
    return row


def test_missing_archive_or_not_a_folder(tmp_path):
    with pytest.raises(TidemarkError, match=f"{tmp_path / 'nope'}: does not exist"):
        planner(tmp_path / "nope", "parquet").partitions()
    (tmp_path / "file").write_text("x")
    with pytest.raises(TidemarkError, match="not a directory"):
        planner(tmp_path / "file", "parquet").partitions()


def test_uri_credentials_never_shown():
    with pytest.raises(TidemarkError) as err:
        planner("nosuch://bob:hunter2@host/x", "parquet").partitions()
    assert "hunter2" not in str(err.value)
    assert "bob:***@host" in str(err.value)


@pytest.mark.parametrize("folder", ["partition=abc", "partition=07", "partition=-1"])
def test_bad_partition_folder(tmp_path, folder):
    (tmp_path / "partition=1").mkdir()
    (tmp_path / folder).mkdir()
    with pytest.raises(TidemarkError, match=folder):
        planner(tmp_path, "jsonl").partitions()


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        (jrow(0, 2, payload="%%%not base64"), "payload is not valid base64"),
        (jrow(0, 2, key="YWJj!"), "key is not valid base64"),
        (b'{"partition": 0, "offset": 2,', "not JSON"),
        (jrow(0, 2, partition=1), "record of partition 1 in the folder of partition 0"),
        (jrow(0, 1), "offset 1 after 1"),
        (jrow(0, 2, headers=[1, 2]), "headers must be a JSON object"),
        (jrow(0, 2, ts="yesterday"), "ts must be ISO-8601"),
        (jrow(0, 25), r"offset 25 outside the segment's interval \[0, 20\)"),
    ],
)
def test_bad_jsonl_line_names_file_and_line(tmp_path, line, problem):
    name = write_lines(tmp_path, 0, 0, [jrow(0, 0), jrow(0, 1), line, jrow(0, 30)])
    write_lines(tmp_path, 0, 20, [jrow(0, 20)])
    with pytest.raises(TidemarkError, match=f"partition=0/{name} line 3: {problem}"):
        read(tmp_path, "jsonl", 0, 0, 20)


def test_jsonl_ts_forms(tmp_path):
    write_lines(
        tmp_path,
        0,
        0,
        [
            jrow(0, 0, ts=1700000000123),
            jrow(0, 1, ts="2024-01-02T03:04:05.123456Z"),
            jrow(0, 2, ts="2024-01-02T03:04:05"),
            jrow(0, 3, ts=None),
        ],
    )
    got = [g["_tm_ts"] for g in rows(read(tmp_path, "jsonl", 0, 0, 4))]
    assert got == [
        datetime(2023, 11, 14, 22, 13, 20, 123000, tzinfo=UTC),
        datetime(2024, 1, 2, 3, 4, 5, 123456, tzinfo=UTC),
        datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC),
        None,
    ]


def test_bad_parquet_records(tmp_path):
    folder = tmp_path / "partition=0"
    folder.mkdir()

    def put(base, offsets, part=0, headers=None):
        rows_ = [archive_writer.arrow_row({**rec(part, o), "headers": headers}) for o in offsets]
        pq.write_table(
            pa.Table.from_pylist(rows_, archive_writer.ARROW_SCHEMA),
            folder / seg_name(base, "parquet"),
        )

    put(0, [0, 1, 2], part=1)
    with pytest.raises(TidemarkError, match=f"{seg_name(0, 'parquet')}: record of partition 1"):
        read(tmp_path, "parquet", 0, 0, 3)
    put(0, [0, 2, 1])
    with pytest.raises(TidemarkError, match="offset 1 after 2"):
        read(tmp_path, "parquet", 0, 0, 3)
    put(0, [0, 1, 2], headers="not json")
    with pytest.raises(TidemarkError, match="offset 0: headers is not a JSON object"):
        read(tmp_path, "parquet", 0, 0, 3)
    pq.write_table(pa.table({"partition": [0], "offset": [0]}), folder / seg_name(0, "parquet"))
    with pytest.raises(TidemarkError, match="missing column.*key, payload, headers, ts"):
        read(tmp_path, "parquet", 0, 0, 1)


def test_range_outside_archive(archive):
    root, fmt = archive
    with pytest.raises(TidemarkError, match="goes past the end of the archive \\(25\\)"):
        read(root, fmt, 0, 20, 30)
    with pytest.raises(TidemarkError, match="first segment starts at 100"):
        read(root, fmt, 1, 90, 105)
    with pytest.raises(TidemarkError, match="it has no segment"):
        read(root, fmt, 9, 0, 1)
    assert read(root, fmt, 0, 3, 3) == []


def test_headers_and_ts_of_letters_by_offset_gone_ones_left_out(archive, monkeypatch):
    """What a redrive reads for dead letters from before ledger V007: the headers text and ts
    of the records the archive still holds, as read_range gives them; a record in a gap, or
    in a segment retention deleted, is left out (the letter then says why)."""
    from tidemark import config

    root, fmt = archive
    monkeypatch.setattr(sources, "REFETCH_GAP", 4)  # 101 and 120 are read as two ranges
    for name in os.listdir(root / "partition=0"):
        if name == seg_name(0, fmt):  # retention: offsets 0 .. 9 are gone
            os.remove(root / "partition=0" / name)
    pipeline = config.parse(
        json.dumps(
            {
                "name": "orders",
                "source": {"type": "file_archive", "uri": str(root), "format": fmt},
                "decode": {"schema": {"id": "int"}},
                "transform": {"select": {"id": "id"}},
                "sinks": [
                    {"name": "main", "dsn": "postgresql://h/db", "table": "public.t", "key": ["id"]}
                ],
            }
        ),
        "test",
        deep=False,
    )
    got = sources.headers_and_ts(pipeline, {0: [14, 6, 12], 1: [120, 103, 101]})
    whole = {
        (p, g["_tm_offset"]): (g["_tm_headers"], g["_tm_ts"])
        for p, a, b in ((0, 10, 15), (1, 101, 121))
        for g in rows(read(root, fmt, p, a, b))
    }
    assert got == {k: whole[k] for k in ((0, 12), (0, 14), (1, 101), (1, 120))}
    headers, ts = got[(0, 14)]
    assert (json.loads(headers), ts) == (rec(0, 14)["headers"], rec(0, 14)["ts"])


# --- formats and names ------------------------------------------------------------------------


def write_mixed(root, p: int, bases: list[int], size: int) -> list[str]:
    """Segments of ``size`` dense offsets from each base, parquet and JSON Lines in turn."""
    fmts = [FORMATS[i % 2] for i in range(len(bases))]
    for base, fmt in zip(bases, fmts, strict=True):
        archive_writer.write_segment(
            str(root), p, [rec(p, o) for o in range(base, base + size)], fmt
        )
    return fmts


@pytest.mark.parametrize("declared", [None, "parquet", "jsonl"])
def test_a_folder_may_mix_formats_and_each_segment_is_read_by_its_extension(tmp_path, declared):
    write_mixed(tmp_path, 0, [0, 10, 20, 30], 10)
    write_mixed(tmp_path, 1, [5, 15], 10)
    add_noise(tmp_path)
    src = FileArchiveSource(type="file_archive", uri=str(tmp_path), format=declared)
    pl = fa.FileArchivePlanner(src)
    assert pl.partitions() == [0, 1]
    assert [pl.earliest(p) for p in (0, 1)] == [0, 5]
    assert [pl.latest(p) for p in (0, 1)] == [40, 25]  # a jsonl last, a parquet last
    assert pl.safe_end(0, 0, 1000) == 40
    got = rows(fa.read_range(src, Range(0, 0, 40)))
    assert normalized(got) == expected(0, range(0, 40))  # none skipped as a gap
    assert normalized(rows(fa.read_range(src, Range(0, 8, 33)))) == expected(0, range(8, 33))
    assert normalized(rows(fa.read_range(src, Range(1, 5, 25)))) == expected(1, range(5, 25))


def test_tombstones_keep_their_key_in_both_formats(tmp_path):
    write_mixed(tmp_path, 0, [0, 20], 10)  # offsets 7 (parquet) and 29 (jsonl): tombstones
    got = {g["_tm_offset"]: g for g in rows(read(tmp_path, None, 0, 0, 30))}
    for o in (7, 29):
        assert got[o]["_tm_payload"] is None
        assert got[o]["_tm_key"] == b"k\x00" + o.to_bytes(8, "big")
    assert got[9]["_tm_key"] is None and got[9]["_tm_payload"] is not None  # a null key


def test_config_accepts_format_and_needs_none():
    from tidemark.config import parse

    base = (
        "name: a\nsource: {type: file_archive, uri: /x%s}\ndecode: {schema: {id: int}}\n"
        "sinks: [{name: s, dsn: 'postgresql://h/d', table: t, key: [id]}]\n"
    )
    assert parse(base % "", "a.yaml").source.format is None
    assert parse(base % ", format: jsonl", "a.yaml").source.format == "jsonl"


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        (seg_name(30, "avro"), "unknown segment format \\(extension '.avro'\\)"),
        (seg_name(30, "json"), "unknown segment format \\(extension '.json'\\)"),
        (f"{seg_name(30, 'parquet')}.gz", "unknown segment format \\(extension '.parquet.gz'\\)"),
        (seg_name(30, "PARQUET"), "unknown segment format"),
        (f"{30:020d}", "unknown segment format \\(extension 'none'\\)"),
        ("30.parquet", "not a segment name"),
        (f"{30:021d}.jsonl", "not a segment name"),
        ("latest.jsonl", "not a segment name"),
    ],
)
def test_a_segment_like_name_stops_the_planner_and_the_reader(archive, name, problem):
    root, fmt = archive
    (root / "partition=0" / name).write_bytes(b"records nobody could read")
    where = f"partition=0/{name}: {problem}"
    with pytest.raises(TidemarkError, match=where):
        planner(root, fmt).safe_end(0, 0, 100)
    with pytest.raises(TidemarkError, match=where):
        planner(root, fmt).earliest(0)
    with pytest.raises(TidemarkError, match=where):
        read(root, fmt, 0, 0, 5)  # even a range below it: its records' place is unknown
    assert planner(root, fmt).safe_end(1, 100, 1000) == 126  # other partitions read on


def test_a_folder_named_like_a_segment_stops_the_run(archive):
    root, fmt = archive
    (root / "partition=1" / seg_name(130, "parquet")).mkdir()  # e.g. Spark's output folder
    with pytest.raises(
        TidemarkError, match=f"{seg_name(130, 'parquet')}: named like a segment but not a file"
    ):
        planner(root, fmt).safe_end(1, 100, 1000)


def test_two_segments_with_one_base_stop_the_run(tmp_path):
    archive_writer.write_segment(str(tmp_path), 0, [rec(0, o) for o in range(0, 5)], "parquet")
    with pytest.raises(TidemarkError, match="segment exists"):  # write_segment refuses it
        archive_writer.write_segment(str(tmp_path), 0, [rec(0, o) for o in range(0, 8)], "jsonl")
    archive_writer.write_segment(str(tmp_path / "x"), 0, [rec(0, o) for o in range(0, 8)], "jsonl")
    os.rename(
        tmp_path / "x" / "partition=0" / seg_name(0, "jsonl"),
        tmp_path / "partition=0" / seg_name(0, "jsonl"),
    )
    with pytest.raises(TidemarkError, match="base offset 0 is also"):
        planner(tmp_path, None).safe_end(0, 0, 100)
    with pytest.raises(TidemarkError, match="base offset 0 is also"):
        read(tmp_path, None, 0, 0, 5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_segment_must_start_at_its_base(tmp_path, fmt):
    archive_writer.write_segment(str(tmp_path), 0, [rec(0, o) for o in range(0, 10)], fmt)
    archive_writer.write_segment(str(tmp_path / "x"), 0, [rec(0, o) for o in range(13, 20)], fmt)
    os.rename(
        tmp_path / "x" / "partition=0" / seg_name(13, fmt),
        tmp_path / "partition=0" / seg_name(10, fmt),
    )  # records 13.. named 10
    problem = f"{seg_name(10, fmt)}: first record has offset 13, not the base offset 10"
    with pytest.raises(TidemarkError, match=problem):
        planner(tmp_path, None).safe_end(0, 0, 100) if fmt == "parquet" else read(
            tmp_path, None, 0, 0, 20
        )
    with pytest.raises(TidemarkError, match=problem):
        read(tmp_path, None, 0, 15, 16)  # also when the range starts past its first record
    assert normalized(rows(read(tmp_path, None, 0, 0, 10))) == expected(0, range(0, 10))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("damage", ["empty", "truncated", "garbage"])
def test_a_damaged_segment_stops_the_run_wherever_it_is(tmp_path, fmt, damage):
    for base in (0, 10, 20):
        archive_writer.write_segment(
            str(tmp_path), 0, [rec(0, o) for o in range(base, base + 10)], fmt
        )
    for base in (10, 20):  # in the middle (the reader finds it), last (the planner does)
        path = tmp_path / "partition=0" / seg_name(base, fmt)
        data = path.read_bytes()
        # JSON Lines: cut inside a line; a cut at a line's end cannot be told from a gap
        path.write_bytes(
            {
                "empty": b"",
                "truncated": data[: len(data) // 2 + 3],
                "garbage": b"\x00\xffPAR1 not a segment\n",
            }[damage]
        )
        name = f"partition=0/{seg_name(base, fmt)}"
        if base == 20:
            with pytest.raises(TidemarkError, match=name):
                planner(tmp_path, None).safe_end(0, 10, 100)
        with pytest.raises(TidemarkError, match=name):
            read(tmp_path, None, 0, 5, base + 5)
        path.write_bytes(data)
    assert normalized(rows(read(tmp_path, None, 0, 0, 10))) == expected(0, range(0, 10))


def test_a_parquet_segment_without_rows_stops_the_run(tmp_path):
    archive_writer.write_segment(str(tmp_path), 0, [rec(0, o) for o in range(0, 10)], "parquet")
    pq.write_table(
        archive_writer.ARROW_SCHEMA.empty_table(),
        tmp_path / "partition=0" / seg_name(10, "parquet"),
    )
    problem = f"{seg_name(10, 'parquet')}: holds no record"
    with pytest.raises(TidemarkError, match=problem):
        planner(tmp_path, None).safe_end(0, 0, 100)
    with pytest.raises(TidemarkError, match=problem):
        read(tmp_path, None, 0, 5, 11)
    assert len(rows(read(tmp_path, None, 0, 5, 10))) == 5  # a range below it does not open it


def test_a_time_window_maps_to_offsets_of_each_partition_from_the_records_times(archive):
    root, _ = archive
    planner = fa.FileArchivePlanner(FileArchiveSource(type="file_archive", uri=str(root)))
    # rec() stamps offset o at T0 + o seconds: [T0+3s, T0+12s) holds offsets 3..11 of
    # partition 0 and 3..4 of partition 2 (partition 1 starts at 100 s).
    since, until = T0 + timedelta(seconds=3), T0 + timedelta(seconds=12)
    assert planner.window(0, since, until, end=25) == (3, 12)
    assert planner.window(0, since, until, end=8) == (3, 8)
    assert planner.window(2, since, until, end=5) == (3, 5)
    assert planner.window(1, since, until, end=126) is None


def test_a_time_window_is_utc_whatever_the_segments_time_zone_or_the_machines(
    tmp_path, monkeypatch
):
    """Issue 45 case 7: times are UTC instants. Parquet with a naive ts (UTC) or one in
    another zone, JSON Lines with naive text (UTC), an offset or epoch milliseconds all map a
    window to the same offsets, whatever TZ the machine (Spark's driver) runs in."""
    monkeypatch.setenv("TZ", "Europe/Berlin")
    time.tzset()
    try:
        t0 = datetime(2026, 5, 1, tzinfo=UTC)
        moments = [t0 + timedelta(minutes=m) for m in (0, 10, 20, 12, 40)]
        root = tmp_path / "arch"
        forms = {
            0: ("parquet", pa.timestamp("us"), [t.replace(tzinfo=None) for t in moments]),
            1: ("parquet", pa.timestamp("us", tz="Europe/Berlin"), moments),
            2: ("jsonl", None, [t.replace(tzinfo=None).isoformat() for t in moments]),
            3: ("jsonl", None, [t.astimezone(timezone(timedelta(hours=2))).isoformat()
                                for t in moments]),
            4: ("jsonl", None, [int(t.timestamp() * 1000) for t in moments]),
        }  # fmt: skip
        for p, (fmt, typ, times) in forms.items():
            folder = root / f"partition={p}"
            folder.mkdir(parents=True)
            cols = {
                "partition": pa.array([p] * 5, pa.int32()),
                "offset": pa.array(range(5), pa.int64()),
                "key": pa.array([b"k"] * 5, pa.binary()),
                "payload": pa.array([b"{}"] * 5, pa.binary()),
                "headers": pa.array([None] * 5, pa.string()),
            }
            if fmt == "parquet":
                table = pa.table({**cols, "ts": pa.array(times, typ)})
                pq.write_table(table, folder / seg_name(0, "parquet"))
                continue
            lines = [
                json.dumps({"partition": p, "offset": o, "key": "aw==", "payload": "e30=",
                            "headers": None, "ts": t})
                for o, t in enumerate(times)
            ]  # fmt: skip
            (folder / seg_name(0, "jsonl")).write_text("\n".join(lines) + "\n")
        plan = fa.FileArchivePlanner(FileArchiveSource(type="file_archive", uri=str(root)))
        since, until = t0 + timedelta(minutes=10), t0 + timedelta(minutes=20)
        berlin = timezone(timedelta(hours=2))
        for p in forms:
            # Minutes 10, 20 and the late 12: offsets [1, 4), however the window is written.
            assert plan.window(p, since, until, end=5) == (1, 4), p
            assert plan.window(p, since.astimezone(berlin), until.astimezone(berlin), 5) == (1, 4)
            got = [t for b in read(root, None, p, 0, 5) for t in b.column("_tm_ts").to_pylist()]
            assert got == moments, p
    finally:
        monkeypatch.undo()
        time.tzset()


def test_the_layout_examples_of_the_docs_write_an_archive_the_reader_reads(tmp_path):
    """docs/pipelines.md shows a Parquet and a JSON Lines segment written with pyarrow and
    json alone; run as they stand (in a temporary folder), the source reads them back."""
    from tests.conftest import REPO

    text = (REPO / "docs" / "pipelines.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    snippets = [b for b in blocks if "/tmp/archive/orders" in b]
    assert len(snippets) == 2, "the docs' two archive examples"
    root = tmp_path / "archive" / "orders"
    for code in snippets:
        exec(compile(code.replace("/tmp/archive/orders", str(root)), "pipelines.md", "exec"), {})
    src = FileArchiveSource(type="file_archive", uri=str(root))
    assert sorted(os.listdir(root / "partition=0")) == [
        "00000000000000000000.parquet",
        "00000000000000000003.jsonl",
    ]
    got = [r for b in fa.read_range(src, Range(0, 0, 6)) for r in b.to_pylist()]
    assert [r["_tm_offset"] for r in got] == [0, 1, 2, 3, 5]
    assert [json.loads(r["_tm_payload"])["id"] for r in got] == [0, 1, 2, 3, 5]
    assert {r["_tm_key"] for r in got} == {b"0", b"1", b"2", b"3", b"5"}
    assert got[3]["_tm_ts"] == datetime(2026, 11, 3, 14, 0, 3, tzinfo=UTC)
    assert all(json.loads(r["_tm_headers"]) == {"source": "shop"} for r in got)
    # The JSON line the docs show is what the example writes.
    line = (root / "partition=0" / "00000000000000000003.jsonl").read_text().splitlines()[0]
    assert f"\n{line}\n" in text


def test_the_postgres_log_ddl_in_the_docs_is_what_source_create_runs():
    from tests.conftest import REPO
    from tidemark.sources import log_table

    text = (REPO / "docs" / "pipelines.md").read_text()
    assert f"```sql\n{log_table.ddl('events.log')}\n```" in text
