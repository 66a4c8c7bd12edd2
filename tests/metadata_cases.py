"""Input builders shared by the metadata test modules."""

import torch

from dsaspec.ops.dsa_metadata_common import Mode

EDGE_LENGTHS = [0, 1, 63, 64, 65, 127, 128, 129]


def make_table(pool: int, width: int, device, seed: int = 0) -> torch.Tensor:
    """A random int32 req_to_token table of distinct-looking slot ids (never a multiple pattern)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, 1 << 30, (pool, width), generator=g, dtype=torch.int32).to(device)


def make_batch(mode: Mode, batch: int, width: int, pool: int, n: int, device, seed: int = 0,
               dtype=torch.int32, lengths=None, variable: bool = False):
    """(req_pool_indices, seq_lens, extend_seq_lens or None) for ``batch`` requests.

    Lengths cycle through the edge lengths and ``width - N`` (verify) / ``width`` (others), then
    random ones; the last request is a padded row (seq_len 1) and pool indices repeat.
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    cap = width - n if mode is Mode.TARGET_VERIFY else width
    edges = [x for x in EDGE_LENGTHS if x <= cap] + [cap]
    if lengths is None:
        lengths = [edges[i] if i < len(edges) else int(torch.randint(0, cap + 1, (1,), generator=g))
                   for i in range(batch)]
        if batch > 1:
            lengths[-1] = 1
    seq_lens = torch.tensor(lengths, dtype=dtype)
    idx = torch.randint(0, pool, (batch,), generator=g)
    if batch > 2:
        idx[1] = idx[0]
    ext = None
    if variable:
        ext = torch.randint(0, n + 1, (batch,), generator=g)
        ext = torch.minimum(ext, seq_lens.long()).to(dtype)
    return idx.to(device), seq_lens.to(device), (ext.to(device) if ext is not None else None)
