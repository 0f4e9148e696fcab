"""Encoding host arrays into Parquet files, atomically. Runs on the recorder's writer thread.

Paths are local directories or object-store locations (storage.py): a file is written to a hidden
temporary name and renamed, or uploaded whole in one PUT under its final name.

Encodings (benchmarks/writer.py measures them against pyarrow's defaults): zstd level 1;
dictionary encoding only for low-cardinality columns (update, seq, group, quadrant, token_id,
advantage: one value per sequence); BYTE_STREAM_SPLIT for the float columns; step and rank live in
the Hive partition path, not in the file; derived columns (schema.Column.derived) are not stored.
Files of a few KB (a step's steps rows, its sequences: ``SMALL_BYTES``) are written without
compression and column statistics (parquet_options); tokens files always keep both.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ...schema import QUADRANT_NAMES, SCHEMA_VERSION, arrow_type, stored_columns
from ...storage import Location, location

TOKEN_DICT_COLUMNS = ("update", "seq", "group", "quadrant", "token_id", "advantage")
TOKEN_FLOAT_COLUMNS = tuple(c.name for c in stored_columns("tokens") if c.dtype == "float32" and c.name != "advantage")
_QUADRANT_DICT = pa.array([QUADRANT_NAMES[i] for i in range(len(QUADRANT_NAMES))], pa.string())
FILE_META = {b"entropylens.schema_version": str(SCHEMA_VERSION).encode()}


def parquet_options(
    names, *, dict_columns=(), float_columns=(), small: bool = False, plain_floats: bool = False
) -> dict:
    """pyarrow write options of every entropylens file (compaction reuses them). ``plain_floats``
    (compacted files): the float columns PLAIN and uncompressed, every other column as below. A
    token's float32 values barely compress (zstd keeps ~93% of them), and reading them back is the
    largest part of a query's scan: on 100M compacted rows, a float column reads in ~0.3 s of CPU
    instead of ~0.8 s (benchmarks/scale.py), for ~0.3 B more per row and float column. ``small``: a
    file of a few KB (a step's steps rows, its sequences) is written without compression and
    without column statistics: the same values, types and nulls, ~30% less encoding CPU per file;
    zstd gains a few hundred bytes there and min/max statistics prune nothing in a file of one row group
    of a few rows (tokens files always keep both: DuckDB's filter pushdown reads them)."""
    names = set(names)
    opts = dict(
        compression="zstd",
        compression_level=1,
        use_dictionary=[c for c in dict_columns if c in names],
        column_encoding={c: "BYTE_STREAM_SPLIT" for c in float_columns if c in names},
    )
    if small:
        opts.update(compression="none", compression_level=None, write_statistics=False)
    elif plain_floats:
        raw = {c for c in float_columns if c in names}
        opts.update(
            compression={c: "none" if c in raw else "zstd" for c in names},
            compression_level={c: 1 for c in names - raw},
            column_encoding={c: "PLAIN" for c in raw},
        )
    return opts


SMALL_BYTES = 64 << 10  # steps / sequences tables up to this size are written as small files (parquet_options)
_BUFFER_BYTES = 64 << 20  # tables up to this size are encoded in memory, then written with one call


def write_parquet_atomic(
    table: pa.Table,
    path: Path | Location,
    *,
    dict_columns=(),
    float_columns=(),
    fsync: bool = False,
    small_bytes: int = 0,
) -> None:
    """Write a whole file atomically: locally to a hidden temporary name that no ``*.parquet`` glob
    matches, then rename (``fsync``: flush file and directory first); on object storage one PUT of
    the finished bytes under the final name. A table of up to 64 MB (every file the recorder
    writes) is encoded into memory first and written with one call: the same bytes, without
    pyarrow opening the path itself (its filesystem lookup and file object cost the writer thread
    ~2 ms of CPU per file). A table of up to ``small_bytes`` is written as a small file
    (:func:`parquet_options`)."""
    loc = location(path)
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), **FILE_META})
    size = table.get_total_buffer_size()
    opts = parquet_options(
        table.column_names, dict_columns=dict_columns, float_columns=float_columns, small=size <= small_bytes
    )
    if loc.remote or size <= _BUFFER_BYTES:
        buf = pa.BufferOutputStream()
        pq.write_table(table, buf, **opts)
        # write_bytes takes any buffer (it calls bytes() / os.write on it) though annotated bytes: no copy here
        loc.write_bytes(memoryview(buf.getvalue()), fsync=fsync)
    else:
        loc.write_with(lambda tmp: pq.write_table(table, tmp, **opts), fsync=fsync)


# NaN on the device = null in the file: a gradient unchanged (entropy_effect_dropped), an entropy bonus's
# own term not measured (entropy_effect: token_columns.entropy_bonus_rule)
NAN_IS_NULL = (
    "entropy_effect",
    "entropy_effect_dropped",
    "sampler_logprob",
)  # sampler_logprob: a token the sampler did not score


_TOKEN_FIELDS: list | None = None  # (name, arrow type) of the stored token columns, built once


def _token_fields() -> list:
    global _TOKEN_FIELDS
    if _TOKEN_FIELDS is None:
        _TOKEN_FIELDS = [
            (c.name, arrow_type(c.dtype)) for c in stored_columns("tokens") if c.name not in ("step", "rank")
        ]  # step and rank: partition keys
    return _TOKEN_FIELDS


def tokens_table(arrs: dict[str, np.ndarray]) -> pa.Table:
    """The token rows of one update: the stored columns (prob, ratio and entropy_ratio are exact
    functions of stored ones and are derived by the views). Absent columns are written as nulls."""
    n = len(arrs["seq"])
    cols, fields = [], []
    for name, typ in _token_fields():
        if name == "quadrant":
            arr = pa.DictionaryArray.from_arrays(pa.array(arrs["quadrant"], pa.int8()), _QUADRANT_DICT)
        elif name in NAN_IS_NULL and name in arrs:  # NaN marks "not applicable" on the device
            arr = pa.array(arrs[name], typ, mask=np.isnan(arrs[name]))
        elif name in arrs:
            arr = pa.array(arrs[name], typ)
        else:
            arr = pa.nulls(n, typ)
        cols.append(arr)
        fields.append(pa.field(name, typ))
    return pa.Table.from_arrays(cols, schema=pa.schema(fields))


def write_tokens(
    run_dir: Path | Location, step: int, rank: int, updates: int | tuple[int, int], arrs: dict, *, fsync: bool = False
) -> Path | Location:
    """update-U.parquet for one update; updates-A-B.parquet for updates A..B sharing a file."""
    first, last = (updates, updates) if isinstance(updates, int) else updates
    name = f"update-{first}.parquet" if first == last else f"updates-{first}-{last}.parquet"
    path = run_dir / "tokens" / f"step={step}" / f"rank={rank}" / name
    write_parquet_atomic(
        tokens_table(arrs), path, dict_columns=TOKEN_DICT_COLUMNS, float_columns=TOKEN_FLOAT_COLUMNS, fsync=fsync
    )
    return path


def write_sequences(
    run_dir: Path | Location, step: int, rank: int, part: int, arrs: dict, *, fsync: bool = False
) -> Path | Location:
    table = pa.table(
        {
            "seq": pa.array(arrs["seq"], pa.int32()),
            "group": pa.array(arrs["group"], pa.int32()),
            "reward": pa.array(arrs["reward"], pa.float32()),
            "advantage": pa.array(arrs["advantage"], pa.float32()),
            "length": pa.array(arrs["length"], pa.int32()),
            "text": pa.array(arrs.get("text") or [None] * len(arrs["seq"]), pa.string()),
        }
    )
    path = run_dir / "sequences" / f"step={step}" / f"rank={rank}" / f"part-{part}.parquet"
    write_parquet_atomic(table, path, dict_columns=("group",), fsync=fsync, small_bytes=SMALL_BYTES)
    return path


_FLOAT32, _FLOAT64 = pa.float32(), pa.float64()
_STEP_TYPES: dict | None = None  # name -> arrow type of the stored steps columns, built once
_STEP_INTS: frozenset = frozenset()  # the integer ones among them
_EXACT_INT = float(2**53)  # integers below this magnitude pass through float64 unchanged


def _step_types() -> dict:
    global _STEP_TYPES, _STEP_INTS
    if _STEP_TYPES is None:
        from ...schema import STEPS

        types = {c.name: arrow_type(c.dtype) for c in STEPS if c.name not in ("step", "rank")}
        _STEP_INTS = frozenset(n for n, t in types.items() if pa.types.is_integer(t))
        _STEP_TYPES = types
    return _STEP_TYPES


def nan_is_null(name: str) -> bool:
    """Whether a NaN in the steps column ``name`` means "not measured" (stored as null): the recorder's
    own aggregates (schema.STEP_METRICS but the loss, and the entropy budget sums, e.g. a mean over zero
    tokens, or a column whose input was not given; an update without loss= leaves loss out of its row). Every other column holds what the caller gave (grad_norm, lr,
    reward_mean, the loss settings, extra metrics): its NaN is a value and stays NaN (+-inf stay in every
    column): a NaN grad norm is the first sign of a blow-up, not a missing one."""
    global _AGGREGATES
    if _AGGREGATES is None:
        from ...schema import STEP_METRICS, STEPS

        # the loss of an update is the caller's value (left out of the row when not given): not an aggregate
        _AGGREGATES = (frozenset(STEP_METRICS) - {"loss"}) | {
            c.name for c in STEPS if c.name.startswith("entropy_effect")
        }
    return name in _AGGREGATES


_AGGREGATES: frozenset | None = None


def _steps_column(vals: list, typ, keep_nan: bool = False) -> pa.Array:
    """One steps column from Python values, value by value: None becomes null, and so does NaN unless
    ``keep_nan``; integer columns round (the reference the column-wise :func:`steps_table` equals)."""
    vals = [None if (v is None or (not keep_nan and isinstance(v, float) and v != v)) else v for v in vals]
    if pa.types.is_integer(typ):
        vals = [None if v is None else int(round(v)) for v in vals]
    return pa.array(vals, typ)


def steps_table(rows: list[dict]) -> pa.Table:
    """The steps rows as a table: the schema's columns (its dtypes) in schema order, then the extra
    metrics (float64) in name order; None becomes null, and so does NaN in the recorder's aggregates
    (not measured, :func:`nan_is_null`); NaN in the caller's scalars stays NaN; integer
    columns round half to even. Column-wise: the rows go into one float64 matrix [rows, columns]
    (None -> NaN) and each column is one numpy slice, when every value is a Python float, None, or
    (integer columns only) a Python int; other values (numpy scalars, bools, strings) take the
    value-by-value path (:func:`_steps_column`), whose result this equals."""
    known = _step_types()
    names = list(known) + sorted({k for r in rows for k in r} - known.keys())
    ints = _STEP_INTS
    fast = bool(rows) and all(
        type(v) is float or v is None or (type(v) is int and k in ints) for r in rows for k, v in r.items()
    )
    if not fast:
        return steps_table_by_values(rows)
    m = np.array([[r.get(n) for r in rows] for n in names], dtype=np.float64)  # [columns, rows], None -> NaN
    null = np.isnan(m)
    for j in np.flatnonzero(null.any(axis=1)).tolist():  # a caller's NaN is a value: only its None is null
        if not nan_is_null(names[j]):
            null[j] = [r.get(names[j]) is None for r in rows]
    n = len(rows)
    cols: list = [None] * len(names)
    # columns of one arrow type become one array (one conversion), cut into per-column slices
    groups: dict = {}
    for j, name in enumerate(names):
        groups.setdefault(known.get(name, _FLOAT64), []).append(j)
    for typ, js in groups.items():
        vals, nulls = m[js], null[js]  # [k, rows]
        if typ == _FLOAT32:
            with np.errstate(over="ignore"):  # beyond float32's range -> inf, as the value-by-value cast
                vals = vals.astype(np.float32)
        elif pa.types.is_integer(typ):
            exact = (np.abs(vals) < _EXACT_INT) | nulls  # [k, rows]
            ok = exact.all(axis=1)
            for j in np.asarray(js)[~ok]:  # beyond float64's exact integers, or inf (an error there): value by value
                cols[j] = _steps_column([r.get(names[j]) for r in rows], typ)
            js, vals, nulls = [j for j, good in zip(js, ok) if good], vals[ok], nulls[ok]
            vals = np.rint(np.where(nulls, 0.0, vals)).astype(np.int64)  # round half to even, as round()
        if not js:
            continue
        arr = pa.array(vals.ravel(), typ, mask=nulls.ravel())
        for i, j in enumerate(js):
            cols[j] = arr.slice(i * n, n)
    return pa.Table.from_arrays(cols, names=names)


def steps_table_by_values(rows: list[dict]) -> pa.Table:
    """:func:`steps_table` value by value (:func:`_steps_column` per column): the path for values the
    column-wise one does not take, and the reference it equals."""
    known = _step_types()
    names = list(known) + sorted({k for r in rows for k in r} - known.keys())
    return pa.Table.from_arrays(
        [
            _steps_column([r.get(n) for r in rows], known.get(n, pa.float64()), keep_nan=not nan_is_null(n))
            for n in names
        ],
        names=names,
    )


def write_steps(
    run_dir: Path | Location, step: int, rank: int, rows: list[dict], *, fsync: bool = False
) -> Path | Location:
    """One file per (step, rank): a row per update (:func:`steps_table`). Known columns get the
    schema's dtype, extra metrics float64; NaN aggregates (not measured) become nulls, the caller's
    NaN and inf scalars are stored as they are."""
    path = run_dir / "steps" / f"step={step}" / f"rank={rank}" / "steps.parquet"
    write_parquet_atomic(steps_table(rows), path, fsync=fsync, small_bytes=SMALL_BYTES)
    return path


def write_probes(
    run_dir: Path | Location, step: int, rank: int, update: int, rows: list[dict], *, fsync: bool = False
) -> Path | Location:
    """probe-U.parquet: the parameter-space probe of one update (schema.PROBES), a row per gradient part.
    Written before the steps file of its step (the step commits it)."""
    from ...schema import PROBES

    cols = {}
    for c in PROBES:
        if c.name in ("step", "rank"):
            continue  # partition keys
        cols[c.name] = _steps_column([r.get(c.name) for r in rows], arrow_type(c.dtype))
    path = run_dir / "probes" / f"step={step}" / f"rank={rank}" / f"probe-{update}.parquet"
    write_parquet_atomic(pa.table(cols), path, fsync=fsync)
    return path
