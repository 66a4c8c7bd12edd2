"""Run every metadata kernel once at a moderate size, for compute-sanitizer (memcheck).

    compute-sanitizer --tool memcheck python3 scripts/sanitize_metadata.py
"""

import torch

from dsaspec.ops.dsa_metadata import context_wide_metadata

from dsaspec.ops.dsa_metadata_common import MetadataBuffers, Mode
from dsaspec.ops.dsa_metadata_bounded import bounded_metadata
from dsaspec.ops.draft_decode_metadata import draft_decode_metadata, precompute_and_copy

W, B, N = 20_000 + 10, 5, 6
dev = torch.device("cuda")
table = torch.randint(0, 1 << 30, (B + 2, W), dtype=torch.int32, device=dev)
idx = torch.tensor([0, 3, 3, 6, 1], device=dev)
seq_lens = torch.tensor([1, 129, W - N, 0, 7000], dtype=torch.int32, device=dev)
for mode in Mode:
    n = 1 if mode is Mode.DECODE else N
    for page_size in (1, 64):
        kw = dict(index_topk=2048, page_size=page_size, num_draft_tokens=n)
        a = MetadataBuffers.allocate(mode, B, W, page_size, dev, num_draft_tokens=n)
        context_wide_metadata(mode, table, idx, seq_lens, a, **kw)
        outs = [MetadataBuffers.allocate(mode, B, W, page_size, dev, num_draft_tokens=n) for _ in range(5)]
        bounded_metadata(mode, table, idx, seq_lens, outs, **kw)
ext = torch.tensor([6, 0, 3, 0, 1], dtype=torch.int32, device=dev)
v = MetadataBuffers.allocate(Mode.DRAFT_EXTEND, B, W, 64, dev, rows=10)
bounded_metadata(Mode.DRAFT_EXTEND, table, idx, seq_lens, v, index_topk=2048, page_size=64, extend_seq_lens=ext)
context_wide_metadata(Mode.DRAFT_EXTEND, table, idx, seq_lens, v, index_topk=2048, page_size=64, extend_seq_lens=ext)
scratch = MetadataBuffers.allocate(Mode.DECODE, B, W, 64, dev)
steps = [MetadataBuffers.allocate(Mode.DECODE, B, W, 64, dev) for _ in range(4)]
precompute_and_copy(table, idx, seq_lens, scratch, steps, index_topk=2048, page_size=64)
draft_decode_metadata(table, idx, seq_lens, steps, index_topk=2048, page_size=64)
torch.cuda.synchronize()
print("sanitize_metadata: all kernels ran")
