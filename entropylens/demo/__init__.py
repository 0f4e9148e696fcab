"""`entropylens demo`: the built-in toy trainer's runs in worker processes, then the report."""
