"""Results files: ``benchmarks/results/<machine>/<name>.{json,md,png}`` (docs/benchmarking.md)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton

from dsaspec import flags
from dsaspec.errors import UserError

RESULTS_ROOT = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def _archived_commit() -> str | None:
    """The commit ``git archive`` wrote into ``archive_commit.txt`` (export-subst in .gitattributes);
    None in a checkout or a copy, where the file holds its unexpanded placeholder."""
    try:
        text = Path(__file__).with_name("archive_commit.txt").read_text().strip()
    except OSError:
        return None
    return None if text.startswith("$Format") or not text else text


def source_commit() -> str | None:
    """HEAD of the checkout this package runs from, with ``+modified`` where tracked files differ
    from it (a run of uncommitted changes), else the commit of the ``git archive`` it was exported
    from (a GPU run's snapshot); None for any other tree (one copied inside another repository's
    work tree would otherwise report that repository's HEAD)."""
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "rev-parse", "--show-toplevel", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10, cwd=root)
        lines = out.stdout.split()
        if out.returncode or len(lines) != 2 or Path(lines[0]).resolve() != root:
            return _archived_commit()
        modified = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], capture_output=True, timeout=30,
                                  cwd=root).returncode != 0
    except (OSError, subprocess.SubprocessError):
        return _archived_commit()
    return lines[1] + ("+modified" if modified else "")


def machine_info() -> dict:
    """GPU, driver, torch, triton, date, command line and the ``DSASPEC_*`` variables set for this run."""
    info = {
        "host": platform.node(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
        "interpreter": flags.triton_interpret(),
        "dsaspec_variables": {k: v for k, v in sorted(os.environ.items()) if k.startswith("DSASPEC_")},
        "git_commit": source_commit(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpus=torch.cuda.device_count(), sms=props.multi_processor_count,
                    cuda=torch.version.cuda)
        try:
            info["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            info["driver"] = None
    else:
        info.update(gpu=None, gpus=0, driver=None, cuda=None)
    return info


def bench_params(args) -> dict:
    """The command's options as recorded in a results JSON (``params``)."""
    return {k: v for k, v in vars(args).items() if k != "run"}


def default_machine_dir() -> str:
    """``h200`` on an H200, ``cpu-interpreter`` without CUDA, else the GPU name in lower case."""
    if not torch.cuda.is_available():
        return "cpu-interpreter"
    name = torch.cuda.get_device_name(0).lower()
    return "h200" if "h200" in name else name.replace("nvidia ", "").replace(" ", "-")


def results_dir(out: str | Path | None) -> Path:
    """The results folder of a benchmark's ``--out``: ``out``, or ``benchmarks/results/<machine>``
    when None. Raises UserError for an empty ``out``."""
    if out is None:
        return RESULTS_ROOT / default_machine_dir()
    if not str(out).strip():
        raise UserError(f"--out {str(out)!r}: expected a folder path (without --out: "
                        "benchmarks/results/<machine>)")
    return Path(out)


def check_results_dir(out: str | Path | None) -> Path:
    """The results folder of ``out`` (:func:`results_dir`), checked before anything is measured:
    raises UserError unless it is a folder this process can write in, or its closest existing
    parent is (a file is written and removed there to find out; nothing else is created)."""
    folder = results_dir(out)
    what = f"--out {out}" if out is not None else f"results folder {folder}"
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"{what}: {existing} exists and is not a folder; choose a folder with --out")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        raise UserError(f"{what}: cannot write in {existing} ({err.strerror or err}); choose a folder "
                        "with --out") from None
    return folder


def markdown_table(columns: list[tuple[str, str]], rows: list[dict]) -> str:
    """A Markdown table; ``columns`` is ``[(key, header)]``; floats get 2 decimals (ratios 1)."""

    def cell(v):
        if v is None:
            return "–"
        if isinstance(v, float):
            return f"{v:.2f}"
        return str(v)

    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(cell(row.get(k)) for k, _ in columns) + " |")
    return "\n".join(lines)


def write_results(name: str, payload: dict, markdown: str, out_dir: str | Path | None = None,
                  figure=None) -> Path:
    """Write ``<name>.json`` (payload + machine), ``<name>.md`` and, if given, ``<name>.png``; print the
    Markdown and where it went. Returns the folder."""
    out = results_dir(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "machine": machine_info(), **payload}
    (out / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    machine = payload["machine"]
    command = " ".join([f"{k}={v}" for k, v in machine["dsaspec_variables"].items()] + [machine["command"]])
    head = (f"# {name}\n\nMachine: {machine.get('gpu') or 'CPU (Triton interpreter)'}, "
            f"torch {machine['torch']}, triton {machine['triton']}, {machine['date']}.\n\n"
            f"Command: `{command}`\n\nMethod: {payload.get('method', '')}\n\n")
    (out / f"{name}.md").write_text(head + markdown + "\n")
    if figure is not None:
        figure.savefig(out / f"{name}.png", dpi=120, bbox_inches="tight")
    print(markdown)
    print(f"results: {out}")
    return out
