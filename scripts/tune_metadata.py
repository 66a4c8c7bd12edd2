"""Sweep the bounded metadata kernel's block size and program budget at a few points (H200).

    PYTHONPATH=. python3 scripts/tune_metadata.py
Prints one line per (point, block_cols, budget): CUPTI median µs in a graph with a cold L2.
"""

import torch

from dsaspec.bench.timing import time_in_graph, warm_up_gpu
from dsaspec.ops.dsa_metadata import MetadataBuffers, Mode
from dsaspec.ops.dsa_metadata_bounded import bounded_metadata

W = (1 << 20) + 4 + 5
dev = torch.device("cuda")
warm_up_gpu()
for mode, n, live, bs in [(Mode.TARGET_VERIFY, 5, 65536, 16), (Mode.DECODE, 1, 65536, 16),
                          (Mode.TARGET_VERIFY, 5, 1024, 16), (Mode.DECODE, 1, 1024, 1)]:
    table = torch.randint(0, 1 << 30, (bs + 1, W), dtype=torch.int32, device=dev)
    idx = torch.arange(bs, device=dev)
    seq_lens = torch.full((bs,), live, dtype=torch.int32, device=dev)
    out = MetadataBuffers.allocate(mode, bs, W, 64, dev, num_draft_tokens=n)
    for block_cols in (256, 512, 1024, 2048, 4096):
        for budget in (512, 1024, 2048, 4096):
            t = time_in_graph(lambda: bounded_metadata(mode, table, idx, seq_lens, out, index_topk=2048, page_size=64,
                                                       num_draft_tokens=n, budget=budget, block_cols=block_cols,
                                                       check=False), iters=100, graph_diff=False)
            print(f"{mode.value:14s} live {live:6d} bs {bs:3d} block {block_cols:5d} budget {budget:5d}: {t.median_us:7.2f} us")
