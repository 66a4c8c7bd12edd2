"""Chained launches (``dsaspec.ops.device.enter_chain``): each kernel that the op wrappers launch as a
programmatic dependent on sm_90 waits for the kernel before it before its first global memory
access, then lets the next one launch. Checked in the PTX of an offline sm_90 compile (no GPU), so a
load or store placed before the wait fails here, not as a race on a GPU. The fused MoE's gate/up waits
without the early release (``wait_in_chain``): its dependents launch as its programs exit. The MoE
router's GEMM loads its first weight blocks and the FP8 GEMM, where M spans several 16-row programs,
its last weight tile (memory no kernel writes) before the wait: exactly those loads, no other access,
come before it."""

from __future__ import annotations

import pytest

from compile_scripts import run_in_scripts, integer_rows
from dsaspec.testing.offline_compile import accesses_before_wait, chain_entry

# (script, the compile call whose kernel is chained): the chained kernels of a decode layer
CASES = [
    ("compile_decode_epilogues", "c.compile_rms_norm(6144, True, True)"),
    ("compile_decode_epilogues", "c.compile_rms_norm(2048, False, False)"),
    ("compile_fp8_dsa", "c.compile_index_rope('qk_dense')"),
    ("compile_fp8_dsa", "c.compile_indexer(False)"),
    ("compile_fp8_dsa", "c.compile_indexer(True)"),
    ("compile_fp8_dsa", "c.compile_sparse_mla(False)"),
    ("compile_fp8_dsa", "c.compile_sparse_mla(True)"),
    ("compile_fp8_dsa", "c.compile_index_rope('qk_fp8')"),
    ("compile_fused_moe", "c.compile_fp8_linear('gemm', True)"),
    ("compile_fused_moe", "c.compile_fp8_linear('gemm', False)"),
    ("compile_fused_moe", "c.compile_fp8_linear('act_quant', False)"),
    ("compile_decode_epilogues", "c.compile_router_logits(c.moe_router.RouterGemmConfig(), 1)"),
    ("compile_decode_epilogues", "c.compile_router_logits(c.moe_router.decode_tile(1), 1)"),
    ("compile_decode_epilogues", "c.compile_router(256, 1, 1, 8, 1)"),
    ("compile_decode_epilogues", "c.compile_silu_and_mul(True)"),
    ("compile_fused_moe", "c.compile_moe('gate_up', True, 4, False)"),
    ("compile_fused_moe", "c.compile_moe('down', True, 4, False)"),
    ("compile_fused_moe", "c.compile_align(257)"),
]
RELEASED_AT_EXIT = {"c.compile_moe('gate_up', True, 4, False)"}
# the calls whose kernel loads weight tiles before its wait: the 16-byte loads of a 128-thread program
# (4 warps) before it, of the FP8 GEMM's tile of 128 x 64 e4m3 codes (M 64; M 1 loads none) and the
# router's 2 blocks of bf16 weights: 2 experts x 1024 in the default tile, 1 expert x 2048 in the
# decode tile of 1 - 2 tokens
WEIGHTS_FIRST = {"c.compile_fp8_linear('gemm', False)": 128 * 64 // (16 * 128),
                 "c.compile_router_logits(c.moe_router.RouterGemmConfig(), 1)": 2 * 2 * 1024 * 2 // (16 * 128),
                 "c.compile_router_logits(c.moe_router.decode_tile(1), 1)": 2 * 1 * 2048 * 2 // (16 * 128)}


@pytest.mark.parametrize("script", sorted({script for script, _ in CASES}))
def test_chained_kernels_wait_before_touching_memory(script):
    calls = [call for s, call in CASES if s == script]
    out = run_in_scripts(script, "from dsaspec.testing.offline_compile import chain_entry\n"
                                 f"for call in {calls!r}:\n"
                                 "    print(*chain_entry(eval(call)['ptx']))")
    rows = integer_rows(out)
    assert len(rows) == len(calls), out
    for call, row in zip(calls, rows):
        _check_chain_entry(call, *row, allowed=WEIGHTS_FIRST.get(call, 0), released_at_exit=call in RELEASED_AT_EXIT)


def _check_chain_entry(name, wait, releases, early, early_loads, allowed=0, released_at_exit=False):
    # a wait, exactly `allowed` accesses before it (all 16-byte weight loads), and the early release
    # (none for a kernel whose dependents launch as its programs exit)
    assert wait >= 0 and early == early_loads == allowed, \
        f"{name}: griddepcontrol.wait at PTX line {wait}, {early} global accesses before it ({allowed} allowed)"
    if released_at_exit:
        assert releases == 0, f"{name}: {releases} griddepcontrol.launch_dependents, expected none"
    else:
        assert releases >= 1, f"{name}: no griddepcontrol.launch_dependents"


# the chained kernels without a compile helper in scripts/, launched through their wrappers on CPU tensors
OTHERS = """
import torch
from dsaspec.ops import mla_latent, row_invariant, sparse_mla
from dsaspec.testing.offline_compile import chain_entry
rows, heads, bf16 = 2, 8, torch.bfloat16
cos = sin = torch.zeros(rows, 32)
launches = [
    (mla_latent._mla_latent_kernel, lambda: mla_latent.store_mla_normed(
        torch.zeros(64, 576, dtype=bf16), torch.zeros(rows, dtype=torch.int64), torch.zeros(rows, 576, dtype=bf16),
        torch.ones(512, dtype=bf16), 1e-6, cos, sin, True, check_values=False)),
    (mla_latent._mla_query_kernel, lambda: mla_latent.mla_query(
        torch.zeros(rows, heads, 256, dtype=bf16), torch.zeros(heads, 192, 512, dtype=bf16), cos, sin, True)),
    (sparse_mla._sparse_mla_combine_kernel, lambda: sparse_mla._combine(
        torch.zeros(rows, heads, 4, sparse_mla.RECORD_WIDTH), torch.zeros(rows, heads, 512, dtype=bf16), True)),
    (row_invariant._gemm_kernel, lambda: row_invariant.linear(torch.zeros(4, 1024, dtype=bf16),
                                                              torch.zeros(512, 1024, dtype=bf16))),
]
for kernel, launch in launches:
    print(kernel.fn.__name__, *chain_entry(c.compile_kernel(kernel, launch, overrides=())["ptx"]))
"""


def test_chained_kernels_without_a_compile_helper_wait_before_touching_memory():
    out = run_in_scripts("compile_fp8_dsa", OTHERS)
    rows = [line.split() for line in out.splitlines() if line.startswith("_")]
    assert len(rows) == 4, out
    for name, *counts in rows:
        _check_chain_entry(name, *map(int, counts))


def test_chain_entry_finds_an_access_before_the_wait():
    ptx = "\n".join([".entry k(", "ld.param.u64 %rd1, [k_param_0];", "@%p1 ld.global.b32 %r1, [%rd1];",
                     "griddepcontrol.wait;", "griddepcontrol.launch_dependents;",
                     "cp.async.cg.shared.global [%r2], [%rd1], 16;", "st.global.b32 [%rd1], %r1;"])
    assert chain_entry(ptx) == (3, 1, 1, 0)
    assert chain_entry(ptx.replace("@%p1 ld.global.b32 %r1, [%rd1];", "mov.u32 %r1, 0;")) == (3, 1, 0, 0)
    assert chain_entry(ptx.replace("griddepcontrol.wait;", "bar.sync 0;")) == (-1, 1, 3, 0)
    assert accesses_before_wait(ptx) == ["@%p1 ld.global.b32 %r1, [%rd1];"]
    assert len(accesses_before_wait(ptx.replace("griddepcontrol.wait;", "bar.sync 0;"))) == 3
