"""`entropylens verify` names every file a reader leaves out or that is wrong, with what is wrong, and exits 1:
wrong types, a foreign table, a file the recorder did not name, a step's token rows against its n_tokens,
run.json of the wrong types, originals a committed compaction superseded; a whole run exits 0."""

import json
import shutil
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent.parent / "helpers"))
from entropylens.cli.main import app  # noqa: E402
from layout_run import make_run  # noqa: E402

from entropylens.read.compact import compact  # noqa: E402
from entropylens.read.query import connect  # noqa: E402

runner = CliRunner()


def _verify(path) -> tuple[int, list[str]]:
    res = runner.invoke(app, ["verify", str(path)])
    assert "Traceback" not in res.output and res.exception is None or isinstance(res.exception, SystemExit)
    return res.exit_code, res.stdout.splitlines()


def test_every_kind_of_wrong_file_is_named_once(tmp_path):
    d = Path(make_run(tmp_path, "a", steps=5, rows=64).path)
    tok = lambda s: d / "tokens" / f"step={s}" / "rank=0" / "update-0.parquet"  # noqa: E731
    assert _verify(tmp_path)[0] == 0
    t = pq.read_table(tok(0), partitioning=None)
    pq.write_table(t.set_column(t.column_names.index("seq"), "seq", t["seq"].cast(pa.string())), tok(0))
    pq.write_table(pa.table({"x": [1]}), tok(1))
    shutil.copy(tok(2), tok(2).with_name("update-0 copy.parquet"))
    shutil.copy(tok(3), tok(3).with_name("update-1.parquet"))  # a recorder's name: 128 rows, n_tokens 64
    info = json.loads((d / "run.json").read_text())
    (d / "run.json").write_text(json.dumps({**info, "eps_low": "0.2"}))
    code, lines = _verify(tmp_path)
    assert code == 1
    bad = [ln for ln in lines if ln.startswith("bad: ")]
    assert len(bad) == 5, lines
    assert any(
        b.startswith(f"bad: {tok(0)}: column(s) of another type than the schema contract: `seq` is string, not int32")
        for b in bad
    )
    assert any(b.startswith(f"bad: {tok(1)}: not an entropylens tokens file") for b in bad)
    assert any(
        b.startswith(f"bad: {tok(2).with_name('update-0 copy.parquet')}: not a file entropylens writes") for b in bad
    )
    assert any(
        f"step 3 rank 0: its token files ({tok(3).parent}/) hold 128 rows, its steps rows say n_tokens 64" in b
        for b in bad
    )
    assert any(b.startswith(f"bad: {d / 'run.json'}: run.json's 'eps_low' is \"0.2\", not a number") for b in bad)
    assert lines[-1].startswith("5 bad file(s) among ")


def test_originals_a_committed_compaction_superseded_are_named(tmp_path):
    d = Path(make_run(tmp_path, "a", steps=3, rows=64).path)
    want = connect(tmp_path).execute("SELECT step, count(*) FROM tokens GROUP BY step ORDER BY step").fetchall()
    keep = tmp_path.parent / (tmp_path.name + "-originals")
    shutil.copytree(d, keep)
    compact(tmp_path, grace_s=0)
    for table in ("tokens", "steps", "sequences"):  # a compaction killed before it removed the originals
        shutil.copytree(keep / table, d / table, dirs_exist_ok=True)
    shutil.rmtree(keep)
    assert (
        connect(tmp_path).execute("SELECT step, count(*) FROM tokens GROUP BY step ORDER BY step").fetchall() == want
    )  # readers already ignore them
    code, lines = _verify(tmp_path)
    superseded = [ln for ln in lines if "superseded by a committed compaction" in ln]
    assert code == 1 and len(superseded) == 9, lines
    assert f"bad: {d / 'tokens' / 'step=0' / 'rank=0' / 'update-0.parquet'}: superseded" in "\n".join(superseded)
