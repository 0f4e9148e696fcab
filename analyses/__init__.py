"""SQL analyses, one question per file; read by entropylens.read.query (installed as entropylens.analyses)."""
