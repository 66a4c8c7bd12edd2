"""Running the offline sm_90 compile scripts of ``scripts/`` from a test, in a subprocess (they
compile instead of interpreting, which must be chosen before triton is imported)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_in_scripts(script: str, code: str, timeout: int = 600) -> str:
    """In ``scripts/``, with this checkout first on PYTHONPATH: ``import <script> as c`` (which
    chooses compiling before triton is imported), ``knobs.nvidia.dump_ptxas_log = True`` (the
    scripts read registers and spills from ptxas's log), then ``code``; asserts the process exits
    0 and returns its stdout."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    program = f"import {script} as c\nfrom triton import knobs\nknobs.nvidia.dump_ptxas_log = True\n{code}"
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT / "scripts")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def compiled_counts(script: str, calls: str, fields: tuple[str, ...]) -> list[dict]:
    """In ``scripts/`` (as :func:`run_in_scripts`): for each result dict of the expression
    ``calls`` (an iterable of ``script``'s compile results, ``c`` being the script), its integer
    ``fields``; one dict per result, in order."""
    out = run_in_scripts(script, f"for r in {calls}:\n    print(*(r[f] for f in {fields!r}))")
    rows = integer_rows(out)
    assert rows and all(len(row) == len(fields) for row in rows), out
    return [dict(zip(fields, row)) for row in rows]


def integer_rows(out: str) -> list[tuple[int, ...]]:
    """The lines of ``out`` that start with a digit, each as a tuple of its whitespace-separated
    integers (what the compile snippets print per kernel)."""
    return [tuple(map(int, line.split())) for line in out.splitlines() if line[:1].isdigit()]
