"""Run the GLM-5 rank's small-M weight-streaming kernels eagerly, a few calls each, for a profiler
(ncu) to look at: the fused MoE at T = 1 (FP8, k 8 routed + the shared expert, H 6144, I 256, the
rank's default split and layout) and ``fp8_linear`` at M = 1 for the attention's three FP8 GEMMs
(fused_input N 2752 K 6144, fused_latent N 6144 K 2048, o_proj N 6144 K 2048).

    ncu -k regex:'_gate_up|_down_kernel|_fp8_gemm' python3 scripts/small_m_kernels.py [--calls 8]
"""

from __future__ import annotations

import sys

import torch

from dsaspec.bench.moe import quantize_experts
from dsaspec.cli_parsing import Parser, parse_or_exit, positive_int
from dsaspec.ops import fp8_gemm, fused_moe as moe

HIDDEN, INTER, EXPERTS, TOPK = 6144, 256, 257, 9
LINEARS = {"fused_input": (2752, 6144), "fused_latent": (6144, 2048), "o_proj": (6144, 2048)}


def main() -> int:
    parser = Parser(prog="small_m_kernels", description="The rank's small-M GEMMs, eagerly, for ncu.")
    parser.add_argument("--calls", type=positive_int, default=8, help="calls of each op")
    args = parse_or_exit(parser, sys.argv[1:])
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    w13, w13_s = quantize_experts(torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen, device=dev) * 0.02)
    w2, w2_s = quantize_experts(torch.randn(EXPERTS, HIDDEN, INTER, generator=gen, device=dev) * 0.06)
    hidden = torch.randn(1, HIDDEN, generator=gen, device=dev).to(torch.bfloat16)
    ids = torch.tensor([[3, 40, 77, 101, 150, 190, 222, 250, 256]], dtype=torch.int32, device=dev)
    weights = torch.rand(1, TOPK, generator=gen, device=dev)
    split = moe.moe_split_k(INTER, True)
    workspace = moe.fused_moe_workspace(1, TOPK, EXPERTS, HIDDEN, INTER, dev, torch.bfloat16, fp8=True,
                                        split_k=split)
    out = torch.empty_like(hidden)
    linears = {name: fp8_gemm.quantize_weight(torch.randn(n, k, generator=gen, device=dev) * k ** -0.5)
               for name, (n, k) in LINEARS.items()}
    xs = {name: torch.randn(1, k, generator=gen, device=dev).to(torch.bfloat16) for name, (_, k) in LINEARS.items()}
    for _ in range(args.calls):
        moe.fused_moe(hidden, w13, w2, ids, weights, out, w13_scale=w13_s, w2_scale=w2_s, workspace=workspace,
                      split_k=split, check_values=False)
        for name, (w, s) in linears.items():
            fp8_gemm.fp8_linear(xs[name], w, s)
    torch.cuda.synchronize()
    print("ran", args.calls, "calls of each:", ", ".join(["fused_moe"] + list(LINEARS)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
