"""Run every metadata kernel once at moderate sizes, for compute-sanitizer (memcheck):

    compute-sanitizer --tool memcheck python3 scripts/sanitize_metadata.py

Covers every mode and page size, five destinations (two launches), variable draft extend with
rows past and short of sum(extend_seq_lens) (unchecked), batch 256 x 8 rows (17 length programs),
16-byte aligned rows with 512-column blocks (vector path), and the draft-decode paths.
"""

import torch

from dsaspec.ops.baseline.draft_decode_metadata import precompute_and_copy
from dsaspec.ops.draft_decode_metadata import draft_decode_metadata
from dsaspec.ops.baseline.dsa_metadata import context_wide_metadata
from dsaspec.ops.dsa_metadata import bounded_metadata
from dsaspec.ops.dsa_metadata_common import MetadataBuffers
from dsaspec.forward_mode import Mode

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
        aligned = [MetadataBuffers.allocate(mode, B, W, page_size, dev, num_draft_tokens=n, row_align=4)
                   for _ in range(2)]
        padded = torch.empty(B + 2, W + 2, dtype=torch.int32, device=dev)[:, :W]
        padded.copy_(table)
        bounded_metadata(mode, padded, idx, seq_lens, aligned, block_cols=512, **kw)
for ext, rows in (([6, 0, 3, 0, 1], 10), ([6, 6, 6, 6, 6], 10), ([1, 0, 0, 0, 1], 10)):
    ext = torch.tensor(ext, dtype=torch.int32, device=dev)
    v = MetadataBuffers.allocate(Mode.DRAFT_EXTEND, B, W, 64, dev, rows=rows)
    for kernel in (bounded_metadata, context_wide_metadata):
        kernel(Mode.DRAFT_EXTEND, table, idx, seq_lens, v, index_topk=2048, page_size=64, extend_seq_lens=ext,
               check_values=False)
big = 256
big_table = torch.randint(0, 1 << 30, (big + 1, 3000), dtype=torch.int32, device=dev)
big_idx = torch.randperm(big + 1, device=dev)[:big]
big_lens = torch.randint(0, 3000 - 8, (big,), dtype=torch.int32, device=dev)
for mode, ext in ((Mode.TARGET_VERIFY, None), (Mode.DRAFT_EXTEND, torch.full((big,), 8, dtype=torch.int32, device=dev))):
    o = MetadataBuffers.allocate(mode, big, 3000, 64, dev, num_draft_tokens=8)
    bounded_metadata(mode, big_table, big_idx, big_lens, o, index_topk=2048, page_size=64, num_draft_tokens=8,
                     extend_seq_lens=ext)
    context_wide_metadata(mode, big_table, big_idx, big_lens, o, index_topk=2048, page_size=64, num_draft_tokens=8,
                          extend_seq_lens=ext)
scratch = MetadataBuffers.allocate(Mode.DECODE, B, W, 64, dev)
steps = [MetadataBuffers.allocate(Mode.DECODE, B, W, 64, dev) for _ in range(4)]
precompute_and_copy(table, idx, seq_lens, scratch, steps, index_topk=2048, page_size=64)
draft_decode_metadata(table, idx, seq_lens, steps, index_topk=2048, page_size=64)
torch.cuda.synchronize()
print("sanitize_metadata: all kernels ran")
