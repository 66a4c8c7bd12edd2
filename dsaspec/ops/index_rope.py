"""The lightning indexer's query and key epilogues in one kernel (Triton): RoPE on the first
``rope_dim`` values of every 128-wide row, the key's LayerNorm before it, the 128-wide Hadamard
rotation after it (FP8 key caches), and the key's cache write. A layer runs both and its head
weights (:mod:`dsaspec.ops.index_weights`' programs) in one launch (``indexer_epilogues``: one
grid, the query's programs first, then the key's, then the head weights'); ``index_q_rope`` /
``store_index_k_normed`` run one part alone, the same bits.

Per row ``x`` (model dtype; ``round`` rounds fp32 to the model dtype, to nearest even):

    key:    y = round(LayerNorm(x) * w + b)    (fp32 statistics, biased variance)
    both:   y = round(RoPE(y))                 (pairs (2i, 2i+1) when interleaved, else (i, i + rope/2);
                                                fp32 x*cos - x'*sin, x*sin + x'*cos, no FMA)
    rotate: y = round(s * 128**-0.5)           (s = y @ H with H the Sylvester +-1 Hadamard matrix:
                                                the fast Walsh-Hadamard transform, 7 stages of fp32
                                                adds/subtracts, then one fp32 multiply)

The key is then written at its slot: a copy into a dense cache ``[slots, 128]`` (model dtype), or
quantized (e4m3, one ue8m0 scale a token, the rule of :mod:`dsaspec.ops.e4m3`) into the FP8 paged
cache. RoPE alone is bit-identical to the torch ops; the LayerNorm's sums and the rotation's
sums run in their own order (the torch ops rotate by an fp32 matmul with ``H * 128**-0.5``), so
a LayerNorm'd or rotated value may differ from them by one ulp of the model dtype. A program owns
16 whole rows, so a row's bits never depend on the other rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaspec.ops.checks import check_tensor
from dsaspec.ops.device import enter_chain, supports_pdl
from dsaspec.ops.e4m3 import quantize_rows
from dsaspec.ops.index_weights import HeadWeightsLaunch, head_weights_program, prepare_index_weights
from dsaspec.ops.kv_cache_layout import INDEX_HEAD_DIM, PAGE_SIZE, index_k_fp8_views, is_fp8_cache

_ROWS = 16                # rows per program
_FLOAT_DTYPES = (torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
_DENSE, _FP8 = 1, 2   # where a key row goes: a dense cache, the FP8 cache (DEST 0: the query's output)


@triton.jit
def _round(x, BF16: tl.constexpr):
    """fp32 ``x`` rounded to bf16 (nearest even, NaN kept) and widened back, when ``BF16``; on the
    bits, as the interpreter's fp32 -> bf16 cast truncates."""
    if BF16:
        bits = x.to(tl.int32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        x = tl.where(x != x, x, rounded)
    return x


@triton.jit
def rope_pairs(c, ROPE: tl.constexpr, INTERLEAVED: tl.constexpr):
    """For rope columns ``c``: the column each is rotated with, the index of its angle, and whether
    its sin term is negated (the first of its pair): ``(c ^ 1, c // 2, c even)`` interleaved, else
    ``(c +- ROPE / 2, c % (ROPE / 2), c < ROPE / 2)``."""
    if INTERLEAVED:
        partner, pair, first = c ^ 1, c // 2, (c % 2) == 0
    else:
        half: tl.constexpr = ROPE // 2
        first = c < half
        partner, pair = tl.where(first, c + half, c - half), c % half
    return partner, pair, first


@triton.jit
def _load_normed(x_ptr, starts, cols, live, mean, rstd, w_ptr, b_ptr, NORM: tl.constexpr, BF16: tl.constexpr):
    x = tl.load(x_ptr + starts[:, None] + cols[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    if NORM:
        w = tl.load(w_ptr + cols).to(tl.float32)
        b = tl.load(b_ptr + cols).to(tl.float32)
        x = _round((x - mean[:, None]) * rstd[:, None] * w[None, :] + b[None, :], BF16)
    return x


@triton.jit
def _epilogue(block, x_ptr, cos_ptr, sin_ptr, w_ptr, b_ptr, out_ptr, loc_ptr, scale_ptr, N, heads, eps,
              stride_x, stride_xh, stride_cos, stride_out, stride_scale, ROWS: tl.constexpr, DIM: tl.constexpr,
              ROPE: tl.constexpr, INTERLEAVED: tl.constexpr, NORM: tl.constexpr, ROTATE: tl.constexpr,
              DEST: tl.constexpr, BF16: tl.constexpr, PAGE: tl.constexpr):
    """Rows ``block * ROWS ..`` of one part (the query's or the key's) through the module
    docstring's steps, written to ``DEST``. Row ``r`` is head ``r % heads`` of token
    ``r // heads``: it starts at ``x_ptr + token * stride_x + head * stride_xh``."""
    rows = block * ROWS + tl.arange(0, ROWS)
    live = rows < N
    token = rows // heads
    starts = token.to(tl.int64) * stride_x + (rows - token * heads).to(tl.int64) * stride_xh
    c = tl.arange(0, DIM)
    # past the rope dims c is its own partner with cos 1, sin 0
    partner, pair, first = rope_pairs(c, ROPE, INTERLEAVED)
    in_rope = c < ROPE
    partner = tl.where(in_rope, partner, c)
    mean = tl.zeros((ROWS,), tl.float32)
    rstd = tl.zeros((ROWS,), tl.float32)
    if NORM:
        x = tl.load(x_ptr + starts[:, None] + c[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=1) / DIM
        centered = x - mean[:, None]
        rstd = 1.0 / tl.sqrt_rn(tl.sum(centered * centered, axis=1) / DIM + eps)
    x = _load_normed(x_ptr, starts, c, live, mean, rstd, w_ptr, b_ptr, NORM, BF16)
    xp = _load_normed(x_ptr, starts, partner, live, mean, rstd, w_ptr, b_ptr, NORM, BF16)
    angle = token[:, None].to(tl.int64) * stride_cos + pair[None, :]
    rope_mask = live[:, None] & in_rope[None, :]
    cos = tl.load(cos_ptr + angle, mask=rope_mask, other=1.0)
    sin = tl.load(sin_ptr + angle, mask=rope_mask, other=0.0)
    sin = tl.where(first[None, :], -sin, sin)
    y = _round(x * cos + xp * sin, BF16)
    if ROTATE:
        # y @ H by the fast Walsh-Hadamard transform: a stage adds and subtracts the column pairs
        # that differ in bit 0, then rotates the column bits right by one (the pair's bit becomes
        # bit 6), so after 7 stages every bit is done and the columns are back in order.
        tl.static_assert(DIM == 128)
        for _ in tl.static_range(7):
            a, b = tl.split(tl.reshape(y, (ROWS, DIM // 2, 2)))
            y = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), (ROWS, DIM))
        y = _round(y * 0.08838834764831845, BF16)
    if DEST == 0:
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out + c[None, :],
                 y.to(out_ptr.dtype.element_ty), mask=live[:, None])
    else:
        slot = tl.load(loc_ptr + rows, mask=live, other=0).to(tl.int64)
        if DEST == 1:
            tl.store(out_ptr + slot[:, None] * stride_out + c[None, :], y.to(out_ptr.dtype.element_ty),
                     mask=live[:, None])
        else:
            q, s = quantize_rows(y, True)
            page, offset = slot // PAGE, slot % PAGE
            tl.store(out_ptr + (page * stride_out + offset * DIM)[:, None] + c[None, :],
                     q.to(out_ptr.dtype.element_ty), mask=live[:, None])
            tl.store(scale_ptr + page * stride_scale + offset, s, mask=live)


@triton.jit(do_not_specialize=["q_rows", "heads", "q_blocks", "k_rows", "k_blocks", "w_rows"])
def _index_rope_kernel(q_ptr, q_out_ptr, q_rows, heads, stride_q, stride_qh, stride_q_out, q_blocks,
                       k_ptr, w_ptr, b_ptr, cache_ptr, loc_ptr, scale_ptr, k_rows, eps, stride_k, stride_cache,
                       stride_scale, k_blocks, cos_ptr, sin_ptr, stride_cos,
                       wx_ptr, ww_ptr, w_out_ptr, w_ws_ptr, w_counters_ptr, w_rows, w_heads, w_k, w_scale,
                       stride_wx, stride_ww, stride_w_out, w_blocks_per_split,
                       ROWS: tl.constexpr, DIM: tl.constexpr,
                       ROPE: tl.constexpr, INTERLEAVED: tl.constexpr, ROTATE: tl.constexpr, K_DEST: tl.constexpr,
                       BF16: tl.constexpr, PAGE: tl.constexpr, QUERY: tl.constexpr, KEY: tl.constexpr,
                       WEIGHTS: tl.constexpr, W_SPLITS: tl.constexpr, W_BLOCK_M: tl.constexpr,
                       W_BLOCK_K: tl.constexpr, W_STAGES: tl.constexpr, CHAINED: tl.constexpr):
    # programs [0, q_blocks) rope the query rows (token = row // heads, read through q's token and
    # head strides) into q_out (contiguous), the next k_blocks norm + rope the key rows (one a token)
    # into the cache, the rest compute the head weights (head_weights_program); QUERY / KEY /
    # WEIGHTS: the launch has that part
    enter_chain(CHAINED)
    block = tl.program_id(0)
    if block < q_blocks:
        if QUERY:
            _epilogue(block, q_ptr, cos_ptr, sin_ptr, q_ptr, q_ptr, q_out_ptr, q_ptr, q_ptr, q_rows, heads, 0.0,
                      stride_q, stride_qh, stride_cos, stride_q_out, 0, ROWS, DIM, ROPE, INTERLEAVED, False, ROTATE, 0,
                      BF16, PAGE)
    elif block < q_blocks + k_blocks:
        if KEY:
            _epilogue(block - q_blocks, k_ptr, cos_ptr, sin_ptr, w_ptr, b_ptr, cache_ptr, loc_ptr, scale_ptr,
                      k_rows, 1, eps, stride_k, 0, stride_cos, stride_cache, stride_scale, ROWS, DIM, ROPE,
                      INTERLEAVED, True, ROTATE, K_DEST, BF16, PAGE)
    else:
        if WEIGHTS:
            head_weights_program(block - q_blocks - k_blocks, wx_ptr, ww_ptr, w_out_ptr, w_ws_ptr, w_counters_ptr,
                                 w_rows, w_heads, w_k, w_scale, stride_wx, stride_ww, stride_w_out,
                                 w_blocks_per_split, W_SPLITS, W_BLOCK_M, W_BLOCK_K, W_STAGES)


def _check_angles(cos, sin, tokens: int, rope_dim: int, device) -> None:
    if rope_dim < 2 or rope_dim % 2 or rope_dim > INDEX_HEAD_DIM:
        raise ValueError(f"rope_dim: expected an even number in [2, {INDEX_HEAD_DIM}], got {rope_dim}")
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(name, t, dtype=(torch.float32,), shape=(tokens, rope_dim // 2), device=device)


def _query(q, cos, sin, rope_dim):
    """Checks ``q`` (read in place through its token and head strides) and the angles; a new
    contiguous output like ``q``."""
    check_tensor("q", q, dtype=_FLOAT_DTYPES, ndim=3, device=cos.device)
    if q.shape[-1] != INDEX_HEAD_DIM:
        raise ValueError(f"q: expected rows of {INDEX_HEAD_DIM} values, got {tuple(q.shape)}")
    _check_angles(cos, sin, q.shape[0], rope_dim, q.device)
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def _key(cache, loc, k, weight, bias, cos, sin, rope_dim, check_values):
    """Checks the key's arguments; ``(codes, scale, dest)``: where and how the keys are written
    (``scale`` None for a dense cache)."""
    check_tensor("k", k, dtype=_FLOAT_DTYPES, shape=(None, INDEX_HEAD_DIM), device=cos.device)
    for name, t in (("weight", weight), ("bias", bias)):
        check_tensor(name, t, dtype=_FLOAT_DTYPES, shape=(INDEX_HEAD_DIM,), device=k.device)
    check_tensor("loc", loc, dtype=_INDEX_DTYPES, shape=(k.shape[0],), device=k.device)
    _check_angles(cos, sin, k.shape[0], rope_dim, k.device)
    if is_fp8_cache(cache):
        codes, scale = index_k_fp8_views(cache)
        num_slots, dest = cache.shape[0] * PAGE_SIZE, _FP8
    else:
        check_tensor("cache", cache, dtype=(k.dtype,), shape=(None, INDEX_HEAD_DIM), device=k.device)
        codes, scale, num_slots, dest = cache, None, cache.shape[0], _DENSE
    if check_values and loc.numel() and (int(loc.min()) < 0 or int(loc.max()) >= num_slots):
        raise ValueError(f"loc: slots must lie in [0, {num_slots}), got [{int(loc.min())}, {int(loc.max())}]")
    return codes, scale, dest


def _launch(cos, sin, rope_dim, interleaved, rotate, q=None, q_out=None, k=None, weight=None, bias=None,
            eps=0.0, codes=None, loc=None, scale=None, dest=_DENSE, head_weights: HeadWeightsLaunch | None = None):
    """One launch over the query ``q`` ``[R, heads, 128]`` (unit last stride; into ``q_out``,
    contiguous, same shape), the key rows ``k`` ``[R, 128]`` (into ``codes`` at ``loc``) and the
    programs of ``head_weights``, any part left out when None (or without programs)."""
    q_rows = 0 if q is None else q.shape[0] * q.shape[1]
    k_rows = 0 if k is None else k.shape[0]
    q_blocks, k_blocks = triton.cdiv(q_rows, _ROWS), triton.cdiv(k_rows, _ROWS)
    any_x = k if q is None else q   # stands in for the pointers of a part left out (never read)
    head_weights = head_weights or HeadWeightsLaunch.absent(any_x)
    blocks = q_blocks + k_blocks + head_weights.programs
    if not blocks:
        return
    k_args = (any_x, any_x, any_x, any_x, any_x, any_x, 0, eps, 0, 0, 0) if k is None else (
        k, weight, bias, codes, loc, any_x if scale is None else scale, k_rows, eps, k.stride(0), codes.stride(0),
        0 if scale is None else scale.stride(0))
    q_args = (any_x, any_x, 0, 1, 0, 0, 0) if q is None else (q, q_out, q_rows, q.shape[1], q.stride(0), q.stride(1),
                                                               INDEX_HEAD_DIM)
    w_constexprs = {f"W_{name}": value for name, value in head_weights.constexprs.items()}
    chained = supports_pdl(any_x.device)
    _index_rope_kernel[(blocks,)](
        *q_args, q_blocks, *k_args, k_blocks, cos, sin, cos.stride(0), *head_weights.args, ROWS=_ROWS,
        DIM=INDEX_HEAD_DIM, ROPE=rope_dim, INTERLEAVED=interleaved, ROTATE=rotate, K_DEST=dest,
        BF16=any_x.dtype == torch.bfloat16, PAGE=PAGE_SIZE, QUERY=q is not None, KEY=k is not None,
        WEIGHTS=head_weights.programs > 0, **w_constexprs, CHAINED=chained, launch_pdl=chained,
        enable_fp_fusion=False)


def index_q_rope(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int, interleaved: bool,
                 rotate: bool) -> torch.Tensor:
    """The indexer query ``q`` ``[R, H, 128]`` (bf16 or fp32; any token and head strides with a
    unit last stride, read in place: e.g. the indexer's columns of a fused GEMM output) with RoPE
    on its first ``rope_dim`` values (``cos``/``sin`` fp32 ``[R, rope_dim / 2]``, one row per
    token) and, when ``rotate``, the Hadamard rotation (module docstring): a new contiguous
    tensor of ``q``'s shape and dtype."""
    out = _query(q, cos, sin, rope_dim)
    _launch(cos, sin, rope_dim, interleaved, rotate, q=q, q_out=out)
    return out


def store_index_k_normed(cache: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int,
                         interleaved: bool, check_values: bool = True) -> None:
    """LayerNorm (``weight``, ``bias`` ``[128]``, ``eps``) then RoPE of the indexer keys ``k``
    ``[R, 128]`` (bf16 or fp32, before ``k_norm``), written at slots ``loc`` ``[R]`` of
    ``cache``: a copy into a dense cache ``[slots, 128]`` of ``k``'s dtype, or Hadamard-rotated
    and quantized into an FP8 paged cache (uint8 ``[pages, 8448]``). ``check_values``: ``loc``
    in range (host sync)."""
    codes, scale, dest = _key(cache, loc, k, weight, bias, cos, sin, rope_dim, check_values)
    _launch(cos, sin, rope_dim, interleaved, dest == _FP8, k=k, weight=weight, bias=bias, eps=eps, codes=codes,
            loc=loc, scale=scale, dest=dest)


def indexer_epilogues(q: torch.Tensor, cache: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
                      weight: torch.Tensor, bias: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                      rope_dim: int, interleaved: bool, x: torch.Tensor | None, head_weight: torch.Tensor,
                      head_scale: float, check_values: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's indexer epilogues and head weights in one launch, on one grid (the query's
    programs, the key's, then the head weights'), the same checks and bits as
    ``index_q_rope(q, cos, sin, rope_dim, interleaved, rotate)`` with ``rotate`` when ``cache`` is an
    FP8 cache, ``store_index_k_normed(cache, loc, k, weight, bias, eps, cos, sin, rope_dim,
    interleaved, check_values)`` and :func:`~dsaspec.ops.index_weights.index_weights` ``(x,
    head_weight, head_scale)`` (``x`` None: no head weights). ``q`` and ``k`` of one dtype, both
    read in place through their strides. Returns ``(query, head weights)``: a new contiguous
    tensor like ``q``, fp32 ``[R, N]`` (None without ``x``)."""
    out = _query(q, cos, sin, rope_dim)
    if isinstance(k, torch.Tensor) and k.dtype != q.dtype:
        raise ValueError(f"k: expected q's dtype {q.dtype}, got {k.dtype}")
    codes, scale, dest = _key(cache, loc, k, weight, bias, cos, sin, rope_dim, check_values)
    head_weights = None if x is None else prepare_index_weights(x, head_weight, head_scale,
                                                                weight_name="head_weight", device=q.device)
    _launch(cos, sin, rope_dim, interleaved, dest == _FP8, q=q, q_out=out, k=k, weight=weight, bias=bias, eps=eps,
            codes=codes, loc=loc, scale=scale, dest=dest, head_weights=head_weights)
    return out, None if head_weights is None else head_weights.out
