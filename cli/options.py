"""The arguments and options that several commands share, declared once: PATH, --run, --format,
--output, --engine, and the choices they take."""

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer


class Format(str, Enum):
    table = "table"
    csv = "csv"
    json = "json"
    parquet = "parquet"


class Engine(str, Enum):
    duckdb = "duckdb"
    spark = "spark"


class Band(str, Enum):
    minmax = "minmax"
    sd = "sd"


PathArg = Annotated[
    str,
    typer.Argument(
        metavar="PATH",
        help="A run directory, a directory of runs, or any directory above them; or an object-store URL "
        "(s3://bucket/prefix; endpoint and keys from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...).",
    ),
]

RunsOpt = Annotated[list[str] | None, typer.Option("--run", help="Only these runs (repeatable).")]

EngineOpt = Annotated[
    Engine,
    typer.Option("--engine", help="duckdb (canonical, local) or spark (the same SQL on pyspark; see docs/spark.md)."),
]

FormatOpt = Annotated[
    Format | None,
    typer.Option(
        "--format",
        "-f",
        show_default=False,
        help="Output format (default: --output's extension; table for .txt, no extension or no --output).",
    ),
]

OutputOpt = Annotated[
    Path | None,
    typer.Option(
        "--output",
        "-o",
        metavar="FILE",
        help="Write to this file. Its extension names the format: .csv .json .parquet .pq .txt or none; any other "
        "is refused.",
    ),
]

TauOpt = Annotated[
    float | None,
    typer.Option(
        "--tau",
        metavar="TAU",
        show_default=False,
        help="Split the quadrants at this probability threshold (HP: p >= TAU) in place of each run's recorded tau, "
        "recomputed from the token rows (docs/analyses.md).",
    ),
]
