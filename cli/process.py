"""The process around the commands: Typer's help and usage errors as users expect them, `query`'s SQL
argument, and how the process leaves (:func:`run`: Ctrl-C, a closed pipe, the exit after torch)."""

from __future__ import annotations

import sys
import time as _time
from collections.abc import Sequence
from typing import Any

import typer
import typer.core


def _plain_metavars() -> None:
    """Help as users expect it: `--quick` (no `<bool>`), `PATH` (no `{PATH}` / `<str>`), `--run RUN`
    (no `<list[str]>`), choices as `[table|csv]`. Typer 0.29 has no setting for this; its display hooks
    are wrapped once here (skipped where a Typer version lacks them)."""
    from typer import core

    opt, arg = getattr(core, "TyperOption", None), getattr(core, "TyperArgument", None)
    if opt is None or arg is None or getattr(opt, "_entropylens_plain", False):
        return
    orig = opt.display_type_rich

    def option_type(self, ctx):
        if self.is_flag or getattr(self, "count", False):
            return None
        if self.metavar is not None:
            return self.metavar
        shown = orig(self, ctx) or ""
        if "|" in shown:  # a choice: <table|csv> or <list[a|b]>
            return "[" + shown.strip("<>").removeprefix("list[").rstrip("]") + "]"
        names = [o for o in self.opts if o.startswith("--")] or self.opts
        return max(names, key=len).lstrip("-").replace("-", "_").upper()

    def argument_usage(self):
        name = self.display_name_raw if self.required else f"[{self.display_name_raw}]"
        return name + ("..." if self.nargs != 1 else "")

    opt.display_type_rich = option_type
    arg.display_type_rich = lambda self, ctx: None  # the name column already says PATH / SQL / NAME
    if hasattr(arg, "_usage_display_name"):
        arg._usage_display_name = argument_usage
    opt._entropylens_plain = True


_plain_metavars()


class OneLineErrors(typer.core.TyperGroup):
    """Usage errors (a bad choice, an unknown option, a missing argument) as ONE line on stderr,
    `error: ... (entropylens CMD --help)`, exit 2, instead of Typer's boxed multi-line panel."""

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        windows_expand_args: bool = True,
        **extra: Any,
    ) -> Any:
        try:  # Typer 0.29 vendors click (typer._click); older Typer uses click itself
            from typer import _click as click
            from typer.exceptions import Abort
        except ImportError:  # pragma: no cover
            import click  # type: ignore[no-redef]  # the fallback for older Typer: the same API, another module
            from click.exceptions import Abort  # type: ignore[assignment]  # (the same fallback)

        if not windows_expand_args:  # passed on only when set, as before (an older click may lack it)
            extra["windows_expand_args"] = False
        try:
            rv = super().main(args=args, prog_name=prog_name, complete_var=complete_var, standalone_mode=False, **extra)
        except click.exceptions.NoArgsIsHelpError:  # `entropylens` alone: the help, in click's standalone mode
            return super().main(
                args=args, prog_name=prog_name, complete_var=complete_var, standalone_mode=standalone_mode, **extra
            )
        except click.ClickException as e:
            if not standalone_mode:
                raise
            msg = " ".join(e.format_message().split()).replace("Value error, ", "")
            ctx = getattr(e, "ctx", None)
            hint = f" ({ctx.command_path} --help)" if ctx is not None else ""
            typer.echo(f"error: {msg}{hint}", err=True)
            sys.exit(e.exit_code)
        except Abort:
            if not standalone_mode:
                raise
            typer.echo("aborted", err=True)
            sys.exit(1)
        if not standalone_mode:
            return rv
        sys.exit(rv if isinstance(rv, int) else 0)  # an Exit's code (--help: 0, fail: 2)


def _is_sql(arg: str) -> bool:
    """An argument that starts with `--` but is SQL (an SQL comment first): it has whitespace before any
    `=`, which no option name has (`--run=a b` is an option, `-- top runs\nSELECT ...` is SQL)."""
    return arg.startswith("--") and len(arg) > 2 and any(c.isspace() for c in arg.split("=", 1)[0])


class QueryCommand(typer.core.TyperCommand):
    """`entropylens query`: SQL that starts with an SQL comment (`-- ...`) is the SQL argument, not an
    unknown option (it is moved behind a `--` separator before parsing)."""

    def parse_args(self, ctx, args):
        if "--" not in args and any(_is_sql(a) for a in args):
            args = [a for a in args if not _is_sql(a)] + ["--"] + [a for a in args if _is_sql(a)]
        return super().parse_args(ctx, args)


_IMPORTED_AT = _time.perf_counter()
_EXEC_GAP_S = 10.0  # a process this much older than the CLI's import was a shell that exec'd us late


def process_seconds() -> float | None:
    """Wall seconds since this process started (Linux: /proc), or None. A shell runs the last command
    of `a && b` in its own process (exec): that process started with `a`, so when it is more than
    _EXEC_GAP_S older than this module's import, the seconds since the import are returned instead."""
    import os

    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            age = float(f.read().split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    since_import = _time.perf_counter() - _IMPORTED_AT
    return since_import if age - since_import > _EXEC_GAP_S else age


def run(app: typer.Typer) -> None:
    """Run the app as the process: Ctrl-C exits 130, a closed pipe exits 1 without a word, and where a
    command loaded torch the process leaves without the interpreter's teardown (:func:`_exit`)."""
    try:
        app()
    except KeyboardInterrupt:  # pragma: no cover
        typer.echo("interrupted", err=True)
        sys.exit(130)
    except BrokenPipeError:  # the reader went away (`entropylens demo | head`): stop quietly, exit 1
        _quiet_exit(1)  # (inside a command click does the same: its main exits 1 on EPIPE, silenced)
    except SystemExit as e:
        _exit(e)


def _quiet_exit(code: int) -> None:
    """Exit without another word: stdout and stderr (maybe the closed pipe) now point to /dev/null, so
    neither an error line nor the interpreter's final flush can raise again."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        try:
            os.dup2(devnull, stream.fileno())
        except (OSError, ValueError):
            pass
    _exit(SystemExit(code))


def _exit(e: SystemExit) -> None:
    """Leave at once where a command loaded torch (the demo): the interpreter's teardown of torch's and
    transformers' modules takes ~1.5 s of CPU (5 s wall under load) and saves nothing (our files are
    closed, the worker pool shut down). atexit handlers and non-daemon threads still finish first."""
    if "torch" not in sys.modules or not (e.code is None or isinstance(e.code, int)):
        raise e
    import atexit
    import os
    import threading

    for t in threading.enumerate():
        if t is not threading.current_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`| head`)
            pass
    os._exit(e.code or 0)
