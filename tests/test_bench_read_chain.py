"""scripts/bench_read_chain.py: its read kernel folds exactly the elements of each program's range,
and its links carry the bytes of the layer they stand for."""

from __future__ import annotations

import functools
import operator
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_read_chain as chain  # noqa: E402
from compile_scripts import integer_rows, run_in_scripts  # noqa: E402

from dsaspec.configs.model_config import PRESETS  # noqa: E402

GLM5_RANK = PRESETS["glm5-fp8-tp8-rank"]


@pytest.mark.parametrize("n,grid", [(1, (1, 1024, 4)), (1023, (3, 1024, 4)), (10_000, (3, 1024, 8)),
                                    (5000, (132, 4096, 4))])
def test_read_kernel_xors_each_programs_range(n, grid):
    x = torch.randint(-2 ** 31, 2 ** 31 - 1, (n,), dtype=torch.int32, generator=torch.Generator().manual_seed(n))
    out = torch.full((160,), 7, dtype=torch.int32)
    chain._read(x, out, grid)()
    per = -(-(-(-n // grid[0])) // grid[1]) * grid[1]
    programs = -(-n // per)
    want = [functools.reduce(operator.xor, x[p * per:(p + 1) * per].tolist(), 0) for p in range(programs)]
    assert out[:programs].tolist() == want
    assert (out[programs:] == 7).all()           # no program past the data


def test_links_at_one_token_read_the_routed_and_shared_experts():
    links = dict(chain.layer_links(GLM5_RANK, 1032, 132, tokens=1))
    expert = 3 * GLM5_RANK.moe_intermediate_size * GLM5_RANK.hidden_size     # gate, up, down at one byte
    assert links["gate_up"] + links["down"] == (GLM5_RANK.num_experts_per_tok + 1) * expert
    partials = links["o_proj GEMM"] - GLM5_RANK.hidden_size * GLM5_RANK.num_attention_heads * GLM5_RANK.v_head_dim
    assert partials > 0 and partials % (2 * GLM5_RANK.hidden_size * 4) == 0   # fp32 K-group partials, in and out
    assert links["sparse_mla"] == 1032 * 576 * 2


def test_links_add_align_and_combine_where_the_moe_sorts_its_pairs():
    few = [name for name, _ in chain.layer_links(GLM5_RANK, 1032, 132, tokens=4)]
    many = [name for name, _ in chain.layer_links(GLM5_RANK, 1032, 132, tokens=32)]
    assert "moe align" not in few and "moe combine" not in few
    assert many == few[:-2] + ["moe align", "gate_up", "down", "moe combine"]


def test_dense_bf16_links_follow_the_bench_presets_launches():
    bench = PRESETS["bench"]
    links = chain.layer_links(bench, 1056, 132, tokens=1)
    names = [name for name, _ in links]
    assert names[-3:] == ["gate_up GEMM", "silu_and_mul", "down GEMM"]
    assert "fused_input split reduce" in names and "o_proj split reduce" in names
    assert "router" not in names and "o_proj act_quant" not in names
    nbytes = dict(links)
    assert nbytes["o_proj GEMM"] == bench.hidden_size * bench.num_attention_heads * bench.v_head_dim * 2
    assert nbytes["gate_up GEMM"] == 2 * bench.intermediate_size * bench.hidden_size * 2
    # the same weights and caches bench decode's floor counts: 501.39 MB a layer at 1,056 live (H100 log)
    assert abs(sum(nbytes.values()) - 501.39e6) / 501.39e6 < 0.001
    assert nbytes["indexer_logits"] == 4                             # 1,056 keys <= top-k: no logits read
    longer = dict(chain.layer_links(bench, 4096, 132, tokens=2))
    keys, query = 4096 * bench.index_head_dim * 2, bench.index_n_heads * bench.index_head_dim * 2
    assert longer["indexer_logits"] == 2 * (keys + query)


# Compiles (instead of launching) the read kernel for sm_90 in the read-first (2) and L2-prefetch-first (3) PDL
# modes; prints per mode the PTX offsets of the first prefetch.global.L2 and the first griddepcontrol.wait (-1: none).
COMPILE_SM90 = """
import torch
import bench_read_chain as chain
x, out = torch.zeros(1 << 16, dtype=torch.int32), torch.zeros(64, dtype=torch.int32)
for pdl in (2, 3):
    record = {}
    with c.compile_instead_of_launch(chain._read_kernel, record, keep_compiled=True):
        chain._read(x, out, (16, 1024, 4), pdl)()
    ptx = record["compiled"].asm["ptx"]
    print(pdl, ptx.find("prefetch.global.L2"), ptx.find("griddepcontrol.wait"))
"""


def test_prefetch_mode_compiles_l2_prefetches_before_the_wait():
    """Without a GPU: the L2-prefetch-first link compiles for sm_90 with its prefetches kept (not
    optimized away as a dead value) and ahead of its wait; the read-first link has none (in a
    subprocess that compiles instead of interpreting, scripts/compile_fp8_dsa.py's choice)."""
    found = {mode: (prefetch, wait) for mode, prefetch, wait in
             integer_rows(run_in_scripts("compile_fp8_dsa", COMPILE_SM90))}
    assert found[2][0] == -1 and found[2][1] > 0
    assert 0 < found[3][0] < found[3][1]
