"""What the two DSA replay-metadata kernels share: the forward :class:`Mode` and its kernel codes,
the static :class:`MetadataBuffers`, the input checks, and the Triton helpers that write the 1-D
outputs and store page-table tiles. Contract: docs/metadata-kernels.md.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

import torch
import triton
import triton.language as tl

TILE = 128  # page-table columns per tile


class Mode(str, enum.Enum):
    """Forward mode of a metadata replay."""

    DECODE = "decode"
    TARGET_VERIFY = "target_verify"
    DRAFT_EXTEND = "draft_extend"


# Kernel-side mode codes: the kernels' ``MODE`` constexpr takes one of these.
MODE_DECODE = tl.constexpr(0)
MODE_VERIFY = tl.constexpr(1)
MODE_EXTEND_STATIC = tl.constexpr(2)      # draft extend, N rows per request
MODE_EXTEND_VARIABLE = tl.constexpr(3)    # draft extend, extend_seq_lens[b] rows per request


def mode_code(mode: Mode, variable_extend: bool) -> int:
    """The kernel code of ``mode`` (draft extend: static or variable form)."""
    mode = Mode(mode)
    if mode is Mode.DECODE:
        return MODE_DECODE.value
    if mode is Mode.TARGET_VERIFY:
        return MODE_VERIFY.value
    return (MODE_EXTEND_VARIABLE if variable_extend else MODE_EXTEND_STATIC).value


@dataclass(eq=False)
class MetadataBuffers:
    """Static metadata buffers of one (batch bucket, mode), all int32 on one device.

    The five 1-D outputs are views of one flat buffer ``lengths`` (so a kernel writes them through one
    pointer and fixed offsets): ``cache_seqlens [B]``, ``cu_seqlens_k [B+1]``,
    ``seqlens_expanded [R]`` (decode: the same view as ``cache_seqlens``), ``dsa_cache_seqlens [R]``,
    ``dsa_cu_seqlens_k [R+1]``. ``page_table_1`` is ``[R, W]``; ``real_page_table`` is
    ``[R, cdiv(W, P)]``, or ``None`` when the real page size ``P`` is 1.
    Build with :meth:`allocate`; shapes and addresses never change afterwards.
    """

    mode: Mode
    page_size: int
    lengths: torch.Tensor
    cache_seqlens: torch.Tensor
    cu_seqlens_k: torch.Tensor
    seqlens_expanded: torch.Tensor
    dsa_cache_seqlens: torch.Tensor
    dsa_cu_seqlens_k: torch.Tensor
    page_table_1: torch.Tensor
    real_page_table: torch.Tensor | None

    @classmethod
    def allocate(cls, mode: Mode, batch: int, width: int, page_size: int, device,
                 num_draft_tokens: int = 1, rows: int | None = None) -> "MetadataBuffers":
        """Zero-filled buffers for ``batch`` requests of a ``width``-column table.

        ``rows`` defaults to ``batch`` (decode) or ``batch * num_draft_tokens`` (verify, draft
        extend); give it only for the variable draft-extend form (``sum(extend_seq_lens)``).
        """
        mode = Mode(mode)
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        if width < 1:
            raise ValueError(f"width must be >= 1, got {width}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        if rows is None:
            rows = batch if mode is Mode.DECODE else batch * num_draft_tokens
        if mode is Mode.DECODE and rows != batch:
            raise ValueError(f"decode has one row per request: rows must equal batch={batch}, got {rows}")
        if rows < 0:
            raise ValueError(f"rows must be >= 0, got {rows}")
        expanded = 0 if mode is Mode.DECODE else rows
        lengths = torch.zeros(2 * batch + 1 + expanded + 2 * rows + 1, dtype=torch.int32, device=device)
        views = torch.split(lengths, [batch, batch + 1, expanded, rows, rows + 1])
        return cls(
            mode=mode,
            page_size=page_size,
            lengths=lengths,
            cache_seqlens=views[0],
            cu_seqlens_k=views[1],
            seqlens_expanded=views[0] if mode is Mode.DECODE else views[2],
            dsa_cache_seqlens=views[3],
            dsa_cu_seqlens_k=views[4],
            page_table_1=torch.zeros(rows, width, dtype=torch.int32, device=device),
            real_page_table=(None if page_size == 1 else
                             torch.zeros(rows, triton.cdiv(width, page_size), dtype=torch.int32, device=device)),
        )

    @property
    def batch(self) -> int:
        return self.cache_seqlens.shape[0]

    @property
    def rows(self) -> int:
        return self.page_table_1.shape[0]

    @property
    def width(self) -> int:
        return self.page_table_1.shape[1]

    def tensors(self) -> list[torch.Tensor]:
        """Every distinct buffer (the flat lengths buffer and the page tables)."""
        out = [self.lengths, self.page_table_1]
        if self.real_page_table is not None:
            out.append(self.real_page_table)
        return out

    def length_offsets(self) -> tuple[int, int, int, int]:
        """Element offsets of cu_seqlens_k, seqlens_expanded, dsa_cache_seqlens, dsa_cu_seqlens_k
        inside ``lengths`` (cache_seqlens is at 0)."""
        base = self.lengths.data_ptr()
        return tuple((t.data_ptr() - base) // 4 for t in
                     (self.cu_seqlens_k, self.seqlens_expanded, self.dsa_cache_seqlens, self.dsa_cu_seqlens_k))

    def same_layout(self, other: "MetadataBuffers") -> bool:
        """True when ``other`` has the same mode, page size, shapes and dtypes (one kernel can write both)."""
        return (self.mode == other.mode and self.page_size == other.page_size
                and self.lengths.shape == other.lengths.shape
                and self.page_table_1.shape == other.page_table_1.shape
                and self.page_table_1.stride() == other.page_table_1.stride()
                and (self.real_page_table is None or self.real_page_table.stride() == other.real_page_table.stride())
                and self.page_table_1.device == other.page_table_1.device
                and (self.real_page_table is None) == (other.real_page_table is None))


def validate_inputs(mode: Mode, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                    seq_lens: torch.Tensor, outs: Sequence[MetadataBuffers], *, index_topk: int,
                    page_size: int, num_draft_tokens: int, extend_seq_lens: torch.Tensor | None,
                    check: bool) -> None:
    """Shape/dtype/device checks (always; no host sync) and, when ``check``, value checks that read
    device data (pool indices in range, ``seq_len (+N) <= W``, ``sum(extend_seq_lens) == rows``)."""
    mode = Mode(mode)
    if not outs:
        raise ValueError("out: at least one MetadataBuffers is required")
    if req_to_token.dim() != 2 or req_to_token.dtype != torch.int32:
        raise ValueError(f"req_to_token must be int32 [pool, W], got {req_to_token.dtype} {tuple(req_to_token.shape)}")
    if req_to_token.stride(1) != 1:
        raise ValueError("req_to_token must have unit column stride")
    device = req_to_token.device
    W = req_to_token.shape[1]
    if req_pool_indices.dim() != 1 or req_pool_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"req_pool_indices must be int32/int64 [B], got {req_pool_indices.dtype} {tuple(req_pool_indices.shape)}")
    if seq_lens.dim() != 1 or seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"seq_lens must be int32/int64 [B], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    B = seq_lens.shape[0]
    if req_pool_indices.shape[0] != B:
        raise ValueError(f"req_pool_indices has {req_pool_indices.shape[0]} entries, seq_lens has {B}")
    for name, t in (("req_pool_indices", req_pool_indices), ("seq_lens", seq_lens)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, req_to_token on {device}")
    if index_topk < 1:
        raise ValueError(f"index_topk must be >= 1, got {index_topk}")
    if num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
    variable = extend_seq_lens is not None
    if variable:
        if mode is not Mode.DRAFT_EXTEND:
            raise ValueError(f"extend_seq_lens is only for draft extend, not {mode.value}")
        if extend_seq_lens.dim() != 1 or extend_seq_lens.shape[0] != B or extend_seq_lens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"extend_seq_lens must be int32/int64 [{B}], got {extend_seq_lens.dtype} {tuple(extend_seq_lens.shape)}")
        if extend_seq_lens.device != device:
            raise ValueError(f"extend_seq_lens is on {extend_seq_lens.device}, req_to_token on {device}")
    expected_rows = B if mode is Mode.DECODE else B * num_draft_tokens
    for i, out in enumerate(outs):
        where = f"out[{i}]" if len(outs) > 1 else "out"
        if out.mode != mode:
            raise ValueError(f"{where} was allocated for {out.mode.value}, called with {mode.value}")
        if out.page_size != page_size:
            raise ValueError(f"{where} was allocated for page_size {out.page_size}, called with {page_size}")
        if out.page_table_1.device != device:
            raise ValueError(f"{where} is on {out.page_table_1.device}, req_to_token on {device}")
        if out.batch != B:
            raise ValueError(f"{where} holds batch {out.batch}, seq_lens has {B} entries")
        if not variable and out.rows != expected_rows:
            raise ValueError(f"{where} has {out.rows} rows, {mode.value} needs {expected_rows}")
        if out.width < W:
            raise ValueError(f"{where}.page_table_1 is {out.width} wide, narrower than req_to_token's W={W}")
        if out.page_table_1.stride(1) != 1 or (out.real_page_table is not None and out.real_page_table.stride(1) != 1):
            raise ValueError(f"{where} page tables must have unit column stride")
        if i and not out.same_layout(outs[0]):
            raise ValueError(f"{where} does not match out[0] (mode, page size, shapes, device)")
    if not check:
        return
    if B and (int(req_pool_indices.min()) < 0 or int(req_pool_indices.max()) >= req_to_token.shape[0]):
        raise ValueError(f"req_pool_indices must lie in [0, {req_to_token.shape[0]})")
    extra = num_draft_tokens if mode is Mode.TARGET_VERIFY else 0
    if B and int(seq_lens.min()) < 0:
        raise ValueError("seq_lens must be >= 0")
    if B and int(seq_lens.max()) + extra > W:
        what = "seq_len + num_draft_tokens" if extra else "seq_len"
        raise ValueError(f"{what} = {int(seq_lens.max()) + extra} exceeds the page-table width W={W}")
    if variable:
        if int(extend_seq_lens.min()) < 0:
            raise ValueError("extend_seq_lens must be >= 0")
        total = int(extend_seq_lens.sum())
        if total != outs[0].rows:
            raise ValueError(f"sum(extend_seq_lens) = {total} but out has {outs[0].rows} rows")


@triton.jit
def extend_prefix(ext_ptr, B, BLOCK_B: tl.constexpr):
    """Variable draft extend: (lane ids, extend lengths, exclusive starts, inclusive ends) over the
    ``B`` requests; lanes past ``B`` have length 0 and an end that no row reaches."""
    offs = tl.arange(0, BLOCK_B)
    ext = tl.load(ext_ptr + offs, mask=offs < B, other=0).to(tl.int32)
    ends = tl.cumsum(ext, axis=0)
    return offs, ext, ends - ext, tl.where(offs < B, ends, 2147483647)


@triton.jit
def write_lengths(seq_lens_ptr, ext_ptr, lengths_ptr, off_cu, off_exp, off_dsa, off_dsacu,
                  B, R, N, K, MODE: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_R: tl.constexpr):
    """Write the five 1-D outputs of one buffer set (see MetadataBuffers) from ``seq_lens``."""
    offs_b = tl.arange(0, BLOCK_B)
    mask_b = offs_b < B
    s = tl.load(seq_lens_ptr + offs_b, mask=mask_b, other=0).to(tl.int32)
    if MODE == MODE_VERIFY:
        s = s + N
    tl.store(lengths_ptr + offs_b, s, mask=mask_b)
    tl.store(lengths_ptr + off_cu + offs_b + 1, tl.cumsum(s, axis=0), mask=mask_b)
    tl.store(lengths_ptr + off_cu, 0)

    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    if MODE == MODE_DECODE:
        expanded = tl.load(seq_lens_ptr + offs_r, mask=mask_r, other=0).to(tl.int32)
    else:
        if MODE == MODE_EXTEND_VARIABLE:
            lanes, ext, starts, ends = extend_prefix(ext_ptr, B, BLOCK_B)
            owner = tl.expand_dims(ends, 0) <= tl.expand_dims(offs_r, 1)  # [BLOCK_R, BLOCK_B]
            b = tl.sum(owner.to(tl.int32), axis=1)
            is_b = tl.expand_dims(lanes, 0) == tl.expand_dims(b, 1)
            first = tl.sum(tl.where(is_b, tl.expand_dims(starts, 0), 0), axis=1)
            count = tl.sum(tl.where(is_b, tl.expand_dims(ext, 0), 0), axis=1)
            local = offs_r - first
        else:
            b = offs_r // N
            count = N
            local = offs_r % N
        # Rows past sum(extend_seq_lens) (a violated precondition) get length 0, no OOB read.
        has_request = mask_r & (b < B)
        s_row = tl.load(seq_lens_ptr + b, mask=has_request, other=0).to(tl.int32)
        if MODE == MODE_VERIFY:
            expanded = s_row + local + 1
        else:
            expanded = tl.maximum(s_row - count + local + 1, 0)
        expanded = tl.where(has_request, expanded, 0)
        tl.store(lengths_ptr + off_exp + offs_r, expanded, mask=mask_r)
    dsa = tl.where(mask_r, tl.minimum(expanded, K), 0)
    tl.store(lengths_ptr + off_dsa + offs_r, dsa, mask=mask_r)
    tl.store(lengths_ptr + off_dsacu + offs_r + 1, tl.cumsum(dsa, axis=0), mask=mask_r)
    tl.store(lengths_ptr + off_dsacu, 0)


@triton.jit
def page_starts(vals, cols, col_mask, PAGE_SIZE: tl.constexpr):
    """Real-table entries of one tile: (``T // P`` values, real columns, mask of page starts)."""
    return vals // PAGE_SIZE, cols // PAGE_SIZE, col_mask & (cols % PAGE_SIZE == 0)


@triton.jit
def store_tile(vals, cols, col_mask, real_vals, real_cols, real_mask, row, pt_ptr, real_ptr,
               stride_pt, stride_real, HAS_REAL: tl.constexpr):
    """Store one loaded ``req_to_token`` tile into ``page_table_1[row]`` and its page starts
    (from :func:`page_starts`) into ``real_page_table[row]``; int64 row offsets."""
    row64 = row.to(tl.int64)
    tl.store(pt_ptr + row64 * stride_pt + cols, vals, mask=col_mask)
    if HAS_REAL:
        tl.store(real_ptr + row64 * stride_real + real_cols, real_vals, mask=real_mask)


def launch_shape(B: int, R: int) -> tuple[int, int]:
    """(BLOCK_B, BLOCK_R): power-of-two vector widths for the 1-D outputs (B + 1, R + 1 entries)."""
    return triton.next_power_of_2(B + 1), triton.next_power_of_2(R + 1)
