"""scripts/serving_report.py on synthetic client outputs: the table's figures and the baseline's tree."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _client_output(path: Path, tpot_ms: float) -> None:
    row = {"completed": 16, "median_tpot_ms": tpot_ms, "output_throughput": 100.0, "median_ttft_ms": 50.0,
           "mean_ttft_ms": 55.0, "p99_ttft_ms": 60.0, "median_itl_ms": tpot_ms, "mean_itl_ms": tpot_ms + 0.5, "p99_itl_ms": 2 * tpot_ms, "accept_length": 3.0}
    path.write_text("{}\n" + json.dumps(row) + "\n")  # the client appends one line per run: the last counts


def _report(tmp_path: Path, baseline_commit) -> tuple[dict, str]:
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    _client_output(work / "c1.jsonl", 2.5)
    for when, ttft_sum, prefill_s, count in (("before", 1.0, 0.5, 4), ("after", 1.8, 0.74, 24)):
        (work / f"metrics-c1-{when}.txt").write_text(
            "# HELP dsaspec_prefill_seconds_total Seconds\n# TYPE dsaspec_prefill_seconds_total counter\n"
            f"dsaspec_prefill_seconds_total {prefill_s}\n"
            f'dsaspec_time_to_first_token_seconds_bucket{{le="0.1"}} {count}\n'
            f"dsaspec_time_to_first_token_seconds_count {count}\n"
            f"dsaspec_time_to_first_token_seconds_sum {ttft_sum}\n")
    (work / "e2e").mkdir()
    (work / "e2e" / "e2e.json").write_text(json.dumps({"params": {"prompt_len": 24}, "rows": [
        {"preset": "tiny", "context": 256, "concurrency": 1, "new_tok_s_user": 500.0, "new_ms_per_iter": 6.0}]}))
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps({"setup": {"commit": baseline_commit},
                                    "rows": [{"concurrency": 1, "tok_s_user": 200.0, "median_itl_ms": 3.0}]}))
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
    assert row["itl_speedup"] == 1.2 and "| 1 | 200.0 | 400.0 | 2.000 | 3.00 | 2.50 | 1.200 |" in text

    (tmp_path / "again").mkdir()
    _, text = _report(tmp_path / "again", source_commit())
    assert "not the same tree" not in text


def test_overhead_over_the_in_process_loop_and_the_prefill_stalls(tmp_path):
    """Per token: median TPOT and ITL over bench e2e's 1000 / new tok/s/user, and the stalls (mean
    ITL - median ITL) in their own column."""
    report, text = _report(tmp_path, "0000000")
    row = report["rows"][0]
    assert abs(row["overhead_tpot"] - 0.25) < 1e-12 and abs(row["overhead_itl"] - 0.25) < 1e-12
    assert "| 1 | 2.00 | 6.00 | +25.0% | +25.0% | 0.50 |" in text


def test_the_engine_side_from_the_metrics_around_the_client_run(tmp_path):
    """Differences of the server's counters over the run: 20 requests, 0.24 s of prefill and 0.8 s
    of TTFT among them: 12 ms and 40 ms a request, beside the client's mean TTFT."""
    report, text = _report(tmp_path, "0000000")
    row = report["rows"][0]
    assert row["engine_requests"] == 20
    assert abs(row["engine_prefill_ms"] - 12.0) < 1e-9 and abs(row["engine_ttft_ms"] - 40.0) < 1e-9
    assert "| 1 | 20 | 12.0 | 40.0 | 55.0 |" in text
