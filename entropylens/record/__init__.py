"""Recording: the Recorder, its device work per update, the one host copy, the writer thread and Parquet."""
