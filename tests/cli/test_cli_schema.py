from entropylens.cli.main import app
from typer.testing import CliRunner

from entropylens.schema import TABLES, schema_markdown

runner = CliRunner()


def test_schema_lists_every_column():
    res = runner.invoke(app, ["schema"])
    assert res.exit_code == 0
    for table, cols in TABLES.items():
        assert f"\n{table}\n" in res.output
        for c in cols:
            assert c.name in res.output


def test_schema_markdown_and_unknown_table():
    assert runner.invoke(app, ["schema", "--markdown"]).output == schema_markdown()
    res = runner.invoke(app, ["schema", "nope"])
    assert res.exit_code == 2
    assert "unknown table 'nope'" in res.output


def test_schema_markdown_of_one_table_prints_only_that_table():
    out = runner.invoke(app, ["schema", "probes", "--markdown"]).output
    assert out.startswith("**probes**\n") and out.count("**") == 2  # one table heading
    assert all(f"`{c.name}`" in out for c in TABLES["probes"])
    assert "`logit_grad_norm`" not in out  # a tokens column
