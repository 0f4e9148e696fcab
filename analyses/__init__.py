"""SQL analyses, one question per file; read by entropylens.query (installed as entropylens.analyses)."""
