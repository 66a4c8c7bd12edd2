"""Input builders shared by the metadata test modules, and poisoned arenas: every buffer a kernel
reads or writes is a view inside a larger tensor filled with a sentinel, so a read outside the
inputs shows up as the sentinel in an output and a write outside the outputs changes the arena."""

import dataclasses

import torch

from dsaspec.ops.dsa_metadata_common import MetadataBuffers
from dsaspec.forward_mode import Mode
from dsaspec.reference.dsa_metadata import assert_written_equal, written_masks

EDGE_LENGTHS = [0, 1, 63, 64, 65, 127, 128, 129]
READ_POISON = -111       # around the req_to_token table: must never reach an output
WRITE_POISON = -123456   # around (and initially inside) the output buffers
GAP = 3                  # sentinel rows / columns / entries on every side


def make_table(pool: int, width: int, device, seed: int = 0) -> torch.Tensor:
    """A random int32 req_to_token table of distinct-looking slot ids (never a multiple pattern)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, 1 << 30, (pool, width), generator=g, dtype=torch.int32).to(device)


def poisoned_table(pool: int, width: int, device, seed: int = 0) -> torch.Tensor:
    """:func:`make_table` as a view with :data:`READ_POISON` rows above/below and columns left/right."""
    arena = torch.full((pool + 2 * GAP, width + 2 * GAP), READ_POISON, dtype=torch.int32, device=device)
    view = arena[GAP:GAP + pool, GAP:GAP + width]
    view.copy_(make_table(pool, width, device, seed))
    return view


@dataclasses.dataclass
class Arena:
    """A sentinel-filled tensor and the index of the view a kernel may write."""

    tensor: torch.Tensor
    index: tuple

    def outside_untouched(self) -> bool:
        check = self.tensor.clone()
        check[self.index] = WRITE_POISON
        return bool((check == WRITE_POISON).all())


def poisoned_buffers(mode: Mode, batch: int, width: int, page_size: int, device, *, num_draft_tokens: int = 1,
                     rows: int | None = None, row_align: int = 1) -> tuple[MetadataBuffers, list[Arena]]:
    """MetadataBuffers whose tensors are views inside :data:`WRITE_POISON` arenas (also poisoned
    inside), with the layout of ``MetadataBuffers.allocate`` plus padded page-table rows; with
    ``row_align``, every page-table row starts at a multiple of ``row_align`` columns."""
    template = MetadataBuffers.allocate(mode, batch, width, page_size, device, num_draft_tokens=num_draft_tokens,
                                        rows=rows)
    n = template.lengths.numel()
    flat = torch.full((n + 2 * GAP,), WRITE_POISON, dtype=torch.int32, device=device)
    lengths = flat[GAP:GAP + n]
    base = template.lengths.data_ptr()
    views = {name: lengths[(t.data_ptr() - base) // 4:][:t.numel()] for name, t in
             (("cache_seqlens", template.cache_seqlens), ("cu_seqlens_k", template.cu_seqlens_k),
              ("seqlens_expanded", template.seqlens_expanded), ("dsa_cache_seqlens", template.dsa_cache_seqlens),
              ("dsa_cu_seqlens_k", template.dsa_cu_seqlens_k))}
    arenas = [Arena(flat, (slice(GAP, GAP + n),))]

    def table(t):
        left = -(-GAP // row_align) * row_align
        stride = -(-(left + t.shape[1] + GAP) // row_align) * row_align
        big = torch.full((t.shape[0] + 2 * GAP, stride), WRITE_POISON, dtype=torch.int32, device=device)
        index = (slice(GAP, GAP + t.shape[0]), slice(left, left + t.shape[1]))
        arenas.append(Arena(big, index))
        return big[index]

    real = None if template.real_page_table is None else table(template.real_page_table)
    out = dataclasses.replace(template, lengths=lengths, page_table_1=table(template.page_table_1),
                              real_page_table=real, **views)
    return out, arenas


def make_batch(mode: Mode, batch: int, width: int, pool: int, n: int, device, seed: int = 0,
               dtype=torch.int32, lengths=None, variable: bool = False):
    """(req_pool_indices, seq_lens, extend_seq_lens or None) for ``batch`` requests.

    Lengths put the live length (``seq_len + N`` for verify, ``seq_len`` otherwise: what the
    kernels round to tiles) on each edge length, then the longest (live ``width``), then random
    ones; the last request is a padded row (seq_len 1) and pool indices repeat. The variable
    draft-extend lengths lie in ``[0, min(N, seq_len)]`` (some 0).
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    extra = n if mode is Mode.TARGET_VERIFY else 0  # live length - seq_len
    cap = width - extra
    edges = list(dict.fromkeys(max(x - extra, 0) for x in EDGE_LENGTHS if x - extra <= cap)) + [cap]
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


def assert_writes_exactly(got: MetadataBuffers, want, mode: Mode, seq_lens: torch.Tensor, n: int = 1,
                          ext: torch.Tensor | None = None) -> None:
    """``got`` (poisoned buffers after one kernel call) equals ``want`` on every cell of the written
    region (the reference's ``written_masks``: the tile-rounded live prefix of each row) and still
    holds :data:`WRITE_POISON` on every page-table cell past it."""
    assert_written_equal(got, want, mode, seq_lens, n, ext)
    pt_mask, real_mask = written_masks(mode, seq_lens, got.width, got.page_size, n, ext)
    assert (got.page_table_1[~pt_mask] == WRITE_POISON).all(), "page_table_1 written past the tile-rounded live prefix"
    if real_mask is not None:
        assert (got.real_page_table[~real_mask] == WRITE_POISON).all(), \
            "real_page_table written past the tile-rounded live prefix"
