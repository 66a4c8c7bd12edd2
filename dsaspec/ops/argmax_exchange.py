"""Vocab-shard argmax and top-k partials and their finalizes (docs/argmax-exchange.md).

``argmax_partials`` runs straight after the local LM-head GEMM: a split reduction over this rank's
valid shard columns (padding excluded by width, never by value) that writes one candidate per
(row, split) as 4 exact fp32 lanes ``(key >> 16, key & 0xFFFF, index >> 16, index & 0xFFFF)`` into
this rank's slots of the ``[rows, TP * splits, 4]`` exchange buffer and +0.0 into every other slot,
in one launch. One fp32 SUM all-reduce of the buffer then gives every rank every candidate exactly
(each lane has a single non-zero contributor, an integer <= 65535). ``draft_finalize`` (one warp per
row) picks the largest key, lowest global index on ties, and writes the greedy token (draft
bookkeeping optional): greedy drafts and target verify.

``topk_partials`` writes, per (row, split), the split's ``k <= 8`` best candidates in the same lanes and
one fp32 lane with the split's sum of ``exp(x - max)``; ``topk_finalize`` merges every rank's candidates
into the exact top-k of the gathered logits (largest first, lowest index among equal values) and their
softmax probabilities (within ``TOPK_P_REL_ERROR`` of the exact softmax), without the gather.

Everything that orders works on the logits' bits: the key is derived from integer operations only, so
the tokens cannot depend on flush-to-zero, fast-math or the interpreter's float handling. The pure
PyTorch definition is ``dsaspec.reference.argmax_exchange``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

LANES = 4
DEFAULT_SPLIT_COLUMNS = 4096
TOPK_MAX = 8
TOPK_SPLIT_COLUMNS = 8192
# Documented accuracy of topk_finalize's probabilities against torch.softmax of the gathered fp32 logits:
# |p - p_ref| <= TOPK_P_REL_ERROR * p_ref + TOPK_P_ABS_ERROR (the absolute term covers subnormal results).
TOPK_P_REL_ERROR = 2.0**-18
TOPK_P_ABS_ERROR = 2.0**-126
# argmax_partials: columns per loop step of a 4-warp program. 1024 on 4 warps beat 2048 on 8 by
# 0.87x at 64-256 verify rows of a TP 2 shard (benchmarks/results/h200/logs/sweep_argmax_partials.json).
_ARGMAX_BLOCK = 1024
_INT32_MIN = tl.constexpr(-(2**31))
_INT32_MAX = tl.constexpr(2**31 - 1)
_INT64_MIN = tl.constexpr(-(2**63))
_INT64_MAX = tl.constexpr(2**63 - 1)
_KEY_NEG_INF = tl.constexpr(-2139095041)  # signed order keys of -inf and +inf
_KEY_POS_INF = tl.constexpr(2139095040)
# exp(d) = 2**n * exp(r), r = d - n * ln2 (Cody-Waite): LN2_HI has 15 significant bits, so n * LN2_HI is
# exact for |n| < 2**9 and d - n * LN2_HI is exact (Sterbenz).
_LOG2E = tl.constexpr(1.4426950408889634)
_LN2_HI = tl.constexpr(0.693145751953125)
_LN2_LO = tl.constexpr(1.4286068202862268e-06)


def topk_slot_lanes(k: int) -> int:
    """fp32 lanes of one top-k slot: ``k`` candidates of 4 exact lanes, then the split's sum of exponentials."""
    return LANES * k + 1


def exchange_layout(shard_size: int, split_columns: int = DEFAULT_SPLIT_COLUMNS) -> tuple[int, int]:
    """Splits per rank and columns per split for a shard of ``shard_size`` columns.

    ``split_width = ceil(ceil(Sh / ceil(Sh / split_columns)) / 64) * 64`` and
    ``splits = ceil(Sh / split_width)``: each program reduces about ``split_columns`` columns. Depends
    only on TP-replicated sizes, so every rank gets the same layout.

    Returns
    -------
    (splits, split_width) : tuple of int.
    """
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    if split_columns < 1:
        raise ValueError(f"split_columns must be >= 1, got {split_columns}")
    splits = triton.cdiv(shard_size, split_columns)
    split_width = triton.cdiv(triton.cdiv(shard_size, splits), 64) * 64
    return triton.cdiv(shard_size, split_width), split_width


def _check_partials(local_logits, out, *, rank, tp_size, vocab_size, split_columns, slot_lanes):
    """Host-side checks shared by the partials ops; returns (rows, Sh, splits, split_width)."""
    if local_logits.dim() != 2 or local_logits.shape[1] < 1:
        raise ValueError(f"local_logits must be [rows, Sh] with Sh >= 1, got {tuple(local_logits.shape)}")
    rows, shard = local_logits.shape
    splits, split_width = exchange_layout(shard, split_columns)
    if local_logits.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"local_logits must be bf16 or fp32, got {local_logits.dtype}")
    if local_logits.stride(1) != 1:
        raise ValueError(f"local_logits must have unit column stride, got strides {local_logits.stride()}")
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank must be in [0, tp_size={tp_size}), got {rank}")
    if not 1 <= vocab_size <= tp_size * shard:
        raise ValueError(f"vocab_size must be in [1, tp_size * Sh = {tp_size * shard}], got {vocab_size}")
    expected = (rows, tp_size * splits, slot_lanes)
    if tuple(out.shape) != expected or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous fp32 tensor of shape {expected}, got "
                         f"{tuple(out.shape)} {out.dtype} contiguous={out.is_contiguous()}")
    if out.device != local_logits.device:
        raise ValueError(f"out must be on local_logits' device {local_logits.device}, got {out.device}")
    return rows, shard, splits, split_width


@triton.jit
def _widened_bits(raw, IS_BF16: tl.constexpr):
    """fp32 bits (int32) of loaded logits bits: bf16 (int16) is widened exactly by ``bits << 16``."""
    if IS_BF16:
        bits = (raw.to(tl.int32) & 0xFFFF) << 16
    else:
        bits = raw
    return bits


@triton.jit
def _values(row_ptr, cols, hi, IS_BF16: tl.constexpr, MASKED: tl.constexpr):
    """fp32 values of the logits bits at ``cols`` (exactly widened); with ``MASKED``, ``-inf`` at
    ``cols >= hi`` (set after the load: Triton 3.6 fills masked bf16 lanes of a vector load from a
    negative constant sign-extended to 32 bits, which turns every second lane into a NaN)."""
    if MASKED:
        bits = _widened_bits(tl.load(row_ptr + cols, mask=cols < hi, other=0), IS_BF16)
        return tl.where(cols < hi, bits.to(tl.float32, bitcast=True), float("-inf"))
    else:
        return _widened_bits(tl.load(row_ptr + cols), IS_BF16).to(tl.float32, bitcast=True)


@triton.jit
def _signed_order_key(bits):
    """Signed form (``key ^ 0x80000000``, int32) of the uint32 order key of fp32 bits: monotone in the
    value, -0 == +0, every NaN on top (0x7FFFFFFF)."""
    magnitude = bits & 0x7FFFFFFF
    bits = tl.where(magnitude == 0, 0, bits)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return tl.where(magnitude > 0x7F800000, 0x7FFFFFFF, key)


@triton.jit
def _signed_key_value(key):
    """The fp32 value of a signed order key (the inverse of ``_signed_order_key``; NaN key → NaN)."""
    return (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _rank_pair(key, position):
    """int64 ordering (signed order key, then lower position first): ``key * 2**32 + (2**31 - 1 - position)``
    for int32 ``key`` and ``0 <= position < 2**31`` (``2**31 - 1 - position == position ^ (2**31 - 1)``);
    always above INT64_MIN. ``position = (pair & (2**31 - 1)) ^ (2**31 - 1)``."""
    return (key.to(tl.int64) << 32) | (position ^ _INT32_MAX).to(tl.int64)


@triton.jit
def _finite_key(key):
    """Whether a signed order key is a finite value (not ±inf, NaN or the INT32_MIN sentinel)."""
    return (key > _KEY_NEG_INF) & (key < _KEY_POS_INF)


@triton.jit
def _exp_nonpositive(d):
    """``exp(d)`` for fp32 ``d <= 0`` (``-inf`` → 0) within about 2 ulp, independent of ``|d|``: Cody-Waite
    reduction to ``|r| <= ln2 / 2``, a degree-7 Taylor polynomial, then ``2**n`` in two exact power-of-two
    scalings (a subnormal result is rounded once). Plain integer and fp32 operations only, so the GPU and the
    interpreter agree (``tl.exp`` is ``ex2.approx`` of ``d * log2(e)`` on the GPU: relative error ``|d| * 2**-24``)."""
    dd = tl.maximum(d, -104.0)  # exp(-104) < 2**-150: rounds to 0 below
    n = tl.floor(dd * _LOG2E + 0.5)
    r = (dd - n * _LN2_HI) - n * _LN2_LO
    poly = 1.0 + r * (1.0 + r * (0.5 + r * (1.0 / 6 + r * (1.0 / 24 + r * (1.0 / 120 + r * (1.0 / 720 + r / 5040))))))
    ni = n.to(tl.int32)
    n1 = tl.maximum(ni, -125)  # poly * 2**n1 stays normal: exact
    scale1 = ((n1 + 127) << 23).to(tl.float32, bitcast=True)
    scale2 = ((ni - n1 + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(d < -104.0, 0.0, (poly * scale1) * scale2)


@triton.jit
def _exp_difference(a, b):
    """``exp(a - b)`` for fp32 ``a <= b``, ``b`` finite (``a = -inf`` → 0), within about 3 ulp of the exact
    value: ``a - b`` is split into its rounded value ``hi`` and rounding error ``lo`` (TwoSum, additions
    only), ``exp(a - b) = exp(hi) * (1 + lo)`` (``|lo| <= 2**-18``: the neglected ``lo**2 / 2`` is below
    2**-37). Without the split, the rounding of ``a - b`` alone costs a relative ``|a - b| * 2**-24``."""
    hi = a - b
    keep = hi > -104.0  # below, exp is 0 (also for a = -inf and an a - b that overflows)
    a_kept = tl.where(keep, a, b)
    hi_kept = tl.where(keep, hi, 0.0)
    b_virtual = hi_kept - a_kept
    lo = (a_kept - (hi_kept - b_virtual)) + (-b - b_virtual)
    e = _exp_nonpositive(hi)
    return e + e * lo


@triton.jit
def _scan_step(value, start, best, best_start, nan_probe):
    """One block of the lane scan: each lane keeps the larger of its best and ``value`` (strict
    ``>``: the earlier column wins ties; NaN never wins here), the block ``start`` it came from,
    and a NaN-propagating max of everything seen."""
    take = value > best
    return (tl.where(take, value, best), tl.where(take, start, best_start),
            tl.maximum(nan_probe, value, propagate_nan=tl.PropagateNan.ALL))


@triton.jit
def _argmax_partials_kernel(
    logits_bits_ptr,  # [rows, Sh] int16 (bf16 bits) or int32 (fp32 bits)
    out_ptr,  # [rows, TP * splits, 4] fp32
    logits_row_stride,
    out_row_stride,
    n_valid,  # valid columns of this shard
    split_width,
    shard_start,  # global index of local column 0
    rank,
    tp_size,
    splits,
    IS_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
    TP_P2: tl.constexpr,
):
    """Program (row, split): the split's candidate, the first column of its largest order key.
    The scan compares the exactly widened fp32 values (no flush to zero in comparisons) per lane, keeping the
    first of equal values, so ±0 tie as the key merges them; NaN never compares greater, so a
    NaN-propagating max watches for NaNs, and only a split that holds one is scanned again for its
    first NaN (NaN is the largest key). The lanes' winners are then ranked by order key."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    lo = split * split_width
    hi = tl.minimum(lo + split_width, n_valid)
    row_ptr = logits_bits_ptr + row.to(tl.int64) * logits_row_stride
    offs = tl.arange(0, BLOCK)
    # each lane starts from its first column (-inf where the split has none), so that a lane of
    # -inf values keeps its first -inf column
    best = _values(row_ptr, lo + offs, hi, IS_BF16, True)
    best_start = tl.full([BLOCK], 0, tl.int32) + lo  # a lane's best column is best_start + its offset
    nan_probe = best
    # whole blocks unmasked, then the partial last block (at most one) masked
    full_hi = lo + (hi - lo) // BLOCK * BLOCK
    for start in range(lo + BLOCK, full_hi, BLOCK):
        best, best_start, nan_probe = _scan_step(_values(row_ptr, start + offs, hi, IS_BF16, False),
                                                 start, best, best_start, nan_probe)
    for start in range(tl.maximum(full_hi, lo + BLOCK), hi, BLOCK):
        best, best_start, nan_probe = _scan_step(_values(row_ptr, start + offs, hi, IS_BF16, True),
                                                 start, best, best_start, nan_probe)
    best_col = best_start + offs
    if tl.max((nan_probe != nan_probe).to(tl.int32), axis=0) > 0:
        first_nan = tl.full([BLOCK], 2147483647, tl.int32)
        for start in range(lo, hi, BLOCK):
            cols = start + offs
            value = _values(row_ptr, cols, hi, IS_BF16, True)
            first_nan = tl.minimum(first_nan, tl.where(value != value, cols, 2147483647))
        top = _INT32_MAX
        col = tl.min(first_nan, axis=0)
    else:
        best_key = tl.where(best_col < hi, _signed_order_key(best.to(tl.int32, bitcast=True)), _INT32_MIN)
        top = tl.max(best_key, axis=0)
        col = tl.min(tl.where(best_key == top, best_col, 2147483647), axis=0)
    index = shard_start + col
    # Real keys are > INT32_MIN (KEY(-inf) signed is 0x807FFFFF); an empty split keeps the sentinel.
    found = top > _INT32_MIN
    lane = tl.arange(0, 4)
    key_hi = ((top >> 16) & 0xFFFF) ^ 0x8000
    key_lo = top & 0xFFFF
    value = tl.where(lane == 0, key_hi, tl.where(lane == 1, key_lo, tl.where(lane == 2, index >> 16, index & 0xFFFF)))
    value = tl.where(found, value, 0).to(tl.float32)
    ranks = tl.arange(0, TP_P2)
    slot = ranks * splits + split
    ptrs = out_ptr + row.to(tl.int64) * out_row_stride + slot[:, None] * 4 + lane[None, :]
    own = (ranks == rank)[:, None]
    tl.store(ptrs, tl.where(own, value[None, :], 0.0), mask=(ranks < tp_size)[:, None])


def argmax_partials(
    local_logits: torch.Tensor,
    out: torch.Tensor,
    *,
    rank: int,
    tp_size: int,
    vocab_size: int,
    split_columns: int = DEFAULT_SPLIT_COLUMNS,
) -> torch.Tensor:
    """Write this rank's argmax candidates into its slots of the exchange buffer, +0.0 elsewhere.

    Rank ``r`` owns global vocab columns ``[r * Sh, r * Sh + n_valid)``,
    ``n_valid = clamp(vocab_size - r * Sh, 0, Sh)``; per (row, split) the candidate is
    (max order key, first column attaining it) as lanes ``(key >> 16, key & 0xFFFF, idx >> 16,
    idx & 0xFFFF)`` with ``idx`` the global index; a split without valid columns writes zeros.

    Parameters
    ----------
    local_logits : Tensor ``[rows, Sh]``, bf16 or fp32, unit column stride; this rank's local logits.
    out : Tensor ``[rows, tp_size * splits, 4]`` fp32, contiguous; written entirely (every slot).
    rank, tp_size, vocab_size : int; ``tp_size * Sh >= vocab_size >= 1``.
    split_columns : int; target columns per program (see ``exchange_layout``).

    Arguments are validated on the host (shapes, dtypes, strides, devices; no device sync), on every
    call: inside a captured CUDA graph that happens once, at capture.

    Returns
    -------
    ``out``.
    """
    rows, shard, splits, split_width = _check_partials(local_logits, out, rank=rank, tp_size=tp_size,
                                                       vocab_size=vocab_size, split_columns=split_columns,
                                                       slot_lanes=LANES)
    if rows == 0:
        return out
    is_bf16 = local_logits.dtype == torch.bfloat16
    bits = local_logits.view(torch.int16 if is_bf16 else torch.int32)
    n_valid = max(0, min(vocab_size - rank * shard, shard))
    _argmax_partials_kernel[(rows, splits)](
        bits, out, bits.stride(0), out.stride(0), n_valid, split_width, rank * shard, rank, tp_size, splits,
        IS_BF16=is_bf16, BLOCK=min(_ARGMAX_BLOCK, triton.next_power_of_2(split_width)),
        TP_P2=triton.next_power_of_2(tp_size), num_warps=4,
    )
    return out


class CarryWrite(NamedTuple):
    """The rows' carry update ``draft_finalize`` can fuse (plain decoding's step): for row ``i`` of
    table row ``r = table_rows[i]``: ``carry_lens[r] = lens[i]``, ``carry_tokens[r] = tokens[i]``; the
    dummy row ``dummy_row`` (which every padded row names) is set to ``(pad_len, 0)`` whether or not a
    row names it. int64 tensors: ``table_rows`` / ``lens`` ``[rows]`` contiguous, ``carry_lens`` /
    ``carry_tokens`` ``[table rows]`` contiguous (written)."""

    table_rows: torch.Tensor
    lens: torch.Tensor
    carry_lens: torch.Tensor
    carry_tokens: torch.Tensor
    dummy_row: int
    pad_len: int


@triton.jit
def _draft_finalize_kernel(
    reduced_ptr,  # [rows, slots, 4] fp32, or unused
    argmax_ptr,  # [rows] int64 tokens, or unused
    positions_ptr,
    token_map_ptr,
    tokens_ptr,
    topk_p_ptr,
    positions_out_ptr,
    table_rows_ptr,  # [rows] int64, or unused
    lens_ptr,  # [rows] int64, or unused
    carry_lens_ptr,  # [table rows] int64, or unused
    carry_tokens_ptr,  # [table rows] int64, or unused
    reduced_row_stride,
    slots,
    dummy_row,
    pad_len,
    FROM_PARTIALS: tl.constexpr,
    HAS_MAP: tl.constexpr,
    HAS_TOPK_P: tl.constexpr,
    HAS_POSITIONS: tl.constexpr,
    HAS_CARRY: tl.constexpr,
    SLOTS_P2: tl.constexpr,
):
    row = tl.program_id(0)
    if FROM_PARTIALS:
        slot = tl.arange(0, SLOTS_P2)
        mask = slot < slots
        base = reduced_ptr + row.to(tl.int64) * reduced_row_stride + slot * 4
        # Lanes are exact integers; -0.0 (a sign-rewriting transport) converts to 0.
        key_hi = tl.load(base + 0, mask=mask, other=0.0).to(tl.int64)
        key_lo = tl.load(base + 1, mask=mask, other=0.0).to(tl.int64)
        idx_hi = tl.load(base + 2, mask=mask, other=0.0).to(tl.int64)
        idx_lo = tl.load(base + 3, mask=mask, other=0.0).to(tl.int64)
        key = tl.where(key_hi > 0, key_hi * 65536 + key_lo, -1)  # lane 0 == 0: empty slot
        index = idx_hi * 65536 + idx_lo
        top = tl.max(key, axis=0)
        token = tl.min(tl.where(key == top, index, 9223372036854775807), axis=0)
    else:
        token = tl.load(argmax_ptr + row).to(tl.int64)
    if HAS_MAP:
        token = tl.load(token_map_ptr + token).to(tl.int64)
    tl.store(tokens_ptr + row, token.to(tokens_ptr.dtype.element_ty))
    if HAS_TOPK_P:
        tl.store(topk_p_ptr + row, 1.0)
    if HAS_POSITIONS:
        tl.store(positions_out_ptr + row, tl.load(positions_ptr + row) + 1)
    if HAS_CARRY:
        # Padded rows all name the dummy row: each writes its reset values, so their order is moot;
        # program 0 resets it even when no row names it.
        table_row = tl.load(table_rows_ptr + row)
        is_dummy = table_row == dummy_row
        reset_len = tl.zeros([], tl.int64) + pad_len  # pad_len may arrive as a constexpr (0 or 1)
        no_token = tl.zeros([], tl.int64)
        tl.store(carry_lens_ptr + table_row, tl.where(is_dummy, reset_len, tl.load(lens_ptr + row).to(tl.int64)))
        tl.store(carry_tokens_ptr + table_row, tl.where(is_dummy, no_token, token.to(tl.int64)))
        if row == 0:
            tl.store(carry_lens_ptr + dummy_row, reset_len)
            tl.store(carry_tokens_ptr + dummy_row, no_token)


def draft_finalize(
    *,
    tokens: torch.Tensor,
    topk_p: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    positions_out: torch.Tensor | None = None,
    reduced: torch.Tensor | None = None,
    argmax_tokens: torch.Tensor | None = None,
    token_map: torch.Tensor | None = None,
    carry: CarryWrite | None = None,
) -> torch.Tensor:
    """Greedy tokens and the greedy (topk = 1) draft bookkeeping: token, ``topk_p = 1.0``, ``positions + 1``;
    one warp per row. Target verify uses it for the token alone (no ``topk_p``, no positions), plain
    decoding for the token and its ``carry`` write-back.

    With ``reduced`` (the all-reduced exchange buffer): ``token = index of max key, lowest global
    index on ties``, i.e. ``torch.argmax`` of the gathered fp32 logits. With ``argmax_tokens`` (the
    gather path): ``token = argmax_tokens``. Then ``token = token_map[token]`` if a map is given.

    ``topk_p = 1.0`` is exact for a topk = 1 chain: each step has a single candidate, every
    candidate is kept, so the score never selects or orders anything; the gathered path stores the
    same constant, hence bit-identical.

    Parameters
    ----------
    tokens : Tensor ``[rows]`` int32/int64, written.
    topk_p : optional Tensor ``[rows]`` fp32, written (1.0).
    positions : optional Tensor ``[rows]`` int32/int64; with ``positions_out``, or neither.
    positions_out : optional Tensor ``[rows]``, dtype of ``positions``, written ``positions + 1``
        (may be ``positions``).
    reduced : Tensor ``[rows, slots, 4]`` fp32, unit lane stride, slot stride 4; exactly one of
        ``reduced`` / ``argmax_tokens``.
    argmax_tokens : Tensor ``[rows]`` int64 (e.g. ``torch.argmax`` output; may be ``tokens``).
    token_map : optional Tensor ``[map_size]`` int32/int64, contiguous.
    carry : optional CarryWrite; the (mapped) tokens and ``carry.lens`` written to the rows' carry.

    Arguments are validated on the host (shapes, dtypes, strides, devices; no device sync), on every
    call: inside a captured CUDA graph that happens once, at capture.

    Preconditions not checked (they are device data): every token, before mapping, indexes
    ``token_map``: ``0 <= token < map_size``. The kernel's ``token_map[token]`` load is unmasked. It
    holds when ``map_size >= vocab_size`` and ``reduced`` comes from ``argmax_partials`` with that
    ``vocab_size``, or ``argmax_tokens`` is an argmax over ``vocab_size`` columns
    (``LogitsProcessor.forward`` checks the map's size). With ``carry``: every ``table_rows`` entry
    indexes the carry, and no entry but ``dummy_row`` repeats (the workers' ``check_rows`` on the host).

    Returns
    -------
    ``tokens``.
    """
    if (reduced is None) == (argmax_tokens is None):
        raise ValueError("pass exactly one of reduced= (exchange path) and argmax_tokens= (gather path)")
    has_positions = positions is not None
    if has_positions != (positions_out is not None):
        raise ValueError("pass both positions= and positions_out=, or neither")
    rows = tokens.shape[0] if tokens.dim() == 1 else -1
    checked = [("tokens", tokens, (torch.int32, torch.int64))]
    if topk_p is not None:
        checked.append(("topk_p", topk_p, (torch.float32,)))
    if has_positions:
        checked += [("positions", positions, (torch.int32, torch.int64)),
                    ("positions_out", positions_out, (positions.dtype,))]
    if argmax_tokens is not None:
        checked.append(("argmax_tokens", argmax_tokens, (torch.int64,)))
    for name, t, dtypes in checked:
        if t.dim() != 1 or t.shape[0] != rows or t.dtype not in dtypes or t.stride(0) != 1:
            raise ValueError(f"{name} must be a contiguous 1-D tensor with one entry per row of tokens, of "
                             f"dtype in {dtypes}, got {tuple(t.shape)} {t.dtype} strides {t.stride()}")
    if reduced is not None and (reduced.dim() != 3 or reduced.shape[0] != rows or reduced.shape[2] != LANES
                                or reduced.dtype != torch.float32 or reduced.stride(2) != 1
                                or reduced.stride(1) != LANES):
        raise ValueError(f"reduced must be fp32 [{rows}, slots, 4] with dense slots, got "
                         f"{tuple(reduced.shape)} {reduced.dtype} strides {reduced.stride()}")
    if token_map is not None and (token_map.dim() != 1 or token_map.dtype not in (torch.int32, torch.int64)
                                  or token_map.stride(0) != 1):
        raise ValueError(f"token_map must be a contiguous 1-D int32/int64 tensor, got {tuple(token_map.shape)} "
                         f"{token_map.dtype} strides {token_map.stride()}")
    if carry is not None:
        _check_carry(carry, rows)
    others = {"topk_p": topk_p, "positions": positions, "positions_out": positions_out, "reduced": reduced,
              "argmax_tokens": argmax_tokens, "token_map": token_map}
    if carry is not None:
        others.update({f"carry.{name}": getattr(carry, name) for name in ("table_rows", "lens", "carry_lens",
                                                                           "carry_tokens")})
    for name, t in others.items():
        if t is not None and t.device != tokens.device:
            raise ValueError(f"{name} must be on tokens' device {tokens.device}, got {t.device}")
    if rows == 0:
        return tokens
    slots = reduced.shape[1] if reduced is not None else 1
    _draft_finalize_kernel[(rows,)](
        reduced if reduced is not None else tokens,
        argmax_tokens if argmax_tokens is not None else tokens,
        positions if has_positions else tokens, token_map if token_map is not None else tokens, tokens,
        topk_p if topk_p is not None else tokens,
        positions_out if has_positions else tokens,
        *(carry[:4] if carry is not None else (tokens,) * 4),
        reduced.stride(0) if reduced is not None else 0, slots,
        carry.dummy_row if carry is not None else 0, carry.pad_len if carry is not None else 0,
        FROM_PARTIALS=reduced is not None, HAS_MAP=token_map is not None, HAS_TOPK_P=topk_p is not None,
        HAS_POSITIONS=has_positions, HAS_CARRY=carry is not None,
        SLOTS_P2=max(2, triton.next_power_of_2(slots)), num_warps=1,
    )
    return tokens


def _check_carry(carry: CarryWrite, rows: int) -> None:
    for name in ("table_rows", "lens", "carry_lens", "carry_tokens"):
        t = getattr(carry, name)
        size = rows if name in ("table_rows", "lens") else None
        if (t.dim() != 1 or (size is not None and t.shape[0] != size) or t.dtype != torch.int64
                or t.stride(0) != 1):
            raise ValueError(f"carry.{name} must be a contiguous 1-D int64 tensor"
                             f"{'' if size is None else f' with one entry per row of tokens ({size})'}, got "
                             f"{tuple(t.shape)} {t.dtype} strides {t.stride()}")
    table_rows = carry.carry_lens.shape[0]
    if carry.carry_tokens.shape[0] != table_rows:
        raise ValueError(f"carry.carry_tokens must have carry.carry_lens' {table_rows} entries, got "
                         f"{carry.carry_tokens.shape[0]}")
    if not 0 <= carry.dummy_row < table_rows:
        raise ValueError(f"carry.dummy_row must be in [0, {table_rows}), got {carry.dummy_row}")
    if not 0 <= carry.pad_len < 2**62:
        raise ValueError(f"carry.pad_len must be in [0, 2**62), got {carry.pad_len}")


def greedy_tokens(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    *,
    vocab_size: int,
    carry: CarryWrite | None = None,
    split_columns: int = DEFAULT_SPLIT_COLUMNS,
) -> torch.Tensor:
    """``tokens = torch.argmax(logits[:, :vocab_size].float(), dim=-1)`` from one replicated head's
    logits, bit for bit (lowest index among equal maxima, the first NaN above everything, -0 == +0),
    without the fp32 copy: ``argmax_partials`` over one shard, then ``draft_finalize`` (two launches),
    which also writes ``carry`` when given. Rows are independent (row-invariant). Graph-safe: the
    partials buffer ``[rows, splits, 4]`` fp32 is allocated per call (from a graph's pool inside a
    capture), no host sync.

    Parameters
    ----------
    logits : Tensor ``[rows, >= vocab_size]`` bf16 or fp32, unit column stride; columns past
        ``vocab_size`` (padding) are never read.
    tokens : Tensor ``[rows]`` int64, contiguous; written.
    vocab_size : int, ``1 <= vocab_size <= logits.shape[1]``.
    carry : optional CarryWrite (see ``draft_finalize``).
    split_columns : int; columns per program of the partials (see ``exchange_layout``).

    Arguments are validated on the host (no device sync), on every call.

    Returns
    -------
    ``tokens``.
    """
    if logits.dim() != 2 or not 1 <= vocab_size <= logits.shape[1]:
        raise ValueError(f"logits must be [rows, >= vocab_size={vocab_size}] with vocab_size >= 1, got "
                         f"{tuple(logits.shape)}")
    rows = logits.shape[0]
    if tuple(tokens.shape) != (rows,) or tokens.dtype != torch.int64 or tokens.stride(0) != 1:
        raise ValueError(f"tokens must be a contiguous int64 [{rows}] (one entry per row of logits), got "
                         f"{tuple(tokens.shape)} {tokens.dtype} strides {tokens.stride()}")
    valid = logits[:, :vocab_size]
    splits, _ = exchange_layout(vocab_size, split_columns)
    reduced = torch.empty(rows, splits, LANES, dtype=torch.float32, device=logits.device)
    argmax_partials(valid, reduced, rank=0, tp_size=1, vocab_size=vocab_size, split_columns=split_columns)
    return draft_finalize(tokens=tokens, reduced=reduced, carry=carry)


@triton.jit
def _topk_partials_kernel(
    logits_bits_ptr,  # [rows, Sh] int16 (bf16 bits) or int32 (fp32 bits)
    out_ptr,  # [rows, TP * splits, 4 * K + 1] fp32
    logits_row_stride,
    out_row_stride,
    n_valid,  # valid columns of this shard
    split_width,
    shard_start,  # global index of local column 0
    rank,
    tp_size,
    splits,
    K: tl.constexpr,
    LANES_P2: tl.constexpr,
    IS_BF16: tl.constexpr,
    BLOCK: tl.constexpr,  # >= split_width: the whole split is one tile
    TP_P2: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    slot_lanes = 4 * K + 1
    out_row = out_ptr + row.to(tl.int64) * out_row_stride
    # Every other rank's slot of this split: +0.0.
    ranks = tl.arange(0, TP_P2)
    lane = tl.arange(0, LANES_P2)
    foreign = out_row + (ranks * splits + split)[:, None] * slot_lanes + lane[None, :]
    tl.store(foreign, tl.zeros([TP_P2, LANES_P2], tl.float32),
             mask=((ranks < tp_size) & (ranks != rank))[:, None] & (lane < slot_lanes)[None, :])
    own = out_row + (rank * splits + split) * slot_lanes
    lo = split * split_width
    cols = lo + tl.arange(0, BLOCK)
    mask = cols < tl.minimum(lo + split_width, n_valid)
    bits = _widened_bits(tl.load(logits_bits_ptr + row.to(tl.int64) * logits_row_stride + cols, mask=mask, other=0),
                         IS_BF16)
    # (key, column) as one int64, ordered by key, then lower column first: one max per round picks both.
    ranked = tl.where(mask, _rank_pair(_signed_order_key(bits), cols), _INT64_MIN)
    part = tl.arange(0, 4)
    # K rounds: the largest key, lowest column among equal keys, then taken out; a round that finds no
    # column (fewer than K valid columns) writes an empty candidate (zeros).
    for j in tl.static_range(K):
        top = tl.max(ranked, axis=0)
        ranked = tl.where(ranked == top, _INT64_MIN, ranked)
        found = top > _INT64_MIN
        best = (top >> 32).to(tl.int32)
        index = shard_start + ((top & _INT32_MAX).to(tl.int32) ^ _INT32_MAX)
        packed = tl.where(part == 0, ((best >> 16) & 0xFFFF) ^ 0x8000,
                          tl.where(part == 1, best & 0xFFFF, tl.where(part == 2, index >> 16, index & 0xFFFF)))
        tl.store(own + 4 * j + part, tl.where(found, packed, 0).to(tl.float32))
        if j == 0:
            # Sum of exp(x - m) over the split, m = its maximum; 0 if m is NaN or ±inf (or the split is
            # empty). Done in the first round so the logits need not stay in registers through the others.
            finite = found & _finite_key(best)
            m = tl.where(finite, _signed_key_value(best), 0.0)
            live = mask & finite
            x = tl.where(live, bits.to(tl.float32, bitcast=True), m)
            tl.store(own + 4 * K, tl.sum(tl.where(live, tl.exp(x - m), 0.0), axis=0))


def topk_partials(
    local_logits: torch.Tensor,
    out: torch.Tensor,
    *,
    k: int,
    rank: int,
    tp_size: int,
    vocab_size: int,
    split_columns: int = TOPK_SPLIT_COLUMNS,
) -> torch.Tensor:
    """Write this rank's top-``k`` candidates and sums of exponentials into its slots, +0.0 elsewhere.

    Columns and splits as in ``argmax_partials``. Per (row, split) the slot holds the split's ``k`` best
    columns in the exchange order (largest order key first, lowest column among equal keys), each as the 4
    exact lanes of ``argmax_partials`` (zeros where the split has fewer than ``k`` valid columns), then lane
    ``4k``: ``s = sum_c exp(x_c - m)`` over the split's valid columns, ``m`` the value of its first candidate
    (``s >= 1``), or 0 when ``m`` is NaN or ±inf or the split is empty. ``s`` is not exact: fp32 ``exp``
    and summation. Every lane a rank sends is 0 or a finite value >= 1: the SUM all-reduce copies it.

    Parameters
    ----------
    local_logits : Tensor ``[rows, Sh]``, bf16 or fp32, unit column stride; this rank's local logits.
    out : Tensor ``[rows, tp_size * splits, 4 * k + 1]`` fp32, contiguous; written entirely.
    k : int, ``1 <= k <= min(TOPK_MAX, vocab_size)``.
    rank, tp_size, vocab_size : int; ``tp_size * Sh >= vocab_size >= 1``.
    split_columns : int, ``<= TOPK_SPLIT_COLUMNS``; target columns per program (see ``exchange_layout``):
        a program holds its whole split.

    Arguments are validated on the host (shapes, dtypes, strides, devices; no device sync), on every
    call: inside a captured CUDA graph that happens once, at capture.

    Returns
    -------
    ``out``.
    """
    if not 1 <= split_columns <= TOPK_SPLIT_COLUMNS:
        raise ValueError(f"split_columns must be in [1, TOPK_SPLIT_COLUMNS={TOPK_SPLIT_COLUMNS}], got {split_columns}")
    if not 1 <= k <= min(TOPK_MAX, vocab_size):
        raise ValueError(f"k must be in [1, min(TOPK_MAX={TOPK_MAX}, vocab_size={vocab_size})], got {k}")
    rows, shard, splits, split_width = _check_partials(local_logits, out, rank=rank, tp_size=tp_size,
                                                       vocab_size=vocab_size, split_columns=split_columns,
                                                       slot_lanes=topk_slot_lanes(k))
    if rows == 0:
        return out
    is_bf16 = local_logits.dtype == torch.bfloat16
    bits = local_logits.view(torch.int16 if is_bf16 else torch.int32)
    n_valid = max(0, min(vocab_size - rank * shard, shard))
    _topk_partials_kernel[(rows, splits)](
        bits, out, bits.stride(0), out.stride(0), n_valid, split_width, rank * shard, rank, tp_size, splits,
        K=k, LANES_P2=triton.next_power_of_2(topk_slot_lanes(k)), IS_BF16=is_bf16,
        BLOCK=triton.next_power_of_2(split_width), TP_P2=triton.next_power_of_2(tp_size),
        num_warps=16 if split_width > 4096 else 8 if split_width >= 2048 else 4,  # about 100 registers a thread
    )
    return out


@triton.jit
def _topk_finalize_kernel(
    reduced_ptr,  # [rows, slots, 4 * K + 1] fp32
    index_ptr,  # [rows, K] int64
    p_ptr,  # [rows, K] fp32
    lse_ptr,  # [rows] fp32, or unused
    reduced_row_stride,
    index_row_stride,
    p_row_stride,
    slots,
    K: tl.constexpr,
    K_P2: tl.constexpr,
    SLOTS_P2: tl.constexpr,
    HAS_LSE: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.arange(0, SLOTS_P2)
    place = tl.arange(0, K_P2)
    live = (slot < slots)[:, None] & (place < K)[None, :]
    row_ptr = reduced_ptr + row.to(tl.int64) * reduced_row_stride
    base = row_ptr + slot[:, None] * (4 * K + 1) + place[None, :] * 4
    # Lanes are exact integers; -0.0 (a sign-rewriting transport) converts to 0.
    key_hi = tl.load(base + 0, mask=live, other=0.0).to(tl.int32)
    key_lo = tl.load(base + 1, mask=live, other=0.0).to(tl.int32)
    idx_hi = tl.load(base + 2, mask=live, other=0.0).to(tl.int32)
    idx_lo = tl.load(base + 3, mask=live, other=0.0).to(tl.int32)
    present = key_hi > 0  # lane 0 == 0: no candidate
    key = tl.where(present, ((key_hi ^ 0x8000) << 16) | key_lo, _INT32_MIN)
    ranked = tl.where(present, _rank_pair(key, (idx_hi << 16) | idx_lo), _INT64_MIN)
    # K rounds over every candidate of the row: largest key, lowest vocab index among equal keys.
    chosen_key = tl.full([K_P2], _INT32_MIN, tl.int32)
    chosen = tl.zeros([K_P2], tl.int64)
    for j in tl.static_range(K):
        top = tl.max(ranked)
        ranked = tl.where(ranked == top, _INT64_MIN, ranked)  # candidates are distinct tokens
        chosen_key = tl.where(place == j, (top >> 32).to(tl.int32), chosen_key)
        chosen = tl.where(place == j, (top & _INT32_MAX) ^ _INT32_MAX, chosen)
    top_key = tl.max(chosen_key, axis=0)
    top = _signed_key_value(top_key)
    finite = _finite_key(top_key)  # NaN or ±inf at the top: softmax is NaN everywhere
    m = tl.where(finite, top, 0.0)
    # Sum of exp(x - M) over the row from the splits: sum_s exp(m_s - M) * s_s (empty splits add 0).
    split_max = tl.max(tl.where(place[None, :] == 0, key, _INT32_MIN), axis=1)
    split_sum = tl.load(row_ptr + slot * (4 * K + 1) + 4 * K, mask=slot < slots, other=0.0)
    split_value = tl.where(finite & (split_max > _INT32_MIN), _signed_key_value(split_max), float("-inf"))
    total = tl.sum(_exp_difference(split_value, m) * split_sum, axis=0)
    total = tl.where(finite, total, 1.0)
    p = _exp_difference(tl.where(finite & (chosen_key > _INT32_MIN), _signed_key_value(chosen_key), m), m) / total
    tl.store(index_ptr + row.to(tl.int64) * index_row_stride + place, chosen, mask=place < K)
    tl.store(p_ptr + row.to(tl.int64) * p_row_stride + place, tl.where(finite, p, float("nan")), mask=place < K)
    if HAS_LSE:
        tl.store(lse_ptr + row, tl.where(finite, top + tl.log(total), top))


def topk_finalize(
    reduced: torch.Tensor,
    *,
    k: int,
    topk_index: torch.Tensor,
    topk_p: torch.Tensor,
    lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact top-``k`` tokens and their softmax probabilities from an all-reduced top-k exchange buffer.

    Merges the ``slots * k`` candidates of a row (``topk_partials`` of every rank, summed) into the top
    ``k`` of the gathered fp32 logits in the exchange order: largest value first, every NaN above +inf,
    -0 == +0, and the lowest vocab index first among equal values (``torch.sort(logits, descending=True,
    stable=True).indices[:, :k]``). With ``M`` the row's maximum and ``S = sum_s exp(m_s - M) * s_s``:
    ``topk_p[j] = exp(x_j - M) / S`` and ``lse = M + log(S)``. Rows whose maximum is NaN or ±inf get
    ``topk_p = NaN`` and ``lse = M`` (as ``torch.softmax`` / ``torch.logsumexp``). Accuracy against
    ``torch.softmax`` of the gathered fp32 logits: ``|p - p_ref| <= TOPK_P_REL_ERROR * p_ref +
    TOPK_P_ABS_ERROR`` (docs/argmax-exchange.md). One warp per row; every rank computes the same bytes.

    Parameters
    ----------
    reduced : Tensor ``[rows, slots, 4 * k + 1]`` fp32, unit lane stride, dense slots.
    k : int, ``1 <= k <= TOPK_MAX``; the ``k`` the buffer was written with.
    topk_index : Tensor ``[rows, k]`` int64, unit column stride; written (global vocab indices).
    topk_p : Tensor ``[rows, k]`` fp32, unit column stride; written.
    lse : optional Tensor ``[rows]`` fp32, contiguous; written with the log-sum-exp of each row.

    Arguments are validated on the host (shapes, dtypes, strides, devices; no device sync), on every
    call: inside a captured CUDA graph that happens once, at capture.

    Precondition not checked (it is device data): every row holds at least ``k`` candidates, which holds
    when ``reduced`` is the sum over ranks of ``topk_partials`` buffers written with ``k <= vocab_size``.

    Returns
    -------
    ``topk_index``.
    """
    if not 1 <= k <= TOPK_MAX:
        raise ValueError(f"k must be in [1, TOPK_MAX={TOPK_MAX}], got {k}")
    lanes = topk_slot_lanes(k)
    if (reduced.dim() != 3 or reduced.shape[2] != lanes or reduced.dtype != torch.float32
            or reduced.stride(2) != 1 or reduced.stride(1) != lanes):
        raise ValueError(f"reduced must be fp32 [rows, slots, {lanes}] with dense slots, got "
                         f"{tuple(reduced.shape)} {reduced.dtype} strides {reduced.stride()}")
    rows = reduced.shape[0]
    for name, t, dtype in (("topk_index", topk_index, torch.int64), ("topk_p", topk_p, torch.float32)):
        if tuple(t.shape) != (rows, k) or t.dtype != dtype or t.stride(1) != 1:
            raise ValueError(f"{name} must be {dtype} [{rows}, {k}] with unit column stride, got "
                             f"{tuple(t.shape)} {t.dtype} strides {t.stride()}")
    if lse is not None and (tuple(lse.shape) != (rows,) or lse.dtype != torch.float32 or lse.stride(0) != 1):
        raise ValueError(f"lse must be a contiguous fp32 [{rows}], got {tuple(lse.shape)} {lse.dtype} "
                         f"strides {lse.stride()}")
    for name, t in (("topk_index", topk_index), ("topk_p", topk_p), ("lse", lse)):
        if t is not None and t.device != reduced.device:
            raise ValueError(f"{name} must be on reduced's device {reduced.device}, got {t.device}")
    if rows == 0:
        return topk_index
    slots = reduced.shape[1]
    _topk_finalize_kernel[(rows,)](
        reduced, topk_index, topk_p, lse if lse is not None else topk_p, reduced.stride(0), topk_index.stride(0),
        topk_p.stride(0), slots, K=k, K_P2=max(2, triton.next_power_of_2(k)),
        SLOTS_P2=max(2, triton.next_power_of_2(slots)), HAS_LSE=lse is not None, num_warps=1,
    )
    return topk_index
