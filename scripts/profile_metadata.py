"""One bounded target-verify launch (1M table, bs 16, live 64k) for Nsight Compute (H200):

    ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
        -k regex:_bounded_kernel -c 1 python3 scripts/profile_metadata.py
"""

import torch

from dsaspec.ops.dsa_metadata_common import MetadataBuffers, Mode
from dsaspec.ops.dsa_metadata_bounded import bounded_metadata

W, B, N, LIVE = (1 << 20) + 9, 16, 5, 65536
dev = torch.device("cuda")
table = torch.randint(0, 1 << 30, (B + 1, W), dtype=torch.int32, device=dev)
out = MetadataBuffers.allocate(Mode.TARGET_VERIFY, B, W, 64, dev, num_draft_tokens=N)
seq_lens = torch.full((B,), LIVE, dtype=torch.int32, device=dev)
bounded_metadata(Mode.TARGET_VERIFY, table, torch.arange(B, device=dev), seq_lens, out, index_topk=2048,
                 page_size=64, num_draft_tokens=N, check_values=False)
torch.cuda.synchronize()
