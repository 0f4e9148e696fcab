"""Reading: which files a reader uses, the DuckDB views, the locked query connection, compaction, Spark."""
