"""Where runs are looked for (`entropylens runs /tmp` does not walk everything below /tmp, nor warn about
unrelated folders): folders that cannot hold a run are not searched, unreadable ones are
skipped silently, warnings name files of runs only; the same rules on object storage."""

import os
import sys
import time
import uuid
from pathlib import Path

from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent.parent / "helpers"))
from entropylens.cli.main import app  # noqa: E402
from layout_run import make_run  # noqa: E402

from entropylens import storage  # noqa: E402
from entropylens.read import catalog

RUNS = ["a", "exp/sweep/b", "x/y/z/w/c"]  # depths 1, 3, 5
# a run.json in each of these is not a run: a folder that cannot hold one, or a run's own folder
DECOYS = [
    ".venv/lib/python3.12/site-packages/pkg",
    "venv/lib/python3.12/site-packages/pkg",
    "venv/share",
    "proj/.git/objects/ab",
    "web/node_modules/m/lib",
    "src/__pycache__",
    "lib/dist-packages/p",
    ".cache/pip",
    "a/tokens/step=0",
    "a/extra",
    "exp/sweep/b/compacted/tokens",
]
UNREADABLE = ["systemd-private-1", "x/locked"]


def _files(d: Path, n: int, ext: str = ".py") -> None:
    d.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (d / f"f{i}{ext}").touch()


def tmp_like_tree(root: Path, n: int = 60) -> None:
    """A /tmp-like tree: virtual environments, a git repo, node_modules, caches, unreadable folders, and
    three runs at different depths (one with a run.json cut mid-write next to them)."""
    for venv in (".venv", "venv"):  # venv/ is found by its pyvenv.cfg, not by its name
        for p in range(n):
            _files(root / venv / "lib/python3.12/site-packages" / f"pkg{p}", 10)
            _files(root / venv / "lib/python3.12/site-packages" / f"pkg{p}/__pycache__", 10, ".pyc")
        (root / venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    for i in range(n):
        _files(root / "proj/.git/objects" / f"{i:02x}", 10, "")
        _files(root / "web/node_modules" / f"m{i}/lib", 10, ".js")
    _files(root / "proj/src", 5)
    for r in RUNS:
        make_run(root / Path(r).parent, Path(r).name, steps=2, rows=8)
    (root / "exp/broken").mkdir(parents=True)
    (root / "exp/broken/run.json").write_text('{"run": "broken", ')  # a run's file: this one is a warning
    for d in DECOYS:
        (root / d).mkdir(parents=True, exist_ok=True)
        (root / d / "run.json").write_text('{"run": "decoy"')  # unreadable too: a warning if it were walked
    (root / "loop").mkdir()
    os.symlink(root, root / "loop" / "back")  # a link back up: never followed
    for d in UNREADABLE:
        _files(root / d / "inner", 3)
        (root / d / "inner" / "run.json").write_text("{}")


def test_walk_skips_folders_that_cannot_hold_a_run(tmp_path, monkeypatch):
    root = tmp_path / "tmp"
    tmp_like_tree(root)
    listed = []
    real_scandir = os.scandir
    unreadable = {str(root / d) for d in UNREADABLE}

    def scandir(path="."):  # tests run as root, for whom chmod 000 blocks nothing: refuse as the kernel would
        if isinstance(path, int):  # a file descriptor (shutil.rmtree's fd walk, a finalizer): not the walk's
            return real_scandir(path)
        listed.append(os.fspath(path))
        if os.fspath(path) in unreadable:
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_scandir(path)

    for d in unreadable:
        os.chmod(d, 0)
    try:
        monkeypatch.setattr(os, "scandir", scandir)
        t = time.perf_counter()
        found = catalog.find_runs(root)
        walk_s = time.perf_counter() - t
        monkeypatch.setattr(os, "scandir", real_scandir)
        t = time.perf_counter()
        everything = [
            p for p in storage.location(root).files() if p.endswith("/run.json")
        ]  # every file listed, for the timing printed
        full_s = time.perf_counter() - t
        print(
            f"\nfind_runs: {len(found)} runs, {len(listed)} folders listed, {walk_s * 1e3:.1f} ms; listing every "
            f"file: {len(everything)} run.json files, {full_s * 1e3:.1f} ms"
        )

        assert [os.path.relpath(d.path, root) for d in found] == sorted(["exp/broken", *RUNS])
        assert all(str(root / d) not in listed for d in DECOYS)
        seen = [os.path.relpath(p, root).split(os.sep) for p in listed if p != str(root)]
        assert not any(part.startswith(".") or part in catalog.SKIP_DIRS for parts in seen for part in parts)
        assert not any(p.startswith(str(root / r) + os.sep) for p in listed for r in RUNS)  # nothing below a run
        assert not any(p.startswith(str(root / "venv") + os.sep) for p in listed)  # found by pyvenv.cfg
        assert not any("back" in p.split(os.sep) for p in listed)  # the link is not followed

        # the CLI: the three runs, one warning (the run.json cut mid-write), nothing about the rest
        monkeypatch.setattr(os, "scandir", scandir)
        res = CliRunner().invoke(app, ["runs", str(root)])
        assert res.exit_code == 0, res.output
        assert [line.split()[0] for line in res.stdout.splitlines()[1:]] == ["a", "b", "c"]
        warnings = [line for line in res.stderr.splitlines() if line.strip()]
        assert len(warnings) == 1 and warnings[0].startswith(
            f"warning: skipped {root / 'exp/broken/run.json'}: unreadable run.json"
        ), res.stderr
    finally:
        for d in unreadable:
            os.chmod(d, 0o755)


def test_rules_are_said_in_docstring_and_help():
    doc = " ".join(catalog.find_runs.__doc__.split())
    for word in (
        "nothing below it",
        "hidden folders",
        "__pycache__",
        "node_modules",
        "site-packages",
        "pyvenv.cfg",
        "cannot be read",
        "skipped silently",
    ):
        assert word in doc
    out = " ".join(CliRunner().invoke(app, ["runs", "--help"]).stdout.split())
    for word in (
        "the folders of a run (nothing below a run)",
        "hidden folders (.git, .venv, .cache, ...)",
        "__pycache__, node_modules, site-packages",
        "folders that cannot be read (skipped silently)",
    ):
        assert word in out


def _remote_tree(url: str) -> str:
    """The runs and decoys of the local tree under an object-store ``url``."""
    for r in RUNS:
        parent, _, name = f"{url}/{r}".rpartition("/")
        make_run(parent, name, steps=1, rows=8)
    for d in DECOYS:
        storage.location(f"{url}/{d}/run.json").write_text('{"run": "decoy"')
    storage.location(f"{url}/venv/pyvenv.cfg").write_text("home = /usr/bin\n")
    return url


def test_same_rules_on_object_storage():
    """The remote walk is one listing of the prefix (fs.find), filtered by the same rules: fsspec's
    in-memory filesystem goes the way s3:// goes (test_storage.py runs the S3 server)."""
    url = _remote_tree(f"memory://el-find-runs-{uuid.uuid4().hex[:8]}/tmp")
    found = catalog.find_runs(url)
    assert [storage.location(url).relative(d) for d in found] == RUNS
    assert [d.name for d in catalog.find_runs(url, runs=["b"])] == ["b"]
    assert catalog.find_runs(f"{url}/a") == [storage.location(f"{url}/a")]  # a run itself


def test_same_rules_on_s3(s3):  # noqa: F811 - the s3 fixture, imported above
    """The same on moto's S3 server (one LIST walk of the prefix, filtered)."""
    url = _remote_tree(s3())
    found = catalog.find_runs(url)
    assert [storage.location(url).relative(d) for d in found] == RUNS
    res = CliRunner().invoke(app, ["runs", url])
    assert res.exit_code == 0 and not res.stderr.strip(), res.output
    assert [line.split()[0] for line in res.stdout.splitlines()[1:]] == ["a", "b", "c"]
