"""A sink table's columns against what the pipeline writes to it: what differs, what a sink
with ``schema: evolve`` changes by itself (adds a column the transform now produces), and
the DDL that fixes the rest. Used by the run before it writes and by ``tidemark pipelines
validate`` (docs/pipelines.md, "Schema changes").

May import: core, config.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import psycopg
from psycopg import sql

from tidemark.config import Pipeline, Sink, pg_type
from tidemark.core.db import qualified

# Tidemark's own columns in every sink table (the record's position and its run).
META_COLUMNS = [("_tm_partition", "integer"), ("_tm_offset", "bigint"), ("_tm_run_id", "bigint")]

# Spellings of a type as Tidemark writes it (config.pg_type) -> as PostgreSQL prints it.
_CANONICAL = {
    "timestamptz": "timestamp with time zone",
    "timestamp": "timestamp without time zone",
    "varchar": "character varying",
    "int": "integer",
    "int4": "integer",
    "int8": "bigint",
    "int2": "smallint",
    "float8": "double precision",
    "float4": "real",
    "bool": "boolean",
}
# Integer digits each integer type may carry (for numeric(p, s) targets).
_DIGITS = {"smallint": 5, "integer": 10, "bigint": 19}
_INT_ORDER = ["smallint", "integer", "bigint"]
# Types PostgreSQL parses from text as a whole value: a string column may go to them (a value
# that does not parse is a dead letter of its own, never a lost record).
_FROM_TEXT = {"text", "character varying", "character", "json", "jsonb", "uuid", "citext", "xml"}
_NUMERIC = re.compile(r"^numeric(?:\((\d+),(\d+)\))?$")


def canonical(pg_type: str) -> str:
    t = " ".join(pg_type.strip().lower().split()).replace(", ", ",")
    base, _, rest = t.partition("(")
    base = _CANONICAL.get(base, base)
    return f"{base}({rest}" if rest else base


def accepts(table_type: str, output_type: str) -> bool:
    """Whether a column of ``table_type`` takes every value of ``output_type`` as it is:
    the same type, or a wider one (never a narrowing that would lose or refuse values)."""
    have, out = canonical(table_type), canonical(output_type)
    if have == out:
        return True
    base = have.partition("(")[0]
    if base == "text" or (base == "character varying" and "(" not in have):
        return True  # every value has a text form
    if out == "text":
        return base in _FROM_TEXT and "(" not in have
    if out in _INT_ORDER:
        if base in _INT_ORDER:
            return _INT_ORDER.index(base) >= _INT_ORDER.index(out)
        if m := _NUMERIC.match(have):
            return m[1] is None or int(m[1]) - int(m[2]) >= _DIGITS[out]
        return (have == "double precision" and out != "bigint") or (
            have == "real" and out == "smallint"
        )
    if out in ("real", "double precision"):
        # An unconstrained numeric holds every finite float exactly.
        return have == "numeric" or (out == "real" and have == "double precision")
    if m_out := _NUMERIC.match(out):
        m = _NUMERIC.match(have)
        if m is None:
            return False
        if m[1] is None:
            return True
        return int(m[2]) >= int(m_out[2]) and int(m[1]) - int(m[2]) >= int(m_out[1]) - int(m_out[2])
    if out == "date":
        return have in ("timestamp without time zone", "timestamp with time zone")
    if out == "timestamp without time zone":
        return have == "timestamp with time zone"
    return False


_CAST_TYPE = re.compile(r"\bas\s+([a-z_]+(?:\(\d+,\s*\d+\))?)\s*$", re.I)
_NAME = re.compile(r"^\s*`?(\w+)`?\s*$")


def static_output(pipeline: Pipeline) -> list[tuple[str, str | None]] | None:
    """The transform's output columns with their PostgreSQL types as far as the file says
    them without running Spark: a decoded field passed through, or a CAST; None for a type
    only Spark's analysis knows, and None for all when a Python transform decides."""
    fields = {n: pg_type(t) for n, t in pipeline.decode.schema_.items()}
    select = pipeline.transform.select
    if pipeline.transform.python:
        return None
    if select is None:
        return list(fields.items())
    out: list[tuple[str, str | None]] = []
    for name, expr in select.items():
        m = _NAME.match(expr)
        out.append((name, fields[m[1]] if m and m[1] in fields else _cast_type(expr)))
    return out


def _cast_type(expr: str) -> str | None:
    """The type of ``CAST(... AS t)`` when the CAST is the whole expression."""
    e = expr.strip()
    if not e.lower().startswith("cast") or not e.endswith(")"):
        return None
    open_at = e.find("(")
    if e[4:open_at].strip():
        return None
    depth = 0
    for i, ch in enumerate(e[open_at:], open_at):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0 and i != len(e) - 1:
            return None  # the CAST closes before the end: it is part of a larger expression
    m = _CAST_TYPE.search(e[open_at + 1 : -1])
    try:
        return pg_type(m[1]) if m else None
    except ValueError:
        return None


@dataclass(frozen=True)
class Column:
    name: str
    type: str  # as PostgreSQL prints it (format_type)
    not_null: bool
    has_default: bool


def table_columns(conn: psycopg.Connection, table: str) -> dict[str, Column] | None:
    """The table's columns by name, or None when it does not exist."""
    if conn.execute("SELECT to_regclass(%s)", (qualified(table),)).fetchone() == (None,):
        return None
    rows = conn.execute(
        """SELECT attname, format_type(atttypid, atttypmod), attnotnull, atthasdef
           FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0
           AND NOT attisdropped ORDER BY attnum""",
        (qualified(table),),
    ).fetchall()
    return {r[0]: Column(r[0], r[1], r[2], r[3]) for r in rows}


def unique_keys(conn: psycopg.Connection, table: str) -> list[tuple[str, list[str]]]:
    """(name, columns) of the table's unique indexes without a predicate (name: the index's,
    or its constraint's when it backs one)."""
    rows = conn.execute(
        """SELECT coalesce(con.conname, ic.relname),
                  array(SELECT a.attname::text FROM unnest(i.indkey) WITH ORDINALITY k(n, o)
                        JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.n
                        ORDER BY k.o)
           FROM pg_index i JOIN pg_class ic ON ic.oid = i.indexrelid
           LEFT JOIN pg_constraint con ON con.conindid = i.indexrelid
           WHERE i.indrelid = %s::regclass AND i.indisunique AND i.indpred IS NULL
           ORDER BY 1""",
        (qualified(table),),
    ).fetchall()
    return [(r[0], list(r[1])) for r in rows]


@dataclass
class Plan:
    """How a sink's table stands against the columns the pipeline writes."""

    sink: str
    table: str
    adds: list[tuple[str, str]] = field(default_factory=list)  # (column, type) to add
    problems: list[str] = field(default_factory=list)  # one line each, naming its fix

    @property
    def ok(self) -> bool:
        return not self.problems

    def changes(self) -> list[str]:
        return [f"added column {c} {t}" for c, t in self.adds]


def plan(
    cfg: Sink,
    have: dict[str, Column],
    keys: list[tuple[str, list[str]]],
    want: list[tuple[str, str | None]] | None,
    pipeline: str = "<pipeline>",
) -> Plan:
    """Compare the table (``have``, its unique ``keys``) with ``want``: the output columns and
    their PostgreSQL types (a type None: known only once the transform runs; ``want`` None:
    a Python transform, whose columns only its run knows). ``pipeline`` names the sink's
    pipeline in the commands a fix gives."""
    t = cfg.table
    out = Plan(cfg.name, t)
    where = f"sink {cfg.name}: table {t}"
    if want is None:
        # Tidemark's own columns and the key are checked whatever the transform produces.
        known = [(c, typ) for c, typ in META_COLUMNS if c not in have]
        out.problems += [
            f"{where} lacks column {c} (Tidemark's own column); fix: ALTER TABLE {t} "
            f"ADD COLUMN {c} {typ}"
            for c, typ in known
        ]
        return out if known else _with_keys(out, cfg, have, keys, where, pipeline)
    evolve = cfg.schema_ == "evolve"
    wanted = {n for n, _ in want}
    for name, typ in [*want, *META_COLUMNS]:
        col = have.get(name)
        if col is None:
            add = typ or "<type>"
            if evolve and not name.startswith("_tm_"):
                if typ is not None:  # else added when the run knows its type
                    out.adds.append((name, typ))
                continue
            why = "schema: strict" if not name.startswith("_tm_") else "Tidemark's own column"
            out.problems.append(
                f"{where} lacks column {name} ({why}); fix: "
                f"ALTER TABLE {t} ADD COLUMN {name} {add}"
                + ("" if name.startswith("_tm_") else ";  or set schema: evolve on the sink")
            )
        elif typ is not None and not accepts(col.type, typ):
            out.problems.append(
                f"{where}: column {name} is {col.type}, the transform writes {canonical(typ)}, "
                f"which it cannot take whole; fix: ALTER TABLE {t} ALTER COLUMN {name} TYPE "
                f"{canonical(typ)}  (or cast {name} to {col.type} in the transform's select)"
            )
        elif cfg.schema_ == "strict" and typ is not None and canonical(col.type) != canonical(typ):
            out.problems.append(
                f"{where}: column {name} is {col.type}, the transform writes "
                f"{canonical(typ)} (schema: strict); fix: ALTER TABLE {t} ALTER COLUMN {name} "
                f"TYPE {canonical(typ)}"
            )
    for col in have.values():
        if col.name in wanted or col.name.startswith("_tm_"):
            continue
        if cfg.schema_ == "strict":
            out.problems.append(
                f"{where} has column {col.name}, which the transform does not produce "
                f"(schema: strict); fix: ALTER TABLE {t} DROP COLUMN {col.name}  "
                f"(or produce it in the transform)"
            )
        elif col.not_null and not col.has_default:
            out.problems.append(
                f"{where}: column {col.name} is NOT NULL without a default and the transform "
                f"does not produce it, so no new row could be written; fix: ALTER TABLE {t} "
                f"ALTER COLUMN {col.name} DROP NOT NULL"
            )
    return _with_keys(out, cfg, have, keys, where, pipeline)


def _with_keys(
    out: Plan,
    cfg: Sink,
    have: dict[str, Column],
    keys: list[tuple[str, list[str]]],
    where: str,
    pipeline: str,
) -> Plan:
    out.problems += _key_problems(cfg, have, keys, where, pipeline)
    return out


def _key_problems(
    cfg: Sink, have: dict[str, Column], keys: list[tuple[str, list[str]]], where: str, pipeline: str
) -> list[str]:
    t, key = cfg.table, cfg.key
    problems = []
    # A NULL key is distinct from every other NULL: the row would duplicate on every
    # re-delivery (and vanish in the merge's DISTINCT ON).
    nullable = [k for k in key if k in have and not have[k].not_null]
    if nullable:
        fix = "; ".join(f"ALTER TABLE {t} ALTER COLUMN {k} SET NOT NULL" for k in nullable)
        problems.append(f"{where} allows NULL in key column(s) {', '.join(nullable)}; fix: {fix}")
    if not all(k in have for k in key):
        return problems
    if not any(sorted(cols) == sorted(key) for _, cols in keys):
        problems.append(
            f"{where} needs a unique index on exactly ({', '.join(key)}) for keyed upserts; "
            f"fix: `tidemark sink rebuild {pipeline} {cfg.name}` (a new table with this "
            f"key, from the source), or CREATE UNIQUE INDEX ON {t} ({', '.join(key)})"
        )
    # A unique index on fewer columns than the key refuses versions the key tells apart: the
    # rows would go to the DLQ as sink_write instead of being written.
    for name, cols in keys:
        if set(cols) < set(key):
            problems.append(
                f"{where}: unique index or constraint {name} on ({', '.join(cols)}) is "
                f"narrower than the key ({', '.join(key)}) and would refuse rows the key "
                f"tells apart; fix: `tidemark sink rebuild {pipeline} {cfg.name}` makes the "
                f"table again from the source with the new key, swapped in atomically (the "
                f"old one kept); or by hand: ALTER TABLE {t} DROP CONSTRAINT {name} (DROP "
                f"INDEX {name} if it is an index alone), then `tidemark backfill {pipeline} "
                f"--partition all`"
            )
    return problems


def evolve(conn: psycopg.Connection, cfg: Sink, adds: list[tuple[str, str]]) -> None:
    """Add the planned columns (nullable: the rows already there have no value for them).
    Idempotent, so two runs or a run after a crash add each column once."""
    if not adds:
        return
    conn.execute(
        sql.SQL("ALTER TABLE {} {}").format(
            sql.SQL(qualified(cfg.table)),
            sql.SQL(", ").join(
                sql.SQL("ADD COLUMN IF NOT EXISTS {} {}").format(sql.Identifier(n), sql.SQL(t))
                for n, t in adds
            ),
        )
    )
