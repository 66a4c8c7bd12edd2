"""``dsaspec bench moe``: the CPU run checks the fused op and the baseline against the reference;
the targets read each row as the module docstring states them."""

import argparse
import json

import pytest
import torch

from dsaspec.bench import moe


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run's fixed sizes")
def test_cpu_run_matches_reference(tmp_path):
    parser = argparse.ArgumentParser()
    moe.add_arguments(parser)
    assert moe.run(parser.parse_args(["--out", str(tmp_path)])) == 0
    rows = json.loads((tmp_path / "moe.json").read_text())["rows"]
    assert [r["tokens"] for r in rows] == moe.CPU_SIZES["tokens"]
    assert all(r["matches_reference"] and not r["baseline_skipped"] for r in rows)
    assert not any("new_us" in r for r in rows)


def test_baseline_matches_reference(device):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 32, generator=gen).to(device)
    w13 = (torch.randn(6, 48, 32, generator=gen) / 6).to(device)
    w2 = (torch.randn(6, 32, 24, generator=gen) / 5).to(device)
    ids = torch.tensor([[0, 5], [5, 5], [1, 2], [3, 4], [0, 0]], dtype=torch.int32, device=device)
    weights = torch.rand(5, 2, generator=gen).to(device)
    from dsaspec.reference.fused_moe import fused_moe as reference

    got = moe.baseline_moe(hidden, w13, w2, ids, weights, torch.empty_like(hidden))
    torch.testing.assert_close(got, reference(hidden, w13, w2, ids, weights), rtol=1e-5, atol=1e-5)


def test_bytes_count_each_hit_expert_once():
    hidden, w2 = torch.zeros(3, 8, dtype=torch.bfloat16), torch.zeros(4, 8, 2, dtype=torch.bfloat16)
    w13 = torch.zeros(4, 4, 8, dtype=torch.bfloat16)
    ids = torch.tensor([[0, 2], [2, 0], [2, 2]], dtype=torch.int32)
    weights = torch.zeros(3, 2)
    # 2 experts x (32 + 16) bf16 values, hidden read + out written, 6 ids and 6 weights
    assert moe.bytes_moved(hidden, w13, w2, ids, weights) == 2 * 48 * 2 + 2 * 24 * 2 + 24 + 24


def test_targets():
    rows = [{"tokens": 1, "intermediate": 256, "new_us": 12.0, "new_over_floor": 1.2, "baseline_us": 50.0,
             "speedup": 50 / 12},
            {"tokens": 64, "intermediate": 256, "new_us": 90.0, "new_over_floor": 1.4, "baseline_us": 80.0,
             "speedup": 80 / 90},
            {"tokens": 128, "intermediate": 2048, "new_us": 900.0, "new_over_floor": 2.0, "baseline_us": None},
            {"tokens": 1, "intermediate": 2048}]  # no time: no target
    got = [(t["tokens"], t["target"], t["met"]) for t in moe._targets(rows)]
    assert got == [(1, "<= 1.3x bytes floor", True), (1, "not slower than baseline (x1.05 noise)", True),
                   (64, "<= 1.3x bytes floor", False), (64, "not slower than baseline (x1.05 noise)", False)]
