"""Tensor-parallel commands: one process per GPU, started by the command itself under torchrun.

A command given ``--tp N`` (N > 1) outside torchrun checks that N GPUs are visible (else a one-line
:class:`~dsaspec.errors.UserError`), then runs ``python -m torch.distributed.run --standalone
--nproc-per-node N -m dsaspec <command> <its options>`` and returns its exit status; each process
finds ``WORLD_SIZE`` set and does the work as one rank. NVLink multicast is disabled for the
children (``disable_nvlink_multicast``). A rank that finishes with a non-zero status (a missed
target, a token mismatch: already reported in its output) hands that status to the launching
process through a file and exits 0 (``worker_exit_status``), so torchrun does not print a
ChildFailedError traceback for a finished run; the launcher returns the largest rank status.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

import torch

from dsaspec.distributed.tp_group import disable_nvlink_multicast
from dsaspec.errors import UserError
from dsaspec.cli_parsing import Parser, format_value

REPO_ROOT = Path(__file__).resolve().parents[2]
STATUS_DIR_ENV = "DSASPEC_RANK_STATUS_DIR"  # set by `torchrun` for its processes


def visible_gpus() -> int:
    """CUDA devices this process can use (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_gpus(tp: int, option: str = "--tp") -> None:
    """Raise UserError unless ``tp`` GPUs are visible (TP N runs one process per GPU)."""
    gpus = visible_gpus()
    if tp > max(gpus, 1):
        raise UserError(f"{option} {tp}: TP {tp} needs {tp} GPUs (one process per GPU), but {gpus} "
                        f"{'is' if gpus == 1 else 'are'} visible")


def under_torchrun() -> bool:
    """Whether this process is one rank of a multi-process torchrun job."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def check_world(tp: int, option: str = "--tp") -> None:
    """Under torchrun: raise UserError unless the job has exactly ``tp`` processes."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != tp:
        raise UserError(f"{option} {tp} under torchrun with WORLD_SIZE={world}: launch {tp} processes "
                        f"(or run without torchrun and let the command start them)")


def command_line(add_arguments: Callable[[argparse.ArgumentParser], None], args) -> list[str]:
    """The options of ``args`` as a command line that parses back to the same values: every option
    ``add_arguments`` defines, with its value (lists comma-joined), store-true flags when set,
    options whose value is None left out."""
    parser = Parser()
    add_arguments(parser)
    argv = []
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        value = getattr(args, action.dest)
        if isinstance(action, argparse._StoreTrueAction):
            argv += [action.option_strings[0]] if value else []
        elif value is not None:
            argv += [action.option_strings[0], format_value(value)]
    return argv


def torchrun(argv: list[str], nproc: int) -> int:
    """Run ``python -m dsaspec *argv`` as ``nproc`` processes under torchrun (standalone, one node,
    this checkout first on ``PYTHONPATH``, the caller's working directory, so relative paths in
    ``argv`` keep their meaning); returns the exit status."""
    disable_nvlink_multicast()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "dsaspec", *argv]
    print("launching:", " ".join(cmd), flush=True)
    with tempfile.TemporaryDirectory(prefix="dsaspec-ranks-") as status_dir:
        env[STATUS_DIR_ENV] = status_dir
        returncode = subprocess.run(cmd, env=env).returncode
        if returncode:
            return returncode
        return max((int(f.read_text()) for f in Path(status_dir).iterdir()), default=0)


def worker_exit_status(status: int) -> int:
    """The exit status of a finished ``dsaspec`` process: ``status``, except in a rank started by
    :func:`torchrun`, where a non-zero ``status`` is written for the launcher and 0 returned."""
    status_dir = os.environ.get(STATUS_DIR_ENV)
    if not status or not status_dir or not under_torchrun():
        return status
    Path(status_dir, f"rank{os.environ.get('RANK', '0')}").write_text(str(status))
    return 0


def relaunch(command: list[str], add_arguments, args, nproc: int) -> int:
    """Run ``dsaspec <command> <args' options>`` as ``nproc`` torchrun processes."""
    return torchrun([*command, *command_line(add_arguments, args)], nproc)
