"""How the user runs ppoflow, for the commands ppoflow suggests (`try … query …` after training,
`resume with: … train …` after a failure or an interrupt): the README's set-up runs
`.venv/bin/ppoflow`, whose folder is not on PATH, so a bare `ppoflow` would not run."""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

PROGRAM = "ppoflow"


def ppoflow_command(
    argv0: str | None = None,
    executable: str | None = None,
    which: Callable[[str], str | None] = shutil.which,
) -> str:
    """The ppoflow program as a shell word the user can type: the program as it was typed when it is
    a relative path (`.venv/bin/ppoflow`); `ppoflow` when PATH finds this very program under that
    name; else the program's path. Run as `python -m ppoflow`, or as flows inside another program (a
    Prefect worker, a Python caller), the program is the `ppoflow` script beside this Python, and
    `python -m ppoflow` with this Python's path when there is none. `argv0`, `executable` and
    `which` default to sys.argv[0], sys.executable and shutil.which."""
    argv0 = sys.argv[0] if argv0 is None else argv0
    executable = sys.executable if executable is None else executable
    if Path(argv0).name == PROGRAM and "/" in argv0:  # the ppoflow script, as the shell started it
        if not os.path.isabs(argv0):
            return shlex.quote(argv0)
        program = argv0
    else:
        program = str(Path(executable).parent / PROGRAM)
        if not os.path.isfile(program):
            return f"{shlex.quote(executable)} -m {PROGRAM}"
    found = which(PROGRAM)  # a shell gives a script found on PATH its absolute path
    return PROGRAM if found is not None and _same_file(program, found) else shlex.quote(program)


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
