"""Sweep the bounded metadata kernel's block size, warps and program budget, with page-table rows
at the contract's width W (row stride W, 8-byte aligned at W = 2^20 + 9) and padded to a
multiple of 16 columns (16-byte aligned rows). H200:

    PYTHONPATH=. python3 scripts/tune_metadata.py
One line per variant: CUPTI median µs in a CUDA graph with a cold L2.
"""

import dataclasses

import torch

from dsaspec.bench.timing import time_in_graph, warm_up_gpu
from dsaspec.ops.dsa_metadata_common import MetadataBuffers, Mode
from dsaspec.ops.dsa_metadata_bounded import bounded_metadata

W = (1 << 20) + 4 + 5
dev = torch.device("cuda")


def rows_view(rows: int, cols: int, pad: bool) -> torch.Tensor:
    stride = -(-cols // 16) * 16 if pad else cols
    return torch.empty(rows, stride, dtype=torch.int32, device=dev)[:, :cols]


warm_up_gpu()
for mode, n, live, bs in [(Mode.TARGET_VERIFY, 5, 65536, 16), (Mode.DECODE, 1, 65536, 16),
                          (Mode.TARGET_VERIFY, 5, 1024, 16), (Mode.DECODE, 1, 1024, 1)]:
    for pad in (False, True):
        table = rows_view(bs + 1, W, pad)
        table.copy_(torch.randint(0, 1 << 30, (bs + 1, W), dtype=torch.int32, device=dev))
        idx = torch.arange(bs, device=dev)
        seq_lens = torch.full((bs,), live, dtype=torch.int32, device=dev)
        out = MetadataBuffers.allocate(mode, bs, W, 64, dev, num_draft_tokens=n)
        out = dataclasses.replace(out, page_table_1=rows_view(out.rows, W, pad),
                                  real_page_table=rows_view(out.rows, out.real_page_table.shape[1], pad))
        for block_cols, num_warps in ((128, 4), (128, 1), (256, 2), (256, 1), (512, 4), (512, 2)):
            for budget in (2048, 4096):
                t = time_in_graph(lambda: bounded_metadata(
                    mode, table, idx, seq_lens, out, index_topk=2048, page_size=64, num_draft_tokens=n,
                    budget=budget, block_cols=block_cols, num_warps=num_warps, check=False),
                    iters=100, graph_diff=False)
                print(f"{mode.value:14s} live {live:6d} bs {bs:3d} pad {int(pad)} block {block_cols:4d} "
                      f"warps {num_warps} budget {budget:5d}: {t.median_us:7.2f} us", flush=True)
