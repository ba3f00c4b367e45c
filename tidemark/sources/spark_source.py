"""The Spark Python data source ``tidemark``: one input partition per offset range."""

from __future__ import annotations

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from tidemark.ledger.state import Range


class RangePartition(InputPartition):
    def __init__(self, partition: int, start: int, end: int):
        super().__init__((partition, start, end))
        self.range = (partition, start, end)


class _Reader(DataSourceReader):
    def __init__(self, job):
        self.job = job  # a tidemark.sources.ReadJob

    def partitions(self):
        return [RangePartition(*r) for r in self.job.ranges]

    def read(self, partition):
        yield from self.job.batches(Range(*partition.range))


class TidemarkSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return "tidemark"

    def schema(self):
        return self._job().spark_schema()

    def reader(self, schema):
        return _Reader(self._job())

    def _job(self):
        from tidemark.sources import ReadJob
        return ReadJob.model_validate_json(self.options["job"])


def register(spark) -> None:
    spark.dataSource.register(TidemarkSource)
