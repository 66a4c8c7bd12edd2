"""``dsaspec bench dsa-ops``: the CPU run checks every op's new form against its baseline and the
plain-torch references; the targets read each row the way docs/benchmarking.md ("Targets") states them."""

import argparse
import json

import pytest
import torch

from dsaspec.bench import dsa_ops
from dsaspec.ops.fp8_kv import gather_index_k


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run's fixed sizes")
def test_cpu_run_matches_baseline_and_references(tmp_path):
    parser = argparse.ArgumentParser()
    dsa_ops.add_arguments(parser)
    assert dsa_ops.run(parser.parse_args(["--out", str(tmp_path)])) == 0
    rows = json.loads((tmp_path / "dsa_ops.json").read_text())["rows"]
    assert {r["op"] for r in rows} == set(dsa_ops.OPS)
    assert all(r["matches_baseline"] and r.get("matches_reference", True) for r in rows)
    assert not any("new_us" in r or "error" in r for r in rows)


def _row(op, bs, live, new_us, baseline_us, floor_us, amax_us=None):
    row = {"op": op, "mode": "decode", "bs": bs, "live_kv": live, "new_us": new_us,
           "baseline_us": baseline_us, "speedup": baseline_us / new_us, "floor_us": floor_us}
    if amax_us is not None:
        row.update(amax_us=amax_us, new_over_amax=new_us / amax_us)
    return row


def test_targets():
    rows = [_row("topk", 1, 1024, 2.0, 5.0, 0.6),                 # small: <= 8 µs, not slower
            _row("sparse_mla", 1, 1024, 9.0, 8.0, 0.6),           # small missed, slower beyond noise
            _row("topk", 16, 65536, 45.0, 230.0, 1.0, amax_us=17.0),   # floor missed, proposal met
            _row("topk", 64, 65536, 140.0, 230.0, 4.0, amax_us=19.0),  # proposal missed
            _row("indexer", 16, 65536, 100.0, 170.0, 66.0),       # floor met; no amax row
            {"op": "layer", "mode": "decode", "bs": 1, "live_kv": 1024}]  # no time: no target
    got = [(t["op"], t["bs"], t["target"], t["met"]) for t in dsa_ops._targets(rows)]
    assert got == [
        ("topk", 1, "<= 8 µs", True), ("topk", 1, "not slower than baseline (x1.05 noise)", True),
        ("sparse_mla", 1, "<= 8 µs", False), ("sparse_mla", 1, "not slower than baseline (x1.05 noise)", False),
        ("topk", 16, "<= 2x floor", False), ("topk", 16, "(proposed) <= 5x same-bytes torch.amax", True),
        ("topk", 16, "not slower than baseline (x1.05 noise)", True),
        ("topk", 64, "<= 2x floor", False), ("topk", 64, "(proposed) <= 5x same-bytes torch.amax", False),
        ("topk", 64, "not slower than baseline (x1.05 noise)", True),
        ("indexer", 16, "<= 2x floor", True), ("indexer", 16, "not slower than baseline (x1.05 noise)", True)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run's fixed sizes")
def test_cpu_run_on_the_fp8_cache(tmp_path):
    """--kv-cache-dtype fp8_e4m3: a sparse MLA row on the FP8 cache after each bf16 one, checked
    against the bf16 cache's output and the FP8 reference."""
    parser = argparse.ArgumentParser()
    dsa_ops.add_arguments(parser)
    args = ["--out", str(tmp_path), "--ops", "sparse_mla", "--modes", "decode",
            "--kv-cache-dtype", "fp8_e4m3"]
    assert dsa_ops.run(parser.parse_args(args)) == 0
    rows = json.loads((tmp_path / "dsa_ops.json").read_text())["rows"]
    assert [r["kv_cache"] for r in rows] == ["bf16", "fp8_e4m3"] * 4
    assert all(r["matches_baseline"] and r["matches_reference"] for r in rows)
    assert not any("error" in r for r in rows)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run's fixed sizes")
def test_cpu_run_at_other_head_counts(tmp_path, monkeypatch):
    """--heads 8,32: every point once per head count (column heads), its sparse MLA query of that
    many heads, each variant (the Triton default's too) checked against the baseline and the
    reference."""
    built, build = [], dsa_ops._build_point

    def recording_build(*args, **kwargs):
        point = build(*args, **kwargs)
        built.append(point.q_mla.shape[1])
        return point

    monkeypatch.setattr(dsa_ops, "_build_point", recording_build)
    parser = argparse.ArgumentParser()
    dsa_ops.add_arguments(parser)
    args = ["--out", str(tmp_path), "--ops", "sparse_mla", "--modes", "decode", "--heads", "8,32"]
    assert dsa_ops.run(parser.parse_args(args)) == 0
    rows = json.loads((tmp_path / "dsa_ops.json").read_text())["rows"]
    assert [r["heads"] for r in rows] == built == [8] * 4 + [32] * 4
    assert all(r["matches_baseline"] and r["matches_reference"] for r in rows)
    assert all("out_triton_max_abs_diff" in r and "out_slot_major_max_abs_diff" in r for r in rows)
    assert ["out_padded_max_abs_diff" in r for r in rows] == [True] * 4 + [False] * 4
    assert not any("error" in r for r in rows)


@pytest.mark.parametrize("gluon_runs", [False, True])
def test_fp8_row_times_the_gluon_fp8_tiles_where_they_run(gluon_runs, monkeypatch):
    """The FP8 sparse MLA row times the Gluon kernel's FP8 tiles (columns gluon_fp8_us,
    gluon_fp8_narrow_us, gluon_fp8_one_split_us) beside the default where the Gluon kernel runs,
    and only there; both rows time the slot-major configuration up to 32 heads and the padded one up to
    16, and only there."""
    monkeypatch.setattr(dsa_ops, "sparse_mla_gluon_supported", lambda device, heads: gluon_runs)
    gluon = {"gluon_fp8", "gluon_fp8_narrow", "gluon_fp8_one_split"}
    for heads in (8, 16, 32, 64):
        shapes = dsa_ops._Shapes(heads=heads, index_heads=4, topk=8, sm_scale=0.1, num_sms=8)
        point = dsa_ops._build_point("decode", 2, 70, 1, shapes, "cpu", seed=0, fp8=True)
        slot_major = ({"slot_major"} if heads <= 32 else set()) | ({"padded"} if heads <= 16 else set())
        variants = dsa_ops._variants(point, "sparse_mla", "fp8_e4m3")
        assert set(variants) == {"baseline", "new", "new_nosplit"} | (gluon if gluon_runs else set()) | slot_major
        assert set(dsa_ops._variants(point, "sparse_mla")) == {"baseline", "new", "new_nosplit", "triton"} | slot_major


def test_fp8_floor_counts_656_bytes_a_slot():
    """The FP8 row's bytes floor differs from the bf16 one by 1152 - 656 bytes a distinct slot."""
    shapes = dsa_ops._Shapes(heads=16, index_heads=4, topk=8, sm_scale=0.1, num_sms=8)
    point = dsa_ops._build_point("decode", 2, 70, 1, shapes, "cpu", seed=0, fp8=True)
    slots = point.buffer("slots_new", (2, 8), torch.int32)
    slots.copy_(torch.tensor([[0, 1, 1, 2, -1, -1, -1, -1], [64, 65, 66, 67, 68, 69, 70, 70]]))
    bf16, flops = dsa_ops._floor_terms(point, "sparse_mla")
    fp8, fp8_flops = dsa_ops._floor_terms(point, "sparse_mla", "fp8_e4m3")
    assert bf16 - fp8 == 10 * (1152 - 656) and flops == fp8_flops


def test_fp8_target():
    rows = [dict(_row("sparse_mla", 16, 65536, 30.0, 40.0, 20.0), kv_cache="fp8_e4m3", rows=16,
                 bytes_floor_us=20.0),
            dict(_row("sparse_mla", 4, 65536, 30.0, 40.0, 20.0), kv_cache="fp8_e4m3", rows=4,
                 bytes_floor_us=20.0)]
    got = [(t["bs"], t["target"], t["met"]) for t in dsa_ops._targets(rows)
           if t["target"].startswith("FP8")]
    assert got == [(16, "FP8 cache: <= 1.3x bytes floor", False)]


def test_fp8_gather_target_from_64_rows():
    """The proposed FP8 target over the same slots' gather applies from 64 rows: met at 1.25x, missed
    at 1.35x, absent at 16 rows and where no gather was timed."""
    def fp8_row(bs, rows, new, gather):
        row = dict(_row("sparse_mla", bs, 65536, new, 100.0, 10.0), kv_cache="fp8_e4m3", rows=rows,
                   bytes_floor_us=10.0)
        return row if gather is None else dict(row, gather_us=gather, new_over_gather=new / gather)

    rows = [fp8_row(64, 64, 50.0, 40.0), fp8_row(16, 64, 54.0, 40.0), fp8_row(16, 16, 30.0, 10.0),
            fp8_row(32, 128, 50.0, None)]
    got = [(t["bs"], t["met"]) for t in dsa_ops._targets(rows) if "same-slots gather" in t["target"]]
    assert got == [(64, True), (16, False)]


def test_sparse_mla_rows_time_the_gather_yardsticks(monkeypatch):
    """Both caches' sparse MLA rows time the same slots' gather; the FP8 row also the gather with
    dequantization (``gather_dequant_*``), on the FP8 cache's bytes; the bf16 row does not."""
    from types import SimpleNamespace

    from dsaspec.bench import timing
    from dsaspec.bench.slot_gather import slot_gather, slot_gather_dequant

    timed = []

    def fake_gather(cache, slots, iters, gather=slot_gather):
        timed.append((cache.dtype, gather))
        return (2.0, "32 x 8w") if gather is slot_gather_dequant else (1.0, "64 x 4w")

    fake_time = SimpleNamespace(median_us=3.0, spread=0.0, summary=lambda: {})
    monkeypatch.setattr(timing, "time_in_graph", lambda fn, **kwargs: fake_time)
    monkeypatch.setattr(dsa_ops, "fastest_slot_gather", fake_gather)
    shapes = dsa_ops._Shapes(heads=16, index_heads=4, topk=8, sm_scale=0.1, num_sms=8)
    point = dsa_ops._build_point("decode", 2, 70, 1, shapes, "cpu", seed=0, fp8=True)
    point.buffer("slots_new", (2, 8), torch.int32).copy_(torch.arange(16).view(2, 8))
    floors, peaks = SimpleNamespace(copy_gbps=1000.0, empty_us=1.0), {"bf16": 100.0, "fp8_e4m3": 200.0}
    bf16 = dsa_ops._time_row(point, "sparse_mla", "bf16", floors, peaks, iters=1)
    fp8 = dsa_ops._time_row(point, "sparse_mla", "fp8_e4m3", floors, peaks, iters=1)
    assert timed == [(torch.bfloat16, slot_gather), (torch.uint8, slot_gather), (torch.uint8, slot_gather_dequant)]
    assert not any(key.startswith("gather_dequant") for key in bf16) and bf16["new_over_gather"] == 3.0
    assert (fp8["gather_us"], fp8["gather_dequant_us"], fp8["gather_dequant_grid"]) == (1.0, 2.0, "32 x 8w")
    assert (fp8["new_over_gather"], fp8["new_over_gather_dequant"]) == (3.0, 1.5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run's fixed sizes")
def test_cpu_run_fp8_indexer(tmp_path):
    """--kv-cache-dtype fp8_e4m3: an indexer row on the FP8 key cache after each bf16 one, checked
    against the bf16 row's logits (the same keys) and the fp8_index reference."""
    parser = argparse.ArgumentParser()
    dsa_ops.add_arguments(parser)
    args = ["--out", str(tmp_path), "--ops", "indexer", "--modes", "decode", "--kv-cache-dtype", "fp8_e4m3"]
    assert dsa_ops.run(parser.parse_args(args)) == 0
    rows = json.loads((tmp_path / "dsa_ops.json").read_text())["rows"]
    assert [r["kv_cache"] for r in rows] == ["bf16", "fp8_e4m3"] * 4
    assert all(r["matches_baseline"] and r["matches_reference"] for r in rows)
    assert not any("error" in r for r in rows)


def test_fp8_indexer_floor_counts_132_bytes_a_token():
    """The FP8 indexer row's bytes floor differs from the bf16 one by 256 - 132 bytes a key read
    (the longest row of each request longer than k), everything else the same."""
    shapes = dsa_ops._Shapes(heads=16, index_heads=4, topk=8, sm_scale=0.1, num_sms=8)
    point = dsa_ops._build_point("target_verify", 3, 70, 2, shapes, "cpu", seed=0, fp8=True)
    every_slot = torch.arange(point.index_k.shape[0])
    assert torch.equal(point.index_k.float(), gather_index_k(point.index_fp8, every_slot))  # the same keys
    point.seqlens.copy_(torch.tensor([69, 70, 5, 6, 30, 8], dtype=torch.int32))
    bf16, flops = dsa_ops._floor_terms(point, "indexer")
    fp8, fp8_flops = dsa_ops._floor_terms(point, "indexer", "fp8_e4m3")
    assert bf16 - fp8 == (70 + 30) * (256 - 132) and flops == fp8_flops
    assert fp8 == (69 + 70 + 30) * 8 + (70 + 30) * 132 + 3 * 4 * (256 + 4)


def test_fp8_indexer_targets():
    def fp8_row(bs, new_us, index_heads=64, live=65536, mode="decode"):
        return dict(_row("indexer", bs, live, new_us, 2 * new_us, new_us), kv_cache="fp8_e4m3",
                    rows=bs, bytes_floor_us=new_us, index_heads=index_heads, mode=mode)

    rows = [fp8_row(32, 69.0), fp8_row(32, 71.0), fp8_row(64, 129.0), fp8_row(64, 131.0),
            fp8_row(16, 200.0), fp8_row(32, 71.0, index_heads=32), fp8_row(64, 200.0, live=8192),
            fp8_row(64, 200.0, mode="target_verify"),
            dict(_row("indexer", 64, 65536, 200.0, 200.0, 100.0), kv_cache="bf16", rows=64, index_heads=64)]
    got = [(t["bs"], t["target"], t["met"]) for t in dsa_ops._targets(rows) if t["target"].startswith("FP8")]
    at_32, at_64 = "FP8 cache, 64 index heads: <= 70 µs", "FP8 cache, 64 index heads: <= 130 µs"
    assert got == [(32, at_32, True), (32, at_32, False), (64, at_64, True), (64, at_64, False)]


def _fp8_tune_point(mode="target_verify"):
    """A small point on the FP8 key cache with the default FP8 configuration's logits written."""
    shapes = dsa_ops._Shapes(heads=16, index_heads=4, topk=8, sm_scale=0.1, num_sms=4)
    point = dsa_ops._build_point(mode, 2, 150, 2, shapes, "cpu", seed=0, fp8=True)
    dsa_ops._indexer(point, True, fp8=True)(check_values=True)
    return point


def test_fp8_indexer_tune_candidates_match_the_default():
    """Every FP8 tune candidate (configuration x programs per SM) writes the default's logits,
    bitwise under the interpreter, and the list starts with the default."""
    point = _fp8_tune_point()
    candidates = dsa_ops._fp8_indexer_tune_candidates(point)
    first = candidates[0][0]
    default = dsa_ops.default_indexer_config(True, 2, point.shapes.index_heads)
    assert default.programs_per_sm == 2  # the row groups' own programs an SM
    assert first == vars(default) | {"rows_per_group": 2, "kv_cache": "fp8_e4m3"}
    assert len(candidates) == len(dsa_ops.TUNE_INDEXER_FP8) * len(dsa_ops.TUNE_PROGRAMS_PER_SM)
    assert len({tuple(sorted(config.items())) for config, _ in candidates}) == len(candidates)
    for config, fn in candidates:
        assert dsa_ops._check_fp8_indexer_candidate(point, fn, on_gpu=False) == 0.0, config


@pytest.mark.parametrize("on_gpu", [False, True])
def test_fp8_indexer_tune_check_catches_other_logits(on_gpu):
    """The candidate check fails a candidate that writes nothing or the bf16 cache's logits
    (the unquantized query: beyond 2**-9 of the absolute sums), in both its modes; the default
    itself passes the GPU mode's tolerance."""
    point = _fp8_tune_point()
    default = dsa_ops._indexer(point, True, fp8=True, out="logits_fp8_tune")
    assert dsa_ops._check_fp8_indexer_candidate(point, default, on_gpu) == 0.0
    bf16 = dsa_ops._indexer(point, True, out="logits_fp8_tune")
    for wrong in (lambda: None, bf16):
        with pytest.raises(AssertionError, match="differ from INDEXER_FP8_CONFIG"):
            dsa_ops._check_fp8_indexer_candidate(point, wrong, on_gpu)


def test_tune_winners():
    """The fastest error-free row per op, heads, KV cache, split choice and point."""
    def row(us, kv_cache=None, bs=32, splits=None, error=None, name="c", heads=64):
        config = {"name": name} | ({"kv_cache": kv_cache} if kv_cache else {}) | ({"splits": splits} if splits else {})
        r = {"op": "indexer", "heads": heads, "mode": "decode", "bs": bs, "live_kv": 65536, "config": config}
        return r | ({"error": error} if error else {"us": us})

    rows = [row(10.0, name="default"), row(9.0, name="b"), row(None, error="shared memory"),
            row(20.0, "fp8_e4m3", name="fp8_default"), row(15.0, "fp8_e4m3", name="fp8_b"),
            row(16.0, "fp8_e4m3", name="fp8_c"), row(5.0, bs=64, name="other_point"),
            row(3.0, splits=4, name="split"), row(4.0, splits=8, name="split_b"),
            row(12.0, heads=8, name="8_heads")]
    got = [r["config"]["name"] for r in dsa_ops._tune_winners(rows)]
    assert got == ["b", "fp8_b", "other_point", "split", "8_heads"]


@pytest.mark.parametrize("gluon", [True, False])
def test_sparse_mla_tune_tries_by_heads(gluon, monkeypatch):
    """--tune's sparse MLA configurations: the Triton lists above 32 heads; at up to 32 the default
    there first and the Gluon kernel's slot-major form (where it runs), SPARSE_MLA_CONFIG and the
    Triton slot-major tiles of each cache, whose FP8 ones are timed only with the FP8 cache."""
    monkeypatch.setattr(dsa_ops, "sparse_mla_gluon_supported", lambda device, heads: gluon)
    assert dsa_ops._sparse_mla_tune_tries(64, False, "cuda") == [("bf16", c) for c in dsa_ops.TUNE_SPARSE_MLA]
    for heads in (8, 16, 32):
        tries = dsa_ops._sparse_mla_tune_tries(heads, True, "cuda")
        bf16 = [c for cache, c in tries if cache == "bf16"]
        fp8 = [c for cache, c in tries if cache == "fp8_e4m3"]
        gluon_bf16 = [dsa_ops.SPARSE_MLA_GLUON_CONFIG, dsa_ops.SPARSE_MLA_GLUON_SLOT_MAJOR_CONFIG] if gluon else []
        gluon_fp8 = [dsa_ops.GLUON_FP8_DEFAULT_CONFIG, dsa_ops.SPARSE_MLA_GLUON_FP8_SLOT_MAJOR_CONFIG] if gluon else []
        assert bf16 == gluon_bf16 + [dsa_ops.SPARSE_MLA_CONFIG, *dsa_ops.TUNE_SPARSE_MLA_SLOT_MAJOR]
        assert fp8 == gluon_fp8 + [dsa_ops.SPARSE_MLA_CONFIG, *dsa_ops.TUNE_SPARSE_MLA_SLOT_MAJOR_FP8]
        assert all(cache == "bf16" for cache, _ in dsa_ops._sparse_mla_tune_tries(heads, False, "cuda"))


def test_gluon_fp8_tune_candidates_are_checked_against_their_twin():
    """Each Gluon FP8 gather candidate of the tune and the one-split and in-slot tiles have the staged FP8
    default of their block size as their twin (no other config has one); the check passes two
    launches that write the same output and fails a candidate that writes nothing (its output
    stays NaN)."""
    staged = (dsa_ops.SPARSE_MLA_GLUON_FP8_CONFIG, dsa_ops.SPARSE_MLA_GLUON_FP8_NARROW_CONFIG)
    for config in (dsa_ops.SPARSE_MLA_GLUON_FP8_ONE_SPLIT_CONFIG, dsa_ops.SPARSE_MLA_GLUON_FP8_IN_SLOT_CONFIG,
                   *dsa_ops.SPARSE_MLA_GLUON_FP8_TUNE_CONFIGS):
        assert config in dsa_ops.TUNE_SPARSE_MLA_FP8
        twin = dsa_ops._gluon_fp8_twin(config)
        assert twin in staged and twin.block_n == config.block_n
    assert set(dsa_ops.GLUON_FP8_VARIANTS.values()) == set(staged) | {dsa_ops.SPARSE_MLA_GLUON_FP8_ONE_SPLIT_CONFIG}
    for config in dsa_ops.TUNE_SPARSE_MLA + staged:
        assert dsa_ops._gluon_fp8_twin(config) is None
    point = _fp8_tune_point("decode")
    dsa_ops._prepare(point)
    candidate = dsa_ops._sparse_mla(point, "slots_new", "out_tune", None, None, fp8=True)
    twin = dsa_ops._sparse_mla(point, "slots_new", "out_tune_twin", None, None, fp8=True)
    dsa_ops._check_gluon_fp8_candidate(point, candidate, twin)
    with pytest.raises(AssertionError, match="differs from the FP8 Gluon default's"):
        dsa_ops._check_gluon_fp8_candidate(point, lambda: None, twin)
