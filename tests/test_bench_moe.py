"""``dsaspec bench moe``: the CPU run checks the fused op and the baseline against the reference;
the targets read each row as the module docstring states them."""

import argparse
import json

import pytest
import torch

from dsaspec.bench import moe
from dsaspec.errors import UserError
from dsaspec.reference import fp8_gemm as fp8_ref


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run's fixed sizes")
def test_cpu_run_matches_reference(tmp_path):
    parser = argparse.ArgumentParser()
    moe.add_arguments(parser)
    assert moe.run(parser.parse_args(["--out", str(tmp_path)])) == 0
    rows = json.loads((tmp_path / "moe.json").read_text())["rows"]
    assert [(r["tokens"], r["weight_dtype"]) for r in rows] == [(t, d) for t in moe.CPU_SIZES["tokens"]
                                                                for d in ("bf16", "fp8")]
    assert all(r["matches_reference"] and not r["baseline_skipped"] for r in rows)
    assert [r["baseline"] for r in rows[:2]] == ["torch gather", "bf16 fused"]
    # no --split-k: the MoE layer's rule, FP8 experts of I 128 in 4 splits, bf16 unsplit
    assert [r["split_k"] for r in rows[:2]] == [1, 4]
    assert not any("new_us" in r for r in rows)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run's fixed sizes")
@pytest.mark.parametrize("option,values,key,want,column", [
    ("--split-k", "1,3,3", "split_k", (1, 3), "split-K"),            # H 128: 4 fp32 K blocks; repeats dropped
    ("--layout", "sorted,pairs", "layout", ("sorted", "pairs"), "layout"),
    ("--block-m", "16,64", "block_m", (16, 64), "block M"),         # 64: unsplit by the layer's rule
])
def test_cpu_run_checks_each_variant(option, values, key, want, column, monkeypatch, tmp_path):
    """``--split-k`` / ``--layout`` / ``--block-m``: a checked row per point, weight dtype and value, in its
    column."""
    monkeypatch.setitem(moe.CPU_SIZES, "tokens", [3])
    parser = argparse.ArgumentParser()
    moe.add_arguments(parser)
    assert moe.run(parser.parse_args([option, values, "--out", str(tmp_path)])) == 0
    rows = json.loads((tmp_path / "moe.json").read_text())["rows"]
    assert [(r["weight_dtype"], r[key]) for r in rows] == [(d, v) for d in ("bf16", "fp8") for v in want]
    assert all(r["matches_reference"] for r in rows)
    assert f"| {column} |" in (tmp_path / "moe.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run's fixed sizes")
def test_fp8_needs_block_multiples(monkeypatch, tmp_path):
    monkeypatch.setitem(moe.CPU_SIZES, "intermediate", [64])
    parser = argparse.ArgumentParser()
    moe.add_arguments(parser)
    with pytest.raises(UserError, match="--intermediate 64"):
        moe.run(parser.parse_args(["--weight-dtype", "fp8", "--out", str(tmp_path)]))


def test_quantize_experts_scales_each_expert_by_its_own_blocks():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 256, 128, generator=gen) * torch.tensor([1e-3, 1.0, 50.0])[:, None, None]
    w[1, 128:] *= 1e-2  # a second row block of another magnitude
    codes, scales = moe.quantize_experts(w)
    assert codes.dtype == torch.float8_e4m3fn and scales.shape == (3, 2, 1)
    for e in range(3):
        # e4m3: half an ulp is 2**-4 of a normal value, 2**-10 of the block scale below 2**-6 of it
        step = scales[e].double().repeat_interleave(128, 0).repeat_interleave(128, 1) * 2**-10
        error = (fp8_ref.dequantize(codes[e], scales[e], 128) - w[e].double()).abs()
        assert (error <= 2**-4 * w[e].double().abs() + step).all()


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


def test_fp8_bytes_count_one_byte_codes_scales_and_quantized_activations():
    hidden = torch.zeros(3, 256, dtype=torch.bfloat16)
    w13, w13_scale = torch.zeros(4, 256, 256, dtype=torch.float8_e4m3fn), torch.zeros(4, 2, 2)
    w2, w2_scale = torch.zeros(4, 256, 128, dtype=torch.float8_e4m3fn), torch.zeros(4, 2, 1)
    ids = torch.tensor([[0, 2], [2, 0], [2, 2]], dtype=torch.int32)
    weights = torch.zeros(3, 2)
    experts = 2 * (256 * 256 + 256 * 128 + (4 + 2) * 4)  # 1-byte codes + fp32 block scales of 2 experts
    # e4m3 + one fp32 scale per 128 columns, written and read: hidden [3, 256] and activations [6, 128]
    quantized = 2 * ((3 * 256 + 6 * 128) + (3 * 2 + 6 * 1) * 4)
    assert moe.bytes_moved(hidden, w13, w2, ids, weights, w13_scale, w2_scale) == (
        experts + 2 * 3 * 256 * 2 + 24 + 24 + quantized)


def test_targets():
    rows = [{"tokens": 1, "intermediate": 256, "new_us": 12.0, "new_over_floor": 1.2, "baseline_us": 50.0,
             "speedup": 50 / 12},
            {"tokens": 64, "intermediate": 256, "new_us": 90.0, "new_over_floor": 1.4, "baseline_us": 80.0,
             "speedup": 80 / 90},
            {"tokens": 128, "intermediate": 2048, "new_us": 900.0, "new_over_floor": 2.0, "baseline_us": None},
            {"tokens": 1, "intermediate": 2048},  # no time: no target
            {"tokens": 1, "intermediate": 256, "new_us": 30.0, "new_over_floor": 1.5, "baseline_us": 53.0,
             "speedup": 53 / 30},
            {"tokens": 64, "intermediate": 2048, "new_us": 2400.0, "new_over_floor": 1.02, "baseline_us": 2200.0,
             "speedup": 2200 / 2400}]
    for r, dtype in zip(rows, ["bf16"] * 4 + ["fp8"] * 2):
        r.update(weight_dtype=dtype, split_k=1, layout="auto", baseline=moe.BASELINES[dtype])
    got = [(t["tokens"], t["weight_dtype"], t["target"], t["met"]) for t in moe._targets(rows)]
    assert got == [(1, "bf16", "<= 1.3x bytes floor", True),
                   (1, "bf16", "not slower than torch gather (x1.05 noise)", True),
                   (64, "bf16", "<= 1.3x bytes floor", False),
                   (64, "bf16", "not slower than torch gather (x1.05 noise)", False),
                   (1, "fp8", "<= 1.3x bytes floor", False),
                   (1, "fp8", "not slower than bf16 fused (x1.05 noise)", True),
                   (64, "fp8", "<= 1.3x bytes floor", True),
                   (64, "fp8", "not slower than bf16 fused (x1.05 noise)", False)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run's fixed sizes")
def test_cpu_run_block_m_and_shared_expert(monkeypatch, tmp_path):
    """``--block-m 64,128 --shared-experts 1``: each token's last slot is expert E at weight 1.0 (every
    token hits it), rows on tall blocks unsplit (the layer's rule), each checked; ``--block-m 32`` is refused."""
    monkeypatch.setitem(moe.CPU_SIZES, "tokens", [3])
    parser = argparse.ArgumentParser()
    moe.add_arguments(parser)
    args = parser.parse_args(["--block-m", "64,128", "--shared-experts", "1", "--out", str(tmp_path)])
    assert moe.run(args) == 0
    rows = json.loads((tmp_path / "moe.json").read_text())["rows"]
    assert [(r["weight_dtype"], r["block_m"], r["split_k"]) for r in rows] == [
        (d, b, 1) for d in ("bf16", "fp8") for b in (64, 128)]
    assert all(r["matches_reference"] for r in rows)
    ids = moe._inputs(3, args, 128, torch.device("cpu"), torch.float32)[3]
    assert ids.shape == (3, moe.CPU_SIZES["topk"] + 1) and ids[:, -1].tolist() == [moe.CPU_SIZES["experts"]] * 3
    with pytest.raises(SystemExit):
        parser.parse_args(["--block-m", "16,32"])
