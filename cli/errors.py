"""What a user can get wrong, as one line on stderr: `error: ...` and exit 2 (never a traceback), and
the library's skipped-file warnings as one `warning: ...` line each."""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import NoReturn

import typer


def fail(msg: str) -> NoReturn:
    """``error: MSG`` on stderr, exit 2; what a user named in MSG (a run id, a path, SQL) shows its control,
    bidi and format characters as codes (report/escape.py), a line break of a message kept."""
    from entropylens.report.escape import terminal

    typer.echo(f"error: {terminal(str(msg), keep=chr(10))}", err=True)
    raise typer.Exit(code=2)


def os_error_line(e: OSError) -> str:
    """'No such file or directory: /proc/demo' rather than '[Errno 2] ...'."""
    return f"{e.strerror}: {e.filename}" if e.strerror and e.filename else (e.strerror or str(e))


def user_error_types() -> tuple[type[Exception], ...]:
    """The exception types that are the user's to fix (printed as one line, exit 2). A missing path, not
    a run, bad SQL (QueryError, NotReadOnly: ValueErrors), an unknown analysis, a bad parameter."""
    from entropylens.read.query import QueryError

    return (QueryError, ValueError, FileNotFoundError, NotADirectoryError, PermissionError)


def user_errors(command):
    """A command whose user errors (:func:`user_error_types`) end as `error: MESSAGE`, exit 2. Anything
    else passes: typer.Exit, KeyboardInterrupt, BrokenPipeError (the reader of our output went away:
    the process leaves quietly, cli.process.run)."""

    @functools.wraps(command)
    def checked(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except user_error_types() as e:
            fail(str(e))

    return checked


@contextmanager
def writing(option: str, value, *, reading_too: bool = False):
    """An OSError inside (a full disk, a read-only or pseudo file system under the output) as one line
    blamed on the option, `error: --out DIR: the system's reason`; a BrokenPipeError passes.
    reading_too: the block also reads the user's files, so a missing file, a directory that is a file or
    no permission prints the system's reason alone (it may name another file than the option's)."""
    try:
        yield
    except BrokenPipeError:
        raise
    except (FileNotFoundError, NotADirectoryError, PermissionError) as e:
        fail(os_error_line(e) if reading_too else f"{option} {value}: {os_error_line(e)}")
    except OSError as e:
        fail(f"{option} {value}: {os_error_line(e)}")


class FileWarnings:
    """Print each skipped-file warning of the library once, as one line on stderr."""

    _seen: set = set()  # messages printed by this command (reset by the app's callback)

    def __enter__(self):
        import warnings

        self._cm = warnings.catch_warnings(record=True)
        self._caught = self._cm.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        from entropylens.read.query import UnreadableFileWarning
        from entropylens.report.escape import terminal

        self._cm.__exit__(*exc)
        for w in self._caught:
            if issubclass(w.category, UnreadableFileWarning) and str(w.message) not in self._seen:
                self._seen.add(str(w.message))
                typer.echo(f"warning: {terminal(str(w.message), keep=chr(10))}", err=True)
        return False
