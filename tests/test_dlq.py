"""Dead-letter review (tidemark/ledger/dlq.py and `tidemark dlq`) against a real PostgreSQL: filters,
counts, keyset pages over 100,000 rows, discard, export, payload rendering
(tidemark/render/payloads.py), injection."""

from __future__ import annotations

import base64
import datetime as dt
import getpass
import json
import socket

import psycopg
import pytest

from tests.test_cli import assert_one_clear_line, tm
from tidemark.core.errors import BadInput, Busy
from tidemark.ledger import dlq
from tidemark.render import payloads

T0 = dt.datetime(2026, 3, 1, 12, 0, tzinfo=dt.UTC)
INJECTIONS = (
    "x' OR '1'='1",
    "'; DROP TABLE tidemark.dlq; --",
    'main" OR 1=1 --',
    "1; DELETE FROM tidemark.dlq",
)
_offsets = iter(range(10_000_000))


def exported(lines) -> list[dict]:
    """An export's letters, checked whole: its last line counts them."""
    lines = [ln for ln in lines if ln.strip()]
    assert lines and json.loads(lines[-1]) == {dlq.EXPORT_END: {"records": len(lines) - 1}}
    return [json.loads(ln) for ln in lines[:-1]]


def add(
    conn,
    pipeline="orders",
    sink="main",
    cls="decode",
    status="quarantined",
    payload=b'{"id": 1}',
    minutes=0,
    key=b"k1",
    headers=None,
    reason="bad record",
    **extra,
) -> int:
    cols = {
        "pipeline": pipeline,
        "sink": sink,
        "run_id": 1,
        "source_partition": 0,
        "source_offset": next(_offsets),
        "key": key,
        "payload": payload,
        "headers": json.dumps(headers) if headers is not None else None,
        "error_class": cls,
        "reason": reason,
        "status": status,
        "first_seen": T0 + dt.timedelta(minutes=minutes),
        "last_seen": T0 + dt.timedelta(minutes=minutes),
        **extra,
    }
    names = ", ".join(cols)
    marks = ", ".join(["%s"] * len(cols))
    return conn.execute(
        f"INSERT INTO tidemark.dlq ({names}) VALUES ({marks}) RETURNING id", list(cols.values())
    ).fetchone()[0]


@pytest.fixture
def ledger(env):
    with psycopg.connect(env.ledger_dsn, autocommit=True) as c:
        yield c


@pytest.fixture
def sample(ledger):
    """Nine dead letters across pipelines, sinks, classes, statuses and an hour of time."""
    ids = {
        "a": add(ledger, minutes=0),
        "b": add(ledger, sink="archive", cls="transform", minutes=10),
        "c": add(ledger, cls="validation", minutes=20, status="discarded"),
        "d": add(ledger, sink="archive", cls="sink_write", minutes=30),
        "e": add(ledger, pipeline="gated", cls="dq_gate", minutes=40),
        "f": add(ledger, pipeline="gated", sink="archive", minutes=50, status="redriven"),
        "g": add(ledger, cls="validation", minutes=60),
        "h": add(ledger, payload=b"\x00\x01binary", minutes=70),
        "i": add(ledger, pipeline="gated", cls="decode", minutes=80),
    }
    return ids


def ids_of(conn, limit=50, **raw) -> list[int]:
    return [r["id"] for r in dlq.page(conn, dlq.Filters.parse(**raw), limit).rows]


def test_each_filter(ledger, sample):
    s = sample
    newest_first = sorted(s.values(), reverse=True)
    assert ids_of(ledger) == newest_first
    assert ids_of(ledger, status="any") == newest_first
    assert ids_of(ledger, pipeline="gated") == [s["i"], s["f"], s["e"]]
    assert ids_of(ledger, sink="archive") == [s["f"], s["d"], s["b"]]
    assert ids_of(ledger, sink="archive", pipeline="orders") == [s["d"], s["b"]]
    for old in ("-", "(source)"):  # every letter names its sink: no pseudo-sink any more
        with pytest.raises(BadInput, match="names its sink"):
            ids_of(ledger, sink=old)
    assert ids_of(ledger, error_class="validation") == [s["g"], s["c"]]
    assert ids_of(ledger, status="quarantined") == sorted(
        set(s.values()) - {s["c"], s["f"]}, reverse=True
    )
    assert ids_of(ledger, status="discarded") == [s["c"]]
    assert ids_of(ledger, status="redriven", pipeline="gated") == [s["f"]]
    since, until = (T0 + dt.timedelta(minutes=20)).isoformat(), "2026-03-01T13:00:00+00:00"
    assert ids_of(ledger, since=since, until=until) == [s["f"], s["e"], s["d"], s["c"]]
    assert ids_of(ledger, since="2026-03-01T15:00:00+02:00") == [s["i"], s["h"], s["g"]]
    assert ids_of(ledger, until="2026-03-01 12:10") == [s["a"]]  # naive means UTC
    assert ids_of(ledger, ids=f"{s['a']},{s['e']} {s['i']}") == [s["i"], s["e"], s["a"]]
    assert ids_of(ledger, ids=[s["a"]], pipeline="gated") == []
    assert ids_of(ledger, pipeline="nope") == []


@pytest.mark.parametrize(
    "raw, needle",
    [
        ({"error_class": "oops"}, "error_class 'oops': expected one of decode, transform"),
        ({"status": "gone"}, "status 'gone': expected one of quarantined, redriven"),
        ({"pipeline": "Orders!"}, "pipeline 'Orders!': not a name"),
        ({"sink": "a b"}, "sink 'a b': not a sink name"),
        ({"since": "yesterday"}, "since 'yesterday': not an ISO timestamp"),
        ({"until": "1700000000"}, "until '1700000000': not an ISO timestamp"),
        (
            {"since": "2026-03-02", "until": "2026-03-01"},
            "until (2026-03-01T00:00:00+00:00) must be after since",
        ),
        ({"ids": "4,x"}, "ids: 'x' is not a dead-letter id"),
        ({"ids": "0"}, "ids: '0' is not a dead-letter id"),
    ],
)
def test_bad_filter_values_are_one_clear_line(raw, needle):
    with pytest.raises(BadInput) as exc:
        dlq.Filters.parse(**raw)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_page_limits_are_checked(ledger, sample):
    f = dlq.Filters()
    for bad in (0, dlq.MAX_LIMIT + 1):
        with pytest.raises(BadInput, match="limit"):
            dlq.page(ledger, f, bad)
    with pytest.raises(BadInput, match="before"):
        dlq.page(ledger, f, 10, before=-3)


def test_counts(ledger, sample):
    zero = dict.fromkeys(dlq.ERROR_CLASSES, 0)
    assert dlq.counts(ledger, dlq.Filters()) == {
        **zero,
        "decode": 4,
        "transform": 1,
        "validation": 2,
        "dq_gate": 1,
        "sink_write": 1,
    }
    assert dlq.counts(ledger, dlq.Filters.parse(pipeline="orders", status="quarantined")) == {
        **zero,
        "decode": 2,
        "transform": 1,
        "validation": 1,
        "sink_write": 1,
    }
    assert dlq.counts_by_pipeline(ledger) == {
        "gated": {**zero, "decode": 1, "dq_gate": 1},
        "orders": {**zero, "decode": 2, "transform": 1, "validation": 1, "sink_write": 1},
    }
    assert dlq.counts_by_pipeline(ledger, ["gated"]) == {
        "gated": {**zero, "decode": 1, "dq_gate": 1}
    }
    assert dlq.pipelines(ledger) == ["gated", "orders"]


def test_keyset_pages_over_100k_rows_are_disjoint_and_complete(ledger):
    ledger.execute("""
        INSERT INTO tidemark.dlq (pipeline, sink, run_id, source_partition, source_offset,
                                  payload, error_class, reason, status, last_seen)
        SELECT CASE WHEN i % 3 = 0 THEN 'gated' ELSE 'orders' END,
               CASE WHEN i % 5 = 0 THEN 'archive' ELSE 'main' END, 1, i % 4, i,
               convert_to('{"i": ' || i || '}', 'UTF8'),
               (ARRAY['decode','transform','validation','dq_gate','sink_write'])[1 + i % 5]
                   ::tidemark.error_class,
               'generated',
               (ARRAY['quarantined','quarantined','quarantined','discarded','redriven'])
                   [1 + i % 7 % 5]::tidemark.dlq_status,
               timestamptz '2026-01-01' + i * interval '1 second'
        FROM generate_series(1, 100000) AS i""")
    ledger.execute("ANALYZE tidemark.dlq")

    def walk(limit: int, **raw) -> list[int]:
        f, seen, before, pages = dlq.Filters.parse(**raw), [], None, 0
        while True:
            pg = dlq.page(ledger, f, limit, before)
            ids = [r["id"] for r in pg.rows]
            assert ids == sorted(ids, reverse=True)
            assert not set(ids) & set(seen), "pages overlap"
            seen.extend(ids)
            pages += 1
            if pg.next_before is None:
                return seen
            assert pg.next_before == ids[-1]
            before = pg.next_before

    def expected(where: str = "TRUE", args=()) -> list[int]:
        return [
            r[0]
            for r in ledger.execute(
                f"SELECT id FROM tidemark.dlq WHERE {where} ORDER BY id DESC", args
            )
        ]

    assert walk(1000, status="quarantined") == expected("status = 'quarantined'")
    assert walk(1000, status="any") == expected()
    assert walk(997, pipeline="orders", status="any") == expected("pipeline = 'orders'")
    assert walk(500, pipeline="gated", sink="archive", error_class="decode") == expected(
        "pipeline = 'gated' AND sink = 'archive' AND error_class = 'decode'"
    )
    assert len(expected()) == 100_000
    every = exported(dlq.export(ledger, dlq.Filters.parse(pipeline="orders")))
    assert len(every) == len(expected("pipeline = 'orders'"))

    # Deep pages walk an index from the cursor; no full scan, no OFFSET.
    for raw in ({"pipeline": "orders"}, {"status": "any"}, {"pipeline": "gated", "status": "any"}):
        f = dlq.Filters.parse(**raw)
        where, args = dlq._where(f, status=f.status or "quarantined", before=1234)
        plan = "\n".join(
            r[0]
            for r in ledger.execute(
                psycopg.sql.SQL(
                    "EXPLAIN SELECT id FROM tidemark.dlq WHERE {} ORDER BY id DESC LIMIT 51"
                ).format(where),
                args,
            )
        )
        assert "Index" in plan and "Seq Scan" not in plan, plan


def test_discard_needs_a_note_and_changes_only_quarantined(env, ledger, sample):
    s = sample
    for note in ("", "   ", None):
        with pytest.raises(BadInput, match="note: required"):
            dlq.discard(ledger, [s["a"]], note, "alice")
    with pytest.raises(BadInput, match="by: required"):
        dlq.discard(ledger, [s["a"]], "dup", " ")
    with pytest.raises(BadInput, match="ids"):
        dlq.discard(ledger, [], "dup", "alice")
    assert env.ledger("SELECT status::text FROM tidemark.dlq WHERE id = %s", (s["a"],)) == [
        ("quarantined",)
    ]

    res = dlq.discard(
        ledger, [s["a"], s["c"], s["f"], 999_999, s["a"]], " known duplicate ", "alice"
    )
    assert res.changed == [s["a"]]
    assert res.skipped == {
        s["c"]: "already discarded",
        s["f"]: "already redriven",
        999_999: "no such dead letter",
    }
    by, at, note, status = env.ledger(
        "SELECT resolved_by, resolved_at, note, status::text FROM tidemark.dlq WHERE id = %s",
        (s["a"],),
    )[0]
    assert (by, note, status) == ("alice", "known duplicate", "discarded")
    assert abs((dt.datetime.now(dt.UTC) - at).total_seconds()) < 60
    again = dlq.discard(ledger, [s["a"]], "twice", "bob")
    assert again.changed == [] and again.skipped == {s["a"]: "already discarded"}
    assert env.ledger("SELECT resolved_by, note FROM tidemark.dlq WHERE id = %s", (s["a"],)) == [
        ("alice", "known duplicate")
    ]


def test_discard_of_a_record_a_redrive_holds_is_busy_not_a_hang(env, ledger, sample):
    s = sample
    with psycopg.connect(env.ledger_dsn, autocommit=True) as redrive:
        redrive.execute("BEGIN")
        redrive.execute("UPDATE tidemark.dlq SET status = 'redriven' WHERE id = %s", (s["g"],))
        redrive.execute("PREPARE TRANSACTION 'tm_test_redrive'")
        try:
            with pytest.raises(Busy) as exc:
                dlq.discard(ledger, [s["a"], s["g"]], "noise", "alice")
            assert str(exc.value).startswith(f"record {s['g']} is being redriven, try again")
            assert env.ledger("SELECT status::text FROM tidemark.dlq WHERE id = %s", (s["a"],)) == [
                ("quarantined",)
            ]  # all or nothing
        finally:
            redrive.execute("ROLLBACK PREPARED 'tm_test_redrive'")
    assert dlq.discard(ledger, [s["a"], s["g"]], "noise", "alice").changed == [s["a"], s["g"]]


def test_export_jsonl_round_trip(ledger, sample):
    blob = bytes(range(256)) * 3
    rid = add(
        ledger,
        payload=blob,
        key=b"\xff\x00key",
        headers={"v": 2, "trace": "ab"},
        detail="Traceback...\nValueError: x",
    )
    lines = list(dlq.export(ledger, dlq.Filters.parse(ids=[rid, sample["a"]])))
    assert all(ln.endswith("\n") for ln in lines)
    recs = exported(lines)
    assert [r["id"] for r in recs] == [sample["a"], rid]  # oldest first
    rec = recs[1]
    assert set(rec) == set(dlq.ENVELOPE)
    assert base64.b64decode(rec["payload"]) == blob
    assert base64.b64decode(rec["key"]) == b"\xff\x00key"
    assert rec["headers"] == {"v": 2, "trace": "ab"}
    assert rec["detail"] == "Traceback...\nValueError: x"
    assert dt.datetime.fromisoformat(rec["first_seen"]) == T0
    assert (rec["pipeline"], rec["sink"], rec["error_class"], rec["status"]) == (
        "orders",
        "main",
        "decode",
        "quarantined",
    )
    every = exported(dlq.export(ledger, dlq.Filters()))
    assert len(every) == len(sample) + 1


def _big_letters(conn, n: int, size: int) -> list[int]:
    """n letters of ``size`` bytes each, made by the server (compressible: small on disk)."""
    return [
        r[0]
        for r in conn.execute(
            """INSERT INTO tidemark.dlq (pipeline, sink, run_id, source_partition, source_offset,
                                     payload, error_class, reason, status)
           SELECT 'big', 'main', 1, 0, i, convert_to(repeat(md5(i::text), %s / 32), 'UTF8'),
                  'decode', 'big letter', 'quarantined'
           FROM generate_series(1, %s) AS i RETURNING id""",
            (size, n),
        ).fetchall()
    ]


def test_export_memory_is_bounded_by_bytes_not_rows(ledger):
    """24 letters of 2 MiB (48 MiB): fetched 2,000 rows at a time they would all be in memory
    at once; by a byte budget the export's peak stays near budget + one letter's lines."""
    import tracemalloc

    mib = 1024 * 1024
    ids = _big_letters(ledger, 24, 2 * mib)
    tracemalloc.start()
    try:
        n = 0
        for line in dlq.export(ledger, dlq.Filters(pipeline="big")):
            n += 1
            assert len(line) > 2 * mib or n == len(ids) + 1  # a letter's line, or the end
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert n == len(ids) + 1
    assert peak < dlq.EXPORT_BYTES + 16 * mib, f"export peak {peak / mib:.1f} MiB"
    # a budget smaller than one letter: one letter at a time, every letter once, in order
    got = [x["id"] for x in exported(dlq.export(ledger, dlq.Filters(pipeline="big"), budget=1))]
    assert got == ids


def test_a_big_payload_is_read_in_slices(ledger):
    (rid,) = _big_letters(ledger, 1, 3 * 1024 * 1024 + 64)
    whole = bytes(
        ledger.execute("SELECT payload FROM tidemark.dlq WHERE id = %s", (rid,)).fetchone()[0]
    )
    head = dlq.get(ledger, rid, payload_limit=1000)
    assert (head["payload"], head["payload_size"]) == (whole[:1000], len(whole))
    assert dlq.get(ledger, rid)["payload"] == whole
    chunks = list(dlq.payload_chunks(ledger, rid, chunk=1024 * 1024))
    assert [len(c) for c in chunks] == [1024 * 1024] * 3 + [64]
    assert b"".join(chunks) == whole
    assert list(dlq.payload_chunks(ledger, 10**9)) == []
    assert dlq.pipeline_of(ledger, rid) == "big" and dlq.pipeline_of(ledger, 10**9) is None


def test_render_payload():
    assert payloads.render_payload(b'{"b": [1, 2], "a": "\xc3\xa9"}') == (
        "json",
        '{\n  "b": [\n    1,\n    2\n  ],\n  "a": "é"\n}',
    )
    assert payloads.render_payload("plain text, ünïcode\n".encode()) == (
        "text",
        "plain text, ünïcode\n",
    )
    kind, text = payloads.render_payload(b"\x00\x01\x02ABC\xff" + b"z" * 20)
    assert kind == "hex"
    assert text.splitlines()[0] == (
        "00000000  00 01 02 41 42 43 ff 7a  7a 7a 7a 7a 7a 7a 7a 7a  |...ABC.zzzzzzzzz|"
    )
    assert payloads.render_payload(b'{"a": 1}', "text") == ("text", '{"a": 1}')
    assert payloads.render_payload(b'{"a": 1}', "hex")[0] == "hex"
    assert payloads.render_payload(b"not json\x07")[0] == "hex"
    with pytest.raises(BadInput, match="payload is not JSON"):
        payloads.render_payload(b"nope", "json")
    with pytest.raises(BadInput, match="format"):
        payloads.render_payload(b"x", "yaml")
    kind, text = payloads.render_payload(b"a" * 100, limit=10)
    assert kind == "text" and text.startswith("a" * 10 + "\n... 90 more bytes not shown")
    assert payloads.render_payload(None) == ("text", "")
    # 100,000 nested '[' make json.loads raise RecursionError: text, not a crash
    assert payloads.render_payload(b"[" * 100_000) == ("text", "[" * 100_000)
    with pytest.raises(BadInput, match="nested too deeply"):
        payloads.render_payload(b"[" * 100_000, "json")
    # only the head of a longer payload (get(..., payload_limit=...)): the note counts the rest
    kind, text = payloads.render_payload(b'{"a": 1', limit=10, size=5000)
    assert kind == "text" and text.endswith(
        "4,993 more bytes not shown; download or export the record for all of them"
    )
    kind, text = payloads.render_payload("ab€".encode()[:4], limit=4, size=5)  # cut inside the €
    assert (kind, text.splitlines()) == (
        "text",
        ["ab", "... 3 more bytes not shown; download or export the record for all of them"],
    )
    assert payloads.preview(b'{"id": "\xc3\xa9\xc3', 40) == '{"id": "é…'


# 121 KB that indent to 48.5 MB: 60,000 numbers 400 levels deep (issue 34)
WIDE_AND_DEEP = b"[" * 400 + b",".join([b"1"] * 60_000) + b"]" * 400


@pytest.mark.parametrize("fmt", ["auto", "json", "text", "hex"])
def test_every_rendering_is_bounded_by_its_output(fmt):
    kind, text = payloads.render_payload(
        WIDE_AND_DEEP,
        fmt,
        limit=256 * 1024,
        size=len(WIDE_AND_DEEP),
        max_chars=payloads.RENDER_CHARS,
    )
    assert len(text) <= payloads.RENDER_CHARS + 300  # the output and its note, not 48.5 MB
    if fmt in ("auto", "json"):  # too big indented: its plain text, whole, saying why
        assert kind == "text" and text.startswith("[" * 400 + "1,1")
        assert text.endswith(
            "\n... not pretty-printed: indented, this JSON would pass "
            "524,288 characters; this is its plain text"
        )
    elif fmt == "text":
        assert (kind, text) == ("text", WIDE_AND_DEEP.decode())
    else:  # about 5 characters a byte: only the lines that fit are made
        assert kind == "hex" and text.splitlines()[0].startswith("00000000  5b 5b")
        assert (
            "more bytes not shown; download or export the record for all of them (this "
            "view shows at most 524,288 characters of hexdump)" in text
        )


def test_renderings_cut_at_their_bound_say_so():
    kind, text = payloads.render_payload(b"abcdefghijklmnop", "text", max_chars=10)
    assert (kind, text) == (
        "text",
        "abcdefghij\n... cut here: this view shows at most 10 "
        "characters; download or export the record for all 16 bytes",
    )
    assert payloads.render_payload(b"a" * 16, max_chars=10)[1].startswith(
        "a" * 10 + "\n... cut here"
    )
    kind, text = payloads.render_payload(b'{"a": [1, 2]}', "json", max_chars=10)
    assert kind == "text" and text.startswith('{"a": [1, \n... not pretty-printed')
    assert text.endswith(
        "cut here: this view shows at most 10 characters; download or "
        "export the record for all 13 bytes"
    )
    kind, text = payloads.render_payload(bytes(range(64)), "hex", max_chars=100)
    assert kind == "hex" and len(text.splitlines()) == 2
    assert text.splitlines()[1].startswith("... 48 more bytes not shown")
    # within the bound: exactly as before
    assert payloads.render_payload(b'{"a": [1]}', max_chars=100) == (
        "json",
        '{\n  "a": [\n    1\n  ]\n}',
    )
    assert (
        payloads.pretty_json({"a": [1]}, 5) is None
        and payloads.pretty_json({"a": 1}) == '{\n  "a": 1\n}'
    )


def test_the_kind_of_a_payload_is_known_without_rendering_it():
    assert payloads.payload_kind(WIDE_AND_DEEP) == "json"
    assert payloads.payload_kind(b"[" * 100_000) == "text"  # too deep to parse
    assert payloads.payload_kind(b'{"a": 1', limit=5, size=5000) == "text"
    assert payloads.payload_kind(b"\x00\x01") == "hex" and payloads.payload_kind(None) == "text"
    assert payloads.payload_kind("ab€".encode()[:4], limit=4, size=5) == "text"


def test_ids_past_bigint_are_refused_naming_the_field():
    for bad in ("99999999999999999999", [2**63], 2**63):
        with pytest.raises(
            BadInput,
            match=r"^ids: .* is not a dead-letter id \(a positive "
            r"integer up to 9,223,372,036,854,775,807\)",
        ):
            dlq.parse_ids(bad)
    assert dlq.parse_ids([2**63 - 1]) == [2**63 - 1]
    with pytest.raises(BadInput, match=r"^ids"):
        dlq.Filters.parse(ids="99999999999999999999")


def test_injection_in_every_filter_finds_nothing_and_harms_nothing(env, ledger, sample):
    before = env.ledger("SELECT count(*) FROM tidemark.dlq")[0][0]
    for field in ("pipeline", "sink", "error_class", "status", "since", "until", "ids"):
        for evil in INJECTIONS:
            with pytest.raises(BadInput):
                dlq.Filters.parse(**{field: evil})
    # Even past validation, values only ever travel as bind parameters.
    for field in ("pipeline", "sink"):
        for evil in INJECTIONS:
            f = dlq.Filters.model_construct(**{field: evil})
            assert dlq.page(ledger, f).rows == []
            assert sum(dlq.counts(ledger, f).values()) == 0
            assert exported(dlq.export(ledger, f)) == []
    f = dlq.Filters.model_construct(pipelines=list(INJECTIONS))
    assert dlq.page(ledger, f).rows == []
    assert env.ledger("SELECT count(*) FROM tidemark.dlq")[0][0] == before == len(sample)


# -- the command line --------------------------------------------------------------------------
def test_cli_show_names_the_airflow_try_of_its_run(env, ledger):
    """The run line names the DAG, DAG run, task and try Airflow ran it in (it printed
    'try -' for every letter: it read a key the ledger never stores)."""
    ledger.execute("INSERT INTO tidemark.pipelines (name) VALUES ('orders') ON CONFLICT DO NOTHING")
    run_id = ledger.execute(
        "INSERT INTO tidemark.runs (pipeline, mode, owner, dag_id, dag_run_id, task_id, "
        "try_number) VALUES ('orders', 'redrive', 'me', 'tidemark_orders_redrive', "
        "'manual__1', 'replay', 3) RETURNING run_id"
    ).fetchone()[0]
    letter = add(ledger, run_id=run_id)
    code, out, err = tm(env.cli_env(), "dlq", "show", str(letter))
    assert code == 0, err
    assert "airflow tidemark_orders_redrive / manual__1 / replay try 3" in out, out
    ledger.execute("UPDATE tidemark.runs SET try_number = NULL WHERE run_id = %s", (run_id,))
    code, out, err = tm(env.cli_env(), "dlq", "show", str(letter))
    assert code == 0 and "/ manual__1 / replay\n" in out and "try" not in out, out


def test_cli_list_show_counts(env, ledger, sample):
    s = sample
    code, out, err = tm(env.cli_env(), "dlq", "list", "--pipeline", "gated")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["ID", "PIPELINE", "SINK"]
    assert [int(ln.split()[0]) for ln in lines[1:3]] == [s["i"], s["e"]]  # f is redriven
    assert "by class: decode 1, transform 0, validation 0, dq_gate 1, sink_write 0" in out

    code, out, err = tm(env.cli_env(), "dlq", "list", "--status", "any", "--limit", "2", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert [r["id"] for r in doc["records"]] == [s["i"], s["h"]]
    assert doc["next_before"] == s["h"] and doc["counts"]["decode"] == 4
    assert doc["records"][1]["payload_preview"].startswith("00 01 62")

    code, out, err = tm(env.cli_env(), "dlq", "list", "--status", "any", "--before", str(s["b"]))
    assert code == 0 and [int(ln.split()[0]) for ln in out.splitlines()[1:2]] == [s["a"]]

    code, out, err = tm(env.cli_env(), "dlq", "show", str(s["h"]))
    assert code == 0, err
    assert f"dead letter {s['h']} (quarantined)" in out and "(hex, 8 bytes)" in out
    assert "00000000  00 01 62 69 6e 61 72 79" in out
    code, out, err = tm(env.cli_env(), "dlq", "show", str(s["a"]), "--json")
    rec = json.loads(out)
    assert base64.b64decode(rec["payload"]) == b'{"id": 1}'
    assert rec["payload_rendered"] == {"kind": "json", "text": '{\n  "id": 1\n}'}
    code, out, err = tm(env.cli_env(), "dlq", "show", str(s["a"]), "--format", "hex")
    assert "(hex, 9 bytes)" in out
    code, _, err = tm(env.cli_env(), "dlq", "show", "999999")
    assert code == 2
    assert_one_clear_line(err, "tidemark: error: no dead letter 999999")

    code, out, err = tm(env.cli_env(), "dlq", "counts", "--json")
    assert code == 0 and json.loads(out)["orders"]["decode"] == 2
    code, out, err = tm(env.cli_env(), "dlq", "counts")
    assert out.splitlines()[1].split() == ["gated", "1", "0", "0", "1", "0", "2"]


def test_cli_discard_and_export(env, ledger, sample, tmp_path):
    s = sample
    code, _, err = tm(env.cli_env(), "dlq", "discard", str(s["a"]))
    assert code == 2 and "--note" in err
    code, out, err = tm(
        env.cli_env(), "dlq", "discard", f"{s['a']},{s['c']}", "--note", "duplicate of 17"
    )
    assert code == 0, err
    assert f"discarded 1: {s['a']}" in out and f"skipped {s['c']}: already discarded" in out
    assert env.ledger("SELECT resolved_by, note FROM tidemark.dlq WHERE id = %s", (s["a"],)) == [
        (f"{getpass.getuser()}@{socket.gethostname()}", "duplicate of 17")
    ]
    code, out, err = tm(
        env.cli_env(), "dlq", "discard", str(s["a"]), "--note", "x", "--by", "carol"
    )
    assert code == 1 and "already discarded" in out
    code, _, err = tm(env.cli_env(), "dlq", "discard", "7x", "--note", "x")
    assert code == 2 and "'7x' is not a dead-letter id" in err

    target = tmp_path / "out.jsonl"
    code, out, err = tm(
        env.cli_env(), "dlq", "export", "--pipeline", "orders", "--out", str(target)
    )
    assert code == 0, err
    recs = exported(target.read_text().splitlines())
    assert [r["id"] for r in recs] == sorted([s["b"], s["d"], s["g"], s["h"]])
    assert base64.b64decode(recs[-1]["payload"]) == b"\x00\x01binary"
    assert "exported 4 dead letter(s)" in err
    code, out, err = tm(env.cli_env(), "dlq", "export", "--ids", f"{s['a']},{s['c']}", "--out", "-")
    assert code == 0, err
    assert [r["status"] for r in exported(out.splitlines())] == ["discarded", "discarded"]


def test_cli_injection_is_refused_and_harmless(env, ledger, sample):
    for opt in ("--pipeline", "--sink", "--class", "--status", "--since", "--until"):
        code, out, err = tm(env.cli_env(), "dlq", "list", opt, INJECTIONS[1])
        assert code == 2, (opt, out, err)
        assert_one_clear_line(err, "tidemark: error:")
    assert env.ledger("SELECT count(*) FROM tidemark.dlq")[0][0] == len(sample)


# -- search on the reason, and acting on everything matching -----------------------------------
@pytest.fixture
def reasons(ledger):
    """Letters whose reasons differ in case and hold LIKE's own wildcards."""
    return {
        "amount": add(
            ledger,
            cls="validation",
            reason="expect_column_values_to_be_between(column=amount): unexpected value -98.12",
        ),
        "AMOUNT": add(ledger, cls="validation", reason="AMOUNT is negative"),
        "pct": add(ledger, cls="decode", reason="100% wrong_value"),
        "plain": add(
            ledger, cls="decode", reason="payload is not valid JSON: unexpected end at byte 24"
        ),
        "gated": add(ledger, pipeline="gated", cls="validation", reason="amount too big"),
        "done": add(ledger, cls="validation", status="discarded", reason="amount again"),
    }


def test_search_on_the_reason_is_a_substring_in_any_case(ledger, reasons):
    r = reasons
    assert ids_of(ledger, reason="amount", status="quarantined") == sorted(
        [r["amount"], r["AMOUNT"], r["gated"]], reverse=True
    )
    assert ids_of(ledger, reason="Amount", status="any") == sorted(
        [r["amount"], r["AMOUNT"], r["gated"], r["done"]], reverse=True
    )
    # combined with the other filters
    assert ids_of(
        ledger, reason="amount", pipeline="orders", error_class="validation", status="quarantined"
    ) == sorted([r["amount"], r["AMOUNT"]], reverse=True)
    # LIKE's wildcards are plain characters in a search
    assert ids_of(ledger, reason="100%") == [r["pct"]]
    assert ids_of(ledger, reason="%") == [r["pct"]]
    assert ids_of(ledger, reason="wrong%value") == []
    assert ids_of(ledger, reason="wrong_value") == [r["pct"]]
    assert ids_of(ledger, reason="  ") == ids_of(ledger)  # blank: no filter
    assert dlq.counts(ledger, dlq.Filters.parse(reason="AMOUNT"))["validation"] == 4
    assert (
        dlq.matching(
            ledger, dlq.Filters.parse(reason="amount", pipeline="orders", status="quarantined")
        )
        == 2
    )
    f = dlq.Filters.parse(reason="amount", pipeline="orders")
    assert f.query()["reason"] == "amount"
    assert f.described() == "pipeline orders, reason contains 'amount'"
    with pytest.raises(BadInput, match="reason .*: 201 characters, at most 200"):
        dlq.Filters.parse(reason="x" * 201)
    for evil in INJECTIONS:  # only ever a bind parameter
        assert ids_of(ledger, reason=evil) == []
    assert ledger.execute("SELECT count(*) FROM tidemark.dlq").fetchone()[0] == len(reasons)


def test_discard_everything_matching_records_who_and_why(env, ledger, reasons):
    r = reasons
    f = dlq.Filters.parse(pipeline="orders", reason="amount")
    with pytest.raises(BadInput, match="note: required"):
        dlq.discard_matching(ledger, f, " ", "alice")
    with pytest.raises(BadInput, match=r"2 dead letter\(s\) match now, not the 1 confirmed"):
        dlq.discard_matching(ledger, f, "bad batch", "alice", expected=1)
    assert env.ledger("SELECT count(*) FROM tidemark.dlq WHERE status = 'discarded'") == [(1,)]
    res = dlq.discard_matching(ledger, f, "bad batch", "alice", expected=2)
    assert res.changed == sorted([r["amount"], r["AMOUNT"]]) and res.skipped == {}
    assert env.ledger(
        "SELECT resolved_by, note FROM tidemark.dlq WHERE id = %s", (r["AMOUNT"],)
    ) == [("alice", "bad batch")]
    # the discarded one and the other pipeline's are untouched
    assert env.ledger("SELECT note FROM tidemark.dlq WHERE id = %s", (r["done"],)) == [(None,)]
    assert env.ledger("SELECT status::text FROM tidemark.dlq WHERE id = %s", (r["gated"],)) == [
        ("quarantined",)
    ]
    assert dlq.discard_matching(ledger, f, "again", "alice").changed == []


def test_cli_search_and_discard_all_matching_asks_first(env, ledger, reasons):
    r = reasons
    code, out, err = tm(env.cli_env(), "dlq", "list", "--reason", "AMOUNT", "--json")
    assert code == 0, err
    assert [x["id"] for x in json.loads(out)["records"]] == sorted(
        [r["amount"], r["AMOUNT"], r["gated"]], reverse=True
    )
    code, out, err = tm(env.cli_env(), "dlq", "export", "--reason", "100%", "--out", "-")
    assert code == 0 and [x["id"] for x in exported(out.splitlines())] == [r["pct"]]

    argv = ("dlq", "discard", "--pipeline", "orders", "--reason", "amount", "--note", "bad batch")
    code, out, err = tm(env.cli_env(), *argv)  # no terminal to ask: refused, nothing changed
    assert code == 2
    assert_one_clear_line(
        err, "2 quarantined dead letters match (pipeline orders, reason contains 'amount')", "--yes"
    )
    code, out, err = tm(env.cli_env(), *argv, input_="n\n")
    assert code == 1 and "Discard 2 quarantined dead letters" in err
    assert "nothing discarded" in err
    assert env.ledger("SELECT count(*) FROM tidemark.dlq WHERE status = 'discarded'") == [(1,)]
    code, out, err = tm(env.cli_env(), *argv, input_="y\n")
    assert code == 0, err
    assert "discarded 2 dead letter(s)" in out
    assert env.ledger(
        "SELECT count(*) FROM tidemark.dlq WHERE status = 'discarded' AND note = 'bad batch'"
    ) == [(2,)]
    code, out, err = tm(
        env.cli_env(),
        "dlq",
        "discard",
        "--class",
        "decode",
        "--note",
        "junk",
        "--by",
        "carol",
        "--yes",
    )
    assert code == 0, err
    assert "discarded 2 dead letter(s)" in out
    code, out, err = tm(
        env.cli_env(), "dlq", "discard", str(r["gated"]), "--class", "decode", "--note", "x"
    )
    assert code == 2 and "ids or filters" in err
    code, out, err = tm(
        env.cli_env(), "dlq", "discard", "--class", "decode", "--note", "x", "--yes"
    )
    assert code == 1 and "no quarantined dead letters match" in out


def test_a_redrive_says_nothing_of_another_pipelines_letters(ledger, sample):
    """A redrive of one pipeline given another's letter id (the redrive DAG's form takes any
    id) reports it as it reports an id that does not exist: not its pipeline's name."""
    from tidemark.ledger import redrives

    s = sample
    req = redrives.create(ledger, "orders", "alice", ids=[s["a"], s["e"], 999_999])
    _, unplaced = redrives.placement(ledger, req.request_id, "orders", ["main", "archive"])
    assert unplaced[s["e"]] == unplaced[999_999] == "no such dead letter in this pipeline"
    assert "gated" not in json.dumps(unplaced)
