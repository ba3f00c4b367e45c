"""The maintenance DAG's health checks (tasks.maintenance alerts on them): halted pipelines
(with the halt's reason, which names the way back, e.g. `tidemark settle RUN`), prepared
transactions left too long, leases held too long, dead letters past their bound, records that
appeared below a checkpoint in a gap a sink stepped over (tidemark/driver/late.py), and lag,
with the lag alerts' episodes so that a breach alerts once while it lasts."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

import psycopg

from tidemark import config
from tidemark.core.db import connect, one_line
from tidemark.core.errors import TidemarkError
from tidemark.core.settings import get_settings
from tidemark.driver import lag, late
from tidemark.driver.lag import Lag
from tidemark.ledger import dlq, history, runs, state
from tidemark.protocol import gids


@dataclass
class Problem:
    pipeline: str
    what: str
    # A lag breach's episode, "pipeline/sink/partition": alerted when it starts, not again
    # while it lasts (maintenance runs every 5 minutes).
    episode: str | None = None


@dataclass
class Health:
    problems: list[Problem] = field(default_factory=list)
    lags: dict[str, list[Lag]] = field(default_factory=dict)  # per pipeline, as measured
    unmeasured: set[str] = field(default_factory=set)  # lag not measured: episodes carry over
    prepared_oldest_seconds: float = 0.0  # over every database checked
    dead_letters: dict[str, dict[str, int]] = field(default_factory=dict)  # live, per class

    def by_pipeline(self) -> dict[str, list[Problem]]:
        out: dict[str, list[Problem]] = {}
        for p in self.problems:
            out.setdefault(p.pipeline, []).append(p)
        return out


def check_health(pipelines: dict[str, config.Pipeline], ledger: str) -> Health:
    """Old prepared transactions, long-held leases, DLQs past their bound and lag, per
    pipeline; ``ledger``: the ledger's DSN."""
    health = Health()
    prefix = get_settings().gid_prefix
    dsns = {ledger: "ledger"}
    users: dict[str, list[str]] = {ledger: ["-"]}  # dsn -> the pipelines with a sink there
    for p in pipelines.values():
        for s in p.sinks:
            try:
                dsn = p.sink_dsn(s)
            except TidemarkError as exc:
                health.problems.append(Problem(p.name, str(exc)))
                continue
            dsns.setdefault(dsn, f"sink {s.name} of {p.name}")
            users.setdefault(dsn, []).append(p.name)
    with connect(ledger, autocommit=True, what="ledger") as c:
        run_pipeline = runs.recent_pipelines(c)
        # Alerted while it lasts: a halt is lifted by an operator only.
        for name, why in sorted(state.halted_pipelines(c).items()):
            if name in pipelines:
                health.problems.append(Problem(name, f"halted: {why}"))
        health.dead_letters = dlq.counts_by_pipeline(c, list(pipelines))
        found, unknown = late.find(c, pipelines)
        health.problems += [Problem(x.gap.pipeline, x.line()) for x in found]
        health.problems += [Problem("-", e) for e in unknown]
        for name, p in pipelines.items():
            age = p.alerts.prepared_max_age_minutes
            for sink, run_id, minutes in runs.long_leases(c, name, age):
                health.problems.append(
                    Problem(
                        name,
                        f"sink {sink}: lease held by run {run_id} for {minutes:.0f} min (> {age})",
                    )
                )
            count = dlq.quarantined(c, name)
            if count > p.alerts.dlq_max:
                health.problems.append(
                    Problem(
                        name, f"{count:,} records quarantined in the DLQ (> {p.alerts.dlq_max:,})"
                    )
                )
            try:
                health.lags[name] = lag.measure(c, p)
            except (TidemarkError, psycopg.Error) as exc:
                health.unmeasured.add(name)
                health.problems.append(Problem(name, f"lag not measured: {one_line(exc)}"))
                continue
            health.problems += lag_problems(p, health.lags[name])
            # The Pipelines page's lag over time (ledger/history.py keeps one every 10 min).
            history.record_lag(
                c,
                name,
                [
                    history.Sample(x.sink, x.partition, x.checkpoint, x.head)
                    for x in health.lags[name]
                ],
                keep_days=get_settings().retention_runs_days,
            )
    for dsn, label in dsns.items():
        try:
            with connect(dsn, autocommit=True, what=label) as c:
                # Every database of the server: an orphan where no sink points any more too.
                rows = c.execute(
                    """SELECT gid, extract(epoch FROM now() - prepared) / 60
                                    FROM pg_prepared_xacts WHERE gid LIKE %s""",
                    (f"{prefix}:%",),
                ).fetchall()
        except TidemarkError as exc:
            health.problems += [Problem(name, str(exc)) for name in dict.fromkeys(users[dsn])]
            continue
        for gid, minutes in rows:
            health.prepared_oldest_seconds = max(
                health.prepared_oldest_seconds, float(minutes) * 60
            )
            g = gids.parse(gid, prefix)
            owner = run_pipeline.get(g.run_id) if g else None
            limit = (
                pipelines[owner].alerts.prepared_max_age_minutes
                if owner is not None and owner in pipelines
                else 30
            )
            if minutes > limit:
                health.problems.append(
                    Problem(
                        owner or "-",
                        f"prepared transaction {gid} on "
                        f"{label} is {minutes:.0f} min old "
                        f"(> {limit})",
                    )
                )
    return health


def lag_problems(p: config.Pipeline, lags: list[Lag], now: datetime | None = None) -> list[Problem]:
    """The (sink, partition)s past the pipeline's ``alerts.lag_max_records`` /
    ``lag_max_minutes``, each naming the sink, the partition and the lag."""
    a = p.alerts
    out = []
    for x in lags:
        why = []
        if a.lag_max_records is not None and x.records > a.lag_max_records:
            why.append(
                f"{x.records:,} records behind the source (checkpoint {x.checkpoint:,}, "
                f"source at {x.head:,}; > {a.lag_max_records:,})"
            )
        minutes = x.age_seconds(now) / 60
        if a.lag_max_minutes is not None and minutes > a.lag_max_minutes:
            why.append(
                f"oldest undelivered record {minutes:,.0f} min old (> {a.lag_max_minutes:g})"
            )
        if why:
            out.append(
                Problem(
                    p.name,
                    f"sink {x.sink} partition {x.partition} lags: " + "; ".join(why),
                    episode=f"{p.name}/{x.sink}/{x.partition}",
                )
            )
    return out


def lag_episodes(
    previous: dict[str, str], health: Health, now: str
) -> tuple[set[str], dict[str, str]]:
    """``(new episodes, state to keep)``; the state maps each open episode to when it began.
    An episode lasts while its breach does: once it ends, the next breach alerts again. The
    episodes of a pipeline whose lag could not be measured are kept as they were."""
    state = {k: v for k, v in previous.items() if k.split("/", 1)[0] in health.unmeasured}
    new = set()
    for prob in health.problems:
        if prob.episode:
            state[prob.episode] = previous.get(prob.episode, now)
            if prob.episode not in previous:
                new.add(prob.episode)
    return new, state


class LagEpisodes:
    """Open lag episodes, kept in the Airflow Variable ``tidemark_lag_episodes`` (JSON
    ``{"pipeline/sink/partition": "since"}``): durable across task processes and workers,
    in Airflow's own database beside the DAG runs that raise them, and visible (or reset, to
    alert again) under Admin -> Variables. Only the maintenance DAG writes it, one run at a
    time. Alerting state, not data: the ledger stays the data path's alone."""

    KEY = "tidemark_lag_episodes"

    def load(self) -> dict[str, str]:
        from airflow.sdk import Variable

        return dict(Variable.get(self.KEY, default={}, deserialize_json=True) or {})

    def save(self, state: dict[str, str]) -> None:
        from airflow.sdk import Variable

        Variable.set(
            self.KEY,
            state,
            serialize_json=True,
            description="Tidemark: open lag alert episodes (maintenance DAG)",
        )
