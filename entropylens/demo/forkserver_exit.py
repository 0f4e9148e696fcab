"""Imported only by the demo's fork server (workers.PRELOAD): it leaves without the interpreter's
teardown of torch / transformers (seconds of CPU), as the CLI does. The server exits when the demo's
process does; until it has, it holds the demo's stdout, so a pipe (`entropylens demo | tee log`) waited
for that teardown. The workers it forks end with os._exit already (multiprocessing)."""

import atexit
import os
import sys


def _leave() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)


atexit.register(_leave)  # atexit runs first at exit, before the modules' teardown
