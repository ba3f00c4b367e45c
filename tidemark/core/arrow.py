"""Arrow helpers shared by the reader and the writer."""

from __future__ import annotations

import numpy as np
import pyarrow as pa


def values(arr: pa.Array) -> pa.Buffer:
    """The bytes of a binary or string array's values, back to back, as one buffer (no copy):
    what Arrow's kernels built row by row, handed on whole (a JSON parse, a COPY body)."""
    wide = pa.types.is_large_binary(arr.type) or pa.types.is_large_string(arr.type)
    dtype = np.dtype(np.int64 if wide else np.int32)
    offsets = np.frombuffer(arr.buffers()[1], dtype, len(arr) + 1, arr.offset * dtype.itemsize)
    return arr.buffers()[2].slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
