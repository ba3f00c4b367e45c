"""What every source yields: Arrow batches of one schema (its own module, so that the
package's readers and the package itself do not import each other)."""

from __future__ import annotations

import pyarrow as pa

# Every source yields batches of exactly this schema.
SCHEMA = pa.schema(
    [
        ("_tm_partition", pa.int32()),
        ("_tm_offset", pa.int64()),
        ("_tm_key", pa.binary()),
        ("_tm_payload", pa.binary()),
        ("_tm_headers", pa.string()),
        ("_tm_ts", pa.timestamp("us", tz="UTC")),
    ]
)
SPARK_SCHEMA = (
    "_tm_partition int, _tm_offset bigint, _tm_key binary, _tm_payload binary, "
    "_tm_headers string, _tm_ts timestamp"
)
BATCH_ROWS = 20_000
# What the reader leaves out of a record it decoded, where payload_source allows.
LEFT_OUT = ("_tm_key", "_tm_payload", "_tm_headers", "_tm_ts")
