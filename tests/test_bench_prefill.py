"""bench prefill (dsaspec/bench/prefill.py): a row per cache dtype and chunk size with its floor, the
MTP layer's output independent of the chunking, and on a GPU the phases of a profiled run."""

from __future__ import annotations

import json

import pytest

from dsaspec.bench.floors import PER_LAYER, STEP
from dsaspec.commands import cli

from conftest import HAS_CUDA


def _rows(tmp_path, *argv):
    assert cli.main(["bench", "prefill", "--out", str(tmp_path), *argv]) == 0
    return json.loads((tmp_path / "prefill.json").read_text())["rows"]


@pytest.mark.skipif(HAS_CUDA, reason="the CPU run of bench prefill")
def test_cpu_rows_per_dtype_and_chunk_with_the_same_tokens(tmp_path, capsys):
    """Chunks of 32 rows (prefixes 0, 32, ..., 128; rows crossing the top-k of 64 on the way) must give
    the MTP layer's last-row output of one chunk of 150 to fp32 rounding: a chunk that read a wrong
    prefix, position or page-table width would not. No time on the CPU; the floor is there. The CPU
    run's fixed tiny preset says it does not cut it to ``--layers``."""
    rows = _rows(tmp_path, "--layers", "5")
    assert "--layers 5 (not used)" in capsys.readouterr().out
    assert [(r["kv_cache_dtype"], r["chunk"]) for r in rows] == [
        ("bf16", 32), ("bf16", 150), ("fp8_e4m3", 32), ("fp8_e4m3", 150)]
    for r in rows:
        assert r["tokens_as_largest_chunk"] and r["draft_hidden_max_diff"] < 1e-4
    for r in rows:
        assert r["ttft_ms"] is None and r["profile"] is None
        phases = [t["phase"] for t in r["floor_table"]]
        assert phases[-2:] == [PER_LAYER, STEP] and "sparse_mla" in phases and "metadata" not in phases
        assert r["floor_ms"] == pytest.approx(r["floor_table"][-1]["floor_us"] / 1e3) and r["floor_ms"] > 0
    # smaller chunks read the weights more often: a higher floor
    assert rows[0]["floor_table"][-1]["bytes"] > rows[1]["floor_table"][-1]["bytes"]


@pytest.mark.gpu
def test_gpu_prefill_phases_add_up_to_the_busy_time(tmp_path):
    rows = _rows(tmp_path, "--preset", "tiny", "--layers", "1", "--prompt-len", "300", "--chunk-sizes", "64,300",
                 "--runs", "2")
    assert "over the 1 target layers" in json.loads((tmp_path / "prefill.json").read_text())["method"]
    for r in rows:
        profile = r["profile"]
        assert r["ttft_ms"] > 0 and len(r["times_ms"]) == 2
        assert sum(profile["phases_us"].values()) == pytest.approx(profile["kernel_sum_us"])
        for phase in ("indexer_logits", "topk", "sparse_mla", "attention_proj", "ffn", "lm_head"):
            assert profile["phases_us"][phase] > 0, phase
        assert r["floor_table"][-1]["measured_us"] == pytest.approx(r["ttft_ms"] * 1e3)
