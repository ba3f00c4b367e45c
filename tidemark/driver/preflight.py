"""What a pipeline needs of the world before a run starts Spark: its source there with the
columns it reads, each sink's database ready for two-phase commit, each sink's table able to
take what the transform writes. ``tidemark pipelines validate`` reports the same.

May import: sources, protocol, config, core.
"""

from __future__ import annotations

from tidemark.config import FileArchiveSource, Pipeline, PostgresLogSource
from tidemark.core.errors import ConfigError, TidemarkError
from tidemark.protocol import sinks
from tidemark.protocol.sink_schema import static_output


def source_problems(pipeline: Pipeline) -> list[str]:
    """What keeps the run from reading its source, one line each."""
    src = pipeline.source
    try:
        if isinstance(src, PostgresLogSource):
            from tidemark.sources import postgres_log

            return postgres_log.problems(src, pipeline.source_dsn())
        assert isinstance(src, FileArchiveSource)
        from tidemark.sources import file_archive

        file_archive.FileArchivePlanner(src).partitions()  # the folder there and readable
        return []
    except ConfigError as exc:  # names where itself: "pipeline p: source: ..."
        return [str(exc)]
    except TidemarkError as exc:
        return [f"source: {exc}"]


def sink_problems(pipeline: Pipeline, names: list[str] | None = None) -> dict[str, list[str]]:
    """By sink (``names``, default all): what keeps the run from writing it, one line each
    with its fix."""
    want = static_output(pipeline)
    out: dict[str, list[str]] = {}
    for sink in pipeline.sinks:
        if names is not None and sink.name not in names:
            continue
        what = f"sink {sink.name}"
        try:
            resolved = sinks.ResolvedSink(sink, pipeline.sink_dsn(sink), pipeline.name)
            out[sink.name] = sinks.table_problems(resolved, want, what)
        except (TidemarkError, ConfigError) as exc:
            out[sink.name] = [str(exc)]
    return out


def problems(pipeline: Pipeline) -> list[str]:
    """Every problem of the source and of every sink, in that order."""
    return source_problems(pipeline) + [
        p for found in sink_problems(pipeline).values() for p in found
    ]
