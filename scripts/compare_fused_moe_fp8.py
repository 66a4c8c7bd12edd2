"""Check the fused MoE's FP8 path bitwise against the form of an earlier commit (``act_quant``
launches into workspace buffers, then GEMMs over the stored codes): the module
``dsaspec/ops/fused_moe.py`` of that commit is loaded from git and both run on the same inputs
(bf16 / fp32 hidden rows, both scale formats, one hidden row with a NaN, several T, k, E, H, I);
the outputs, the activations of the rows in use and the fp32 partials must be equal bit for bit.
Runs on a CUDA device (else under the interpreter, set ``TRITON_INTERPRET=1``). Exit status 1 on
any difference.

    python3 scripts/compare_fused_moe_fp8.py [COMMIT]      (default 1fb8715: before the fusion)
"""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from dsaspec.ops import fused_moe as new
from dsaspec.reference import fp8_gemm as fp8_ref

CASES = [(1, 3, 8, 256, 256), (5, 2, 4, 384, 128), (24, 4, 8, 256, 384), (40, 8, 16, 128, 256),
         (3, 1, 1, 512, 128), (64, 8, 256, 7168, 256)]


def _module_at(commit: str):
    source = subprocess.run(["git", "show", f"{commit}:dsaspec/ops/fused_moe.py"], capture_output=True,
                            text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "fused_moe_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("fused_moe_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _inputs(tokens, topk, experts, h, inter, dtype, seed, device):
    gen = torch.Generator().manual_seed(seed)
    magnitude = torch.exp2(torch.randint(-8, 9, (tokens, h // 128), generator=gen).float())
    hidden = (torch.randn(tokens, h, generator=gen) * magnitude.repeat_interleave(128, 1)).to(dtype)
    if tokens > 2:
        hidden[2, 5] = math.nan
    w13, s13 = zip(*(fp8_ref.quantize_weight(torch.randn(2 * inter, h, generator=gen) / h ** 0.5)
                     for _ in range(experts)))
    w2, s2 = zip(*(fp8_ref.quantize_weight(torch.randn(h, inter, generator=gen) / inter ** 0.5)
                   for _ in range(experts)))
    ids = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)]).int()
    weights = torch.rand(tokens, topk, generator=gen)
    return [t.to(device) for t in (hidden, torch.stack(w13), torch.stack(s13), torch.stack(w2),
                                   torch.stack(s2), ids, weights)]


def main() -> int:
    old = _module_at(sys.argv[1] if len(sys.argv) > 1 else "1fb8715")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cases = CASES if device == "cuda" else CASES[:-1]
    differ = 0
    for seed, (tokens, topk, experts, h, inter) in enumerate(cases):
        for dtype in (torch.bfloat16, torch.float32):
            for fmt in (None, "ue8m0"):
                hidden, w13, s13, w2, s2, ids, weights = _inputs(tokens, topk, experts, h, inter, dtype, seed, device)
                got = []
                for module in (old, new):
                    workspace = module.fused_moe_workspace(tokens, topk, experts, h, inter, device, dtype, fp8=True)
                    out = module.fused_moe(hidden, w13, w2, ids, weights, torch.empty_like(hidden), w13_scale=s13,
                                           w2_scale=s2, scale_fmt=fmt, workspace=workspace)
                    used = workspace.sorted_pairs >= 0
                    got.append([t.view(torch.uint8) for t in (out, workspace.act[used], workspace.partial)])
                same = all(torch.equal(a, b) for a, b in zip(*got))
                differ += not same
                print(f"T {tokens} k {topk} E {experts} H {h} I {inter} {dtype} scale_fmt {fmt}: "
                      f"{'bitwise equal' if same else 'DIFFERENT'}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
