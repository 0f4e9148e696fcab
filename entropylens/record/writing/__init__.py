"""The writer thread and what it writes: messages, the step table, token rows, Parquet files, its CPU place."""
