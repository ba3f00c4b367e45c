"""The chaos world's source log, in one of two places, behind one small interface.

- :class:`PostgresLog`: a ``postgres_log`` table in the ledger database (``src.log``);
- :class:`FileArchive`: a ``file_archive`` folder of Kafka-style segments,
  ``<uri>/partition=<P>/<20-digit base offset>.<parquet|jsonl>``, both formats mixed within a
  partition, optionally with compaction gaps (offsets no segment holds) between segments.

Both append through a writer of Tidemark's (``postgres_log.append``,
``archive_writer.write_segment``) and read the records back with plain SQL or plain
pyarrow/JSON (the checker and the oracle read the source through :meth:`records`, never
through ``tidemark.sources``'s readers: a reader bug cannot hide itself from its judge).
"""

from __future__ import annotations

import base64
import json
import random
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import psycopg
import pyarrow.parquet as pq
from psycopg import sql

# One appended record: (partition, key, payload, headers JSON text).
Draft = tuple[int, bytes | None, bytes | None, str | None]


@dataclass(frozen=True)
class SourceRecord:
    p: int
    o: int
    key: bytes | None
    payload: bytes | None
    headers: str | None  # as the transform's _tm_headers reads them
    ts: datetime | None


def _ident(table: str) -> sql.Composable:
    return sql.SQL(".").join(sql.Identifier(p) for p in table.split(".", 1))


class PostgresLog:
    kind = "postgres_log"

    def __init__(self, dsn: str, table: str):
        self.dsn, self.table = dsn, table
        self.segments = {"parquet": 0, "jsonl": 0, "gaps": 0}

    def create(self) -> None:
        from tidemark.sources.postgres_log import create_log_table

        with psycopg.connect(self.dsn) as conn:
            create_log_table(conn, self.table)

    def spec(self) -> dict:
        return {"type": "postgres_log", "dsn": self.dsn, "table": self.table}

    def append(
        self, records: list[Draft], rng: random.Random | None = None
    ) -> dict[int, tuple[int, int]]:
        """Append records in one transaction; {partition: (first offset, last offset)}."""
        from tidemark.sources.postgres_log import append

        with psycopg.connect(self.dsn, application_name="chaos") as conn:
            return append(conn, self.table, [(*r, None) for r in records])

    def records(self, after: dict[int, int] | None = None) -> list[SourceRecord]:
        """Every record (or those above ``after``'s offset per partition)."""
        with psycopg.connect(self.dsn, autocommit=True, application_name="chaos-check") as c:
            return [
                SourceRecord(
                    p, o, None if k is None else bytes(k), None if v is None else bytes(v), h, ts
                )
                for p, o, k, v, h, ts in c.execute(
                    sql.SQL(
                        'SELECT "partition", "offset", key, payload, headers::text, ts FROM {} '
                        'WHERE "offset" > coalesce((%s::jsonb ->> "partition"::text)::bigint, '
                        "-1)"
                    ).format(_ident(self.table)),
                    (json.dumps({str(k): v for k, v in (after or {}).items()}),),
                )
            ]

    def trim(self, partition: int, below: int) -> list[tuple[int, int]]:
        """Retention: delete the partition's records below ``below``; the positions gone."""
        with psycopg.connect(self.dsn, autocommit=True, application_name="chaos") as c:
            rows = c.execute(
                sql.SQL(
                    'DELETE FROM {} WHERE "partition" = %s AND "offset" < %s '
                    'RETURNING "partition", "offset"'
                ).format(_ident(self.table)),
                (partition, below),
            ).fetchall()
        return sorted((p, o) for p, o in rows)

    def ends(self) -> dict[int, int]:
        """Partition -> its highest offset + 1."""
        with psycopg.connect(self.dsn, autocommit=True, application_name="chaos-check") as c:
            return dict(
                c.execute(
                    sql.SQL('SELECT "partition", max("offset") + 1 FROM {} GROUP BY 1').format(
                        _ident(self.table)
                    )
                ).fetchall()
            )


class FileArchive:
    kind = "file_archive"
    GAP = 0.3  # a new segment starts a few offsets past the end (a compaction gap)

    def __init__(self, root: Path):
        self.root = root
        self.next: dict[int, int] = {}
        self.segments = {"parquet": 0, "jsonl": 0, "gaps": 0, "trimmed": 0, "late": 0}
        self.gaps: dict[int, list[tuple[int, int]]] = {}  # partition -> [a, b) no segment holds

    def create(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def spec(self) -> dict:
        return {"type": "file_archive", "uri": str(self.root)}

    def append(
        self, records: list[Draft], rng: random.Random | None = None
    ) -> dict[int, tuple[int, int]]:
        """Append records as new segments, one or two per partition, each of a format drawn
        from ``rng`` (seeded), sometimes after a gap; {partition: (first, last offset)}."""
        from tidemark.devstack.archive_writer import write_segment

        r = rng or random.Random(0)
        by_part: dict[int, list[Draft]] = {}
        for rec in records:
            by_part.setdefault(rec[0], []).append(rec)
        spans: dict[int, tuple[int, int]] = {}
        ts = datetime.now(UTC)
        for p, recs in sorted(by_part.items()):
            cut = r.randint(1, len(recs)) if len(recs) > 1 and r.random() < 0.4 else len(recs)
            for chunk in (recs[:cut], recs[cut:]):
                if not chunk:
                    continue
                start = self.next.get(p, 0)
                if start and r.random() < self.GAP:
                    gap = r.randint(1, 3)
                    self.gaps.setdefault(p, []).append((start, start + gap))
                    start += gap
                    self.segments["gaps"] += 1
                fmt = r.choice(("parquet", "jsonl"))
                rows = [
                    {
                        "partition": p,
                        "offset": start + i,
                        "key": k,
                        "payload": v,
                        "headers": h,
                        "ts": ts,
                    }
                    for i, (_p, k, v, h) in enumerate(chunk)
                ]
                write_segment(str(self.root), p, rows, fmt)
                self.segments[fmt] += 1
                self.next[p] = start + len(chunk)
                first = spans.get(p, (start, 0))[0]
                spans[p] = (first, start + len(chunk) - 1)
        return spans

    def write_late(
        self, partition: int, base: int, records: list[Draft], rng: random.Random
    ) -> dict[int, tuple[int, int]]:
        """A segment that appears late, at ``base`` inside one of the partition's gaps (which
        it fills from its start): an archive writer that broke its contract."""
        from tidemark.devstack.archive_writer import write_segment

        fmt = rng.choice(("parquet", "jsonl"))
        ts = datetime.now(UTC)
        rows = [
            {
                "partition": partition,
                "offset": base + i,
                "key": k,
                "payload": v,
                "headers": h,
                "ts": ts,
            }
            for i, (_p, k, v, h) in enumerate(records)
        ]
        write_segment(str(self.root), partition, rows, fmt)
        self.segments["late"] += 1
        self.segments[fmt] += 1
        gaps = self.gaps.get(partition, [])
        for i, (a, b) in enumerate(gaps):
            if a == base:
                gaps[i] = (base + len(records), b)
        self.gaps[partition] = [(a, b) for a, b in gaps if b > a]
        return {partition: (base, base + len(records) - 1)}

    def trim(self, partition: int, below: int) -> list[tuple[int, int]]:
        """Retention: delete the partition's segments whose every record lies below
        ``below``; the positions gone."""
        gone: list[tuple[int, int]] = []
        for p, _base, f in self._files():
            if p != partition:
                continue
            offs = [r.o for r in self._read(f)]
            if offs and max(offs) < below:
                f.unlink()
                gone += [(p, o) for o in offs]
                self.segments["trimmed"] += 1
        return sorted(gone)

    def _read(self, f: Path) -> list[SourceRecord]:
        out: list[SourceRecord] = []
        if f.suffix == ".parquet":
            for r in pq.read_table(f).to_pylist():
                out.append(
                    SourceRecord(
                        r["partition"], r["offset"], r["key"], r["payload"], r["headers"], r["ts"]
                    )
                )
            return out
        for line in f.read_bytes().splitlines():
            if not line.strip():
                continue
            r = json.loads(line)
            h = r["headers"]
            ts = datetime.fromisoformat(r["ts"]) if r["ts"] is not None else None
            out.append(
                SourceRecord(
                    r["partition"],
                    r["offset"],
                    _unb64(r["key"]),
                    _unb64(r["payload"]),
                    None if h is None else json.dumps(h, ensure_ascii=False),
                    ts,
                )
            )
        return out

    def _files(self) -> list[tuple[int, int, Path]]:
        out = []
        for d in self.root.glob("partition=*"):
            p = int(d.name.split("=", 1)[1])
            for f in d.iterdir():
                if f.name[:1] in "._" or f.suffix not in (".parquet", ".jsonl"):
                    continue
                out.append((p, int(f.stem), f))
        return sorted(out)

    def records(self, after: dict[int, int] | None = None) -> list[SourceRecord]:
        after = after or {}
        files = self._files()
        out: list[SourceRecord] = []
        for i, (p, _base, f) in enumerate(files):
            nxt = files[i + 1] if i + 1 < len(files) else None
            if nxt and nxt[0] == p and nxt[1] <= after.get(p, -1) + 1:
                continue  # every record of this segment is below the next segment's base
            out += self._read(f)
        return [r for r in out if r.o > after.get(r.p, -1)]

    def ends(self) -> dict[int, int]:
        return (
            dict(self.next)
            if self.next
            else {r.p: r.o + 1 for r in sorted(self.records(), key=lambda r: (r.p, r.o))}
        )


def _unb64(v: str | None) -> bytes | None:
    return None if v is None else base64.b64decode(v)
