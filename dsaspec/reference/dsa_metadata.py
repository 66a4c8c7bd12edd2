"""Pure-PyTorch DSA replay metadata (docs/metadata-kernels.md): the spec both kernels are tested against."""

from __future__ import annotations

import torch

from dsaspec.ops.dsa_metadata_common import MetadataBuffers, Mode


def expanded_lengths(mode: Mode, seq_lens: torch.Tensor, num_draft_tokens: int = 1,
                     extend_seq_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(request of each row, seqlens_expanded of each row), int64, for ``mode``."""
    mode = Mode(mode)
    s = seq_lens.long()
    B = s.shape[0]
    if mode is Mode.DECODE:
        return torch.arange(B, device=s.device), s.clone()
    if extend_seq_lens is not None:
        ext = extend_seq_lens.long()
        owner = torch.repeat_interleave(torch.arange(B, device=s.device), ext)
        starts = torch.cumsum(ext, 0) - ext
        local = torch.arange(owner.shape[0], device=s.device) - starts[owner]
        return owner, torch.clamp(s[owner] - ext[owner] + local + 1, min=0)
    N = num_draft_tokens
    owner = torch.arange(B, device=s.device).repeat_interleave(N)
    local = torch.arange(B * N, device=s.device) % N
    if mode is Mode.TARGET_VERIFY:
        return owner, s[owner] + local + 1
    return owner, torch.clamp(s[owner] - N + local + 1, min=0)


def live_lengths(mode: Mode, seq_lens: torch.Tensor, num_draft_tokens: int = 1) -> torch.Tensor:
    """live(request): ``s + N`` for target verify, ``s`` otherwise (int64 ``[B]``)."""
    return seq_lens.long() + (num_draft_tokens if Mode(mode) is Mode.TARGET_VERIFY else 0)


def reference_metadata(mode: Mode, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                       seq_lens: torch.Tensor, *, index_topk: int, page_size: int,
                       num_draft_tokens: int = 1, extend_seq_lens: torch.Tensor | None = None,
                       width: int | None = None) -> MetadataBuffers:
    """Every output of ``mode`` over the full width, as new buffers (see MetadataBuffers)."""
    mode = Mode(mode)
    B = seq_lens.shape[0]
    W = req_to_token.shape[1]
    owner, expanded = expanded_lengths(mode, seq_lens, num_draft_tokens, extend_seq_lens)
    out = MetadataBuffers.allocate(mode, B, width or W, page_size, req_to_token.device,
                                   num_draft_tokens=num_draft_tokens, rows=owner.shape[0])
    cache = live_lengths(mode, seq_lens, num_draft_tokens)
    out.cache_seqlens.copy_(cache)
    out.cu_seqlens_k.copy_(torch.cat([cache.new_zeros(1), torch.cumsum(cache, 0)]))
    if mode is not Mode.DECODE:
        out.seqlens_expanded.copy_(expanded)
    dsa = torch.clamp(expanded, max=index_topk)
    out.dsa_cache_seqlens.copy_(dsa)
    out.dsa_cu_seqlens_k.copy_(torch.cat([dsa.new_zeros(1), torch.cumsum(dsa, 0)]))
    rows = req_to_token[req_pool_indices.long()[owner]]
    out.page_table_1[:, :W] = rows
    if out.real_page_table is not None:
        out.real_page_table[:, : -(-W // page_size)] = rows[:, ::page_size] // page_size
    return out


def contract_masks(mode: Mode, seq_lens: torch.Tensor, width: int, page_size: int,
                   num_draft_tokens: int = 1, extend_seq_lens: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Boolean masks of the contract region: ``page_table_1[row, :live)`` and
    ``real_page_table[row, :cdiv(live, P))`` for every metadata row."""
    owner, _ = expanded_lengths(mode, seq_lens, num_draft_tokens, extend_seq_lens)
    live = live_lengths(mode, seq_lens, num_draft_tokens)[owner]
    cols = torch.arange(width, device=seq_lens.device)
    pt_mask = cols[None, :] < live[:, None]
    if page_size == 1:
        return pt_mask, None
    real_cols = torch.arange(-(-width // page_size), device=seq_lens.device)
    return pt_mask, real_cols[None, :] < (-(-live // page_size))[:, None]


def assert_contract_equal(got: MetadataBuffers, want: MetadataBuffers, mode: Mode,
                          seq_lens: torch.Tensor, num_draft_tokens: int = 1,
                          extend_seq_lens: torch.Tensor | None = None) -> None:
    """Assert bit-identity on the contract region: all 1-D outputs and the live page-table prefixes."""
    names = ["cache_seqlens", "cu_seqlens_k", "seqlens_expanded", "dsa_cache_seqlens", "dsa_cu_seqlens_k"]
    for name in names:
        a, b = getattr(got, name), getattr(want, name)
        if not torch.equal(a.cpu(), b.cpu()):
            raise AssertionError(f"{name} differs:\n got  {a.tolist()}\n want {b.tolist()}")
    pt_mask, real_mask = contract_masks(mode, seq_lens, got.width, got.page_size, num_draft_tokens,
                                        extend_seq_lens)
    diff = (got.page_table_1 != want.page_table_1) & pt_mask
    if diff.any():
        r, c = diff.nonzero()[0].tolist()
        raise AssertionError(f"page_table_1[{r}, {c}] = {int(got.page_table_1[r, c])}, want {int(want.page_table_1[r, c])}")
    if real_mask is not None:
        diff = (got.real_page_table != want.real_page_table) & real_mask
        if diff.any():
            r, c = diff.nonzero()[0].tolist()
            raise AssertionError(f"real_page_table[{r}, {c}] = {int(got.real_page_table[r, c])}, "
                                 f"want {int(want.real_page_table[r, c])}")
