"""scripts/serving_report.py on synthetic client outputs: the table's figures and the baseline's tree."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _client_output(path: Path, tpot_ms: float) -> None:
    row = {"completed": 16, "median_tpot_ms": tpot_ms, "output_throughput": 100.0, "median_ttft_ms": 50.0,
           "p99_ttft_ms": 60.0, "median_itl_ms": tpot_ms, "p99_itl_ms": 2 * tpot_ms, "accept_length": 3.0}
    path.write_text("{}\n" + json.dumps(row) + "\n")  # the client appends one line per run: the last counts


def _report(tmp_path: Path, baseline_commit) -> tuple[dict, str]:
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    _client_output(work / "c1.jsonl", 2.5)
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps({"setup": {"commit": baseline_commit},
                                    "rows": [{"concurrency": 1, "tok_s_user": 200.0}]}))
    env = dict(os.environ, PYTHONPATH=str(ROOT), MPLBACKEND="Agg")
    subprocess.run([sys.executable, "scripts/serving_report.py", str(work), str(out), "serving", "tiny", "16",
                    "256", "1", "--baseline", str(baseline)], cwd=ROOT, env=env, check=True, capture_output=True)
    return json.loads((out / "serving.json").read_text()), (out / "serving.md").read_text()


def test_speedup_and_the_trees_of_both_runs(tmp_path):
    """tok/s/user = 1000 / median TPOT, the speedup over the baseline's, and both commits; a baseline
    of another tree is flagged, one of this tree is not."""
    from dsaspec.bench.results import source_commit

    report, text = _report(tmp_path, "0000000")
    row = report["rows"][0]
    assert row["tok_s_user"] == 400.0 and row["speedup"] == 2.0
    assert report["setup"]["baseline_commit"] == "0000000"
    assert report["setup"]["commit"] == source_commit()
    assert "baseline tree 0000000" in text and "not the same tree" in text

    (tmp_path / "again").mkdir()
    _, text = _report(tmp_path / "again", source_commit())
    assert "not the same tree" not in text
