"""FP8 block-scaled linear algebra of the DeepSeek-V3 / V3.2 / GLM-5 FP8 checkpoints: per-token
activation quantization and the block-scaled GEMM ``y = (A_q * a_scale) @ (W_q * w_scale)^T``.

The format (``quantization_config {quant_method: fp8, fmt: e4m3, weight_block_size: [128, 128]}``):
a weight ``W [N, K]`` is stored as ``weight`` e4m3 (``torch.float8_e4m3fn``) and
``weight_scale_inv`` fp32 ``[ceil(N / 128), K / 128]``, one scale per 128 x 128 block, with
``W[n, k] ~= weight[n, k] * weight_scale_inv[n // 128, k // 128]`` (DeepSeek's ``weight_dequant``).
Activations are quantized at run time per token per 128 columns (DeepSeek's ``act_quant``), and the
GEMM accumulates each 128-column K block in fp32 and scales it by ``a_scale[m, kb] * w_scale[nb, kb]``
(DeepSeek's ``fp8_gemm``), adding the blocks in two levels (below).

Activation scales, as the reference ``inference/kernel.py`` files compute them:

* DeepSeek-V3 (Triton ``act_quant``): ``s = amax / 448`` (448: the e4m3 maximum), fp32, not
  rounded, no floor (an all-zero block gives ``s = 0`` and NaN values), ``q = e4m3(x / s)``.
* DeepSeek-V3.2 (tilelang ``act_quant``): ``amax = max(amax, 1e-4)``; with ``scale_fmt`` None
  ``s = amax * fp32(1 / 448)``, with ``scale_fmt`` set (its ``config.json`` has ``"scale_fmt":
  "ue8m0"``) ``s = 2 ** ceil(log2(amax / 448))``, a power of two (UE8M0: exponent only), computed on
  the fp32 bits; ``q = e4m3(clamp(x / s, -448, 448))``; scales stored fp32 either way.

This module follows V3.2 (floor 1e-4, clamp) with V3's correctly rounded ``amax / 448`` for fp32
scales (V3.2's multiply by ``fp32(1 / 448)`` may differ from it in the last bit):

    amax = max(max |x[m, 128 kb : 128 kb + 128]|, 1e-4)
    s    = amax / 448                              scale_fmt None (fp32, correctly rounded)
    s    = 2 ** ceil(log2(amax / 448))             scale_fmt "ue8m0"
    q    = e4m3_rne(clamp(x / s, -448, 448))       x / s correctly rounded; a zero code is +0

A block holding a NaN or an infinity gets ``s = NaN`` and ``q = 0``, so every output of its row is
NaN (a non-finite activation never turns into finite garbage). Weights are quantized the same way
per 128 x 128 block (:func:`quantize_weight`, fp32 scales). The kernel quantizes with the device
functions of :mod:`dsaspec.ops.e4m3`, which round ``x / s`` to the e4m3 grid before the cast, so
the codes are the same on the GPU and under the Triton interpreter.

The GEMM computes 16 x 64 output tiles (64 x 64 from ``TALL_TILE_MIN_M`` rows with ``fast_accum``:
:func:`tile_rows`) and sums K in groups of ``G`` consecutive blocks, ``G = k_group(N, K, SMs)`` from
the weight's shape and the device only:

    acc_g = sum over the blocks kb of group g, in order from 0, of dot_kb * a_scale * w_scale
    out   = cast(sum over g, in order from 0, of acc_g)                  (fp32 sums)

One program per tile may add every group in turn (unsplit), or each group runs as its own program
writing fp32 ``acc_g`` into ``[groups, M, N]`` partials, the tile's last program to finish (an
arrival counter, :func:`~dsaspec.ops.device.last_to_arrive`) adding them in group order and casting
(split: ``ceil(N / 64) * groups`` programs a row block instead of ``ceil(N / 64)``, where a decode M
leaves SMs idle behind one serial K loop; one launch either way). Both forms do the same fp32
operations in the same order, so the choice may follow M (:func:`gemm_plan`: split below one tile
per SM) while every row's bits depend on neither M nor the other rows. At the TP 8 rank shapes on
132 SMs ``G`` is 8 for the fused attention inputs (K 6144 / 7168: 6 / 7 groups), ``o_proj`` and
GLM-5's fused q latent GEMM (2 groups), 2 for the shared expert's gate/up (24 / 28 groups), 1 for
its down (2 groups); DeepSeek-V3.2's fused q latent GEMM (176 tiles) keeps one group.

:func:`fp8_linear` runs :func:`act_quant`, then :func:`fp8_gemm` (two chained launches). Where
the kernel that writes the activations can write their codes too (the RMSNorm kernel of
:mod:`dsaspec.ops.row_invariant`: ``rms_norm`` / ``add_rms_norm`` with ``q_out`` /
``scale_out``, the same device function on the rounded values it stores), the caller runs
:func:`fp8_gemm` on them: one launch, the same bits. (Quantizing inside the GEMM's programs, which
redo it in every N program, was never faster than the two launches on an H200 at the rank shapes
and M 1 - 4: benchmarks/results/h200/logs/fp8_linear_cuda_cores_glm5_rank_session30.md.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaspec.ops.checks import check_count, check_tensor
from dsaspec.ops.device import enter_chain, last_to_arrive, sm_count, supports_pdl, tile_counters
from dsaspec.ops.e4m3 import quantize_rows

BLOCK = 128              # quantization block: 128 columns of a token, 128 x 128 of a weight
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4
SCALE_FORMATS = (None, "ue8m0")
_ACT_DTYPES = (torch.bfloat16, torch.float32)
_OUT_DTYPES = (torch.bfloat16, torch.float32)
# rows per act_quant program: up to 16, fewer for fewer rows (every row of a program is computed,
# padding included: at M = 1 a 16-row program did 16x the work); one warp up to 2 rows
_QUANT_ROWS = 16
# One GEMM tile for every M and K groups fixed by the weight's shape (k_group), so each output row
# is computed the same way whatever the other rows are (row-invariant by construction).
_GEMM_BLOCK_M, _GEMM_BLOCK_N = 16, 64
# With fast_accum, TALL_TILE_MIN_M rows and more take 64-row tiles: the e4m3 warpgroup MMA (16-row
# tiles compile to HMMAs on widened codes, fp32 sums) and the weights read M / 64 times instead of
# M / 16: at the GLM-5 rank shapes 1.08 - 1.44x faster at 64 rows, 1.02 - 1.62x at 128,
# 1.3 - 2.4x at 256 and 1.3 - 2.8x at 1024, 1.00 - 1.04x at 32
# (benchmarks/results/h200/logs/fp8_linear_tall_e4m3_session10.md). That MMA keeps fewer bits than
# fp32 in its sum of a 128-column block: errors to 2^-9.9 of sum |a||w| against 2^-22 with the
# codes widened to fp16 first, which is no faster than 16-row tiles
# (benchmarks/results/h200/logs/fp8_tall_tile_accuracy_session10.log, fp8_linear_tall_widened_session10.md).
TALL_BLOCK_M = 64
TALL_TILE_MIN_M = 32
# The split form aims at this many programs per SM for one row block (k_group): two 16 x 64 programs
# of 4 stages (_GEMM_STAGES) keep ~64 KB of weight loads in flight per SM.
SPLIT_PROGRAMS_PER_SM = 2
# K blocks a program keeps in flight (pipeline stages): 4 for 16-row tiles, alone at cold L2 on the
# GLM-5 rank shapes 3 - 5% faster split at M 1 - 16 and 10 - 15% unsplit than 3 (6 and 8 slower
# than 4; benchmarks/results/h200/logs/fp8_linear_stages_glm5_rank_session14.md); 3 for the tall
# 64-row tiles, not timed at 4
_GEMM_STAGES, _TALL_GEMM_STAGES = 4, 3


def _check_scale_fmt(scale_fmt) -> None:
    if scale_fmt not in SCALE_FORMATS:
        raise ValueError(f"scale_fmt: expected one of {SCALE_FORMATS}, got {scale_fmt!r}")


def _check_k(name: str, k: int) -> None:
    if k < BLOCK or k % BLOCK:
        raise ValueError(f"{name}: K = {k} must be a positive multiple of {BLOCK} (the FP8 quantization block)")


@triton.jit(do_not_specialize=["M"])
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, stride_xm, stride_qm, stride_sm,
                      UE8M0: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, CHAINED: tl.constexpr):
    enter_chain(CHAINED)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    kb = tl.program_id(1)
    cols = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    live = rows < M
    mask = live[:, None]
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :], mask=mask, other=0.0)
    y, s = quantize_rows(x.to(tl.float32), UE8M0)
    tl.store(q_ptr + rows[:, None].to(tl.int64) * stride_qm + cols[None, :], y.to(q_ptr.dtype.element_ty),
             mask=mask)
    tl.store(s_ptr + rows.to(tl.int64) * stride_sm + kb, s, mask=live)


def act_quant(x: torch.Tensor, scale_fmt: str | None = None, *, out: torch.Tensor | None = None,
              scale_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize activations per token per 128 columns (module docstring for the math).

    ``x``: bf16 or fp32 ``[M, K]`` (last dim contiguous), ``K`` a multiple of 128. ``scale_fmt``:
    None (fp32 scales) or ``"ue8m0"`` (power-of-two scales). Writes and returns ``out`` e4m3
    ``[M, K]`` and ``scale_out`` fp32 ``[M, K / 128]`` (allocated when None). No host sync."""
    _check_scale_fmt(scale_fmt)
    m, k = _check_x(x)
    if out is None:
        out = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    if scale_out is None:
        scale_out = torch.empty(m, k // BLOCK, dtype=torch.float32, device=x.device)
    check_tensor("out", out, dtype=torch.float8_e4m3fn, shape=(m, k), device=x.device)
    check_tensor("scale_out", scale_out, dtype=torch.float32, shape=(m, k // BLOCK), device=x.device)
    rows = min(_QUANT_ROWS, triton.next_power_of_2(max(m, 1)))
    grid = (triton.cdiv(m, rows), k // BLOCK)
    chained = supports_pdl(x.device)
    _act_quant_kernel[grid](x, out, scale_out, m, x.stride(0), out.stride(0), scale_out.stride(0),
                            UE8M0=scale_fmt == "ue8m0", ROWS=rows, BLOCK_K=BLOCK, CHAINED=chained,
                            launch_pdl=chained, num_warps=1 if rows <= 2 else 4)
    return out, scale_out


@triton.jit
def _k_block(acc, acc_g, left, group, a, w, a_s, w_s):
    # one K block's terms into its group's sum acc_g; a group's last block adds acc_g into acc
    acc_g += tl.dot(a, w) * (a_s[:, None] * w_s)
    left -= 1
    if left == 0:
        acc += acc_g
        acc_g = tl.zeros(acc_g.shape, dtype=tl.float32)
        left = group
    return acc, acc_g, left


@triton.jit
def _late_block(acc, acc_g, left, group, a, w, as_ptrs, ws_ptrs, kb, kb_end, row_live):
    # _k_block of K block kb (none at or past kb_end), its activations a and weight tile w loaded earlier
    if kb < kb_end:
        a_s = tl.load(as_ptrs + kb, mask=row_live, other=0.0)
        acc, acc_g, left = _k_block(acc, acc_g, left, group, a, w, a_s, tl.load(ws_ptrs + kb))
    return acc, acc_g, left


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, c_ptr, p_ptr, counters_ptr, M, N, K, group,
                     stride_am, stride_asm, stride_wn, stride_wsn, stride_cm, stride_pg, stride_pm,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SPLIT: tl.constexpr, EARLY: tl.constexpr, CHAINED: tl.constexpr):
    # acc = ((0 + acc_0) + acc_1) + ..., acc_g = (0 + its K blocks' terms in order); group g is K
    # blocks [g * group, (g + 1) * group). SPLIT: program (i, j, g) runs group g alone and stores fp32
    # acc = 0 + acc_g at p_ptr + g * stride_pg; the tile's last program to arrive (its counter) adds
    # the groups' partials from 0 in g order, the same sums.
    # EARLY (0 or 1): the weight tile of the program's last K block is loaded before the chain's wait
    # (the kernel before never writes weights) and held in registers; the loop runs the blocks before
    # it, then its term is added, in order
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n0 = tl.program_id(1) * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_live = rows < M
    col_live = cols < N
    kb_end = K // BLOCK_K
    kb_first = 0
    if SPLIT:
        kb_first = tl.program_id(2) * group
        kb_end = tl.minimum(kb_first + group, kb_end)
    kb_late = tl.maximum(kb_end - EARLY, kb_first)        # the late block (kb_end where none)
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + (kb_first * BLOCK_K + ks)[None, :]
    w_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_wn + (kb_first * BLOCK_K + ks)[:, None]  # [BLOCK_K, BLOCK_N]
    as_ptrs = as_ptr + rows.to(tl.int64) * stride_asm
    ws_ptrs = ws_ptr + (n0 // BLOCK_K) * stride_wsn       # BLOCK_N divides 128: one scale row per tile
    late = (kb_late - kb_first) * BLOCK_K                 # the late block's offset from a_ptrs / w_ptrs
    if EARLY > 0:
        w0 = tl.load(w_ptrs + late, mask=col_live[None, :] & (kb_late < kb_end), other=0.0)
    enter_chain(CHAINED)
    if EARLY > 0:
        a0 = tl.load(a_ptrs + late, mask=row_live[:, None] & (kb_late < kb_end), other=0.0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    left = group                                          # K blocks left in the current group
    for kb in range(kb_first, kb_late):
        a = tl.load(a_ptrs, mask=row_live[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=col_live[None, :], other=0.0)
        a_s = tl.load(as_ptrs + kb, mask=row_live, other=0.0)
        acc, acc_g, left = _k_block(acc, acc_g, left, group, a, w, a_s, tl.load(ws_ptrs + kb))
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if EARLY > 0:
        acc, acc_g, left = _late_block(acc, acc_g, left, group, a0, w0, as_ptrs, ws_ptrs, kb_late, kb_end, row_live)
    acc += acc_g       # a partial last group; else acc_g is +0 and acc (never -0: it starts at +0) stays
    live = row_live[:, None] & col_live[None, :]
    c_ptrs = c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :]
    if SPLIT:
        p_ptrs = p_ptr + rows[:, None].to(tl.int64) * stride_pm + cols[None, :]
        groups = tl.num_programs(2)
        tl.store(p_ptrs + tl.program_id(2).to(tl.int64) * stride_pg, acc, mask=live)
        tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if last_to_arrive(counters_ptr + tile, groups):
            for g in range(groups):
                acc += tl.load(p_ptrs + g * stride_pg, mask=live, other=0.0, cache_modifier=".cg")
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=live)
    else:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=live)


def _check_x(x: torch.Tensor) -> tuple[int, int]:
    check_tensor("x", x, dtype=_ACT_DTYPES, ndim=2)
    m, k = x.shape
    check_count("x.shape[0] (M)", m)
    _check_k("x", k)
    return m, k


def _check_weight(w: torch.Tensor, w_scale: torch.Tensor, k: int, device: torch.device) -> int:
    """Check ``w [N, K]`` and ``w_scale`` against the activations' ``K`` and device; returns N."""
    check_tensor("w", w, dtype=torch.float8_e4m3fn, ndim=2)
    n = w.shape[0]
    check_count("w.shape[0] (N)", n)
    check_tensor("w", w, dtype=torch.float8_e4m3fn, shape=(n, k), device=device)
    check_tensor("w_scale", w_scale, dtype=torch.float32, shape=(triton.cdiv(n, BLOCK), k // BLOCK), device=device)
    return n


def k_group(n: int, k: int, sms: int) -> int:
    """K blocks (of 128 columns) per K group of an ``[N, K]`` weight on a device of ``sms`` SMs:
    the fewest that keep the split form at most ``SPLIT_PROGRAMS_PER_SM * sms`` programs a row
    block (``ceil(N / 64)`` tiles times ``ceil(K / 128 / G)`` groups); all of K (one group) where
    the tiles alone reach that. Never a function of M: the bits of every row depend on it."""
    blocks = k // BLOCK
    groups = max(1, min(blocks, SPLIT_PROGRAMS_PER_SM * sms // triton.cdiv(n, _GEMM_BLOCK_N)))
    return triton.cdiv(blocks, groups)


def tile_rows(m: int, fast_accum: bool) -> int:
    """Rows of a GEMM tile for M rows: 16, or with ``fast_accum`` ``TALL_BLOCK_M`` from
    ``TALL_TILE_MIN_M`` rows on."""
    return TALL_BLOCK_M if fast_accum and m >= TALL_TILE_MIN_M else _GEMM_BLOCK_M


def gemm_plan(m: int, n: int, k: int, device: torch.device, split: bool | None = None,
              block_m: int | None = None) -> tuple[int, int, bool]:
    """``(G, groups, split)`` of an ``[M, K] x [N, K]^T`` product on ``device`` in tiles of
    ``block_m`` rows (None: 16): :func:`k_group`, its group count and the form; ``split`` None:
    split where there is more than one group and the unsplit form's tiles (``ceil(M / block_m)
    ceil(N / 64)``) are fewer than the SMs."""
    sms = sm_count(device)
    group = k_group(n, k, sms)
    groups = triton.cdiv(k // BLOCK, group)
    if split is None:
        split = groups > 1 and triton.cdiv(m, block_m or _GEMM_BLOCK_M) * triton.cdiv(n, _GEMM_BLOCK_N) < sms
    return group, groups, split


def _gemm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
          out: torch.Tensor | None, out_dtype: torch.dtype, plan: tuple[int, int, bool], block_m: int) -> torch.Tensor:
    """Check ``out`` and launch the GEMM of the codes ``a [M, K]`` (scales ``a_scale``) and ``w``
    (both checked) in tiles of ``block_m`` rows as ``plan`` (:func:`gemm_plan`) says."""
    m, k = a.shape
    n = w.shape[0]
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype: expected one of {_OUT_DTYPES}, got {out_dtype}")
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if out.dtype not in _OUT_DTYPES:
        raise ValueError(f"out: expected dtype in {_OUT_DTYPES}, got {out.dtype}")
    check_tensor("out", out, dtype=out.dtype, shape=(m, n), device=a.device)
    group, groups, split = plan
    chained = supports_pdl(a.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, _GEMM_BLOCK_N), groups if split else 1)
    if split:
        partials = torch.empty(groups, m, n, dtype=torch.float32, device=a.device)
        counters = tile_counters(a.device, grid[0] * grid[1])
    else:
        partials = counters = out                         # unread
    # 16-row programs take their last weight tile before the chain's wait where M spans several of them:
    # on the 24-layer GLM-5 rank (H100) TPOT at bs 32 went 6.46 -> 6.41 ms, the wait filling the gap after
    # the kernel before; at 1 - 16 rows the same tile cost 0.4 - 1% (docs/runtime.md, "Chained launches")
    _fp8_gemm_kernel[grid](a, a_scale, w, w_scale, out, partials, counters, m, n, k, group,
                           a.stride(0), a_scale.stride(0), w.stride(0), w_scale.stride(0), out.stride(0),
                           partials.stride(0) if split else 0, partials.stride(1) if split else 0,
                           BLOCK_M=block_m, BLOCK_N=_GEMM_BLOCK_N, BLOCK_K=BLOCK, SPLIT=split,
                           EARLY=int(block_m == _GEMM_BLOCK_M and m > block_m),
                           CHAINED=chained, launch_pdl=chained, num_warps=4,
                           num_stages=_GEMM_STAGES if block_m == _GEMM_BLOCK_M else _TALL_GEMM_STAGES)
    return out


def fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, *,
             out: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
             split: bool | None = None, fast_accum: bool = False) -> torch.Tensor:
    """Block-scaled FP8 GEMM in K groups of ``G = k_group(N, K, SMs)`` blocks of 128:

        acc_g[m, n]  = sum over the blocks kb of group g in order, from 0, of
                       (sum_{k in kb} a[m, k] w[n, k]) * (a_scale[m, kb] * w_scale[n // 128, kb])
        out[m, n]    = sum over g in order, from 0, of acc_g[m, n]      (fp32), cast once

    ``a``: e4m3 ``[M, K]`` with ``a_scale`` fp32 ``[M, K / 128]`` (:func:`act_quant`); ``w``: e4m3
    ``[N, K]`` with ``w_scale`` fp32 ``[ceil(N / 128), K / 128]`` (a checkpoint's ``weight`` and
    ``weight_scale_inv``); ``K`` a multiple of 128, any ``N >= 1``, any ``M >= 1`` (tuned for the
    decode / verify sizes 1..512). Writes and returns ``out`` ``[M, N]`` (``out_dtype`` bf16 or
    fp32; allocated when None). ``split`` True: one program per tile and K group, each writing its
    fp32 ``acc_g`` to a ``[groups, M, N]`` buffer (allocated per call) that the tile's last program
    to finish adds and casts (the device's tile counters: the first split call on a device must not
    be under CUDA-graph capture); False: one program per tile, all groups in turn; None: split where
    the unsplit tiles leave SMs idle (module docstring). Both forms give the same bits, and G does
    not depend on M: each row's result is bitwise independent of M and of the other rows.
    ``fast_accum``: tiles of :func:`tile_rows` rows (64 from ``TALL_TILE_MIN_M``, each 128-column
    block summed at the e4m3 MMA's precision: not fp32, not row-invariant across the switch). No
    host sync."""
    check_tensor("a", a, dtype=torch.float8_e4m3fn, ndim=2)
    m, k = a.shape
    check_count("a.shape[0] (M)", m)
    _check_k("a", k)
    check_tensor("a_scale", a_scale, dtype=torch.float32, shape=(m, k // BLOCK), device=a.device)
    n = _check_weight(w, w_scale, k, a.device)
    block_m = tile_rows(m, fast_accum)
    return _gemm(a, a_scale, w, w_scale, out, out_dtype, gemm_plan(m, n, k, a.device, split, block_m), block_m)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, scale_fmt: str | None = None, *,
               out: torch.Tensor | None = None, split: bool | None = None, fast_accum: bool = False) -> torch.Tensor:
    """``x @ W^T`` for an FP8 block-scaled ``W`` (``w`` e4m3 ``[N, K]``, ``w_scale``
    ``[ceil(N / 128), K / 128]``): ``x`` (bf16 or fp32 ``[M, K]``, unit last stride) quantized by
    :func:`act_quant` with ``scale_fmt``, then the :func:`fp8_gemm` product (``split`` and
    ``fast_accum`` as there); writes and returns ``out`` ``[M, N]`` in ``x``'s dtype."""
    _check_scale_fmt(scale_fmt)
    m, k = _check_x(x)
    n = _check_weight(w, w_scale, k, x.device)
    block_m = tile_rows(m, fast_accum)
    q, s = act_quant(x, scale_fmt)
    return _gemm(q, s, w, w_scale, out, x.dtype, gemm_plan(m, n, k, x.device, split, block_m), block_m)


def quantize_blocks(x: torch.Tensor, block_rows: int, scale_fmt: str | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch quantization of ``x [N, K]`` (float, ``K`` a multiple of 128) per
    ``block_rows`` x 128 block, with :func:`act_quant`'s math (the floor, ``scale_fmt``, the clamp,
    +0 for a zero code, scale NaN and codes 0 for a block with NaN or inf): ``block_rows`` 1 is
    :func:`act_quant` (eager, any device), 128 the weights' blocks (a partial last block uses its
    rows). Returns e4m3 ``[N, K]`` and fp32 ``[ceil(N / block_rows), K / 128]``."""
    _check_scale_fmt(scale_fmt)
    n, k = x.shape
    _check_k("x", k)
    nb = triton.cdiv(n, block_rows)
    padded = torch.zeros(nb * block_rows, k, dtype=torch.float32, device=x.device)
    padded[:n] = x
    blocks = padded.view(nb, block_rows, k // BLOCK, BLOCK)
    bad = ~torch.isfinite(blocks).all(dim=3).all(dim=1)
    amax = blocks.abs().nan_to_num(0.0, 0.0, 0.0).amax(dim=(1, 3)).clamp_min(AMAX_FLOOR)
    # A tensor divisor: CUDA divides by a Python scalar as a multiply by its reciprocal, which can
    # differ from the correctly rounded quotient in the last bit.
    scale = amax / torch.full_like(amax, E4M3_MAX)
    if scale_fmt == "ue8m0":
        bits = scale.view(torch.int32)
        exponent = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
        scale = (exponent << 23).view(torch.float32)
    q = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
    q = torch.where(bad[:, None, :, None], 0.0, q)
    q = q.view(nb * block_rows, k)[:n].to(torch.float8_e4m3fn)
    bits = q.view(torch.uint8)
    bits.masked_fill_(bits == 0x80, 0)                                  # -0 -> +0
    return q, torch.where(bad, torch.nan, scale)


@torch.no_grad()
def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a float ``weight [N, K]`` (``K`` a multiple of 128) per 128 x 128 block
    (:func:`quantize_blocks`, fp32 scales): e4m3 ``[N, K]`` and ``weight_scale_inv``
    ``[ceil(N / 128), K / 128]``. Raises ``ValueError`` for a non-finite weight."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight: expected a 2-D float tensor, got {getattr(weight, 'shape', weight)!r}")
    _check_k("weight", weight.shape[1])
    if not torch.isfinite(weight).all():
        raise ValueError("weight: holds NaN or infinite values; FP8 block scales need finite weights")
    return quantize_blocks(weight, BLOCK)


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight [N, K]`` e4m3 times its block scales ``[ceil(N / 128), K / 128]`` (fp32 math),
    as ``dtype``. Plain torch, no host sync (graph-capturable)."""
    n, k = weight.shape
    expanded = scale.repeat_interleave(BLOCK, dim=0)[:n].repeat_interleave(BLOCK, dim=1)
    return (weight.float() * expanded).to(dtype)
