"""Row-invariant GEMM and norms: each output row is bitwise the same whatever the row count M and
whatever the other rows hold, so a target-verify step over ``bs * N`` rows reproduces the decode
step over ``bs`` rows token for token.

cuBLAS picks its kernel and split-K by M, and torch's row reductions pick block shapes by the
number of rows; here nothing that shapes the arithmetic depends on M:

* GEMM (``linear``, ``bmm``): one kernel, ``C[b] = A[b] @ B[b]`` with fp32 accumulation. The tile
  ``(BLOCK_M, BLOCK_N, BLOCK_K)``, the warps and the K split are a :class:`GemmConfig` chosen from
  ``(N, K, dtype, device, batch)`` by :func:`gemm_config`, never from M. A row of A meets a tile of
  B in a ``tl.dot`` of fixed shape (rows past M are masked to zero, and a tensor-core or FMA dot
  computes each output element from its own row and column only), K blocks are accumulated in
  order, and with a split K the splits' fp32 partials go to a workspace and the program that
  arrives last at a tile (an atomic tile counter, which it resets to 0) sums them in split order
  0, 1, ..., S-1 and writes the tile: the order of arrival decides who sums, never the order of
  the sum. fp32 operands use ``input_precision="ieee"`` (FMA, no TF32).
* Norms (``rms_norm``, ``add_rms_norm``, ``layer_norm``): the row's statistics in blocks and warps chosen
  from the row width only, by every program of the row alike (few rows: several programs a row, each
  writing its share of the columns). The RMSNorms can also write the FP8 GEMM's input in the same launch: act_quant's
  e4m3 codes and scales of each stored output row per 128 columns (``q_out`` / ``scale_out``:
  :func:`~dsaspec.ops.fp8_gemm.act_quant`'s math through :func:`~dsaspec.ops.e4m3.quantize_rows`,
  on the output's rounded values), per row, so row-invariant too.

The decode GEMMs are weight-bandwidth bound (M of 1..256, weights of 1..2000 MB), so a
configuration streams the weight once per M tile with many programs in flight: the K split is
picked so that at M <= BLOCK_M the grid holds about two programs per SM. The pure PyTorch
definitions are ``dsaspec.reference.row_invariant``.

Split-K launches on one device share one buffer of tile counters (allocated zeroed on the first
split launch, which must therefore happen outside CUDA-graph capture; every launch leaves it
zeroed; the indexer's split head weights, :mod:`dsaspec.ops.index_weights`, use it too): two
split-K launches must not run at the same time on different streams of one device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsaspec.ops.checks import check_tensor
from dsaspec.ops.device import enter_chain, last_to_arrive, sm_count, supports_pdl, tile_counters
from dsaspec.ops.e4m3 import quantize_rows
from dsaspec.ops.fp8_gemm import BLOCK as FP8_BLOCK, SCALE_FORMATS

_DTYPES = (torch.bfloat16, torch.float32)
_PROGRAMS_PER_SM = 2
_MIN_K_BLOCKS_PER_SPLIT = 2
_MAX_SPLIT_K = 32
_NORM_MAX_BLOCK = 8192
# The hidden-width norms writing FP8 codes at bs 1 / 4 / 32 took 2.96 / 3.10 / 4.03 us in programs of 1024
# columns against 6.11 / 6.02 / 6.24 in one program a row (GLM-5's 6144; DeepSeek-V3.2's 7168: 2.88 / 2.94 /
# 4.03 against 4.19 / 4.19 / 4.51) but 9.98 against 7.30 at 128 rows (768 programs; H200, cold L2, norms.md)
_NORM_TILE, _NORM_TILED_PROGRAMS_PER_SM = 1024, 2


@dataclass(frozen=True)
class GemmConfig:
    """Tile and K split of the row-invariant GEMM. Calls whose rows must agree bitwise must use
    the same configuration (the default, :func:`gemm_config`, depends only on N, K, dtype, device
    and batch)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"config.{name}: expected a power of two >= 16, got {value}")
        if not 1 <= self.split_k <= 256:
            raise ValueError(f"config.split_k: expected 1..256, got {self.split_k}")


def _k_split(k: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(K blocks per split, number of splits <= ``split_k``): no split is empty."""
    k_blocks = max(1, triton.cdiv(k, block_k))
    per_split = triton.cdiv(k_blocks, split_k)
    return per_split, triton.cdiv(k_blocks, per_split)


def split_k_for(n: int, k: int, block_n: int, block_k: int, device: torch.device | str, batch: int = 1) -> int:
    """K splits for ``batch`` products ``[*, K] @ [K, N]`` tiled ``block_n x block_k``:
    ``min(2 * SMs // (batch * N-tiles), K-blocks // 2, 32)``, at least 1, lowered so no split is
    empty. At M <= BLOCK_M the grid then holds about two programs per SM and each split keeps >= 2
    K blocks. SMs: the device's, 132 off-GPU."""
    tiles = max(1, batch * triton.cdiv(n, block_n))
    k_blocks = triton.cdiv(k, block_k)
    wanted = _PROGRAMS_PER_SM * sm_count(device) // tiles
    return _k_split(k, block_k, max(1, min(wanted, k_blocks // _MIN_K_BLOCKS_PER_SPLIT, _MAX_SPLIT_K)))[1]


def gemm_config(n: int, k: int, dtype: torch.dtype, device: torch.device | str, batch: int = 1) -> GemmConfig:
    """The default GEMM configuration for ``batch`` products ``[*, K] @ [K, N]``.

    bf16: ``BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, min(128, K rounded up to a power of 2)``, 4 warps,
    4 stages; fp32 (FMA dot): ``16, 32, min(32, ...)``, 4 warps, 3 stages; ``split_k`` from
    :func:`split_k_for`. Nothing depends on M.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: expected one of {_DTYPES}, got {dtype}")
    if dtype == torch.float32:
        block_n, block_k, num_warps, num_stages = 32, 32, 4, 3
    else:
        block_n, block_k, num_warps, num_stages = 64, 128, 4, 4
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    return GemmConfig(16, block_n, block_k, split_k_for(n, k, block_n, block_k, device, batch),
                      num_warps, num_stages)


@triton.jit(do_not_specialize=["M", "m_tiles"])
def _gemm_kernel(a_ptr, b_ptr, c_ptr, ws_ptr, counters_ptr,
                 M, N, K,
                 stride_ab, stride_am, stride_ak,
                 stride_bb, stride_bk, stride_bn,
                 stride_cb, stride_cm, stride_cn,
                 m_tiles, n_tiles, k_blocks_per_split,
                 SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, CHAINED: tl.constexpr):
    # M tiles vary fastest, so the programs that read one weight tile run together (L2 reuse).
    enter_chain(CHAINED)
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    pid_m = pid % m_tiles
    rest = pid // m_tiles
    split = rest % SPLIT_K
    pid_n = rest // SPLIT_K

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    k_lo = split * k_blocks_per_split * BLOCK_K
    k_hi = tl.minimum(K, k_lo + k_blocks_per_split * BLOCK_K)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = (a_ptr + batch * stride_ab + rows.to(tl.int64)[:, None] * stride_am
              + (k_lo + ks)[None, :] * stride_ak)
    b_ptrs = (b_ptr + batch * stride_bb + (k_lo + ks)[:, None] * stride_bk
              + cols.to(tl.int64)[None, :] * stride_bn)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        k_ok = (k + ks) < k_hi
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:  # the interpreter's bf16 dot multiplies the raw bits
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        # "ieee" keeps fp32 operands off TF32 (an FMA dot); bf16 operands ignore it.
        acc = tl.dot(a, b, acc, input_precision="ieee")
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    c_ptrs = (c_ptr + batch * stride_cb + rows.to(tl.int64)[:, None] * stride_cm
              + cols.to(tl.int64)[None, :] * stride_cn)
    c_mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)
    else:
        tile = (batch * n_tiles + pid_n) * m_tiles + pid_m
        in_tile = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        ws_tile = ws_ptr + tile * (SPLIT_K * BLOCK_M * BLOCK_N) + in_tile
        tl.store(ws_tile + split * (BLOCK_M * BLOCK_N), acc)
        if last_to_arrive(counters_ptr + tile, SPLIT_K):
            total = tl.load(ws_tile, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT_K):
                total += tl.load(ws_tile + s * (BLOCK_M * BLOCK_N), cache_modifier=".cg")
            tl.store(c_ptrs, total.to(c_ptr.dtype.element_ty), mask=c_mask)


def _gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, config: GemmConfig) -> torch.Tensor:
    """``out[i] = a[i] @ b[i]`` for 3-D strided ``a [B, M, K]``, ``b [B, K, N]``, ``out [B, M, N]``."""
    batch, m, k = a.shape
    n = b.shape[2]
    if batch == 0 or m == 0 or n == 0:
        return out
    per_split, splits = _k_split(k, config.block_k, config.split_k)
    m_tiles = triton.cdiv(m, config.block_m)
    n_tiles = triton.cdiv(n, config.block_n)
    if splits > 1:
        tiles = batch * m_tiles * n_tiles
        counters = tile_counters(out.device, tiles)
        workspace = torch.empty(tiles * splits * config.block_m * config.block_n,
                                dtype=torch.float32, device=out.device)
    else:
        counters = workspace = out  # not read by a one-split launch
    grid = (m_tiles * splits * n_tiles, batch)
    chained = supports_pdl(out.device)
    _gemm_kernel[grid](
        a, b, out, workspace, counters, m, n, k,
        a.stride(0), a.stride(1), a.stride(2),
        b.stride(0), b.stride(1), b.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        m_tiles, n_tiles, per_split,
        SPLIT_K=splits, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        UPCAST=not out.is_cuda, CHAINED=chained, launch_pdl=chained, num_warps=config.num_warps,
        num_stages=config.num_stages)
    return out


def _check_dtype(name: str, tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in _DTYPES:
        raise ValueError(f"{name}: expected dtype bfloat16 or float32, got {tensor.dtype}")


def linear(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None, *,
           config: GemmConfig | None = None) -> torch.Tensor:
    """Row-invariant ``y = x @ weight.T`` (fp32 accumulation, result in ``x``'s dtype).

    Parameters
    ----------
    x : Tensor ``[M, K]``, bf16 or fp32, unit last stride (any row stride).
    weight : Tensor ``[N, K]``, ``x``'s dtype and device, unit last stride.
    out : Tensor ``[M, N]``, ``x``'s dtype, unit last stride (any row stride), or None (allocated).
    config : GemmConfig or None; None: ``gemm_config(N, K, dtype, device)``. Each row's result is
        bitwise independent of M and of the other rows for a fixed configuration.

    Returns
    -------
    ``out``.
    """
    _check_dtype("x", x)
    check_tensor("x", x, dtype=x.dtype, ndim=2)
    m, k = x.shape
    check_tensor("weight", weight, dtype=x.dtype, shape=(None, k), device=x.device)
    n = weight.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    check_tensor("out", out, dtype=x.dtype, shape=(m, n), device=x.device)
    config = config or gemm_config(n, k, x.dtype, x.device)
    _gemm(x[None], weight.t()[None], out[None], config)
    return out


def bmm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, *,
        config: GemmConfig | None = None) -> torch.Tensor:
    """Row-invariant batched ``out[i] = a[i] @ b[i]`` (fp32 accumulation, result in ``a``'s dtype).

    Parameters
    ----------
    a : Tensor ``[B, M, K]``, bf16 or fp32, unit last stride (other strides free, e.g.
        ``q_nope.transpose(0, 1)``).
    b : Tensor ``[B, K, N]``, ``a``'s dtype and device, any strides (e.g. ``W_UV.transpose(1, 2)``).
    out : Tensor ``[B, M, N]``, ``a``'s dtype, unit last stride, or None (allocated contiguous).
    config : GemmConfig or None; None: ``gemm_config(N, K, dtype, device, batch=B)``.

    Returns
    -------
    ``out``.
    """
    _check_dtype("a", a)
    check_tensor("a", a, dtype=a.dtype, ndim=3)
    batch, m, k = a.shape
    if not isinstance(b, torch.Tensor):
        raise TypeError(f"b: expected a torch.Tensor, got {type(b).__name__}")
    if b.dtype != a.dtype:
        raise ValueError(f"b: expected dtype {a.dtype}, got {b.dtype}")
    if b.dim() != 3 or b.shape[0] != batch or b.shape[1] != k:
        raise ValueError(f"b: expected shape ({batch}, {k}, *), got {tuple(b.shape)}")
    if b.device != a.device:
        raise ValueError(f"b: expected device {a.device}, got {b.device}")
    n = b.shape[2]
    if out is None:
        out = torch.empty(batch, m, n, dtype=a.dtype, device=a.device)
    check_tensor("out", out, dtype=a.dtype, shape=(batch, m, n), device=a.device)
    return _gemm(a, b, out, config or gemm_config(n, k, a.dtype, a.device, batch=batch))


@triton.jit
def _norm_load(x_row, r_row, idx, mask, ADD: tl.constexpr):
    """fp32 of ``x`` at ``idx``; with ``ADD``, of ``x + r`` rounded to ``x``'s dtype (torch's add)."""
    x = tl.load(x_row + idx, mask=mask, other=0.0)
    if ADD:
        x = (x.to(tl.float32) + tl.load(r_row + idx, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
    return x.to(tl.float32)


@triton.jit
def _norm_kernel(x_ptr, r_ptr, s_ptr, w_ptr, b_ptr, y_ptr, q_ptr, qs_ptr, D, stride_x, stride_r, stride_s, stride_y,
                 stride_q, stride_qs, eps, LAYER_NORM: tl.constexpr, ADD: tl.constexpr, QUANT: tl.constexpr,
                 UE8M0: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr, QBLOCK: tl.constexpr,
                 CHAINED: tl.constexpr):
    # Program (row, c): the row's statistics over BLOCK-wide chunks (every program of the row the same
    # sums, so the same bits), then the outputs of columns [c * TILE, (c + 1) * TILE) as
    # [TILE / QBLOCK, QBLOCK] (QBLOCK divides TILE, TILE divides BLOCK). With ADD this program also
    # stores s over its columns. QUANT: act_quant of the stored y (its dtype's values) per QBLOCK
    # columns, e4m3 codes to q_ptr and fp32 scales to qs_ptr (D a multiple of QBLOCK).
    enter_chain(CHAINED)
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * TILE
    x_row = x_ptr + row * stride_x
    r_row = r_ptr + row * stride_r
    groups = tl.arange(0, TILE // QBLOCK)
    cols = start + groups[:, None] * QBLOCK + tl.arange(0, QBLOCK)[None, :]
    mask = cols < D
    # this program's columns and weights first: their loads overlap the statistics' loads
    x_tile = _norm_load(x_row, r_row, cols, mask, ADD)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if LAYER_NORM:
        b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    offs = tl.arange(0, BLOCK)
    if LAYER_NORM:
        total = tl.zeros((BLOCK,), dtype=tl.float32)
        for chunk in range(0, D, BLOCK):
            total += tl.load(x_row + chunk + offs, mask=chunk + offs < D, other=0.0).to(tl.float32)
        mean = tl.sum(total, axis=0) / D
    else:
        mean = 0.0
    squares = tl.zeros((BLOCK,), dtype=tl.float32)
    for chunk in range(0, D, BLOCK):
        in_row = chunk + offs < D
        centred = tl.where(in_row, _norm_load(x_row, r_row, chunk + offs, in_row, ADD) - mean, 0.0)
        squares += centred * centred
    rstd = tl.rsqrt(tl.sum(squares, axis=0) / D + eps)
    if ADD:
        tl.store(s_ptr + row * stride_s + cols, x_tile.to(s_ptr.dtype.element_ty), mask=mask)
    y = (x_tile - mean) * rstd * w
    if LAYER_NORM:
        y += b
    y = y.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * stride_y + cols, y, mask=mask)
    if QUANT:
        codes, scales = quantize_rows(y.to(tl.float32), UE8M0)
        tl.store(q_ptr + row * stride_q + cols, codes.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(qs_ptr + row * stride_qs + start // QBLOCK + groups, scales, mask=start + groups * QBLOCK < D)


def _norm(x, weight, bias, eps, out, residual=None, residual_out=None, q_out=None, scale_out=None, scale_fmt=None):
    """``out`` (``(out, residual_out)`` with ``residual``): see :func:`rms_norm`, :func:`add_rms_norm`."""
    _check_dtype("x", x)
    check_tensor("x", x, dtype=x.dtype, ndim=2)
    m, d = x.shape
    if d < 1:
        raise ValueError(f"x: expected at least one column, got shape {tuple(x.shape)}")
    check_tensor("weight", weight, dtype=x.dtype, shape=(d,), device=x.device)
    if bias is not None:
        check_tensor("bias", bias, dtype=x.dtype, shape=(d,), device=x.device)
    if out is None:
        out = torch.empty(m, d, dtype=x.dtype, device=x.device)
    check_tensor("out", out, dtype=x.dtype, shape=(m, d), device=x.device)
    add = residual is not None
    if add:
        check_tensor("residual", residual, dtype=x.dtype, shape=(m, d), device=x.device)
        if residual_out is None:
            residual_out = torch.empty(m, d, dtype=x.dtype, device=x.device)
        check_tensor("residual_out", residual_out, dtype=x.dtype, shape=(m, d), device=x.device)
        shared = residual_out.untyped_storage().data_ptr()
        if m and shared in (x.untyped_storage().data_ptr(), residual.untyped_storage().data_ptr()):
            raise ValueError("residual_out: must not share storage with x or residual (the kernel reads "
                             "them again after writing it)")
    quant = q_out is not None or scale_out is not None
    if quant:
        if scale_fmt not in SCALE_FORMATS:
            raise ValueError(f"scale_fmt: expected one of {SCALE_FORMATS}, got {scale_fmt!r}")
        if d % FP8_BLOCK:
            raise ValueError(f"x: D = {d} must be a multiple of {FP8_BLOCK} (the FP8 quantization block) to quantize")
        if q_out is None or scale_out is None:
            raise ValueError("q_out, scale_out: expected both tensors (the codes and the scales) or neither")
        check_tensor("q_out", q_out, dtype=torch.float8_e4m3fn, shape=(m, d), device=x.device)
        check_tensor("scale_out", scale_out, dtype=torch.float32, shape=(m, d // FP8_BLOCK), device=x.device)
    if m == 0:
        return (out, residual_out) if add else out
    block = min(triton.next_power_of_2(d), _NORM_MAX_BLOCK)
    # few rows: a row's outputs split over programs of _NORM_TILE columns, each summing the whole row
    # again (the row's bytes from L2), so one row's normalize and quantize arithmetic is not one SM's;
    # up to two programs per SM (more lost: norms.md)
    tile = min(block, _NORM_TILE)
    if m * triton.cdiv(d, tile) > _NORM_TILED_PROGRAMS_PER_SM * sm_count(x.device):
        tile = block
    chained = supports_pdl(x.device)
    _norm_kernel[(m, triton.cdiv(d, tile))](
        x, residual if add else x, residual_out if add else x, weight, weight if bias is None else bias, out,
        q_out if quant else out, scale_out if quant else out, d, x.stride(0), residual.stride(0) if add else 0,
        residual_out.stride(0) if add else 0, out.stride(0), q_out.stride(0) if quant else 0,
        scale_out.stride(0) if quant else 0, float(eps), LAYER_NORM=bias is not None, ADD=add, QUANT=quant,
        UE8M0=scale_fmt == "ue8m0", BLOCK=block, TILE=tile, QBLOCK=min(tile, FP8_BLOCK),
        CHAINED=chained, launch_pdl=chained, num_warps=min(16, max(1, block // 512)))
    return (out, residual_out) if add else out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None, *,
             q_out: torch.Tensor | None = None, scale_out: torch.Tensor | None = None,
             scale_fmt: str | None = None) -> torch.Tensor:
    """Row-invariant ``y = x * rsqrt(mean(x^2) + eps) * weight``, fp32 math, result in ``x``'s dtype.

    Parameters
    ----------
    x : Tensor ``[M, D]``, bf16 or fp32, unit last stride (any row stride), D >= 1.
    weight : Tensor ``[D]``, ``x``'s dtype and device.
    eps : float.
    out : Tensor ``[M, D]``, ``x``'s dtype, unit last stride, or None (allocated).
    q_out, scale_out : both or neither: e4m3 ``[M, D]`` and fp32 ``[M, D / 128]`` (unit last
        strides; D a multiple of 128), where the same launch also writes
        :func:`~dsaspec.ops.fp8_gemm.act_quant` of ``out`` as stored (its dtype's values, not the
        fp32 ones) with ``scale_fmt`` (None or ``"ue8m0"``): bitwise act_quant's codes and scales,
        the input of :func:`~dsaspec.ops.fp8_gemm.fp8_gemm`.

    Returns
    -------
    ``out``.
    """
    return _norm(x, weight, None, eps, out, q_out=q_out, scale_out=scale_out, scale_fmt=scale_fmt)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None, *,
                 q_out: torch.Tensor | None = None, scale_out: torch.Tensor | None = None,
                 scale_fmt: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-invariant residual add and RMSNorm in one kernel: ``s = x + residual`` rounded to ``x``'s
    dtype (torch's add), ``y = rms_norm(s, weight, eps)``; both bitwise what ``x + residual`` then
    :func:`rms_norm` give (the same kernel, the same reduction).

    Parameters
    ----------
    x, residual : Tensor ``[M, D]``, bf16 or fp32 (one dtype), unit last stride, D >= 1.
    weight : Tensor ``[D]``, ``x``'s dtype and device.
    eps : float.
    out : Tensor ``[M, D]`` for ``y``, or None (allocated).
    residual_out : Tensor ``[M, D]`` for ``s``, not sharing storage with ``x`` or ``residual``, or
        None (allocated).
    q_out, scale_out, scale_fmt : ``y``'s act_quant, as :func:`rms_norm`.

    Returns
    -------
    ``(out, residual_out)``.
    """
    if residual is None:
        raise ValueError("residual: expected a tensor of shape (M, D), got None")
    return _norm(x, weight, None, eps, out, residual, residual_out, q_out, scale_out, scale_fmt)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Row-invariant ``y = (x - mean(x)) * rsqrt(var(x) + eps) * weight + bias`` (biased variance,
    two passes), fp32 math, result in ``x``'s dtype. Shapes as :func:`rms_norm`; ``bias`` like
    ``weight``."""
    if bias is None:
        raise ValueError("bias: expected a tensor of shape (D,), got None")
    return _norm(x, weight, bias, eps, out)
