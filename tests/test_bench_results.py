"""Provenance in the benchmarks' JSON: the commit recorded is the checkout's own HEAD (marked
``+modified`` where tracked files differ from it), the
commit a ``git archive`` export came from (as a GPU run's snapshot is), and nothing for a tree
copied into another repository's work tree; the ``DSASPEC_*`` variables of the run in the JSON
and on the Markdown's command line."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

from dsaspec.bench.results import write_results

ROOT = Path(__file__).resolve().parents[1]


def _git(*args, cwd):
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def _source_commit_in(tree: Path) -> str:
    out = subprocess.run([sys.executable, "-c", "from dsaspec.bench.results import source_commit; print(source_commit())"],
                         cwd=tree, env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_commit_of_a_checkout_and_of_its_uncommitted_changes(tmp_path):
    shutil.copytree(ROOT / "dsaspec", tmp_path / "dsaspec", ignore=shutil.ignore_patterns("__pycache__"))
    _git("init", "-q", cwd=tmp_path)
    _git("add", "dsaspec", cwd=tmp_path)
    _git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "snapshot", cwd=tmp_path)
    head = _git("rev-parse", "--short", "HEAD", cwd=tmp_path)
    (tmp_path / "untracked.log").write_text("not part of the source")
    assert _source_commit_in(tmp_path) == head
    with open(tmp_path / "dsaspec" / "__init__.py", "a") as f:
        f.write("# an uncommitted change\n")
    assert _source_commit_in(tmp_path) == head + "+modified"


def test_no_commit_for_a_tree_inside_another_repository(tmp_path):
    _git("init", "-q", cwd=tmp_path)
    _git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "outer", cwd=tmp_path)
    inner = tmp_path / "snapshot"
    shutil.copytree(ROOT / "dsaspec", inner / "dsaspec", ignore=shutil.ignore_patterns("__pycache__"))
    assert _source_commit_in(inner) == "None"


def test_commit_of_a_git_archive_inside_another_repository(tmp_path):
    _git("init", "-q", cwd=tmp_path)
    _git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "outer", cwd=tmp_path)
    inner = tmp_path / "snapshot"
    inner.mkdir()
    archive = subprocess.run(["git", "archive", "HEAD", "dsaspec"], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(inner)], input=archive, check=True)
    assert _source_commit_in(inner) == _git("rev-parse", "--short", "HEAD", cwd=ROOT)


def test_the_runs_dsaspec_variables_are_recorded(tmp_path, monkeypatch):
    monkeypatch.setenv("DSASPEC_FP8_FAST_ACCUM", "1")
    monkeypatch.setenv("DSASPEC_FUSED_MOE", "0")
    monkeypatch.setenv("OTHER_VARIABLE", "x")
    write_results("probe", {"method": "m"}, "table", tmp_path)
    machine = json.loads((tmp_path / "probe.json").read_text())["machine"]
    assert {k: v for k, v in machine["dsaspec_variables"].items() if k in ("DSASPEC_FP8_FAST_ACCUM", "DSASPEC_FUSED_MOE",
                                                                            "OTHER_VARIABLE")} == \
        {"DSASPEC_FP8_FAST_ACCUM": "1", "DSASPEC_FUSED_MOE": "0"}
    command = next(line for line in (tmp_path / "probe.md").read_text().splitlines() if line.startswith("Command:"))
    assert command.startswith("Command: `") and "DSASPEC_FP8_FAST_ACCUM=1" in command and "DSASPEC_FUSED_MOE=0" in command
