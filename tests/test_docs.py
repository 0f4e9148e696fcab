"""README stays true: the column table matches the schema, both commands are there, every CLI
command is documented."""

import re
from pathlib import Path

from entropylens.schema import schema_markdown

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_column_table_matches_schema():
    m = re.search(r"<!-- schema:start -->\n(.*)<!-- schema:end -->", README, re.S)
    assert m, "README lacks the schema markers"
    assert m.group(1) == schema_markdown(), "README column table is stale: entropylens schema --markdown"


def test_readme_has_two_commands():
    for marker in ("<!-- run-command -->", "<!-- test-command -->"):
        block = README.split(marker, 1)[1]
        line = block.split("```bash\n", 1)[1].split("\n", 1)[0]
        assert "pip install torch==2.13.0" in line


def test_every_cli_command_in_readme():
    from entropylens.cli.main import app

    names = [c.name or c.callback.__name__ for c in app.registered_commands]
    assert names
    for name in names:
        assert f"entropylens {name}" in README, f"README does not document `entropylens {name}`"
