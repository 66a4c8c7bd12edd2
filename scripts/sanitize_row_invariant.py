"""Run every row-invariant kernel once at moderate sizes, for compute-sanitizer (memcheck, racecheck):

    compute-sanitizer --tool memcheck python3 scripts/sanitize_row_invariant.py

Covers the GEMM with and without a K split (tile counters, workspace, last-arrival sum), ragged
M / N / K, bf16 and fp32, the batched form over strided views, and both norms over strided rows.
"""

import torch

from dsaspec.ops.row_invariant import GemmConfig, bmm, layer_norm, linear, rms_norm

dev = torch.device("cuda")
torch.manual_seed(0)
for dtype in (torch.bfloat16, torch.float32):
    for m, k, n in ((1, 6144, 2048), (37, 6144, 576), (130, 2048, 1031), (5, 576, 200)):
        x = torch.randn(m, k, device=dev, dtype=dtype)
        w = torch.randn(n, k, device=dev, dtype=dtype)
        linear(x, w)
        linear(x, w, config=GemmConfig(16, 64, 128, 1, 4, 3))
        linear(x, w, config=GemmConfig(16, 64, 64, 4, 4, 3))
q = torch.randn(9, 64, 192, device=dev, dtype=torch.bfloat16)
w_uk = torch.randn(64, 192, 512, device=dev, dtype=torch.bfloat16)
bmm(q.transpose(0, 1), w_uk)
latent = torch.randn(7, 576, device=dev, dtype=torch.bfloat16)
rms_norm(latent[:, :512], torch.ones(512, device=dev, dtype=torch.bfloat16), 1e-6)
layer_norm(torch.randn(33, 128, device=dev, dtype=torch.bfloat16), torch.ones(128, device=dev, dtype=torch.bfloat16),
           torch.zeros(128, device=dev, dtype=torch.bfloat16), 1e-6)
torch.cuda.synchronize()
print("row-invariant kernels ran")
