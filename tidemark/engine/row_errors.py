"""The columns that carry a record's verdict through the Spark batch: set when decoding,
transforming or checking fails (tidemark/engine/records.py), read by corrections and the
writer. Their own module, so corrections need not import records, which applies them.
"""

ERR_CLASS, ERR_REASON = "_tm_error_class", "_tm_reason"
