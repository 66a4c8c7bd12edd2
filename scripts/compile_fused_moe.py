"""Compile the fused MoE's gate/up grouped GEMM (``split_k`` 1, 2, 4, bf16 and FP8 experts) and the
split-K reduce for sm_90 without a GPU and print registers, spilled bytes, shared memory and the
tensor-core instructions in the SASS, as scripts/compile_fp8_dsa.py does for the DSA kernels.

Each case goes through ``fused_moe`` at T = 1 on small CPU tensors of the production widths (k 8
routed + 1 shared slot, H 7168, I 256: a TP 8 rank's experts; 9 experts, which no tile depends on)
with the tiles an H200's 132 SMs give; the other launches of the call are skipped.

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
KERNELS = {"gate_up": moe._gate_up_kernel, "split_reduce": moe._split_reduce_kernel}
SPLITS = (1, 2, 4)


def compile_moe(kernel: str, fp8: bool, split_k: int) -> dict:
    """Compile ``kernel`` (a :data:`KERNELS` key) as one bf16-activation ``fused_moe`` call with
    ``split_k`` launches it (FP8 experts with ``fp8``); the call's other kernels are not launched."""
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
        check_values=False, **scales)
    skipped = [k for k in (moe._align_kernel, moe._gate_up_kernel, moe._split_reduce_kernel, moe._down_kernel,
                           moe._combine_kernel, fp8_gemm._act_quant_kernel) if k is not KERNELS[kernel]]
    with mock.patch.object(moe, "sm_count", lambda device, without_cuda=1: H200_SMS):
        for other in skipped:
            other.run = lambda *args, **kwargs: None
        try:
            return dsa.compile_kernel(KERNELS[kernel], launch, (("UPCAST", False),) if kernel == "gate_up" else ())
        finally:
            for other in skipped:
                del other.run


def main() -> int:
    parse_or_exit(Parser(description=__doc__.splitlines()[0]))
    knobs.nvidia.dump_ptxas_log = True
    for fp8 in (False, True):
        experts = "fp8" if fp8 else "bf16"
        for split_k in SPLITS:
            print(dsa.summary_line(f"gate_up {experts} split_k={split_k}", compile_moe("gate_up", fp8, split_k)), flush=True)
        print(dsa.summary_line(f"split_reduce {experts} split_k=4", compile_moe("split_reduce", fp8, 4)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
