"""The floor model of bench decode / e2e (dsaspec/bench/floors.py): bytes by hand for the tiny
config, the FP8 layouts and weights, and the table's ratio columns."""

from __future__ import annotations

import pytest

from dsaspec.bench import e2e, phases
from dsaspec.bench.floors import (ITERATION, PER_LAYER, PHASES, STEP, Cost, FloorModel, QueryRows, Rates,
                                  floor_markdown, floor_rows, iteration_rows)
from dsaspec.bench.results import markdown_table
from dsaspec.configs.model_config import get_config
from dsaspec.configs.quantization import Fp8Quantization

RATES = Rates(copy_gbps=1000.0, empty_us=1.0, bf16_tflops=100.0, fp8_tflops=200.0)


def _bytes(costs):
    return {phase: c.bytes for phase, c in costs.items()}


def test_decode_step_bytes_of_the_tiny_config_by_hand():
    """bs 2 at live 100 (> top-k 64, so the indexer logits run), bf16 (2 bytes), 2 layers."""
    costs = FloorModel(get_config("tiny"), act_bytes=2).decode_step(2, 100)
    rows, a, layers = 2, 2, 2
    indexer = (256 * 4 * a                                          # weights_proj
               + 2 * 128 * a                                        # k_norm weight + bias
               + rows * ((256 + 4 * 128 + 128 + 4 * 128) * a + 4 * 4)   # x, q and k projections in; q, weights out
               + rows * 128 * a)                                    # index keys written
    index_proj = (128 * 4 * 128 + 256 * 128) * a + rows * (4 * 128 + 128) * a   # wq_b, wk in the fused GEMMs
    logits = 2 * 100 * (128 * a + 4) + rows * (4 * 128 * a + 4 * 4) + rows * 100 * 4
    topk = rows * (100 + 64) * 4
    sparse_mla = 2 * 64 * (512 + 64) * a + rows * 64 * 4 + rows * 4 * (576 + 512) * a
    attention = ((256 * 128 + 128 * 4 * 128 + 256 * 576 + 512 * 4 * (64 + 64) + 4 * 64 * 256) * a
                 + (128 + 512) * a + rows * (256 + 4 * 512 + 128 + 4 * 576 + 256) * a + rows * 576 * a
                 + index_proj)
    ffn = 3 * 256 * 512 * a + 2 * rows * 256 * a
    act = rows * 256 * a
    assert _bytes(costs) == {
        "metadata": 2 * 100 * 4, "indexer": layers * indexer, "indexer_logits": layers * logits,
        "topk": layers * topk, "sparse_mla": layers * sparse_mla, "attention_proj": layers * attention,
        "ffn": layers * ffn, "lm_head": 256 * 1031 * a + rows * (256 + 1031) * a,
        "sampling": rows * (1031 * a + 8), "other": 2 * act + layers * 2 * (4 * act + 256 * a) + 2 * act + 256 * a,
        "feedback": 2 * rows * 8}
    assert costs["indexer_logits"].flops == layers * 2 * rows * 100 * 4 * 128
    assert costs["sparse_mla"].flops == layers * 2 * rows * 4 * 64 * (576 + 512)


def test_short_rows_skip_the_indexer_logits():
    costs = FloorModel(get_config("tiny"), act_bytes=2).decode_step(2, 64)
    assert costs["indexer_logits"] == Cost()
    assert costs["sparse_mla"].bytes == 2 * (2 * 64 * 576 * 2 + 2 * 64 * 4 + 2 * 4 * (576 + 512) * 2)


def test_fp8_caches_and_weights_count_codes_scales_and_rope():
    """fp8_e4m3: 656-byte MLA entries (512 codes, 4 fp32 scales, 64 bf16 rope), 132-byte index keys;
    FP8 linears: 1 byte a weight + an fp32 scale per 128 x 128 block, FLOPs at the FP8 rate;
    weights_proj and the LM head stay bf16."""
    config = get_config("tiny").replace(quantization=Fp8Quantization())
    costs = FloorModel(config, act_bytes=2, kv_cache_dtype="fp8_e4m3").decode_step(2, 100)
    rows, a = 2, 2
    assert costs["sparse_mla"].bytes == 2 * (2 * 64 * 656 + rows * 64 * 4 + rows * 4 * (576 + 512) * a)
    assert costs["indexer_logits"].bytes == 2 * (2 * 100 * (132 + 4) + rows * (4 * 128 * a + 4 * 4) + rows * 100 * 4)
    assert costs["indexer_logits"].flops == 0 and costs["indexer_logits"].fp8_flops == 2 * 2 * rows * 100 * 4 * 128
    weights = (256 * 128 + 1 * 2 * 4 + 128 * 512 + 4 * 1 * 4 + 256 * 576 + 5 * 2 * 4
               + 512 * 512 + 4 * 4 * 4 + 256 * 256 + 2 * 2 * 4        # q_a, q_b, kv_a, kv_b, o_proj + scales
               + 128 * 512 + 4 * 1 * 4 + 256 * 128 + 1 * 2 * 4)       # the indexer's wq_b, wk + scales
    attention = (weights + (128 + 512) * a + rows * (256 + 4 * 512 + 128 + 4 * 576 + 256) * a + rows * 656
                 + rows * (512 + 128) * a)
    assert costs["attention_proj"].bytes == 2 * attention
    assert costs["attention_proj"].flops == 0
    assert costs["attention_proj"].fp8_flops == 2 * 2 * rows * (weights - (8 + 16 + 40 + 64 + 16 + 16 + 8))
    indexer = (256 * 4 * a + 2 * 128 * a + rows * ((256 + 512 + 128 + 512) * a + 16) + rows * 132)
    assert costs["indexer"].bytes == 2 * indexer
    assert costs["lm_head"] == FloorModel(get_config("tiny"), act_bytes=2).decode_step(2, 100)["lm_head"]


def test_moe_counts_the_experts_a_token_hits():
    """tiny-moe layer 1: one token hits its 3 of 8 experts (plus router fp32 and the shared expert)."""
    config = get_config("tiny-moe")
    model = FloorModel(config, act_bytes=2)
    expert = 3 * 256 * 128 * 2
    ffn = model._layer("model.layers.1", 1, QueryRows.uniform(1, 1, 10, 64), seeded=False)["ffn"]
    assert ffn.bytes == pytest.approx(256 * 8 * 4 + 3 * expert + expert + 2 * 256 * 2)


def test_moe_takes_the_counted_experts_where_given():
    """A count for a row count replaces uniform routing's expectation for that row count only."""
    config = get_config("tiny-moe")
    expert = 3 * 256 * 128 * 2
    uniform = FloorModel(config, act_bytes=2)
    counted = FloorModel(config, act_bytes=2, experts_hit={4: 5.5})
    ffn = {m: {rows: m._layer("model.layers.1", 1, QueryRows.uniform(rows, 1, 10, 64), seeded=False)["ffn"].bytes
               for rows in (2, 4)}
           for m in (uniform, counted)}
    expected_4 = 8 * (1 - (1 - 3 / 8) ** 4)
    assert ffn[counted][4] - ffn[uniform][4] == pytest.approx((5.5 - expected_4) * expert, abs=1)
    assert ffn[counted][2] == ffn[uniform][2]


def test_spec_iteration_phases():
    """draft: S - 1 MTP steps, no MTP indexer with IndexShare; verify: LM head on every row;
    extend: on one row a request."""
    config = get_config("tiny")
    model = FloorModel(config, act_bytes=2)
    it = model.spec_iteration(2, 100, 3)
    step = model.forward(2, 1, 100, mtp=True)
    assert it["draft"]["sparse_mla"] == step["sparse_mla"] * 2
    assert it["verify"]["lm_head"] == model.forward(2, 4, 104)["lm_head"]
    assert it["extend"]["lm_head"] == model.forward(2, 1, 104)["lm_head"]
    shared = FloorModel(config.replace(index_share_for_mtp_iteration=True), act_bytes=2).spec_iteration(2, 100, 3)
    assert shared["draft"]["indexer"] == Cost() and shared["extend"]["indexer"] != Cost()
    # a seeded draft step reads no wq_b / wk either (its q_b_proj runs alone): 2 steps x 2 rows
    index_proj = (128 * 4 * 128 + 256 * 128) * 2 + 2 * (4 * 128 + 128) * 2
    assert it["draft"]["attention_proj"].bytes - shared["draft"]["attention_proj"].bytes == 2 * index_proj


def test_rates_floor_is_the_largest_of_bytes_flops_and_launches():
    assert RATES.floor(Cost(bytes=3_000_000))["floor_us"] == pytest.approx(3.0)
    assert RATES.floor(Cost(flops=500_000_000, fp8_flops=800_000_000))["floor_us"] == pytest.approx(9.0)
    assert RATES.floor(Cost(bytes=1000, launches=4))["floor_us"] == 4.0
    no_fp8 = Rates(1000.0, 0.0, 100.0, None)
    assert no_fp8.floor(Cost(fp8_flops=100_000_000))["flops_floor_us"] == pytest.approx(1.0)


def test_ratio_columns_are_measured_over_the_floor_of_their_row():
    costs = FloorModel(get_config("tiny"), act_bytes=2).decode_step(2, 100)
    measured = {phase: 10.0 + 7 * i for i, phase in enumerate(PHASES)}
    rows = floor_rows(costs, RATES, measured, layers=2, step_us=5000.0)
    by = {r["phase"]: r for r in rows}
    for phase in PHASES:
        assert by[phase]["measured_over_floor"] == pytest.approx(measured[phase] / by[phase]["floor_us"])
        assert by[phase]["measured_over_bytes_floor"] == pytest.approx(measured[phase] / by[phase]["bytes_floor_us"])
    layer = ("indexer", "indexer_logits", "topk", "sparse_mla", "attention_proj", "ffn")
    assert by[PER_LAYER]["floor_us"] == pytest.approx(sum(by[p]["floor_us"] for p in layer) / 2)
    assert by[PER_LAYER]["measured_us"] == pytest.approx(sum(measured[p] for p in layer) / 2)
    assert by[STEP]["measured_over_floor"] == pytest.approx(5000.0 / sum(by[p]["floor_us"] for p in PHASES))
    lines = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in
             floor_markdown(rows, markdown_table).splitlines()[2:]}
    for phase in (*PHASES, PER_LAYER, STEP):
        assert float(lines[phase][-2]) == pytest.approx(by[phase]["measured_over_floor"], abs=0.006)
        assert float(lines[phase][6]) == pytest.approx(by[phase]["measured_us"], abs=0.006)


def test_iteration_floor_is_the_sum_of_its_phases():
    model = FloorModel(get_config("tiny"), act_bytes=2)
    rows, detail = iteration_rows(model, 2, 100, 3, RATES, {"metadata": 5.0, "draft": 100.0, "verify": 300.0,
                                                            "extend": 80.0}, 600.0)
    by = {r["phase"]: r for r in rows}
    assert by["verify"]["floor_us"] == pytest.approx(detail["verify"][-1]["floor_us"])
    assert by["draft"]["measured_over_floor"] == pytest.approx(100.0 / by["draft"]["floor_us"])
    total = sum(by[p]["floor_us"] for p in ("metadata", "draft", "verify", "extend"))
    assert by[ITERATION]["measured_over_floor"] == pytest.approx(600.0 / total)
    table = e2e._floor_markdown([{"context": 128, "kv_cache_dtype": "bf16", "accept": "3.0", "concurrency": 2,
                                  "floor_live": 100, "floor_table": rows}], markdown_table).splitlines()
    cells = dict(zip((c.strip() for c in table[0].strip("|").split("|")),
                     (c.strip() for c in table[2].strip("|").split("|"))))
    assert float(cells["iteration / floor"]) == pytest.approx(by[ITERATION]["measured_over_floor"], abs=0.006)
    assert float(cells["draft / floor"]) == pytest.approx(by["draft"]["measured_over_floor"], abs=0.006)


def test_decode_phases_are_the_floor_phases():
    assert tuple(phases.PHASE_PATTERNS) == PHASES


def test_floor_model_rejects_bad_arguments():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        FloorModel(get_config("tiny"), act_bytes=2, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="act_bytes"):
        FloorModel(get_config("tiny"), act_bytes=3)


@pytest.mark.parametrize("prefix, rows, k", [(0, 1, 64), (0, 64, 64), (0, 65, 64), (63, 1, 64), (64, 1, 64),
                                             (10, 200, 64), (100, 7, 64), (0, 129, 128), (127, 2, 128)])
def test_causal_rows_sum_what_each_row_reads(prefix, rows, k):
    """A prefill chunk's aggregates against a row-by-row count: row i lives over prefix + i + 1
    positions, selects min(live, k), runs the indexer logits only when live > k."""
    lives = [prefix + i + 1 for i in range(rows)]
    long = [live for live in lives if live > k]
    assert QueryRows.causal(prefix, rows, k) == QueryRows(
        rows=rows, positions=sum(lives), selected=sum(min(live, k) for live in lives),
        gathered=min(max(lives), k), logit_rows=len(long), logit_positions=sum(long),
        logit_keys=max(long, default=0))


def test_prefill_chunks_read_the_weights_once_each_and_the_lm_head_once():
    """The attention and indexer FLOPs do not depend on the chunking; the weights are read once a
    chunk; the LM head runs on the last row only, once for the target and once for the MTP layer."""
    model = FloorModel(get_config("tiny"), act_bytes=2)
    whole, chunked = model.prefill(300, 300), model.prefill(300, 100)
    for part in ("target", "mtp"):
        for phase in ("indexer_logits", "sparse_mla"):
            assert chunked[part][phase].flops == whole[part][phase].flops > 0
        one_row = model.forward(1, 1, 300, mtp=part == "mtp")
        assert chunked[part]["lm_head"] == whole[part]["lm_head"] == one_row["lm_head"]
    weights = model.forward(1, 0, 10)["attention_proj"].bytes        # no rows: the weights alone
    assert 0 < weights < model.forward(1, 1, 10)["attention_proj"].bytes
    assert chunked["target"]["attention_proj"].bytes - whole["target"]["attention_proj"].bytes == 2 * weights
    layers, heads, dim = 2, 4, 128
    assert whole["target"]["indexer_logits"].flops == layers * 2 * heads * dim * sum(range(65, 301))
