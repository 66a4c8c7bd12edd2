"""Pure-PyTorch DSA replay metadata (docs/metadata-kernels.md): the contract both kernels are tested
against, stated with plain torch ops (nothing here comes from ``dsaspec.ops``).

For ``B`` requests with committed lengths ``s``, pool rows ``r`` and ``N`` draft tokens:

- decode: one row per request, ``live = s``, ``seqlens_expanded = s``;
- target verify: rows ``b*N + j`` (``j < N``), ``live = s + N``, ``seqlens_expanded = s + j + 1``;
- draft extend: rows ``b*N + j``, or ``extend_seq_lens[b]`` consecutive rows per request when given,
  ``live = s``, ``seqlens_expanded = max(s - n_b + j + 1, 0)`` with ``n_b`` the request's row count;
- ``cache_seqlens = live``, ``cu_seqlens_k = [0, cumsum(live)]``,
  ``dsa_cache_seqlens = min(seqlens_expanded, index_topk)``, ``dsa_cu_seqlens_k = [0, cumsum(dsa)]``;
- ``page_table_1[row, c] = T[r[b], c]`` and ``real_page_table[row, c] = T[r[b], c*P] // P``.

Consumers read ``page_table_1[row, :live)`` and ``real_page_table[row, :cdiv(live, P))`` only:
that and the five 1-D outputs are the contract region. Both kernels write the five 1-D outputs and
the tile-rounded live prefix ``page_table_1[row, :min(roundup(live, 128), W))`` with the real-table
columns ``c`` of those tiles (``c * P`` inside it), and nothing else: the written region.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DECODE, TARGET_VERIFY, DRAFT_EXTEND = "decode", "target_verify", "draft_extend"
TILE = 128  # the kernels write page-table rows in tiles of this many columns
ONE_D_OUTPUTS = ("cache_seqlens", "cu_seqlens_k", "seqlens_expanded", "dsa_cache_seqlens", "dsa_cu_seqlens_k")


def _mode(mode) -> str:
    name = getattr(mode, "value", mode)
    if name not in (DECODE, TARGET_VERIFY, DRAFT_EXTEND):
        raise ValueError(f"mode must be one of {DECODE}, {TARGET_VERIFY}, {DRAFT_EXTEND}; got {mode!r}")
    return name


@dataclass
class ReferenceMetadata:
    """Every output of one replay as plain int32 tensors (``real_page_table`` is ``None`` when P = 1)."""

    page_size: int
    cache_seqlens: torch.Tensor
    cu_seqlens_k: torch.Tensor
    seqlens_expanded: torch.Tensor
    dsa_cache_seqlens: torch.Tensor
    dsa_cu_seqlens_k: torch.Tensor
    page_table_1: torch.Tensor
    real_page_table: torch.Tensor | None

    @property
    def rows(self) -> int:
        return self.page_table_1.shape[0]


def expanded_lengths(mode, seq_lens: torch.Tensor, num_draft_tokens: int = 1,
                     extend_seq_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(request of each row, seqlens_expanded of each row), int64, for ``mode``."""
    mode = _mode(mode)
    s = seq_lens.long()
    B = s.shape[0]
    requests = torch.arange(B, device=s.device)
    if mode == DECODE:
        return requests, s.clone()
    if extend_seq_lens is not None:
        rows_per_request = extend_seq_lens.long()
    else:
        rows_per_request = torch.full((B,), num_draft_tokens, dtype=torch.long, device=s.device)
    owner = torch.repeat_interleave(requests, rows_per_request)
    starts = torch.cumsum(rows_per_request, 0) - rows_per_request
    j = torch.arange(owner.shape[0], device=s.device) - starts[owner]
    if mode == TARGET_VERIFY:
        return owner, s[owner] + j + 1
    return owner, torch.clamp(s[owner] - rows_per_request[owner] + j + 1, min=0)


def live_lengths(mode, seq_lens: torch.Tensor, num_draft_tokens: int = 1) -> torch.Tensor:
    """live(request): ``s + N`` for target verify, ``s`` otherwise (int64 ``[B]``)."""
    return seq_lens.long() + (num_draft_tokens if _mode(mode) == TARGET_VERIFY else 0)


def _with_leading_zero(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x.new_zeros(1), torch.cumsum(x, 0)])


def reference_metadata(mode, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                       seq_lens: torch.Tensor, *, index_topk: int, page_size: int,
                       num_draft_tokens: int = 1, extend_seq_lens: torch.Tensor | None = None,
                       width: int | None = None) -> ReferenceMetadata:
    """Every output of ``mode`` over the full width (``width`` columns, default W; columns past W
    are 0), as new int32 tensors."""
    W = req_to_token.shape[1]
    width = W if width is None else width
    owner, expanded = expanded_lengths(mode, seq_lens, num_draft_tokens, extend_seq_lens)
    cache = live_lengths(mode, seq_lens, num_draft_tokens)
    dsa = torch.clamp(expanded, max=index_topk)
    table = torch.zeros(owner.shape[0], width, dtype=torch.int32, device=req_to_token.device)
    table[:, :W] = req_to_token[req_pool_indices.long()[owner]]
    real = None
    if page_size > 1:
        real = torch.zeros(owner.shape[0], -(-width // page_size), dtype=torch.int32, device=table.device)
        real[:, : -(-W // page_size)] = table[:, :W:page_size] // page_size
    i32 = lambda x: x.to(torch.int32)  # noqa: E731
    return ReferenceMetadata(page_size=page_size, cache_seqlens=i32(cache), cu_seqlens_k=i32(_with_leading_zero(cache)),
                             seqlens_expanded=i32(expanded), dsa_cache_seqlens=i32(dsa),
                             dsa_cu_seqlens_k=i32(_with_leading_zero(dsa)), page_table_1=table, real_page_table=real)


def _row_masks(bounds: torch.Tensor, width: int, page_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Masks of ``page_table_1[row, :bounds[row])`` and of the real-table columns ``c`` with
    ``c * P < bounds[row]``."""
    cols = torch.arange(width, device=bounds.device)
    pt_mask = cols[None, :] < bounds[:, None]
    if page_size == 1:
        return pt_mask, None
    real_cols = torch.arange(-(-width // page_size), device=bounds.device)
    return pt_mask, real_cols[None, :] * page_size < bounds[:, None]


def contract_masks(mode, seq_lens: torch.Tensor, width: int, page_size: int, num_draft_tokens: int = 1,
                   extend_seq_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Boolean masks of the contract region: ``page_table_1[row, :live)`` and
    ``real_page_table[row, :cdiv(live, P))`` for every metadata row."""
    owner, _ = expanded_lengths(mode, seq_lens, num_draft_tokens, extend_seq_lens)
    return _row_masks(live_lengths(mode, seq_lens, num_draft_tokens)[owner], width, page_size)


def written_masks(mode, seq_lens: torch.Tensor, width: int, page_size: int, num_draft_tokens: int = 1,
                  extend_seq_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Boolean masks of the page-table cells the kernels write: ``page_table_1[row, :e)`` and the
    real-table columns ``c`` with ``c * P < e``, ``e = min(roundup(live, 128), width)`` (0 for
    ``live <= 0``)."""
    owner, _ = expanded_lengths(mode, seq_lens, num_draft_tokens, extend_seq_lens)
    live = live_lengths(mode, seq_lens, num_draft_tokens)[owner].clamp(min=0)
    return _row_masks(torch.clamp(-(-live // TILE) * TILE, max=width), width, page_size)


def _assert_one_d_equal(got, want) -> None:
    for name in ONE_D_OUTPUTS:
        a, b = getattr(got, name), getattr(want, name)
        if a.dtype != torch.int32 or b.dtype != torch.int32 or not torch.equal(a.cpu(), b.cpu()):
            raise AssertionError(f"{name} differs:\n got  {a.dtype} {a.tolist()}\n want {b.dtype} {b.tolist()}")


def _assert_tables_equal(got, want, pt_mask: torch.Tensor, real_mask: torch.Tensor | None, region: str) -> None:
    checks = [("page_table_1", got.page_table_1, want.page_table_1, pt_mask)]
    if real_mask is not None:
        checks.append(("real_page_table", got.real_page_table, want.real_page_table, real_mask))
    for name, a, b, mask in checks:
        if a.shape[0] != mask.shape[0] or b.shape[0] != mask.shape[0]:
            raise AssertionError(f"{name} has {a.shape[0]} / {b.shape[0]} rows, the contract {mask.shape[0]}")
        cols = min(a.shape[1], b.shape[1])
        if mask[:, cols:].any():
            raise AssertionError(f"{name} is narrower ({cols} columns) than the {region}")
        diff = (a[:, :cols] != b[:, :cols]) & mask[:, :cols]
        if diff.any():
            r, c = diff.nonzero()[0].tolist()
            raise AssertionError(f"{name}[{r}, {c}] = {int(a[r, c])}, want {int(b[r, c])}")


def assert_contract_equal(got, want, mode, seq_lens: torch.Tensor, num_draft_tokens: int = 1,
                          extend_seq_lens: torch.Tensor | None = None) -> None:
    """Assert bit-identity on the contract region: the five 1-D outputs (values and int32 dtype)
    and the live page-table prefixes. ``got`` and ``want``: anything with the attributes of
    :class:`ReferenceMetadata` (kernel output buffers or the reference)."""
    _assert_one_d_equal(got, want)
    masks = contract_masks(mode, seq_lens, got.page_table_1.shape[1], got.page_size, num_draft_tokens,
                           extend_seq_lens)
    _assert_tables_equal(got, want, *masks, "live prefix")


def assert_written_equal(got, want, mode, seq_lens: torch.Tensor, num_draft_tokens: int = 1,
                         extend_seq_lens: torch.Tensor | None = None) -> None:
    """Assert bit-identity on the written region (:func:`written_masks`, a superset of the
    contract region): the five 1-D outputs and every page-table cell the kernels write, for
    buffers as wide as ``req_to_token``. Arguments as :func:`assert_contract_equal`."""
    _assert_one_d_equal(got, want)
    masks = written_masks(mode, seq_lens, got.page_table_1.shape[1], got.page_size, num_draft_tokens,
                          extend_seq_lens)
    _assert_tables_equal(got, want, *masks, "written region")
