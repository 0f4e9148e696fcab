"""entropylens command line. Each command parses, calls one library function, prints.

Errors a user can cause (a missing path, bad SQL, a bad parameter) end with one line on stderr
and exit code 2, never a traceback.
"""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

app = typer.Typer(
    name="entropylens",
    help="Per-token training dynamics of GRPO-family RL: record, query, report.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """Per-token training dynamics of GRPO-family RL: record, query, report."""


class UserError(Exception):
    """An error the user can fix: printed as one line, exit code 2."""


def _fail(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(code=2)


@app.command()
def schema(
    table: Annotated[Optional[str], typer.Argument(help="Only this table (runs, steps, sequences, tokens).")] = None,
    markdown: Annotated[bool, typer.Option("--markdown", help="Print Markdown tables (as in README).")] = False,
) -> None:
    """Print the column contract (name, dtype, meaning) of every table."""
    from entropylens.schema import SCHEMA_VERSION, TABLES, schema_markdown

    if table is not None and table not in TABLES:
        _fail(f"unknown table {table!r}; tables: {', '.join(TABLES)}")
    if markdown:
        typer.echo(schema_markdown(), nl=False)
        return
    typer.echo(f"schema version {SCHEMA_VERSION}")
    for name, cols in TABLES.items():
        if table is not None and name != table:
            continue
        typer.echo(f"\n{name}")
        width = max(len(c.name) for c in cols)
        for c in cols:
            dtype = "dictionary<int8,string>" if c.dtype == "dict8" else c.dtype
            typer.echo(f"  {c.name:<{width}}  {dtype:<23}  {c.meaning}")


def main() -> None:
    try:
        app()
    except UserError as e:  # pragma: no cover - commands raise it through typer
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
