"""The Typer app (installed as entropylens.cli): thin commands over the entropylens library."""
