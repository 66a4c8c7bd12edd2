"""Sparse MQA attention in the MLA latent space over the slots the indexer selected.

Each query row attends to its own ``k`` selected cache slots (``-1`` = no slot) with one shared
576-wide key per slot (latent 512 + rope 64) whose first 512 values are the value. Grid
``(R, cdiv(H, BLOCK_H) * 512 / BLOCK_DV, num_splits)``: a program holds a block of heads as the
M dimension of its bf16 tensor-core dots (64: every head of a GLM-5 row, so each gathered key
serves all heads) and ``BLOCK_DV`` of the 512 value columns (fewer accumulator registers and more
programs; every value block recomputes the same scores), scans the row's slot list once for its
last valid entry, then runs an online softmax (fp32) over blocks of ``BLOCK_N`` slots up to it,
the gathers software-pipelined by Triton (how far they overlap the dots: docs/dsa-kernels.md). Without a
workspace ``num_splits`` is 1 and a row's result depends only on that row (row-invariant). With a
workspace (sized from ``R`` and the SM count by :func:`sparse_mla_workspace`) the slot blocks are
split over the third grid dimension and a combine kernel merges the partial softmaxes
(flash-decoding), for small ``R * H`` (docs/dsa-kernels.md); on Hopper and newer the combine is
launched as a programmatic dependent of the split kernel, so its launch overlaps the split
kernel's run.

The cache is bf16 ``[slots, 576]`` or the ``fp8_ds_mla`` bytes (uint8 ``[slots, 656]``: 512 e4m3
latent codes, 4 fp32 power-of-two scales, 64 bf16 rope values). On the FP8 cache the same kernel
(constexpr ``FP8`` in its gathers) loads the selected slots' codes and scales and dequantizes the
latent to bf16 in registers before the same bf16 dots (exact: a power-of-two scale times an
e4m3 code is a bf16 value), reading 656 bytes a selected slot instead of 1,152.

With ``slot_major`` (:attr:`SparseMLAConfig.slot_major`) the dots swap roles: the block's slots,
then the value columns, are their M dimension and the heads their N, for a rank's few heads (in
this Triton kernel and in the Gluon kernel's slot-major attend partition).

On Hopper (compute capability 9.x) with a head count of 8, 16 or 32 (a GLM-5 or DeepSeek-V3.2
rank's share at TP 2 to 8: one program of 64 head slots, the rest padding) or a multiple of 64,
the default configuration is :data:`SPARSE_MLA_GLUON_CONFIG` for the single pass at every row
count and for the split path from :data:`GLUON_MIN_SPLIT_HEAD_BLOCKS` programs without splits
(rows x ``cdiv(H, 64)`` head blocks): the warp-specialized Gluon kernel of
:mod:`dsaspec.ops.sparse_mla_gluon` (same contract, same split records and combine; its own
summation order), at 8 and 16 heads in its slot-major form (:data:`SLOT_MAJOR_DEFAULT_MAX_HEADS`;
``sparse_mla_config(..., slot_major=False)`` keeps the padded one). On an FP8 cache its gathers
dequantize each block into the bf16 ring (:data:`SPARSE_MLA_GLUON_FP8_CONFIG`, :data:`SPARSE_MLA_GLUON_FP8_NARROW_CONFIG`,
:data:`SPARSE_MLA_GLUON_FP8_ONE_SPLIT_CONFIG`, :data:`SPARSE_MLA_GLUON_FP8_IN_SLOT_CONFIG`);
:func:`sparse_mla_config` gives FP8 caches :data:`GLUON_FP8_DEFAULT_CONFIG` (64-slot blocks
dequantized in their ring slot) where it gives bf16 caches the Gluon kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsaspec.ops.checks import check_count, check_tensor
from dsaspec.ops.device import enter_chain, sm_count, supports_pdl
from dsaspec.ops.kv_cache_layout import FP8_GROUP, MLA_FP8_BYTES, is_fp8_cache, mla_fp8_views
from dsaspec.ops import sparse_mla_gluon
from dsaspec.ops.sparse_mla_gluon import launch_sparse_mla_gluon, sparse_mla_gluon_supported

LATENT_DIM = 512  # value / latent width
ROPE_DIM = 64
QK_DIM = LATENT_DIM + ROPE_DIM
_SCAN = 2048  # slot ids per step of the last-valid scan (one step at k = 2048)
# A split's workspace record: its 512 normalised outputs, its log-sum (index 512), then padding to a
# multiple of 32 bytes so that every record is aligned for vector loads and stores.
RECORD_WIDTH = 520
# Output columns per combine program: 256 (two programs per row and head) while R * H <= 256, for
# more programs when rows are few; 512 above (more programs were slower there: bench sweep in
# scripts/sweep_sparse_mla.py).
COMBINE_FEW_HEAD_ROWS = 256


def _gluon_tiles(fp8: bool = False, slot_major: bool = False) -> tuple[tuple[int, ...], ...]:
    """The Gluon kernel's tiles (:attr:`SparseMLAConfig.tiles`) on a bf16 cache (one), or with
    ``fp8`` on an ``fp8_ds_mla`` one (:data:`sparse_mla_gluon.FP8_TILES`, then the tune candidates
    :data:`sparse_mla_gluon.FP8_TUNE_TILES`); with ``slot_major`` the same gathers beside the
    slot-major attend partition (up to 32 heads a program, one warpgroup)."""
    g = sparse_mla_gluon
    blocks = g.FP8_TILES + g.FP8_TUNE_TILES if fp8 else (g.BF16_TILES,)
    heads, warps = ((g.SLOT_MAJOR_MAX_HEADS, g.SLOT_MAJOR_WARPS) if slot_major
                    else (g.HEADS_PER_PROGRAM, g.ATTEND_WARPS))
    return tuple((heads, t.block_n, warps, t.stages, LATENT_DIM,
                  *(getattr(t, name) for name in g.GATHER_FIELDS)) for t in blocks)


@dataclass(frozen=True)
class SparseMLAConfig:
    """Launch configuration of :func:`sparse_mla_decode`. It sets the summation order, so a
    row's output depends on it (and on nothing else of the launch without a workspace).

    block_h : heads per program, the dots' M dimension (N with ``slot_major``; capped at
        ``max(16, next_pow2(H))``: on sm_90 Triton takes wgmma for N = 16, mma.sync for 8).
    block_n : selected slots per online-softmax step.
    num_warps : warps per program (8: two warpgroups share a ``[block_h, 512]`` accumulator).
    num_stages : Triton's software-pipelining depth of the loop over slot blocks (2: the next
        block's slot ids and cache rows are gathered while the current one is on the tensor
        cores).
    block_dv : value columns per program (512, 256 or 128): ``512 / block_dv`` programs share a
        head block, each recomputing the scores. A row's output does not depend on it.
    max_splits : split-slot runs per row at most (with a workspace).
    kernel : ``"triton"`` (any device, the interpreter included) or ``"gluon"`` (the
        warp-specialized kernel of :mod:`dsaspec.ops.sparse_mla_gluon`: compute capability 9.x,
        8, 16 or 32 heads or a multiple of 64, and only its own tiles: those of
        :data:`SPARSE_MLA_GLUON_CONFIG` on a bf16 cache, of :data:`SPARSE_MLA_GLUON_FP8_CONFIG`,
        :data:`SPARSE_MLA_GLUON_FP8_NARROW_CONFIG`, :data:`SPARSE_MLA_GLUON_FP8_ONE_SPLIT_CONFIG`,
        :data:`SPARSE_MLA_GLUON_FP8_IN_SLOT_CONFIG` or one of :data:`SPARSE_MLA_GLUON_FP8_TUNE_CONFIGS` on an ``fp8_ds_mla`` one;
        slot-major, the same gathers with 32 heads and 4 warps: :data:`SPARSE_MLA_GLUON_SLOT_MAJOR_CONFIG`,
        :data:`SPARSE_MLA_GLUON_FP8_SLOT_MAJOR_CONFIG`; 8, 16 or 32 heads).
    slot_major : the dots with the roles swapped: the block's slots (then its value columns)
        are the M dimension and the heads the N one, so a rank's 8 - 32 heads fill no 64-row M
        tile (wgmma's) with padding. A row's output depends on it (the dots' order differs).
    staging, gather_warps, gather_registers, dequant_steps, slot_loads, refill, in_slot : the Gluon
        kernel's gather partition on an ``fp8_ds_mla`` cache (:class:`sparse_mla_gluon.FP8Tiles`:
        its staging stages, None for as many as ``num_stages``, 0 for none: the codes and
        scales loaded into registers and dequantized there; its warps; its registers per
        thread; the steps a staged block is dequantized in; how the copies get their slot ids,
        ``"convert"`` or ``"per_layout"``; when a staging stage is refilled, ``"block"`` or
        ``"step"``; with ``staging=0``, whether the block's bytes are copied into its ring slot
        and dequantized there); the Triton kernel has none and takes only the defaults. A row's output does
        not depend on them.
    """

    block_h: int
    block_n: int
    num_warps: int
    num_stages: int
    block_dv: int = 512
    max_splits: int = 16
    kernel: str = "triton"
    slot_major: bool = False
    staging: int | None = None
    gather_warps: int = sparse_mla_gluon.GATHER_WARPS
    gather_registers: int = sparse_mla_gluon.GATHER_REGISTERS
    dequant_steps: int = sparse_mla_gluon.DEQUANT_STEPS
    slot_loads: str = sparse_mla_gluon.SLOT_LOADS[0]
    refill: str = sparse_mla_gluon.REFILLS[0]
    in_slot: bool = False

    def __post_init__(self):
        if self.block_dv not in (128, 256, 512):
            raise ValueError(f"block_dv: expected 128, 256 or 512, got {self.block_dv}")
        if self.max_splits < 1:
            raise ValueError(f"max_splits: expected >= 1, got {self.max_splits}")
        if self.kernel not in ("triton", "gluon"):
            raise ValueError(f"kernel: expected 'triton' or 'gluon', got {self.kernel!r}")
        gather = self.gather_tiles   # FP8Tiles checks the gather fields' values
        gluon_tiles = _gluon_tiles(slot_major=self.slot_major) + _gluon_tiles(True, self.slot_major)
        if self.kernel == "gluon" and self.tiles not in gluon_tiles:
            raise ValueError(f"kernel: the Gluon kernel's tiles {TILE_FIELDS} are one of "
                             f"{gluon_tiles}, got {self.tiles}")
        defaults = sparse_mla_gluon.FP8Tiles(self.block_n, self.num_stages)
        if self.kernel == "triton" and gather != defaults:
            fields = sparse_mla_gluon.GATHER_FIELDS
            raise ValueError(f"{', '.join(fields)}: the Triton kernel has no gather partition, expected the "
                             f"defaults {tuple(getattr(defaults, f) for f in fields)}, got "
                             f"{tuple(getattr(gather, f) for f in fields)}")

    @property
    def tiles(self) -> tuple[int, ...]:
        """The values of :data:`TILE_FIELDS`."""
        return tuple(getattr(self, name) for name in TILE_FIELDS)

    @property
    def gather_tiles(self) -> "sparse_mla_gluon.FP8Tiles":
        """The Gluon kernel's launch shape of this config (``block_n``, ``num_stages`` and the
        gather fields)."""
        return sparse_mla_gluon.FP8Tiles(self.block_n, self.num_stages,
                                         **{name: getattr(self, name) for name in sparse_mla_gluon.GATHER_FIELDS})


TILE_FIELDS = ("block_h", "block_n", "num_warps", "num_stages", "block_dv", *sparse_mla_gluon.GATHER_FIELDS)


def _gluon_config(tiles: tuple[int, ...], slot_major: bool = False) -> SparseMLAConfig:
    """The Gluon kernel's config of ``tiles`` (the values of :data:`TILE_FIELDS`)."""
    return SparseMLAConfig(**dict(zip(TILE_FIELDS, tiles)), kernel="gluon", slot_major=slot_major)


# Fastest of the --tune sweep (benchmarks/results/h200/dsa_ops_tune_wide.md) from 16 rows up, split or
# not, and within 1.2x of the best at one row: the row-invariant path (no workspace) always uses it.
SPARSE_MLA_CONFIG = SparseMLAConfig(block_h=64, block_n=64, num_warps=8, num_stages=2)
# With a workspace and one row of up to 64 heads: 16 heads and every value column per program on
# 4 warps, as many splits as fill the SMs (33 on the H200; grid sweep of tile shapes in
# benchmarks/results/h200/logs/sweep_sparse_mla_grid.json: 9.8 against 11.1 us for 64 heads x 128
# columns at one row of 1k live tokens, 12.4 against 13.4 at 64k; at four rows it was not faster
# than SPARSE_MLA_CONFIG).
SPARSE_MLA_FEW_ROWS_CONFIG = SparseMLAConfig(block_h=16, block_n=32, num_warps=4, num_stages=2,
                                             block_dv=512, max_splits=64)
FEW_ROWS_HEAD_BLOCKS = 4  # R * cdiv(H, block_h) up to which the split path takes the few-rows config
# The Gluon kernel (dsaspec.ops.sparse_mla_gluon): 64 heads per program against blocks of 64 slots,
# one program per SM (224 KiB of shared memory), 8 attend warps beside 4 gather warps.
SPARSE_MLA_GLUON_CONFIG = _gluon_config(_gluon_tiles()[0])
# The Gluon kernel on an fp8_ds_mla cache (the gathers dequantize into the bf16 ring): blocks of 64
# slots, one ring slot and one staging stage (the bf16 kernel's dots: bitwise its output on the
# dequantized cache); blocks of 32, two of each (dequantizing overlaps the dots); blocks of 64
# gathered through registers into two ring slots, and blocks of 64 copied into their ring slot and
# dequantized there (both the same dots in the same order, so the first one's output bit for bit;
# sparse_mla_gluon.FP8_TILES).
(SPARSE_MLA_GLUON_FP8_CONFIG, SPARSE_MLA_GLUON_FP8_NARROW_CONFIG,
 SPARSE_MLA_GLUON_FP8_ONE_SPLIT_CONFIG, SPARSE_MLA_GLUON_FP8_IN_SLOT_CONFIG) = (
    _gluon_config(tiles) for tiles in _gluon_tiles(fp8=True)[:len(sparse_mla_gluon.FP8_TILES)])
# The Gluon kernel's FP8 tune candidates (sparse_mla_gluon.FP8_TUNE_TILES: other gather partitions),
# timed by `bench dsa-ops --tune --kv-cache-dtype fp8_e4m3`; none is a default.
SPARSE_MLA_GLUON_FP8_TUNE_CONFIGS = tuple(
    _gluon_config(tiles) for tiles in _gluon_tiles(fp8=True)[len(sparse_mla_gluon.FP8_TILES):])
# What sparse_mla_config gives an FP8 cache where the Gluon kernel runs (None: the Triton configs):
# the dequantizing in the ring slot, faster than the other FP8 tiles at every point from 4 rows in
# launches of one split and of several (3 - 11%; GLM-5, 64 heads, 64k live, H200:
# sparse_mla_gluon.FP8_TILES). Measured at 64 heads; at 8 - 32 (one padded program a row) and 128
# (two programs a row) a program gathers the same blocks.
GLUON_FP8_DEFAULT_CONFIG: SparseMLAConfig | None = SPARSE_MLA_GLUON_FP8_IN_SLOT_CONFIG
# Programs without splits (rows x 64-head blocks) from which the split path takes the Gluon kernel;
# at one (one row of 64 heads) the Triton few-rows config is faster: 9.8 against 14.5 us at 1k live,
# 12.3 against 17.4 at 64k; from two rows on the Gluon kernel
# (benchmarks/results/h200/logs/sweep_sparse_mla_gluon_rows.json).
GLUON_MIN_SPLIT_HEAD_BLOCKS = 2
# Slot-major dots for a rank's few heads (8 - 32: GLM-5 at TP 8 - 2): the slots of a block are the QK
# dots' M, the 512 value columns the PV dots', the heads (16 a program) their N, where the head-major
# kernels pad 8 - 32 heads to an M tile of 64 (wgmma's; the Gluon kernel) or run mma.sync (16-row
# tiles; Triton). Triton issues a block's gathers after the previous block's dots and waits for them
# before its own, so one program does not overlap the two: blocks of 32 slots keep two programs an
# SM on either cache (sm_90: 193 / 255 registers, 55 KiB of shared memory, no spills; the PV dots on
# m64n16k16 wgmma, the QK ones, M 32, on mma.sync); 64 slots put both dots on wgmma but take 164 KiB
# (one program) and spill 1.4 KB on an FP8 cache (scripts/compile_fp8_dsa.py --sweep). What
# slot_major_config gives where the Gluon kernel does not run; no default takes it (not timed as one).
SPARSE_MLA_SLOT_MAJOR_CONFIG = SparseMLAConfig(block_h=16, block_n=32, num_warps=4, num_stages=2,
                                               slot_major=True)
# The Gluon kernel's slot-major form (sparse_mla_gluon._attend_slot_major): its gathers
# (the bf16 cache's, and on an FP8 cache the default's in-slot dequantizing) beside one attend
# warpgroup whose dots take 16 or 32 heads as N (68 m64n16k16 / m64n32k16 wgmma a 64-slot block,
# against the padded 64-head form's m64n32k16 on two warpgroups over 64 rows of which 8 - 32 are
# heads). sm_90 compile: no spills, 168 - 216 KiB of shared memory (scripts/compile_sparse_mla_gluon.py).
# sparse_mla_config takes them at up to SLOT_MAJOR_DEFAULT_MAX_HEADS heads where it takes the Gluon kernel.
SPARSE_MLA_GLUON_SLOT_MAJOR_CONFIG = _gluon_config(_gluon_tiles(slot_major=True)[0], slot_major=True)
SPARSE_MLA_GLUON_FP8_SLOT_MAJOR_CONFIG = _gluon_config(
    _gluon_tiles(True, True)[sparse_mla_gluon.FP8_TILES.index(SPARSE_MLA_GLUON_FP8_IN_SLOT_CONFIG.gather_tiles)],
    slot_major=True)
SLOT_MAJOR_MAX_HEADS = sparse_mla_gluon.SLOT_MAJOR_MAX_HEADS
# Heads up to which sparse_mla_config takes the Gluon slot-major form where it takes the Gluon kernel.
# H100, GLM-5 latent, top-k 2048, CUDA graphs, cold L2 (benchmarks/results/h100/logs/
# slot_major_dsa_ops_session24.md, slot_major_prefill_rows_session24.md): against the padded head-major
# form at 8 and 16 heads 0.89 - 0.98x its time at 4 to 256 rows of 64k live on both caches and 0.86 -
# 0.89x at 512 and 2,048 rows of 16k; at 32 heads 1.03 - 1.13x at 4 to 64 rows (0.91 - 0.99x from 256).
# At one row the split path's Triton few-rows configuration stays (the slot-major form 1.22x its time).
# H200, the GLM-5 FP8 rank's 16k prefill on FP8 caches: TTFT 1,951 against 2,074 ms
# (benchmarks/results/h200/logs/prefill_glm5_rank_slot_major_on_session24.md,
# prefill_glm5_rank_slot_major_off_session24.md).
SLOT_MAJOR_DEFAULT_MAX_HEADS = 16
# The earlier kernel's tiles (32 heads per program, Triton's default pipelining depth): the
# benchmark's baseline.
SPARSE_MLA_BASELINE_CONFIG = SparseMLAConfig(block_h=32, block_n=32, num_warps=8, num_stages=3)


@triton.jit
def _block_slots(row_slots, block, stop_block, topk, BLOCK_N: tl.constexpr):
    """The row's slot ids of block ``block`` (``-1`` where none, and for ``block >= stop_block``)."""
    index = block * BLOCK_N + tl.arange(0, BLOCK_N)
    return tl.load(row_slots + index, mask=(index < topk) & (block < stop_block), other=-1)


@triton.jit
def _gather_latent(latent_ptr, latent_stride, scale_ptr, scale_stride, slot, start,
                   WIDTH: tl.constexpr, GROUP: tl.constexpr, FP8: tl.constexpr):
    """Latent columns ``start .. start + WIDTH`` of the valid slots' cache rows, bf16
    ``[BLOCK_N, WIDTH]``; zeros (no memory access) elsewhere. ``FP8``: the e4m3 codes times the
    fp32 scale of their 128-column group, rounded to bf16, which is exact (a power-of-two scale
    times a 4-significant-bit code; bf16 has fp32's exponent range): the dots then see exactly
    the values the cache holds."""
    valid = slot >= 0
    row = tl.where(valid, slot, 0).to(tl.int64)
    columns = start + tl.arange(0, WIDTH)
    latent = tl.load(latent_ptr + row[:, None] * latent_stride + columns[None, :],
                     mask=valid[:, None], other=0.0)
    if FP8:
        # the row's scales of these columns as one [BLOCK_N, GROUPS] load, broadcast over each
        # group's GROUP codes (a [BLOCK_N, WIDTH] fp32 scale tile would hold registers the
        # accumulator needs)
        GROUPS: tl.constexpr = WIDTH // GROUP
        groups = start // GROUP + tl.arange(0, GROUPS)
        scale = tl.load(scale_ptr + row[:, None] * scale_stride + groups[None, :],
                        mask=valid[:, None], other=0.0)
        codes = tl.reshape(latent.to(tl.float32), (row.shape[0], GROUPS, GROUP))
        latent = tl.reshape(codes * scale[:, :, None], (row.shape[0], WIDTH)).to(tl.bfloat16)
    return latent


@triton.jit
def _gather_rows(latent_ptr, latent_stride, scale_ptr, scale_stride, rope_ptr, rope_stride, slot,
                 LATENT: tl.constexpr, ROPE: tl.constexpr, GROUP: tl.constexpr,
                 FP8: tl.constexpr):
    """Cache rows ``[latent | rope]`` of the valid slots (the latent dequantized with ``FP8``);
    zeros (no memory access) elsewhere."""
    kv_latent = _gather_latent(latent_ptr, latent_stride, scale_ptr, scale_stride, slot, 0,
                               LATENT, GROUP, FP8)
    valid = slot >= 0
    rope_row = tl.where(valid, slot, 0).to(tl.int64) * rope_stride
    if FP8:
        # an fp8_ds_mla row stride of 656 bytes (328 bf16) is no multiple of 16 elements, so
        # Triton assumes 2-byte alignment: scalar loads outside the software pipeline. Rows are
        # 16-byte aligned (the host checks the stride): with the hint the rope values go by
        # 16-byte cp.async like the latent codes.
        rope_row = tl.multiple_of(rope_row, 8)
    rope_row = rope_ptr + rope_row[:, None]
    kv_rope = tl.load(rope_row + tl.arange(0, ROPE)[None, :], mask=valid[:, None], other=0.0)
    return kv_latent, kv_rope


@triton.jit
def _gather_values(latent_ptr, latent_stride, scale_ptr, scale_stride, slot, kv_latent,
                   value_start, LATENT: tl.constexpr, BLOCK_DV: tl.constexpr,
                   GROUP: tl.constexpr, FP8: tl.constexpr):
    """The ``[BLOCK_N, BLOCK_DV]`` value columns ``value_start ..`` of the gathered rows: the
    latent rows themselves when one program holds every column, else a second (cache-hot) load."""
    if BLOCK_DV == LATENT:
        return kv_latent
    return _gather_latent(latent_ptr, latent_stride, scale_ptr, scale_stride, slot, value_start,
                          BLOCK_DV, GROUP, FP8)


@triton.jit
def _attend_block(q_latent, q_rope, valid, kv_latent, kv_rope, kv_value, running_max,
                  denominator, acc, qk_scale_log2, UPCAST: tl.constexpr,
                  SLOT_MAJOR: tl.constexpr):
    """One online-softmax step over a block of slots: returns the updated running max (log2
    domain), denominator and unnormalised accumulator, ``[BLOCK_H, BLOCK_DV]`` (heads are the
    dots' M dimension) or with ``SLOT_MAJOR`` ``[BLOCK_DV, BLOCK_H]`` (the queries come
    transposed, ``[576 part, BLOCK_H]``: slots, then value columns, are the M dimension and the
    heads the N one, so a few heads need no padding to an M tile)."""
    if UPCAST:
        kv_latent = kv_latent.to(tl.float32)
        kv_rope = kv_rope.to(tl.float32)
        kv_value = kv_value.to(tl.float32)
    if SLOT_MAJOR:
        scores = tl.dot(kv_latent, q_latent)
        scores = tl.dot(kv_rope, q_rope, scores)  # [BLOCK_N, BLOCK_H], fp32
        scores = tl.where(valid[:, None], scores * qk_scale_log2, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 0))
        rescale = tl.exp2(running_max - new_max)
        probs = tl.exp2(scores - new_max[None, :])
        denominator = denominator * rescale + tl.sum(probs, 0)
        acc = tl.dot(tl.trans(kv_value), probs.to(kv_value.dtype), acc * rescale[None, :])
    else:
        scores = tl.dot(q_latent, tl.trans(kv_latent))
        scores = tl.dot(q_rope, tl.trans(kv_rope), scores)  # [BLOCK_H, BLOCK_N], fp32
        scores = tl.where(valid[None, :], scores * qk_scale_log2, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        rescale = tl.exp2(running_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        denominator = denominator * rescale + tl.sum(probs, 1)
        acc = tl.dot(probs.to(kv_value.dtype), kv_value, acc * rescale[:, None])
    return new_max, denominator, acc


@triton.jit
def _sparse_mla_decode_kernel(q_ptr, latent_ptr, scale_ptr, rope_ptr, slots_ptr, out_ptr,
                              workspace_ptr, qk_scale_log2, q_stride_row, q_stride_head,
                              latent_stride, scale_stride, rope_stride, slots_stride,
                              out_stride_row, out_stride_head, num_heads, topk,
                              LATENT: tl.constexpr, ROPE: tl.constexpr, GROUP: tl.constexpr,
                              FP8: tl.constexpr, BLOCK_H: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr,
                              SCAN: tl.constexpr, NUM_STAGES: tl.constexpr,
                              UPCAST: tl.constexpr, SLOT_MAJOR: tl.constexpr,
                              SPLIT: tl.constexpr, RECORD: tl.constexpr, CHAINED: tl.constexpr):
    enter_chain(CHAINED)
    row = tl.program_id(0).to(tl.int64)
    value_blocks: tl.constexpr = LATENT // BLOCK_DV
    heads = tl.program_id(1) // value_blocks * BLOCK_H + tl.arange(0, BLOCK_H)
    value_start = tl.program_id(1) % value_blocks * BLOCK_DV
    real_head = heads < num_heads
    latent = tl.arange(0, LATENT)
    values = value_start + tl.arange(0, BLOCK_DV)
    rope = tl.arange(0, ROPE)
    row_slots = slots_ptr + row * slots_stride

    # the query loads go first: their latency overlaps the scan's
    q_row = q_ptr + row * q_stride_row + heads[:, None] * q_stride_head
    q_latent = tl.load(q_row + latent[None, :], mask=real_head[:, None], other=0.0)
    q_rope = tl.load(q_row + LATENT + rope[None, :], mask=real_head[:, None], other=0.0)
    last_valid = -1
    for start in range(0, topk, SCAN):
        index = start + tl.arange(0, SCAN)
        slot = tl.load(row_slots + index, mask=index < topk, other=-1)
        last_valid = tl.maximum(last_valid, tl.max(tl.where(slot >= 0, index, -1), 0))
    if UPCAST:
        q_latent = q_latent.to(tl.float32)
        q_rope = q_rope.to(tl.float32)
    if SLOT_MAJOR:
        q_latent = tl.trans(q_latent)
        q_rope = tl.trans(q_rope)
        acc = tl.zeros((BLOCK_DV, BLOCK_H), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_H, BLOCK_DV), dtype=tl.float32)
    # a finite start keeps exp2(running_max - new_max) NaN-free while every slot is masked
    running_max = tl.full((BLOCK_H,), -1.0e30, dtype=tl.float32)
    denominator = tl.zeros((BLOCK_H,), dtype=tl.float32)
    # split `split` of `num_splits` takes an equal run of the row's slot blocks
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    num_blocks = tl.cdiv(last_valid + 1, BLOCK_N)
    per_split = tl.cdiv(num_blocks, num_splits)
    first_block = split * per_split
    stop_block = tl.minimum(first_block + per_split, num_blocks)
    for block in tl.range(first_block, stop_block, num_stages=NUM_STAGES):
        slot = _block_slots(row_slots, block, stop_block, topk, BLOCK_N)
        kv_latent, kv_rope = _gather_rows(latent_ptr, latent_stride, scale_ptr, scale_stride,
                                          rope_ptr, rope_stride, slot, LATENT, ROPE, GROUP, FP8)
        kv_value = _gather_values(latent_ptr, latent_stride, scale_ptr, scale_stride, slot,
                                  kv_latent, value_start, LATENT, BLOCK_DV, GROUP, FP8)
        running_max, denominator, acc = _attend_block(
            q_latent, q_rope, slot >= 0, kv_latent, kv_rope, kv_value, running_max,
            denominator, acc, qk_scale_log2, UPCAST, SLOT_MAJOR)
    safe_denominator = tl.where(denominator > 0, denominator, 1.0)
    if SLOT_MAJOR:
        result = tl.trans(acc / safe_denominator[None, :])
    else:
        result = acc / safe_denominator[:, None]
    if SPLIT:
        # workspace [R, H, num_splits, RECORD]: the split's normalised output, then its
        # log2-sum-exp2 of the scaled scores (-inf when the split saw no valid slot)
        record = workspace_ptr + ((row * num_heads + heads) * num_splits + split) * RECORD
        tl.store(record[:, None] + values[None, :], result, mask=real_head[:, None])
        seen = denominator > 0
        log_sum = tl.where(seen, running_max + tl.log2(tl.where(seen, denominator, 1.0)),
                           float("-inf"))
        # every value block computed the same scores; the first one records their log-sum
        tl.store(record + LATENT, log_sum, mask=real_head & (value_start == 0))
    else:
        out_row = out_ptr + row * out_stride_row + heads[:, None] * out_stride_head
        tl.store(out_row + values[None, :], result.to(out_ptr.dtype.element_ty),
                 mask=real_head[:, None])


@triton.jit
def _sparse_mla_combine_kernel(workspace_ptr, out_ptr, out_stride_row, out_stride_head,
                               num_heads, num_splits, LATENT: tl.constexpr, RECORD: tl.constexpr,
                               BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, CHAINED: tl.constexpr):
    """Program ``(r, h, c)``: output columns ``c * BLOCK_C ..`` of row ``r``, head ``h`` from the
    splits' records, weighted by ``exp2(log_sum - max log_sum)``. ``CHAINED``: launched while the split
    kernel runs (``enter_chain``)."""
    enter_chain(CHAINED)
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    columns = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    splits = tl.arange(0, BLOCK_S)
    real_split = splits < num_splits
    records = workspace_ptr + ((row * num_heads + head) * num_splits + splits) * RECORD
    log_sums = tl.load(records + LATENT, mask=real_split, other=float("-inf"))
    top = tl.max(log_sums, 0)
    weights = tl.exp2(log_sums - tl.where(top == float("-inf"), 0.0, top))
    partial = tl.load(records[:, None] + columns[None, :], mask=(weights > 0)[:, None], other=0.0)
    total = tl.sum(weights, 0)
    result = tl.sum(partial * weights[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * out_stride_row + head * out_stride_head + columns,
             result.to(out_ptr.dtype.element_ty))


def _block_h(num_heads: int, config: SparseMLAConfig) -> int:
    return min(config.block_h, max(16, triton.next_power_of_2(num_heads)))


def slot_major_config(num_heads: int, device: torch.device | str | None = None,
                      fp8_cache: bool = False) -> SparseMLAConfig:
    """The slot-major configuration for ``num_heads`` (at most ``SLOT_MAJOR_MAX_HEADS``, else a
    ``ValueError``) on ``device``: where the Gluon kernel runs slot-major (compute capability 9.x,
    8, 16 or 32 heads) :data:`SPARSE_MLA_GLUON_SLOT_MAJOR_CONFIG`
    (:data:`SPARSE_MLA_GLUON_FP8_SLOT_MAJOR_CONFIG` on an FP8 cache), elsewhere (and with
    ``device`` None) :data:`SPARSE_MLA_SLOT_MAJOR_CONFIG`."""
    if num_heads > SLOT_MAJOR_MAX_HEADS:
        raise ValueError(f"num_heads: slot-major tiles take at most {SLOT_MAJOR_MAX_HEADS} heads, got {num_heads}")
    if device is not None and sparse_mla_gluon_supported(device, num_heads, slot_major=True):
        return SPARSE_MLA_GLUON_FP8_SLOT_MAJOR_CONFIG if fp8_cache else SPARSE_MLA_GLUON_SLOT_MAJOR_CONFIG
    return SPARSE_MLA_SLOT_MAJOR_CONFIG


def sparse_mla_config(num_rows: int, num_heads: int, split: bool,
                      device: torch.device | str | None = None,
                      fp8_cache: bool = False, slot_major: bool = True) -> SparseMLAConfig:
    """The default launch configuration of ``R = num_rows`` rows on ``device`` over a bf16 cache,
    or with ``fp8_cache`` an ``fp8_ds_mla`` one.

    Where the Gluon kernel runs (``device`` of compute capability 9.x, ``H`` in 8, 16, 32 or a
    multiple of 64: :func:`sparse_mla_gluon_supported`), without a workspace, and with one
    (``split``) from ``R * cdiv(H, 64) >= GLUON_MIN_SPLIT_HEAD_BLOCKS``: with ``slot_major`` and
    ``H <= SLOT_MAJOR_DEFAULT_MAX_HEADS`` its slot-major form (:func:`slot_major_config`), else on a
    bf16 cache :data:`SPARSE_MLA_GLUON_CONFIG` and on an FP8 cache :data:`GLUON_FP8_DEFAULT_CONFIG`
    (None: the Triton configurations). Elsewhere (and with ``device`` None): with a workspace and
    ``R * cdiv(H, block_h) <= FEW_ROWS_HEAD_BLOCKS``, :data:`SPARSE_MLA_FEW_ROWS_CONFIG`, else
    :data:`SPARSE_MLA_CONFIG`. Without a workspace the choice never depends on ``R``, so a row's
    output there does not depend on ``R``."""
    rows = max(num_rows, 1)
    if ((not fp8_cache or GLUON_FP8_DEFAULT_CONFIG is not None) and device is not None
            and sparse_mla_gluon_supported(device, num_heads)):
        head_blocks = triton.cdiv(num_heads, sparse_mla_gluon.HEADS_PER_PROGRAM)
        if not split or rows * head_blocks >= GLUON_MIN_SPLIT_HEAD_BLOCKS:
            if slot_major and num_heads <= SLOT_MAJOR_DEFAULT_MAX_HEADS:
                return slot_major_config(num_heads, device, fp8_cache)
            return GLUON_FP8_DEFAULT_CONFIG if fp8_cache else SPARSE_MLA_GLUON_CONFIG
    head_blocks = triton.cdiv(num_heads, _block_h(num_heads, SPARSE_MLA_FEW_ROWS_CONFIG))
    if split and rows * head_blocks <= FEW_ROWS_HEAD_BLOCKS:
        return SPARSE_MLA_FEW_ROWS_CONFIG
    return SPARSE_MLA_CONFIG


def _programs_per_row(num_heads: int, config: SparseMLAConfig) -> int:
    return triton.cdiv(num_heads, _block_h(num_heads, config)) * (LATENT_DIM // config.block_dv)


def sparse_mla_num_splits(num_rows: int, num_heads: int, num_sms: int,
                          config: SparseMLAConfig | None = None) -> int:
    """Split-slot runs per row for a launch of ``R = num_rows`` rows: as many as keep one
    program per SM, ``clamp(num_sms // (R * cdiv(H, block_h) * 512 / block_dv), 1,
    max_splits)``; ``config`` defaults to ``sparse_mla_config(R, H, split=True)``."""
    config = config or sparse_mla_config(num_rows, num_heads, split=True)
    programs = max(num_rows, 1) * _programs_per_row(num_heads, config)
    return max(1, min(config.max_splits, num_sms // programs))


def sparse_mla_workspace(num_rows: int, num_heads: int, device, num_splits: int | None = None,
                         num_sms: int | None = None,
                         config: SparseMLAConfig | None = None) -> torch.Tensor | None:
    """Allocate the split-slot workspace of :func:`sparse_mla_decode` for a bucket of
    ``num_rows`` rows (once, before capture; reuse it for every replay of that bucket).

    ``num_splits`` defaults to :func:`sparse_mla_num_splits` with ``num_sms`` (default: the
    device's count; 132 without CUDA) and ``config`` (default: the one ``sparse_mla_decode``
    picks on ``device`` with a workspace); when that is 1 (the rows' programs already fill the
    GPU) no workspace helps and None is returned. An explicit ``num_splits >= 1`` always gets a
    workspace.

    Returns
    -------
    fp32 ``[num_rows, num_heads, num_splits, RECORD_WIDTH]`` (a split's 512 outputs, its log-sum,
    padding), or None. ``num_rows``, ``num_heads``, ``num_splits`` and ``num_sms`` must be ints
    >= 1 (else a ``TypeError`` / ``ValueError`` naming the argument).
    """
    check_count("num_rows", num_rows)
    check_count("num_heads", num_heads)
    if num_splits is None:
        if num_sms is None:
            num_sms = sm_count(device)
        check_count("num_sms", num_sms)
        config = config or sparse_mla_config(num_rows, num_heads, split=True, device=device)
        num_splits = sparse_mla_num_splits(num_rows, num_heads, num_sms, config)
        if num_splits == 1:
            return None
    check_count("num_splits", num_splits)
    return torch.empty(num_rows, num_heads, num_splits, RECORD_WIDTH, dtype=torch.float32,
                       device=device)


def sparse_mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
                      sm_scale: float, out: torch.Tensor, *, check_values: bool = True,
                      workspace: torch.Tensor | None = None,
                      config: SparseMLAConfig | None = None) -> torch.Tensor:
    """Sparse MQA attention of every query row over its selected slots, in the latent space.

    ``out[r, h] = sum_j p_j * kv[s_j, :512]`` with ``p = softmax_j(sm_scale * q[r, h] . kv[s_j])``
    over the valid entries ``s_j = slots[r, j] >= 0``, ``kv`` the cache's 576 values a slot
    (an ``fp8_ds_mla`` entry's: its latent codes times their group's scale | its rope key);
    fp32 softmax and accumulation of bf16 products (on the GPU ``p`` enters the value product as
    bf16). A row without a valid slot gets zeros. Repeated slots count once per occurrence. Only
    the cache rows of valid slots are read, and no slot entry after a row's last valid one.

    Parameters
    ----------
    q : bf16 ``[R, H, 576]``, absorbed queries ``[latent 512 | rope 64]`` (last dim contiguous).
    kv_cache : the MLA cache indexed by slot: bf16 ``[num_slots, 576]`` (latent then rope), or
        uint8 ``[num_slots, 656]`` in the ``fp8_ds_mla`` layout
        (:mod:`dsaspec.ops.kv_cache_layout`; row stride a multiple of 16 bytes), whose latent
        the Triton kernel dequantizes to bf16 as it gathers it (exact: power-of-two scales),
        then the same bf16 dots (on a GPU of compute capability 8.9 or newer). The choice is made on the dtype on the host:
        graph-safe.
    slots : int32 ``[R, k]``, selected slots, ``-1`` = none (e.g. from ``topk_slots``). Work per
        row stops after its last valid entry.
    sm_scale : softmax scale applied to the 576-wide dot product.
    out : bf16 ``[R, H, 512]``, written (every entry).
    check_values : also check (a host sync, so not inside CUDA graphs) that every slot is below
        ``num_slots``. Shapes, dtypes, devices and strides are always checked. With ``False``
        the caller guarantees ``slots < num_slots``.
    workspace : optional fp32 ``[R, H, num_splits, RECORD_WIDTH]`` from
        :func:`sparse_mla_workspace` (None there means: pass None), written. With it each row's slot blocks are split into
        ``num_splits`` runs handled by separate programs and a second kernel combines them: more
        parallelism when ``R * H`` is small; the result then depends on ``num_splits`` (through
        the summation order). Without it: grid ``(R, cdiv(H, block_h) * 512 / block_dv)``, and
        a row's output is
        bitwise independent of ``R`` and of the other rows (for a given ``config`` and device).
    config : launch configuration (default ``sparse_mla_config(R, H, workspace is not None,
        q.device, fp8_cache)``); :data:`SPARSE_MLA_BASELINE_CONFIG` is the earlier kernel (the
        benchmark's baseline). A Gluon config must have the tiles of the cache's dtype
        (:data:`SPARSE_MLA_GLUON_CONFIG` for bf16, :data:`SPARSE_MLA_GLUON_FP8_CONFIG`,
        :data:`SPARSE_MLA_GLUON_FP8_NARROW_CONFIG`, :data:`SPARSE_MLA_GLUON_FP8_ONE_SPLIT_CONFIG`,
        :data:`SPARSE_MLA_GLUON_FP8_IN_SLOT_CONFIG` or one of :data:`SPARSE_MLA_GLUON_FP8_TUNE_CONFIGS` for ``fp8_ds_mla``).

    Returns
    -------
    ``out``.
    """
    _check_inputs(q, kv_cache, slots, out, workspace)
    if check_values and slots.numel() and int(slots.max()) >= kv_cache.shape[0]:
        raise ValueError(f"slots: slot {int(slots.max())} is out of range for a kv_cache of "
                         f"{kv_cache.shape[0]} slots")
    num_rows, num_heads, _ = q.shape
    fp8 = is_fp8_cache(kv_cache)
    if fp8 and q.is_cuda and torch.cuda.get_device_capability(q.device) < (8, 9):
        raise ValueError(f"kv_cache: an fp8_ds_mla cache needs a GPU of compute capability 8.9 or "
                         f"newer (e4m3 conversions), got {q.device} of "
                         f"{torch.cuda.get_device_capability(q.device)}")
    config = config or sparse_mla_config(num_rows, num_heads, workspace is not None, q.device,
                                         fp8_cache=fp8)
    scan = min(_SCAN, triton.next_power_of_2(max(slots.shape[1], 1)))
    qk_scale_log2 = sm_scale * math.log2(math.e)
    chained = supports_pdl(q.device)
    if config.kernel == "gluon":
        cache_tiles = _gluon_tiles(fp8, config.slot_major)
        if config.tiles not in cache_tiles:
            raise ValueError(f"config: the Gluon kernel's tiles {TILE_FIELDS} on "
                             f"{'an fp8_ds_mla' if fp8 else 'a bf16'} kv_cache are one of "
                             f"{cache_tiles}, got {config.tiles}")
        if not sparse_mla_gluon_supported(q.device, num_heads, config.slot_major):
            raise ValueError(f"config: the Gluon kernel needs a CUDA device of compute "
                             f"capability 9.x and 8, 16, 32 or{' (not slot-major)' if config.slot_major else ''} "
                             f"a multiple of 64 heads, got {q.device} and {num_heads} heads")
        launch_sparse_mla_gluon(q, kv_cache, slots, out, workspace, qk_scale_log2, scan=scan,
                                record_width=RECORD_WIDTH, tiles=config.gather_tiles,
                                slot_major=config.slot_major)
        if workspace is not None:
            # chained: the Gluon kernel does not trigger early, so the combine starts as its
            # programs exit (0.2-0.5 µs less at 4-16 rows, H200)
            _combine(workspace, out, chained)
        return out
    if fp8:
        latent, scale, rope = mla_fp8_views(kv_cache)
    else:  # no scales: the latent's pointer stands in, never read
        latent, scale, rope = kv_cache, kv_cache, kv_cache[:, LATENT_DIM:]
    num_splits = 1 if workspace is None else workspace.shape[2]
    grid = (num_rows, _programs_per_row(num_heads, config), num_splits)
    _sparse_mla_decode_kernel[grid](
        q, latent, scale, rope, slots, out, out if workspace is None else workspace,
        qk_scale_log2, q.stride(0), q.stride(1), latent.stride(0), scale.stride(0),
        rope.stride(0), slots.stride(0), out.stride(0), out.stride(1), num_heads, slots.shape[1],
        LATENT=LATENT_DIM, ROPE=ROPE_DIM, GROUP=FP8_GROUP, FP8=fp8,
        BLOCK_H=_block_h(num_heads, config),
        BLOCK_N=config.block_n, BLOCK_DV=config.block_dv, SCAN=scan,
        NUM_STAGES=config.num_stages, UPCAST=not q.is_cuda, SLOT_MAJOR=config.slot_major,
        SPLIT=workspace is not None, RECORD=RECORD_WIDTH, CHAINED=chained, launch_pdl=chained,
        num_warps=config.num_warps)
    if workspace is not None:
        _combine(workspace, out, chained)
    return out


def _combine(workspace: torch.Tensor, out: torch.Tensor, chained: bool) -> None:
    """Launch the combine of ``workspace``'s split records into ``out`` (chained to the split kernel
    launched just before it, with ``chained``)."""
    num_rows, num_heads, num_splits, _ = workspace.shape
    columns = LATENT_DIM // 2 if num_rows * num_heads <= COMBINE_FEW_HEAD_ROWS else LATENT_DIM
    _sparse_mla_combine_kernel[(num_rows, num_heads, LATENT_DIM // columns)](
        workspace, out, out.stride(0), out.stride(1), num_heads, num_splits,
        LATENT=LATENT_DIM, RECORD=RECORD_WIDTH, BLOCK_S=triton.next_power_of_2(num_splits),
        BLOCK_C=columns, CHAINED=chained, launch_pdl=chained, num_warps=4)


def _check_inputs(q, kv_cache, slots, out, workspace) -> None:
    check_tensor("q", q, dtype=torch.bfloat16, shape=(None, None, QK_DIM))
    num_rows, num_heads, _ = q.shape
    device = q.device
    check_tensor("kv_cache", kv_cache, dtype=(torch.bfloat16, torch.uint8), device=device, ndim=2)
    width = MLA_FP8_BYTES if is_fp8_cache(kv_cache) else QK_DIM
    check_tensor("kv_cache", kv_cache, dtype=kv_cache.dtype, shape=(None, width))
    if is_fp8_cache(kv_cache) and kv_cache.stride(0) % 16:
        raise ValueError(f"kv_cache: an fp8_ds_mla cache's row stride must be a multiple of 16 "
                         f"bytes, got {kv_cache.stride(0)}")
    check_tensor("slots", slots, dtype=torch.int32, shape=(num_rows, None), device=device)
    check_tensor("out", out, dtype=torch.bfloat16, shape=(num_rows, num_heads, LATENT_DIM),
                 device=device)
    if workspace is not None:
        check_tensor("workspace", workspace, dtype=torch.float32,
                     shape=(num_rows, num_heads, None, RECORD_WIDTH), device=device)
        if not workspace.is_contiguous() or workspace.shape[2] < 1:
            raise ValueError(f"workspace: expected a contiguous [R, H, num_splits >= 1, "
                             f"{RECORD_WIDTH}] tensor, got shape {tuple(workspace.shape)}")
