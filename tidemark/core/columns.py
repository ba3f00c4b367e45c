"""The names of the columns Tidemark adds to a record on its way through a run: where it sits
in the source log (partition, offset) and what the source held (key, payload, headers, time).
A sink's table carries the position columns; SQL text spells them too, as these say."""

PARTITION = "_tm_partition"
OFFSET = "_tm_offset"
KEY = "_tm_key"
PAYLOAD = "_tm_payload"
HEADERS = "_tm_headers"
TS = "_tm_ts"
