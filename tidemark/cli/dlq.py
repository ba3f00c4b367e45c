"""`tidemark dlq ...`: review, redrive and discard dead letters from the command line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from tidemark.cli.app import Ctx, cli, dry_run_option, pass_ctx, run_and_report, run_options
from tidemark.core.db import connect
from tidemark.core.errors import BadInput, NotFound
from tidemark.ledger import dlq as dlq_mod
from tidemark.ledger import letters
from tidemark.ledger.state import AirflowRun
from tidemark.render import payloads


@cli.group("dlq")
def dlq() -> None:
    """Dead letters: list, show, export, redrive, discard."""


def _ids(values: tuple[str, ...]) -> list[int]:
    out = []
    for v in values:
        for part in v.replace(",", " ").split():
            if not part.isdigit():
                raise click.BadParameter(f"{part!r} is not a dead-letter id", param_hint="IDS")
            out.append(int(part))
    return out


# -- review: list, show, discard, export, counts ----------------------------------------------
def _filter_options(fn):
    for opt in reversed(
        [
            click.option("--pipeline", help="Only this pipeline."),
            click.option("--sink", help="Only this sink."),
            click.option(
                "--class",
                "error_class",
                help="Only this error class: " + ", ".join(dlq_mod.ERROR_CLASSES) + ".",
            ),
            click.option(
                "--status",
                help="quarantined, redriven, discarded or any "
                "(default: quarantined; any with --ids).",
            ),
            click.option("--since", help="Last seen at or after this ISO timestamp."),
            click.option("--until", help="Last seen before this ISO timestamp."),
            click.option("--reason", help="Only reasons containing this text (any case)."),
        ]
    ):
        fn = opt(fn)
    return fn


def _confirmed(what: str, n: int, f: dlq_mod.Filters, yes: bool) -> None:
    """An action on every letter that matches goes ahead only once its count is confirmed:
    at a prompt naming it, or by --yes. Without a terminal to ask, BadInput says so."""
    if yes:
        return
    f = f.without("status")  # "quarantined dead letters" says it
    question = f"{what} {n:,} quarantined dead letter{'s' if n != 1 else ''} ({f.described()})?"
    if not sys.stdin.isatty() and not _piped():
        raise BadInput(
            f"{n:,} quarantined dead letters match ({f.described()}); add --yes to "
            f"{what.lower()} them without a prompt"
        )
    if not click.confirm(question, default=False, err=True):
        click.echo(f"not confirmed: nothing {_past(what)}", err=True)
        sys.exit(1)


def _piped() -> bool:
    """stdin is a pipe or a file someone gave (an answer), not nothing (/dev/null, closed)."""
    import os
    import stat

    try:
        mode = os.fstat(sys.stdin.fileno()).st_mode
    except (OSError, ValueError):
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISREG(mode)


def _past(what: str) -> str:
    return {"Discard": "discarded", "Redrive": "redriven"}[what]


def _filters(ids: list[int] | None = None, status: str | None = None, **kw) -> dlq_mod.Filters:
    return dlq_mod.Filters.parse(ids=ids, status=status or ("any" if ids else "quarantined"), **kw)


def _when(ts) -> str:
    return f"{ts:%Y-%m-%d %H:%M:%S}" if ts else "-"


def _plain(row: dict) -> dict:
    """A list row as JSON: datetimes ISO, the payload as a one-line preview."""
    out = {
        k: (v.isoformat() if hasattr(v, "isoformat") else v)
        for k, v in row.items()
        if k != "payload_head"
    }
    out["payload_preview"] = payloads.preview(row["payload_head"], row["payload_size"])
    return out


@dlq.command("list")
@_filter_options
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1, dlq_mod.MAX_LIMIT))
@click.option("--before", type=click.IntRange(min=1), help="Only ids below this (the next page).")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
def dlq_list(ctx: Ctx, limit: int, before: int | None, as_json: bool, **kw) -> None:
    """Dead letters, newest first, with counts by error class."""
    f = _filters(**kw)
    with connect(ctx.ledger_dsn, autocommit=True, what="ledger") as conn:
        pg = dlq_mod.page(conn, f, limit, before)
        by_class = dlq_mod.counts(conn, f)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "records": [_plain(r) for r in pg.rows],
                    "next_before": pg.next_before,
                    "counts": by_class,
                }
            )
        )
        return
    if not pg.rows:
        click.echo("no dead letters match")
    else:
        click.echo(
            f"{'ID':>8}  {'PIPELINE':<16} {'SINK':<12} {'CLASS':<10} {'STATUS':<11} "
            f"{'PART:OFFSET':<16} {'TRIES':>5}  {'LAST SEEN':<19}  REASON"
        )
    for r in pg.rows:
        where = f"{r['source_partition']}:{r['source_offset']}"
        click.echo(
            f"{r['id']:>8}  {r['pipeline']:<16} {r['sink'] or '-':<12} "
            f"{r['error_class']:<10} {r['status']:<11} {where:<16} {r['attempts']:>5}  "
            f"{_when(r['last_seen']):<19}  {' '.join(r['reason'].split())[:80]}"
        )
    click.echo(
        "by class: "
        + ", ".join(f"{k} {v:,}" for k, v in by_class.items())
        + f" (total {sum(by_class.values()):,})"
    )
    if pg.next_before:
        click.echo(f"older: add --before {pg.next_before}")


def _airflow_ids(af: dict) -> str:
    """Where in Airflow the run ran: DAG / DAG run / task, and the task's try when known
    (the ledger stores it as ``try_number``)."""
    line = f"  airflow {af['dag_id']} / {af['run_id']} / {af.get('task_id') or '-'}"
    return line + (f" try {af['try_number']}" if af.get("try_number") is not None else "")


@dlq.command("show")
@click.argument("record_id", metavar="ID", type=click.IntRange(min=1))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["auto", "text", "json", "hex"]),
    default="auto",
    show_default=True,
    help="How to show the payload.",
)
@click.option("--json", "as_json", is_flag=True, help="The whole envelope as JSON.")
@pass_ctx
def dlq_show(ctx: Ctx, record_id: int, fmt: str, as_json: bool) -> None:
    """One dead letter: envelope, payload, key, headers, detail, the run it came from."""
    with connect(ctx.ledger_dsn, autocommit=True, what="ledger") as conn:
        rec = dlq_mod.get(conn, record_id)
    if rec is None:
        raise NotFound(f"no dead letter {record_id}")
    kind, text = payloads.render_payload(rec["payload"], fmt)
    if as_json:
        out = dlq_mod.envelope(rec)
        out["payload_rendered"] = {"kind": kind, "text": text}
        out["run"] = {
            k: (v.isoformat() if hasattr(v, "isoformat") else v)
            for k, v in (rec["run"] or {}).items()
        } or None
        out["quality"] = rec["quality"]
        click.echo(json.dumps(out))
        return
    run = rec["run"] or {}
    af = run.get("airflow")
    lines = [
        f"dead letter {rec['id']} ({rec['status']})",
        f"  pipeline   {rec['pipeline']}   sink {rec['sink']}",
        f"  error      {rec['error_class']}: {rec['reason']}",
        f"  source     partition {rec['source_partition']} offset {rec['source_offset']}",
        f"  run        {rec['run_id']}"
        + (f" ({run['mode']}, {_when(run['created_at'])})" if run else " (not in the ledger)")
        + (_airflow_ids(af) if af else ""),
        f"  attempts   {rec['attempts']}   first seen {_when(rec['first_seen'])}   "
        f"last seen {_when(rec['last_seen'])}",
    ]
    if rec["resolved_by"] or rec["note"]:
        # Live again, an earlier resolution is history, not this letter's.
        again = rec["status"] == "quarantined"
        lines.append(
            f"  {'earlier  ' if again else 'resolved '}  by {rec['resolved_by'] or '-'} at "
            f"{_when(rec['resolved_at'])}: {rec['note'] or ''}"
            + ("   (its record failed again since: live again)" if again else "")
        )
    if rec["pruned_at"]:
        lines.append(
            f"  pruned     {_when(rec['pruned_at'])}: retention dropped the payload, headers "
            f"and detail; the letter stays where its record was discarded"
        )
    for q in rec["quality"]:
        if q["docs_path"] and rec["error_class"] in ("validation", "dq_gate"):
            lines.append(f"  data docs  {q['scope'] or '(pipeline)'}: {q['docs_path']}")
    key = payloads.render_payload(rec["key"])[1] if rec["key"] is not None else "(none)"
    lines.append(f"  key        {key}")
    # As the source had them when the letter kept them; else as jsonb stored them.
    exact = letters.header_text(rec["source_headers"])
    shown = (
        exact if exact is not None else json.dumps(rec["headers"]) if rec["headers"] else "(none)"
    )
    lines.append(f"  headers    {shown}")
    lines.append(
        f"  source ts  {_when(rec['source_ts'])}"
        + (f"   {rec['source_note']}" if rec["source_note"] else "")
    )
    size = len(rec["payload"]) if rec["payload"] is not None else 0
    lines.append(f"  payload    ({kind}, {size:,} bytes)")
    lines.extend(f"    {ln}" for ln in text.splitlines() or ["(empty)"])
    if rec["detail"]:
        lines.append("  detail")
        lines.extend(f"    {ln}" for ln in rec["detail"].splitlines())
    click.echo("\n".join(lines))


@dlq.command("discard")
@click.argument("ids", nargs=-1)
@click.option(
    "--pipeline",
    help="Every quarantined record of this pipeline (with the others: that match them all).",
)
@click.option("--sink", help="Every quarantined record of this sink.")
@click.option("--class", "error_class", help="Every quarantined record of this error class.")
@click.option("--since", help="Only records last seen at or after this ISO timestamp.")
@click.option("--until", help="Only records last seen before this ISO timestamp.")
@click.option("--reason", help="Only records whose reason contains this text (any case).")
@click.option(
    "--all", "everything", is_flag=True, help="Every quarantined record (narrowed by the filters)."
)
@click.option("--yes", is_flag=True, help="Do not ask before discarding all that match.")
@click.option("--note", required=True, help="Why (required; kept with the records).")
@click.option("--by", help="Who discards (default: user@host).")
@pass_ctx
def dlq_discard(
    ctx: Ctx,
    ids: tuple[str, ...],
    pipeline: str | None,
    sink: str | None,
    error_class: str | None,
    since: str | None,
    until: str | None,
    reason: str | None,
    everything: bool,
    yes: bool,
    note: str,
    by: str | None,
) -> None:
    """Discard quarantined records (IDS, e.g. 4 7 9 or 4,7,9, or all that match the filters,
    after a prompt naming how many): they stay in the DLQ with status discarded, who, when
    and the note. Other records are skipped, with the reason."""
    chosen = _ids(ids)
    raw = {
        "pipeline": pipeline,
        "sink": sink,
        "error_class": error_class,
        "since": since,
        "until": until,
        "reason": reason,
    }
    filtered = everything or any(v not in (None, "") for v in raw.values())
    if chosen and filtered:
        raise click.UsageError(
            "give dead-letter ids or filters (--pipeline/--class/--reason/--all ...), not both"
        )
    if not chosen and not filtered:
        raise click.UsageError(
            "give dead-letter ids, filters (--pipeline/--class/--reason ...) or --all"
        )
    by = by or dlq_mod.default_by()
    with connect(ctx.ledger_dsn, autocommit=True, what="ledger") as conn:
        if chosen:
            res = dlq_mod.discard(conn, chosen, note, by)
        else:
            f = dlq_mod.Filters.parse(**raw, status="quarantined")
            n = dlq_mod.matching(conn, f)
            if n == 0:
                click.echo(f"no quarantined dead letters match ({f.without('status').described()})")
                sys.exit(1)
            _confirmed("Discard", n, f, yes)
            res = dlq_mod.discard_matching(conn, f, note, by, expected=None if yes else n)
            click.echo(
                f"discarded {len(res.changed):,} dead letter(s) matching "
                f"{f.without('status').described()}"
            )
            if not res.changed:
                sys.exit(1)
            return
    if res.changed:
        click.echo(f"discarded {len(res.changed):,}: {', '.join(map(str, res.changed))}")
    for i, why in sorted(res.skipped.items()):
        click.echo(f"skipped {i}: {why}")
    if not res.changed:
        sys.exit(1)


@dlq.command("export")
@_filter_options
@click.option("--ids", "id_list", multiple=True, help="Only these ids (e.g. 4,7,9).")
@click.option("--out", required=True, help="File to write the JSON Lines to ('-': stdout).")
@pass_ctx
def dlq_export(ctx: Ctx, id_list: tuple[str, ...], out: str, **kw) -> None:
    """Export dead letters as JSON Lines: every envelope field, key and payload base64."""
    f = _filters(ids=_ids(id_list) or None, **kw)
    n = 0
    with connect(ctx.ledger_dsn, autocommit=True, what="ledger") as conn:
        if out == "-":
            for n, line in enumerate(dlq_mod.export(conn, f), 1):
                sys.stdout.write(line)
                if n % 10_000 == 0:
                    click.echo(f"\rexported {n:,}", nl=False, err=True)
        else:
            path = Path(out)
            part = path.with_name(path.name + ".part")  # no half-written FILE on failure
            try:
                with part.open("w", encoding="utf-8") as fh:
                    for n, line in enumerate(dlq_mod.export(conn, f), 1):
                        fh.write(line)
                        if n % 10_000 == 0:
                            click.echo(f"\rexported {n:,}", nl=False, err=True)
                part.replace(path)
            except OSError as exc:
                raise BadInput(f"--out {out}: {exc.strerror or exc}") from None
            finally:
                part.unlink(missing_ok=True)
    n -= 1  # the last line is the export's end, with the count
    click.echo(f"\rexported {n:,} dead letter(s) to {'stdout' if out == '-' else out}", err=True)


@dlq.command("counts")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
def dlq_counts(ctx: Ctx, as_json: bool) -> None:
    """Quarantined records per pipeline and error class."""
    with connect(ctx.ledger_dsn, autocommit=True, what="ledger") as conn:
        by_pipeline = dlq_mod.counts_by_pipeline(conn)
    if as_json:
        click.echo(json.dumps(by_pipeline))
        return
    if not by_pipeline:
        click.echo("no quarantined dead letters")
        return
    heads = dlq_mod.ERROR_CLASSES
    click.echo(f"{'PIPELINE':<20}" + "".join(f"{h:>11}" for h in heads) + f"{'TOTAL':>9}")
    for p, c in by_pipeline.items():
        click.echo(f"{p:<20}" + "".join(f"{c[h]:>11,}" for h in heads) + f"{sum(c.values()):>9,}")


@dlq.command("redrive")
@click.argument("pipeline")
@click.argument("ids", nargs=-1)
@click.option("--class", "error_class", help="Every quarantined record of this error class.")
@click.option("--sink", help="Every quarantined record of this sink.")
@click.option("--since", help="Only records last seen at or after this ISO timestamp.")
@click.option("--until", help="Only records last seen before this ISO timestamp.")
@click.option("--reason", help="Only records whose reason contains this text (any case).")
@click.option(
    "--all",
    "everything",
    is_flag=True,
    help="Every quarantined record of PIPELINE (narrowed by --class/--sink/--since/"
    "--until/--reason).",
)
@click.option("--yes", is_flag=True, help="Do not ask before redriving all that match.")
@click.option(
    "--request",
    "request",
    type=click.IntRange(min=1),
    help="Run an existing redrive request (the redrive DAG's select task makes one).",
)
@click.option("--by", help="Who asks (recorded on the dead letters; default: user@host).")
@dry_run_option
@run_options
@pass_ctx
def dlq_redrive(
    ctx: Ctx,
    pipeline: str,
    ids: tuple[str, ...],
    error_class: str | None,
    sink: str | None,
    since: str | None,
    until: str | None,
    reason: str | None,
    everything: bool,
    yes: bool,
    request: int | None,
    by: str | None,
    external_id: str | None,
    dry_run: bool,
    airflow: AirflowRun | None,
    as_json: bool,
) -> None:
    """Replay quarantined records (IDS, e.g. 4 7 9 or 4,7,9, or all that match the filters)
    through the current pipeline code into the sinks, exactly once. Records that pass are
    written and marked redriven in the same two-phase commit; records that fail again stay
    quarantined with attempts + 1. The selection is kept in the ledger as a redrive request:
    any number of records (up to 200,000 at a time) goes to the Spark job as its id.
    --dry-run previews it (what would be redriven or fail again), nothing committed; the
    request stays, for --request."""
    from tidemark.driver import redrive
    from tidemark.ledger import redrives

    by = by or dlq_mod.default_by()
    chosen = _ids(ids)
    filtered = bool(error_class or sink or since or until or reason or everything)
    if request is not None and (chosen or filtered):
        raise click.UsageError("--request runs a request as it is: no ids or filters with it")
    if request is None and chosen and filtered:
        raise click.UsageError("give dead-letter ids or filters (--class/--sink/--all), not both")
    if request is None and not chosen:
        if not filtered:
            raise click.UsageError("give dead-letter ids, --class/--sink, or --all")
        f = dlq_mod.Filters.parse(
            pipeline=pipeline,
            error_class=error_class,
            sink=sink,
            since=since,
            until=until,
            reason=reason,
            status="quarantined",
        )
        with connect(ctx.ledger_dsn, autocommit=True, what="ledger") as conn:
            n = dlq_mod.matching(conn, f)
            if n and not dry_run:  # a preview changes nothing: no need to ask
                _confirmed("Redrive", n, f, yes)
            req = redrives.create(conn, pipeline, by, filters=f)
        if req is None:
            click.echo(f"{pipeline}: no quarantined records match; nothing to redrive")
            return
        click.echo(
            f"redrive request {req.request_id}: {req.letters:,} dead letter(s) of {pipeline}",
            err=True,
        )
        request = req.request_id
    run_and_report(
        ctx,
        pipeline,
        as_json,
        runner=redrive.redrive_run,
        request=request,
        ids=None if request is not None else chosen,
        by=by,
        external_id=external_id,
        airflow=airflow,
        dry_run=dry_run,
    )
