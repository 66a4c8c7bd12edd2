"""Compile the fused MoE's align kernel, gate/up grouped GEMM (``split_k`` 1, 2, 4, bf16 and FP8 experts; with
a split, the last program of a group adds the partials), and the down GEMM, in the sorted layout and the pair layout (down: the combine folded
in), and the FP8 block-scaled GEMM of the shared expert and the other FP8 linear layers
(``fp8_linear``: unsplit and K-group split, with and without the fused activation quantization, and
the split's reduce), for sm_90 without a GPU and print registers, spilled bytes, shared memory and
the tensor-core instructions in the SASS, as scripts/compile_fp8_dsa.py does for the DSA kernels.

Each MoE case goes through ``fused_moe`` at T = 1 (the pair layout's gate/up ranks 64 ids at any
default P) on small CPU tensors of the production widths (k 8 routed + 1 shared slot, H 7168, I 256:
a TP 8 rank's experts; 9 experts, which no tile depends on) with the tiles an H200's 132 SMs give;
the down lines also count the fp32 FMAs in the PTX (none: it compiles without contraction). Each
FP8 linear case goes through ``fp8_linear`` at GLM-5's fused attention input (N 2752, K 6144; G 8 on
132 SMs), M 1 split and M 64 unsplit. Every kernel compiles chained (``enter_chain``) as on an H200.
The other launches of a call are skipped.

    python3 scripts/compile_fused_moe.py
"""

from __future__ import annotations

from unittest import mock

import compile_fp8_dsa as dsa  # first: it chooses compiling before triton is imported

import torch  # noqa: E402
from triton import knobs  # noqa: E402

from dsaspec.cli_parsing import Parser, parse_or_exit  # noqa: E402
from dsaspec.ops import fp8_gemm, fused_moe as moe  # noqa: E402
from dsaspec.ops.device import H200_SMS  # noqa: E402

TOPK, EXPERTS, HIDDEN, INTER = 9, 9, 7168, 256  # k: 8 routed slots and the shared expert's
KERNELS = {"gate_up": moe._gate_up_kernel, "down": moe._down_kernel}
SPLITS = (1, 2, 4)


def _compile_alone(kernel, launch, others, overrides) -> dict:
    """``dsa.compile_kernel(kernel, launch, overrides)`` with the ``others`` kernels that
    ``launch()`` would also launch skipped."""
    for other in others:
        other.run = lambda *args, **kwargs: None
    try:
        return dsa.compile_kernel(kernel, launch, overrides)
    finally:
        for other in others:
            del other.run


def compile_moe(kernel: str, fp8: bool, split_k: int, sort_pairs: bool = True) -> dict:
    """Compile ``kernel`` (a :data:`KERNELS` key) as one bf16-activation ``fused_moe`` call with
    ``split_k`` launches it (FP8 experts with ``fp8``) in the sorted layout (``sort_pairs``) or the
    pair layout; the call's other kernels are not launched."""
    hidden = torch.zeros(1, HIDDEN, dtype=torch.bfloat16)
    dtype = moe.FP8 if fp8 else torch.bfloat16
    w13 = torch.zeros(EXPERTS, 2 * INTER, HIDDEN, dtype=dtype)
    w2 = torch.zeros(EXPERTS, HIDDEN, INTER, dtype=dtype)
    scales = {}
    if fp8:
        scales = dict(w13_scale=torch.ones(EXPERTS, 2 * INTER // 128, HIDDEN // 128),
                      w2_scale=torch.ones(EXPERTS, HIDDEN // 128, INTER // 128))
    ids = torch.arange(TOPK, dtype=torch.int32)[None]
    launch = lambda: moe.fused_moe(  # noqa: E731
        hidden, w13, w2, ids, torch.ones(1, TOPK), torch.empty_like(hidden), split_k=split_k,
        sort_pairs=sort_pairs, check_values=False, **scales)
    skipped = [k for k in (moe._align_kernel, moe._gate_up_kernel, moe._down_kernel, moe._combine_kernel,
                           fp8_gemm._act_quant_kernel) if k is not KERNELS[kernel]]
    with mock.patch.object(moe, "sm_count", lambda device, without_cuda=1: H200_SMS):
        return _compile_alone(KERNELS[kernel], launch, skipped, (("UPCAST", False),))


ALIGN_EXPERTS = (9, 257)  # this script's experts; a rank's 256 routed + the shared one


def compile_align(experts: int) -> dict:
    """Compile the align kernel as a sorted-layout ``fused_moe`` call over ``experts`` experts
    launches it (its code depends on the expert count only); the call's other kernels are not
    launched."""
    hidden = torch.zeros(1, 128, dtype=torch.bfloat16)
    w13, w2 = torch.zeros(experts, 256, 128, dtype=torch.bfloat16), torch.zeros(experts, 128, 128, dtype=torch.bfloat16)
    ids = torch.arange(TOPK, dtype=torch.int32)[None]
    launch = lambda: moe.fused_moe(hidden, w13, w2, ids, torch.ones(1, TOPK), torch.empty_like(hidden),  # noqa: E731
                                   sort_pairs=True, check_values=False)
    return _compile_alone(moe._align_kernel, launch,
                          (moe._gate_up_kernel, moe._down_kernel, moe._combine_kernel), ())


FP8_LINEAR = {"gemm": fp8_gemm._fp8_gemm_kernel, "act_quant": fp8_gemm._act_quant_kernel}
LINEAR_N, LINEAR_K = 2752, 6144


def compile_fp8_linear(kernel: str, split: bool) -> dict:
    """Compile ``kernel`` (a :data:`FP8_LINEAR` key) as one bf16 ``fp8_linear`` call of
    :data:`LINEAR_N` x :data:`LINEAR_K` launches it: M 1 ``split``, else M 64 unsplit. The call's
    other kernel is not launched."""
    x = torch.zeros(1 if split else 64, LINEAR_K, dtype=torch.bfloat16)
    w = torch.zeros(LINEAR_N, LINEAR_K, dtype=torch.float8_e4m3fn)
    w_scale = torch.ones(-(-LINEAR_N // fp8_gemm.BLOCK), LINEAR_K // fp8_gemm.BLOCK)
    launch = lambda: fp8_gemm.fp8_linear(x, w, w_scale, "ue8m0", split=split)  # noqa: E731
    skipped = [k for k in FP8_LINEAR.values() if k is not FP8_LINEAR[kernel]]
    return _compile_alone(FP8_LINEAR[kernel], launch, skipped, ())


def main() -> int:
    parse_or_exit(Parser(description=__doc__.splitlines()[0]))
    knobs.nvidia.dump_ptxas_log = True
    for fp8 in (False, True):
        experts = "fp8" if fp8 else "bf16"
        for sort_pairs in (True, False):
            layout = "sorted" if sort_pairs else "pairs"
            for kernel, split_k in [("gate_up", s) for s in SPLITS] + [("down", 1)]:
                name = f"{kernel} {experts} {layout}" + (f" split_k={split_k}" if kernel != "down" else "")
                result = compile_moe(kernel, fp8, split_k, sort_pairs)
                fma = f"; {result['ptx'].count('fma.rn.f32')} fp32 FMAs in the PTX" if kernel == "down" else ""
                print(dsa.summary_line(name, result) + fma, flush=True)
    for experts in ALIGN_EXPERTS:
        print(dsa.summary_line(f"align {experts} experts", compile_align(experts)), flush=True)
    for split in (False, True):
        name = f"fp8_linear gemm {'split' if split else 'unsplit'}"
        print(dsa.summary_line(name, compile_fp8_linear("gemm", split)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
