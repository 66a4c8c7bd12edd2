"""What the two DSA replay-metadata kernels share: the kernel codes of the forward mode,
the static :class:`MetadataBuffers`, the input checks, and the Triton helpers that write the 1-D
outputs and store page-table tiles. Contract: docs/metadata-kernels.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import triton
import triton.language as tl

from dsaspec.forward_mode import Mode

TILE = 128  # page-table columns per tile
VECTOR = 4  # int32 columns per 16-byte vector access
MAX_CHUNK_R = 128  # metadata rows per lengths program (bounds registers: one per thread at 4 warps)


# Kernel-side mode codes: the kernels' ``MODE`` constexpr takes one of these.
MODE_DECODE = tl.constexpr(0)
MODE_VERIFY = tl.constexpr(1)
MODE_EXTEND_STATIC = tl.constexpr(2)      # draft extend, N rows per request
MODE_EXTEND_VARIABLE = tl.constexpr(3)    # draft extend, extend_seq_lens[b] rows per request
MAX_LOG2_BLOCK_B = tl.constexpr(24)       # binary-search steps the kernels unroll at most (B < 2^24)


def mode_code(mode: Mode, variable_extend: bool) -> int:
    """The kernel code of ``mode`` (draft extend: static or variable form)."""
    mode = Mode(mode)
    if mode is Mode.DECODE:
        return MODE_DECODE.value
    if mode is Mode.TARGET_VERIFY:
        return MODE_VERIFY.value
    return (MODE_EXTEND_VARIABLE if variable_extend else MODE_EXTEND_STATIC).value


def _padded_rows(rows: int, cols: int, row_align: int, device) -> torch.Tensor:
    stride = -(-cols // row_align) * row_align
    return torch.zeros(rows, stride, dtype=torch.int32, device=device)[:, :cols]


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
                 num_draft_tokens: int = 1, rows: int | None = None,
                 row_align: int = 1) -> "MetadataBuffers":
        """Zero-filled buffers for ``batch`` requests of a ``width``-column table.

        ``rows`` defaults to ``batch`` (decode) or ``batch * num_draft_tokens`` (verify, draft
        extend); give it only for the variable draft-extend form (``sum(extend_seq_lens)``).
        ``row_align``: the page tables' row stride is ``width`` (resp. ``cdiv(width, P)``) rounded
        up to a multiple of it (default 1: contiguous). A multiple of 4 makes every row 16-byte
        aligned, so the bounded kernel can use 16-byte vector stores (a tuning knob; consumers
        take the row stride as an argument).
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
        if row_align < 1:
            raise ValueError(f"row_align must be >= 1, got {row_align}")
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
            page_table_1=_padded_rows(rows, width, row_align, device),
            real_page_table=(None if page_size == 1 else
                             _padded_rows(rows, triton.cdiv(width, page_size), row_align, device)),
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
        inside ``lengths`` (cache_seqlens is at 0). An empty output (0 rows) gets offset 0: no
        element of it is ever addressed, and torch reports 0 as the data pointer of an empty view."""
        base = self.lengths.data_ptr()
        return tuple((t.data_ptr() - base) // 4 if t.numel() else 0 for t in
                     (self.cu_seqlens_k, self.seqlens_expanded, self.dsa_cache_seqlens, self.dsa_cu_seqlens_k))

    def same_layout(self, other: "MetadataBuffers") -> bool:
        """True when ``other`` has the same mode, page size, and buffers of the same shapes, strides,
        dtypes, device and 1-D output offsets (one kernel launch can write both)."""
        if (self.real_page_table is None) != (other.real_page_table is None):
            return False
        return (self.mode == other.mode and self.page_size == other.page_size
                and self.length_offsets() == other.length_offsets()
                and all(_layout(a) == _layout(b) for a, b in zip(self.tensors(), other.tensors())))


def _layout(t: torch.Tensor) -> tuple:
    """What addressing a tensor depends on: shape, dtype, device and the strides of its dimensions
    longer than 1 (a 0- or 1-long dimension's stride is never used, and torch leaves it arbitrary)."""
    return t.shape, t.dtype, t.device, tuple(st for st, n in zip(t.stride(), t.shape) if n > 1)


def validate_inputs(mode: Mode, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                    seq_lens: torch.Tensor, outs: Sequence[MetadataBuffers], *, index_topk: int,
                    page_size: int, num_draft_tokens: int, extend_seq_lens: torch.Tensor | None,
                    check_values: bool) -> None:
    """Shape/dtype/device/stride checks (always; no host sync) and, when ``check_values``, the value
    checks that read device data: pool indices in ``[0, pool)``, ``0 <= seq_len (+N) <= W``,
    ``extend_seq_lens >= 0`` and ``sum(extend_seq_lens) == rows``."""
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
        if B > 1 and t.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous, got stride {t.stride(0)}")
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
        if B > 1 and extend_seq_lens.stride(0) != 1:
            raise ValueError(f"extend_seq_lens must be contiguous, got stride {extend_seq_lens.stride(0)}")
    expected_rows = B if mode is Mode.DECODE else B * num_draft_tokens
    for i, out in enumerate(outs):
        where = f"out[{i}]" if len(outs) > 1 else "out"
        if out.mode != mode:
            raise ValueError(f"{where} was allocated for {out.mode.value}, called with {mode.value}")
        if out.page_size != page_size:
            raise ValueError(f"{where} was allocated for page_size {out.page_size}, called with {page_size}")
        if any(t.dtype != torch.int32 for t in out.tensors()):
            raise ValueError(f"{where} buffers must be int32, got {[t.dtype for t in out.tensors()]}")
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
            raise ValueError(f"{where} does not match out[0] (mode, page size, shapes, strides, device)")
    if not check_values:
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
        if B and int(extend_seq_lens.min()) < 0:
            raise ValueError("extend_seq_lens must be >= 0")
        total = int(extend_seq_lens.sum())
        if total != outs[0].rows:
            raise ValueError(f"sum(extend_seq_lens) = {total} but out has {outs[0].rows} rows")


def vector_width(*rows: torch.Tensor) -> int:
    """4 (:data:`VECTOR`) when every row of every given 2-D tensor starts 16-byte aligned, else 1:
    the column alignment the kernels may promise Triton for 16-byte vector accesses."""
    aligned = all(t.data_ptr() % 16 == 0 and (t.shape[0] <= 1 or t.stride(0) % VECTOR == 0) for t in rows)
    return VECTOR if aligned else 1


@triton.jit
def load_extend(ext_ptr, lanes, n):
    """Extend lengths of requests ``lanes < n`` (0 elsewhere); negative lengths count as 0."""
    return tl.maximum(tl.load(ext_ptr + lanes, mask=lanes < n, other=0).to(tl.int32), 0)


@triton.jit
def extend_prefix(ext_ptr, B, BLOCK_B: tl.constexpr):
    """Variable draft extend: (extend lengths, exclusive starts, inclusive ends) over lanes
    ``0..BLOCK_B-1``; lanes past ``B`` have length 0 and an end that no row reaches."""
    lanes = tl.arange(0, BLOCK_B)
    ext = load_extend(ext_ptr, lanes, B)
    ends = tl.cumsum(ext, axis=0)
    return ext, ends - ext, tl.where(lanes < B, ends, 2147483647)


@triton.jit
def extend_owner(ends, rows, BLOCK_B: tl.constexpr):
    """Variable draft extend: the request owning each metadata row in ``rows``, from
    :func:`extend_prefix`'s inclusive ``ends``: ``#{b : ends[b] <= row}`` (rows at or past
    ``sum(ext)`` get ``B``). A branch-free binary search, ``log2(BLOCK_B) + 1`` gathers per row:
    O(rows * log B) work, no ``[rows x B]`` tile."""
    owner = tl.zeros_like(rows)
    # Binary lifting with steps BLOCK_B/2, ..., 1 (ends are non-decreasing) finds the answer up
    # to BLOCK_B - 1; one last probe adds the lane BLOCK_B - 1 itself.
    for i in tl.static_range(MAX_LOG2_BLOCK_B):
        if (BLOCK_B >> (i + 1)) > 0:
            probe = tl.gather(ends, owner + ((BLOCK_B >> (i + 1)) - 1), 0)
            owner = tl.where(probe <= rows, owner + (BLOCK_B >> (i + 1)), owner)
    return owner + (tl.gather(ends, owner, 0) <= rows).to(tl.int32)


@triton.jit
def request_rows(ext_ptr, b, R, N, MODE: tl.constexpr, BLOCK_B: tl.constexpr):
    """(first metadata row, row count) of request ``b``: decode ``(b, 1)``; target verify and the
    static draft extend ``(b * N, N)``; the variable draft extend ``(sum(ext[:b]), ext[b])`` with
    negative lengths counted as 0 and rows past ``R`` (``sum(ext) > R``, a violated precondition)
    dropped."""
    if MODE == MODE_DECODE:
        first = b
        count = 1
    elif MODE == MODE_EXTEND_VARIABLE:
        first = tl.sum(load_extend(ext_ptr, tl.arange(0, BLOCK_B), b), axis=0)
        count = tl.minimum(tl.maximum(tl.load(ext_ptr + b).to(tl.int32), 0), tl.maximum(R - first, 0))
    else:
        first = b * N
        count = N
    return first, count


@triton.jit
def clamped_sum(a, m, K, LOWER: tl.constexpr):
    """``sum_{j < m} min(a + j, K)``, or with ``LOWER`` ``sum_{j < m} min(max(a + j, 0), K)``, in
    closed form with int32 wrap-around (the same bits as a running int32 sum); ``m >= 0``."""
    above = tl.minimum(tl.maximum(a + m - 1 - K, 0), m)   # terms clamped to K
    if LOWER:
        below = tl.minimum(tl.maximum(-a, 0), m)          # terms clamped to 0
    else:
        below = tl.zeros_like(a)
    mid = m - below - above
    triangle = tl.where(mid % 2 == 0, (mid // 2) * (mid - 1), mid * ((mid - 1) // 2))  # mid(mid-1)/2
    return mid * (a + below) + triangle + above * K


@triton.jit
def store_all(offs, vals, mask, dst0, dst1, dst2, dst3, NUM_DEST: tl.constexpr):
    """Store ``vals`` at ``offs`` into the same buffer (``lengths`` or a real page table) of every
    destination set."""
    tl.store(dst0 + offs, vals, mask=mask)
    if NUM_DEST > 1:
        tl.store(dst1 + offs, vals, mask=mask)
    if NUM_DEST > 2:
        tl.store(dst2 + offs, vals, mask=mask)
    if NUM_DEST > 3:
        tl.store(dst3 + offs, vals, mask=mask)


@triton.jit
def write_lengths(chunk, seq_lens_ptr, ext_ptr, len0, len1, len2, len3, off_cu, off_exp, off_dsa, off_dsacu,
                  B, R, N, K, MODE: tl.constexpr, NUM_DEST: tl.constexpr, BLOCK_B: tl.constexpr,
                  CHUNK_R: tl.constexpr):
    """One "lengths program": the 1-D outputs (see MetadataBuffers) of rows
    ``[chunk * CHUNK_R, +CHUNK_R) ∩ [0, R]``, and for chunk 0 the per-request outputs, stored into
    the ``lengths`` buffer of each of the ``NUM_DEST`` destinations (same offsets).

    Row ``r`` of request ``b`` (local index ``j``, ``m_b`` rows) has ``expanded = a_b + j`` (draft
    extend: ``max(a_b + j, 0)``) with ``a_b = s + 1`` (verify), ``s - m_b + 1`` (draft extend),
    ``s`` (decode). Its ``dsa_cu_seqlens_k`` entry is the sum over earlier requests of their row
    totals (an exclusive prefix over the ``BLOCK_B`` request lanes) plus the closed-form sum of its
    own first ``j`` rows, so chunks need no running sum and run as parallel programs.
    """
    lanes = tl.arange(0, BLOCK_B)
    s = tl.load(seq_lens_ptr + lanes, mask=lanes < B, other=0).to(tl.int32)
    if chunk == 0:
        live = s
        if MODE == MODE_VERIFY:
            live = s + N
        store_all(lanes, live, lanes < B, len0, len1, len2, len3, NUM_DEST)
        store_all(off_cu + 1 + lanes, tl.cumsum(live, axis=0), lanes < B, len0, len1, len2, len3, NUM_DEST)
        store_all(off_cu, 0, None, len0, len1, len2, len3, NUM_DEST)
    # Per request: rows m, offset a, total of its rows' dsa lengths, exclusive prefix of totals.
    if MODE == MODE_EXTEND_VARIABLE:
        m, starts, ends = extend_prefix(ext_ptr, B, BLOCK_B)
    elif MODE == MODE_DECODE:
        m = tl.where(lanes < B, 1, 0)
    else:
        m = tl.where(lanes < B, N, 0)
    if MODE == MODE_VERIFY:
        a = s + 1
    elif MODE == MODE_DECODE:
        a = s
    else:
        a = s - m + 1
    lower: tl.constexpr = MODE == MODE_EXTEND_STATIC or MODE == MODE_EXTEND_VARIABLE
    totals = clamped_sum(a, m, K, lower)
    before = tl.cumsum(totals, axis=0) - totals
    total = tl.sum(totals, axis=0)

    rows = chunk * CHUNK_R + tl.arange(0, CHUNK_R)
    if MODE == MODE_DECODE:
        b = tl.minimum(rows, B)
    elif MODE == MODE_EXTEND_VARIABLE:
        b = extend_owner(ends, rows, BLOCK_B)
    else:
        b = tl.minimum(rows // N, B)
    # Rows past sum(extend_seq_lens) (a violated precondition) and row R get no request.
    has_request = (rows < R) & (b < B)
    lane = tl.minimum(b, BLOCK_B - 1)
    a_row = tl.gather(a, lane, 0)
    if MODE == MODE_DECODE:
        j = tl.zeros_like(rows)
    elif MODE == MODE_EXTEND_VARIABLE:
        j = rows - tl.gather(starts, lane, 0)
    else:
        j = rows % N
    expanded = a_row + j
    if lower:
        expanded = tl.maximum(expanded, 0)
    expanded = tl.where(has_request, expanded, 0)
    if MODE != MODE_DECODE:  # decode: seqlens_expanded is the cache_seqlens view
        store_all(off_exp + rows, expanded, rows < R, len0, len1, len2, len3, NUM_DEST)
    store_all(off_dsa + rows, tl.minimum(expanded, K), rows < R, len0, len1, len2, len3, NUM_DEST)
    cu = tl.where(b < B, tl.gather(before, lane, 0) + clamped_sum(a_row, j, K, lower), total)
    store_all(off_dsacu + rows, cu, rows <= R, len0, len1, len2, len3, NUM_DEST)


def launch_shape(B: int, R: int) -> tuple[int, int, int]:
    """(BLOCK_B, CHUNK_R, lengths programs) of :func:`write_lengths`: the per-request vector width
    (B rounded up to a power of two), the row chunk (``R + 1`` rounded up to a power of two, at
    most :data:`MAX_CHUNK_R`) and the number of chunks covering rows ``0..R``."""
    chunk = min(triton.next_power_of_2(R + 1), MAX_CHUNK_R)
    return triton.next_power_of_2(B), chunk, triton.cdiv(R + 1, chunk)
