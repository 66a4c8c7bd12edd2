"""Compile the small per-step kernels of a decode forward for sm_90 without a GPU and print
registers, spilled bytes and the SASS length, as scripts/compile_fp8_dsa.py does for the DSA
kernels (which also compiles the indexer's query / key epilogue, ``compile_index_rope``): the
indexer's head weights (``index_weights``, split over K: GLM-5's 32 x 6144 and DeepSeek-V3.2's
64 x 7168 fp32 weights, 1 and 64 bf16 rows), the RoPE tables (``rope_cos_sin``: fp64 angles,
libdevice cos / sin, 1 and 64 rows), the dense FFN's SiLU-and-mul (``silu_and_mul``: libdevice
``expf``, IEEE division; bf16 and fp32), the decode step's inputs (``decode_inputs``), the MoE
router's selection (``moe_router``: GLM-5's and DeepSeek-V3.2's routing, 256 experts, with the
slot of their shared expert) and GEMM (``router_logits``: each tile, bf16 rows of 7168 on the bf16
weight), and the RMSNorms before the attention's FP8 GEMMs (``rms_norm``: the
input norm with its residual add at hidden 6144 / 7168, ``q_a_layernorm`` at 2048 / 1536, each
plain and writing act_quant's codes and scales too).

Each case goes through the real host wrapper on small CPU tensors; the launch is intercepted and
compiled as Triton's JIT would specialize it on a CUDA device, K splits as on the H200's 132 SMs.

    python3 scripts/compile_decode_epilogues.py
"""

from __future__ import annotations

import compile_fp8_dsa as dsa  # first: it chooses compiling before triton is imported

import torch  # noqa: E402
from triton import knobs  # noqa: E402

from dsaspec.cli_parsing import Parser, parse_or_exit  # noqa: E402
from dsaspec.ops import decode_inputs, index_weights, moe_router, rope_cos_sin, row_invariant, silu_and_mul  # noqa: E402

WEIGHT_SHAPES = ((32, 6144), (64, 7168))   # (index heads, hidden): GLM-5, DeepSeek-V3.2
ROW_COUNTS = (1, 64)
SLOW_REDUCTION = "call.uni (retval0), __internal_trig_reduction_slowpathd"   # libdevice's large-argument path
EXPF_STEP = "fma.rm.ftz.f32"   # libdevice expf's range reduction (one per exp; tl.exp is a bare ex2.approx)


def compile_index_weights(heads: int, hidden: int, rows: int) -> dict:
    """One ``index_weights`` launch: ``rows`` bf16 rows of ``hidden``, fp32 weights ``[heads,
    hidden]``; the result also holds the launch's K chunks (``splits``)."""
    x = torch.zeros(rows, hidden, dtype=torch.bfloat16)
    weight = torch.zeros(heads, hidden)
    result = dsa.compile_kernel(index_weights._index_weights_kernel,
                                lambda: index_weights.index_weights(x, weight, 0.01), overrides=())
    return result | dict(splits=index_weights.index_weights_splits(heads, hidden, "cpu")[1])


def compile_rope_cos_sin(rows: int = 64) -> dict:
    """One ``rope_cos_sin`` launch over ``rows`` int64 positions, 32 fp64 frequencies, a factor
    that is not 1; the result also counts the PTX's calls of libdevice's slow argument reduction
    (``libdevice_calls``: the fp64 cos and sin are libdevice's)."""
    positions = torch.zeros(rows, dtype=torch.int64)
    inv_freq = torch.ones(32, dtype=torch.float64)
    result = dsa.compile_kernel(rope_cos_sin._rope_cos_sin_kernel,
                                lambda: rope_cos_sin.rope_cos_sin(positions, inv_freq, 1.25), overrides=())
    return result | dict(libdevice_calls=result["ptx"].count(SLOW_REDUCTION))


def compile_silu_and_mul(bf16: bool, rows: int = 4, width: int = 1536) -> dict:
    """One ``silu_and_mul`` launch over the two halves of a ``[rows, 2 * width]`` GEMM output (bf16
    or fp32); the result also counts libdevice ``expf`` calls (``expf_calls``), IEEE divisions
    (``div_rn``) and approximate ones (``div_approx``) in the PTX."""
    gate, up = torch.zeros(rows, 2 * width, dtype=torch.bfloat16 if bf16 else torch.float32).split(width, dim=-1)
    result = dsa.compile_kernel(silu_and_mul._silu_and_mul_kernel, lambda: silu_and_mul.silu_and_mul(gate, up),
                                overrides=())
    ptx = result["ptx"]
    return result | dict(expf_calls=ptx.count(EXPF_STEP), div_rn=ptx.count("div.rn.f32"),
                         div_approx=ptx.count("div.full.f32") + ptx.count("div.approx"))


def compile_decode_inputs(rows: int = 64) -> dict:
    """One ``decode_inputs`` launch: ``rows`` int64 rows of an int32 ``req_to_token`` table."""
    index = torch.zeros(rows, dtype=torch.int64)
    carry = torch.zeros(rows + 1, dtype=torch.int64)
    table = torch.zeros(rows + 1, 1024, dtype=torch.int32)
    outs = [torch.zeros(rows, dtype=torch.int64) for _ in range(4)]
    return dsa.compile_kernel(decode_inputs._decode_inputs_kernel,
                              lambda: decode_inputs.decode_inputs(index, carry, carry, table, *outs), overrides=())


# (experts, n_group, topk_group, top_k, n_shared): GLM-5, DeepSeek-V3.2, with the slot of their shared
# expert (the fused MoE runs it)
ROUTINGS = ((256, 1, 1, 8, 1), (256, 8, 4, 8, 1))


def compile_router(experts: int, n_group: int, topk_group: int, top_k: int, n_shared: int, rows: int = 4) -> dict:
    """One ``route_topk`` launch over ``rows`` tokens' fp32 logits (with ``n_shared`` shared slots);
    the result also counts libdevice ``expf`` calls (``expf_calls``), IEEE divisions (``div_rn``)
    and approximate ones (``div_approx``) in the PTX."""
    logits, bias = torch.zeros(rows, experts), torch.zeros(experts)
    result = dsa.compile_kernel(moe_router._router_kernel, lambda: moe_router.route_topk(
        logits, bias, top_k=top_k, n_group=n_group, topk_group=topk_group, norm_topk_prob=True, scaling=2.5,
        n_shared=n_shared), overrides=())
    ptx = result["ptx"]
    return result | dict(expf_calls=ptx.count(EXPF_STEP), div_rn=ptx.count("div.rn.f32"),
                         div_approx=ptx.count("div.full.f32") + ptx.count("div.approx"))


def compile_router_logits(tile: moe_router.RouterGemmConfig, tokens: int, hidden: int = 7168) -> dict:
    """One ``router_logits`` launch in ``tile`` over ``tokens`` bf16 rows of ``hidden`` (256 experts,
    the bf16 weight the Router's tiles read)."""
    x, weight = torch.zeros(tokens, hidden, dtype=torch.bfloat16), torch.zeros(256, hidden, dtype=torch.bfloat16)
    return dsa.compile_kernel(moe_router._router_logits_kernel,
                              lambda: moe_router.router_logits(x, weight, config=tile), overrides=())


# (D, residual add): GLM-5's and DeepSeek-V3.2's input norms (hidden), their q_a_layernorm (q latent)
NORMS = ((6144, True), (7168, True), (2048, False), (1536, False))


def compile_rms_norm(d: int, add: bool, quant: bool, rows: int = 4) -> dict:
    """One ``rms_norm`` (``add_rms_norm`` with ``add``) launch over ``rows`` bf16 rows of ``d``;
    ``quant``: also the e4m3 codes and ue8m0 scales of the output (the FP8 GEMM's input)."""
    x = torch.zeros(rows, d, dtype=torch.bfloat16)
    weight = torch.zeros(d, dtype=torch.bfloat16)
    fp8 = dict(q_out=torch.zeros(rows, d, dtype=torch.float8_e4m3fn), scale_out=torch.zeros(rows, d // 128),
               scale_fmt="ue8m0") if quant else {}
    if add:
        launch = lambda: row_invariant.add_rms_norm(x, x.clone(), weight, 1e-6, **fp8)  # noqa: E731
    else:
        launch = lambda: row_invariant.rms_norm(x, weight, 1e-6, **fp8)  # noqa: E731
    return dsa.compile_kernel(row_invariant._norm_kernel, launch, overrides=())


def _line(name: str, result: dict) -> str:
    return (f"{name}: {result['regs']} regs, {result['spill']} B spilled, {result['shared']} B shared, "
            f"{result['instructions']} SASS instructions")


def main() -> int:
    parse_or_exit(Parser(description=__doc__.splitlines()[0]))
    knobs.nvidia.dump_ptxas_log = True
    for heads, hidden in WEIGHT_SHAPES:
        for rows in ROW_COUNTS:
            result = compile_index_weights(heads, hidden, rows)
            print(_line(f"index_weights {heads} x {hidden}, {rows} rows, {result['splits']} K chunks", result),
                  flush=True)
    for rows in ROW_COUNTS:
        result = compile_rope_cos_sin(rows)
        print(_line(f"rope_cos_sin {rows} rows", result) + f", {result['libdevice_calls']} slow-reduction calls",
              flush=True)
    for bf16 in (True, False):
        result = compile_silu_and_mul(bf16)
        print(_line(f"silu_and_mul {'bf16' if bf16 else 'fp32'}", result)
              + f", {result['expf_calls']} libdevice expf, {result['div_rn']} div.rn, {result['div_approx']} "
                "approximate divisions", flush=True)
    print(_line("decode_inputs 64 rows", compile_decode_inputs()), flush=True)
    for routing in ROUTINGS:
        result = compile_router(*routing)
        print(_line(f"moe_router {routing}", result) + f", {result['expf_calls']} libdevice expf, "
              f"{result['div_rn']} div.rn, {result['div_approx']} approximate divisions", flush=True)
    for tokens, tile in ((1, moe_router.RouterGemmConfig()), *moe_router._DECODE_TILES):
        print(_line(f"router_logits {tile}, {tokens} rows", compile_router_logits(tile, tokens)), flush=True)
    for d, add in NORMS:
        for quant in (False, True):
            print(_line(f"{'add_rms_norm' if add else 'rms_norm'} {d}{' + act_quant' if quant else ''}",
                        compile_rms_norm(d, add, quant)), flush=True)
    for kind in dsa.INDEX_ROPE_KINDS:
        print(dsa.summary_line(f"index_rope {kind}", dsa.compile_index_rope(kind)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
