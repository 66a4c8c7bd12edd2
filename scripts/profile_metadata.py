"""One bounded metadata launch (1M table, live 64k; default: target verify, bs 16) for Nsight
Compute (H200); the knobs of scripts/tune_metadata.py select the variant:

    ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        -k regex:_bounded_kernel -c 1 python3 scripts/profile_metadata.py [--row-align 4 --block-cols 512]
"""

import argparse

import torch

from dsaspec.ops.dsa_metadata import BLOCK_COLS, NUM_WARPS, bounded_metadata
from dsaspec.ops.dsa_metadata_common import MetadataBuffers
from dsaspec.forward_mode import Mode

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--mode", choices=[m.value for m in Mode], default=Mode.TARGET_VERIFY.value)
p.add_argument("--bs", type=int, default=16)
p.add_argument("--live", type=int, default=65536)
p.add_argument("--destinations", type=int, default=1, help="buffer sets written by the launch (<= 4)")
p.add_argument("--row-align", type=int, default=1, help="pad table and page-table rows to this many columns")
p.add_argument("--block-cols", type=int, default=BLOCK_COLS)
p.add_argument("--num-warps", type=int, default=NUM_WARPS)
p.add_argument("--budget", type=int, default=2048)
args = p.parse_args()

mode = Mode(args.mode)
N = 1 if mode is Mode.DECODE else 5
W = (1 << 20) + 9
dev = torch.device("cuda")
stride = -(-W // args.row_align) * args.row_align
table = torch.empty(args.bs + 1, stride, dtype=torch.int32, device=dev)[:, :W]
table.copy_(torch.randint(0, 1 << 30, (args.bs + 1, W), dtype=torch.int32, device=dev))
outs = [MetadataBuffers.allocate(mode, args.bs, W, 64, dev, num_draft_tokens=N, row_align=args.row_align)
        for _ in range(args.destinations)]
seq_lens = torch.full((args.bs,), args.live, dtype=torch.int32, device=dev)
bounded_metadata(mode, table, torch.arange(args.bs, device=dev), seq_lens, outs, index_topk=2048, page_size=64,
                 num_draft_tokens=N, budget=args.budget, block_cols=args.block_cols, num_warps=args.num_warps,
                 check_values=False)
torch.cuda.synchronize()
