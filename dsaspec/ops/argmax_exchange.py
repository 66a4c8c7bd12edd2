"""Vocab-shard argmax partials and their finalize (docs/argmax-exchange.md).

``argmax_partials`` runs straight after the local LM-head GEMM: a split reduction over this rank's
valid shard columns (padding excluded by width, never by value) that writes one candidate per
(row, split) as 4 exact fp32 lanes ``(key >> 16, key & 0xFFFF, index >> 16, index & 0xFFFF)`` into
this rank's slots of the ``[rows, TP * splits, 4]`` exchange buffer and +0.0 into every other slot,
in one launch. One fp32 SUM all-reduce of the buffer then gives every rank every candidate exactly
(each lane has a single non-zero contributor, an integer <= 65535). ``draft_finalize`` (one warp per
row) picks the largest key, lowest global index on ties, and writes the draft bookkeeping.

Everything works on the logits' bits: the key is derived from integer operations only, so the
result cannot depend on flush-to-zero, fast-math or the interpreter's float handling. The pure
PyTorch definition is ``dsaspec.reference.argmax_exchange``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LANES = 4
DEFAULT_SPLIT_COLUMNS = 4096
_MAX_BLOCK = 2048
_INT32_MIN = tl.constexpr(-(2**31))


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
    row = tl.program_id(0)
    split = tl.program_id(1)
    lo = split * split_width
    hi = tl.minimum(lo + split_width, n_valid)
    row_ptr = logits_bits_ptr + row.to(tl.int64) * logits_row_stride
    offs = tl.arange(0, BLOCK)
    best_key = tl.full([BLOCK], _INT32_MIN, tl.int32)
    best_col = tl.zeros([BLOCK], tl.int32)
    for start in range(lo, hi, BLOCK):
        cols = start + offs
        mask = cols < hi
        raw = tl.load(row_ptr + cols, mask=mask, other=0)
        if IS_BF16:
            bits = (raw.to(tl.int32) & 0xFFFF) << 16  # exact bf16 -> fp32 widening
        else:
            bits = raw
        magnitude = bits & 0x7FFFFFFF
        bits = tl.where(magnitude == 0, 0, bits)  # -0 -> +0
        # Signed form of the uint32 key (key ^ 0x80000000): monotone in the fp32 value.
        key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        key = tl.where(magnitude > 0x7F800000, 0x7FFFFFFF, key)  # every NaN on top
        key = tl.where(mask, key, _INT32_MIN)
        # Strict '>' keeps the earlier column of a lane on equal keys.
        take = key > best_key
        best_key = tl.where(take, key, best_key)
        best_col = tl.where(take, cols, best_col)
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
    expected = (rows, tp_size * splits, LANES)
    if tuple(out.shape) != expected or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous fp32 tensor of shape {expected}, got "
                         f"{tuple(out.shape)} {out.dtype} contiguous={out.is_contiguous()}")
    if out.device != local_logits.device:
        raise ValueError(f"out must be on local_logits' device {local_logits.device}, got {out.device}")
    if rows == 0:
        return out
    is_bf16 = local_logits.dtype == torch.bfloat16
    bits = local_logits.view(torch.int16 if is_bf16 else torch.int32)
    n_valid = max(0, min(vocab_size - rank * shard, shard))
    _argmax_partials_kernel[(rows, splits)](
        bits, out, bits.stride(0), out.stride(0), n_valid, split_width, rank * shard, rank, tp_size, splits,
        IS_BF16=is_bf16, BLOCK=min(_MAX_BLOCK, triton.next_power_of_2(split_width)),
        TP_P2=triton.next_power_of_2(tp_size), num_warps=8 if split_width >= 2048 else 4,
    )
    return out


@triton.jit
def _draft_finalize_kernel(
    reduced_ptr,  # [rows, slots, 4] fp32, or unused
    argmax_ptr,  # [rows] int64 tokens, or unused
    positions_ptr,
    token_map_ptr,
    tokens_ptr,
    topk_p_ptr,
    positions_out_ptr,
    reduced_row_stride,
    slots,
    FROM_PARTIALS: tl.constexpr,
    HAS_MAP: tl.constexpr,
    HAS_POSITIONS: tl.constexpr,
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
    tl.store(topk_p_ptr + row, 1.0)
    if HAS_POSITIONS:
        tl.store(positions_out_ptr + row, tl.load(positions_ptr + row) + 1)


def draft_finalize(
    *,
    tokens: torch.Tensor,
    topk_p: torch.Tensor,
    positions: torch.Tensor | None = None,
    positions_out: torch.Tensor | None = None,
    reduced: torch.Tensor | None = None,
    argmax_tokens: torch.Tensor | None = None,
    token_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """Greedy (topk = 1) draft bookkeeping: token, ``topk_p = 1.0``, ``positions + 1``; one warp per row.

    With ``reduced`` (the all-reduced exchange buffer): ``token = index of max key, lowest global
    index on ties``, i.e. ``torch.argmax`` of the gathered fp32 logits. With ``argmax_tokens`` (the
    gather path): ``token = argmax_tokens``. Then ``token = token_map[token]`` if a map is given.

    ``topk_p = 1.0`` is exact for a topk = 1 chain: each step has a single candidate, every
    candidate is kept, so the score never selects or orders anything; the gathered path stores the
    same constant, hence bit-identical.

    Parameters
    ----------
    tokens : Tensor ``[rows]`` int32/int64, written.
    topk_p : Tensor ``[rows]`` fp32, written (1.0).
    positions : optional Tensor ``[rows]`` int32/int64; with ``positions_out``, or neither.
    positions_out : optional Tensor ``[rows]``, dtype of ``positions``, written ``positions + 1``
        (may be ``positions``).
    reduced : Tensor ``[rows, slots, 4]`` fp32, unit lane stride, slot stride 4; exactly one of
        ``reduced`` / ``argmax_tokens``.
    argmax_tokens : Tensor ``[rows]`` int64 (e.g. ``torch.argmax`` output; may be ``tokens``).
    token_map : optional Tensor ``[map_size]`` int32/int64, contiguous.

    Arguments are validated on the host (shapes, dtypes, strides, devices; no device sync), on every
    call: inside a captured CUDA graph that happens once, at capture.

    Precondition not checked (it is device data): every token, before mapping, indexes
    ``token_map``: ``0 <= token < map_size``. The kernel's ``token_map[token]`` load is unmasked. It
    holds when ``map_size >= vocab_size`` and ``reduced`` comes from ``argmax_partials`` with that
    ``vocab_size``, or ``argmax_tokens`` is an argmax over ``vocab_size`` columns
    (``LogitsProcessor.forward`` checks the map's size).

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
    checked = [("tokens", tokens, (torch.int32, torch.int64)), ("topk_p", topk_p, (torch.float32,))]
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
    others = {"topk_p": topk_p, "positions": positions, "positions_out": positions_out, "reduced": reduced,
              "argmax_tokens": argmax_tokens, "token_map": token_map}
    for name, t in others.items():
        if t is not None and t.device != tokens.device:
            raise ValueError(f"{name} must be on tokens' device {tokens.device}, got {t.device}")
    if rows == 0:
        return tokens
    slots = reduced.shape[1] if reduced is not None else 1
    _draft_finalize_kernel[(rows,)](
        reduced if reduced is not None else topk_p,
        argmax_tokens if argmax_tokens is not None else tokens,
        positions if has_positions else tokens, token_map if token_map is not None else tokens, tokens, topk_p,
        positions_out if has_positions else tokens, reduced.stride(0) if reduced is not None else 0, slots,
        FROM_PARTIALS=reduced is not None, HAS_MAP=token_map is not None, HAS_POSITIONS=has_positions,
        SLOTS_P2=max(2, triton.next_power_of_2(slots)), num_warps=1,
    )
    return tokens
