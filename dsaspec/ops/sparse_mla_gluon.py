"""Sparse MLA decode for Hopper as a warp-specialized Gluon kernel: the many-rows path.

Same math and contract as :func:`dsaspec.ops.sparse_mla.sparse_mla_decode` (each query row
attends to its own selected cache slots, ``-1`` = none, in the 576-wide latent space), written in
Triton's Gluon dialect so that the gathers and the tensor-core dots run on separate warps
(docs/dsa-kernels.md, "Gathers and the dots"). A program takes one row, 64 head slots and one
split of its slot blocks. With fewer than 64 heads left (8, 16 or 32 heads a rank, see
:func:`sparse_mla_gluon_supported`) the missing heads are padding: their query rows are
zero-filled in shared memory (scores 0, a finite softmax) and their outputs never stored. The
kernel is gather-bound and a row gathers the same cache rows whatever its head count, so the
padded wgmma rows cost tensor-core time it has to spare.

- the gather partition (4 warps) copies the program's queries into shared memory with
  ``cp.async`` while it finds the split's blocks (a scan of the row's slot ids up to its last
  valid one), then copies the ``BLOCK_N`` selected cache rows of each block into a ring of
  ``STAGES`` shared-memory slots (latent and rope apart); a slot's arrival is signalled on its
  ``full`` mbarrier by one copy-completion arrive per gather thread (the first block's also
  covers the queries); an invalid slot's row is zero-filled, never read. On an ``fp8_ds_mla``
  cache (constexpr ``FP8``, tiles :class:`FP8Tiles`: the defaults :data:`FP8_TILES`, the tune
  candidates :data:`FP8_TUNE_TILES`) it copies the slots' bytes into staging stages instead and
  dequantizes each block into its ring slot (bf16, exact), then signals it, refilling the staging
  stage after the block or after each dequantizing step (``FP8Tiles.refill``); with
  ``FP8Tiles.staging=0`` it loads the codes and scales from global memory into registers instead,
  dequantizes them there into the ring slot and copies the rope values into it by ``cp.async``,
  or with ``FP8Tiles.in_slot`` (the default's) copies the block's bytes into the ring slot itself
  and dequantizes them there in place;
- the attend partition (8 warps, two warpgroups, each owning half of the score columns and half
  of the 512 value columns) per block waits for its slot, runs the QK dot of the 64 heads against
  it as wgmma (latent, then rope), the online softmax (fp32, log2 domain), stores the
  probabilities as bf16 to shared memory, runs the PV wgmma into a ``[64, 512]`` fp32
  accumulator and frees the slot on its ``empty`` mbarrier; the single pass's bf16 output leaves
  through the idle ring so that each warp stores whole rows;
- or, slot-major (``slot_major``, 8 - 32 heads), the attend partition on one warpgroup with the
  dots' roles swapped (:func:`_attend_slot_major`): the ring slot's 64 slots are the QK
  wgmma's M and its transposed 512 value columns the PV wgmma's, the program's 16 or 32 heads
  (:func:`slot_major_block_h`, padding zero-filled) their N, so no dot pads the heads to 64 rows.

Where the time goes (``benchmarks/results/h200/logs/sweep_sparse_mla_timeline.md``, the phase
stamps of ``trace``): from 16 rows of 64k on, the blocks stream at about the copy bandwidth
(2.4-2.6 µs a block of 64 slots on each of 128 SMs); a split program adds about 2.5 µs before its
first copies (the scan), its fp32 record's store (4-5 µs at 16-64 rows, bound by DRAM writes)
and the combine kernel (about 4 µs). With one program (1 row) the attend partition bounds it:
zero-filled gathers take as long as real ones (``sweep_sparse_mla_gluon_splits.json``).
docs/dsa-kernels.md has the numbers.

Without a workspace a row's output depends only on that row. With one, each row's slot blocks are
split into ``num_splits`` runs and :func:`dsaspec.ops.sparse_mla` 's combine kernel merges the
split records (same record layout as the Triton kernel). The summation order differs from the
Triton kernel's, so the two agree to bf16 rounding, not bitwise.

Gluon kernels do not run under Triton's interpreter and wgmma exists only on compute capability
9.x: off Hopper the Triton kernel is the path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait)

from dsaspec.ops.checks import check_tensor
from dsaspec.ops.kv_cache_layout import FP8_GROUP, MLA_LATENT_DIM, is_fp8_cache


HEADS_PER_PROGRAM = 64  # the wgmma M dimension of one warpgroup
FEW_HEADS = (8, 16, 32)  # head counts below 64 that run as one padded program
# Slot-major (the heads as the dots' N, _attend_slot_major): a program's heads, the next
# power of two of H from 16 up to this; its attend partition is one warpgroup.
SLOT_MAJOR_MAX_HEADS = 32
SLOT_MAJOR_WARPS = 4
BLOCK_N = 64  # selected slots per ring slot and softmax step
STAGES = 2  # ring slots: 2 x 64 x 576 x 2 B = 144 KiB, with the queries and probabilities 224 KiB
ATTEND_WARPS = 8
GATHER_WARPS = 4
# Registers per gather thread after the partitions' setmaxnreg split; the attend warps get the rest
# of the SM's 64K (the launch bound is 65536 / (12 warps x 32) = 168 for every warp before it).
GATHER_REGISTERS = 88
DEQUANT_STEPS = 4  # steps a staged FP8 block is dequantized in (BLOCK_N // 4 rows a step)
# How the FP8 gathers get a block's slot ids into the layouts of their three copies (codes, scales,
# rope): loaded once and converted ("convert", shared-memory round trips with barriers), or loaded
# from global memory in each layout ("per_layout", as the bf16 loop does; L1/L2-resident).
SLOT_LOADS = ("convert", "per_layout")
# When the FP8 gathers refill a staging stage with the copies of the block STAGING ahead: after the
# whole block is dequantized ("block"), or a dequantizing step's rows right after that step has read
# them ("step": the copies overlap the rest of the block's dequantization).
REFILLS = ("block", "step")


@dataclass(frozen=True)
class FP8Tiles:
    """The kernel's launch shape on an ``fp8_ds_mla`` cache.

    block_n : selected slots per block (the ring slot, the staging stage and the softmax step).
    stages : bf16 ring slots (blocks the dequantizing may run ahead of the attend partition).
    staging : staging stages of the cache's bytes (656 a slot; blocks of copies in flight), None:
        as many as ``stages``; 0: none, the gathers load each block's codes and scales from
        global memory into registers, dequantize them there and store them into the ring slot,
        and copy its rope values into the ring slot by ``cp.async`` (then ``dequant_steps`` are
        the steps a block is loaded in, of at least 8 rows: its first step's loads issued before
        the wait for its ring slot, each later step's before the step ahead of it is converted;
        needs ``slot_loads="per_layout"`` and ``refill="block"``).
    in_slot : with ``staging=0``, copy each block's cache bytes by ``cp.async`` into its own ring
        slot instead (codes and scales into the slot's latent rows, the rope values into its rope
        rows) and dequantize them there in place, a 64-column chunk a step (``dequant_steps=8``)
        or two, one scale group (``dequant_steps=4``) (:func:`_gather_fp8_in_slot`; 64-slot
        blocks, 2 ring slots).
    gather_warps : warps of the gather partition, which copies and dequantizes (the attend
        partition keeps its 8). Only 4 compiles for sm_90: with 8 (16 warps) the launch bound
        is 128 registers a thread and ptxas needs 154 for the attend partition's dots.
    gather_registers : registers per gather thread after the partitions' setmaxnreg split (a
        multiple of 8); the attend partition gets the rest of the SM's 64K.
    dequant_steps : steps a staged block is dequantized in (with ``staging=0``: loaded and
        converted in), each ``block_n // dequant_steps`` rows and ending in a barrier of the
        gather warps (with ``staging=0`` the compiler's, between two steps' stores to the slot).
    slot_loads : how the copies get a block's slot ids in their three layouts, one of
        :data:`SLOT_LOADS`: ``"convert"`` (loaded in the codes' layout, converted through shared
        memory for the scales and rope) or ``"per_layout"`` (loaded from global in each layout).
    refill : when a staging stage is refilled, one of :data:`REFILLS`: ``"block"`` (the next
        block's copies issued after the whole block is dequantized, one commit group a block) or
        ``"step"`` (each dequantizing step's rows issued as soon as the step has read them, one
        commit group a step; needs ``dequant_steps >= 2`` and at least ``8 * gather_warps``
        rows a step, so that each thread of a step's scale copies has a whole fp32 scale).
    """

    block_n: int
    stages: int
    staging: int | None = None
    gather_warps: int = GATHER_WARPS
    gather_registers: int = GATHER_REGISTERS
    dequant_steps: int = DEQUANT_STEPS
    slot_loads: str = SLOT_LOADS[0]
    refill: str = REFILLS[0]
    in_slot: bool = False

    def __post_init__(self):
        _check_gather_options(self.block_n, self.stages, self.staging, self.gather_warps,
                              self.dequant_steps, self.slot_loads, self.refill, self.in_slot)


def _check_gather_options(block_n: int, stages: int, staging: int | None, gather_warps: int,
                          dequant_steps: int, slot_loads: str, refill: str, in_slot: bool) -> None:
    """Raise ValueError naming the argument unless ``staging`` is None or ``>= 0``, ``slot_loads``
    is one of :data:`SLOT_LOADS`, ``refill`` one of :data:`REFILLS`, a ``"step"`` refill has at
    least two dequantizing steps of at least ``8 * gather_warps`` rows each (``block_n //
    dequant_steps``: 32 thread rows of four fp32 scales a warp), and ``staging=0`` (the gathers
    through registers) comes with ``dequant_steps`` dividing ``block_n`` into steps of at least
    8 rows (sm_90 compile: a ring-slot slice of 4 rows splits its swizzle pattern),
    ``slot_loads="per_layout"`` and ``refill="block"`` (it has no staging stage to refill and
    loads each layout's slot ids itself), and ``in_slot`` comes with ``staging=0``, 64-slot
    blocks, 2 ring slots and ``dequant_steps`` 8 or 4; for :class:`FP8Tiles` (and
    ``SparseMLAConfig``, which builds one)."""
    if staging is not None and staging < 0:
        raise ValueError(f"staging: expected None or >= 0 staging stages, got {staging}")
    if in_slot and (staging != 0 or block_n != BLOCK_N or stages != STAGES or dequant_steps not in (4, 8)):
        raise ValueError(f"in_slot: the dequantizing in the ring slot needs staging 0, block_n {BLOCK_N}, "
                         f"stages {STAGES} and dequant_steps 8 or 4 (a 64-column chunk or a scale group "
                         f"a step), got staging {staging}, block_n {block_n}, stages {stages}, "
                         f"dequant_steps {dequant_steps}")
    if staging == 0 and (block_n % dequant_steps or block_n // dequant_steps < 8):
        raise ValueError(f"dequant_steps: staging 0 (the gathers through registers) needs a divisor of "
                         f"block_n {block_n} leaving at least 8 rows a step (a step's rows of the ring "
                         f"slot span whole 128-byte swizzle patterns), got {dequant_steps}")
    if slot_loads not in SLOT_LOADS:
        raise ValueError(f"slot_loads: expected one of {SLOT_LOADS}, got {slot_loads!r}")
    if refill not in REFILLS:
        raise ValueError(f"refill: expected one of {REFILLS}, got {refill!r}")
    if staging == 0 and (slot_loads != "per_layout" or refill != "block"):
        raise ValueError(f"staging: 0 (the gathers through registers) needs slot_loads='per_layout' and "
                         f"refill='block', got slot_loads {slot_loads!r}, refill {refill!r}")
    if refill == "step" and (dequant_steps < 2 or block_n // dequant_steps < 8 * gather_warps):
        raise ValueError(f"refill: 'step' needs dequant_steps >= 2 and block_n // dequant_steps "
                         f">= 8 * gather_warps = {8 * gather_warps} rows a step, got block_n "
                         f"{block_n}, dequant_steps {dequant_steps}")


# The fields of FP8Tiles past (block_n, stages): the gather partition's shape.
GATHER_FIELDS = ("staging", "gather_warps", "gather_registers", "dequant_steps", "slot_loads", "refill",
                 "in_slot")
# The bf16 cache's launch shape: blocks of BLOCK_N slots in STAGES ring slots, the default gathers.
BF16_TILES = FP8Tiles(BLOCK_N, STAGES)
# The FP8 cache's defaults. Staged: the gathers stage each block's cache bytes in as many staging
# stages as ring slots and dequantize them into the bf16 ring. 64 slots a block (the bf16 kernel's
# dots and summation order) leaves room for one ring slot and one staging stage (194 KiB),
# dequantized in half-block steps, each copy loading the block's slot ids in its own layout; 32
# slots a block for two of each (189 KiB), dequantizing one block while the other is attended, in
# one step with 96 gather registers. Each was the fastest of its block size in `bench dsa-ops
# --tune --kv-cache-dtype fp8_e4m3` (GLM-5, 64 heads, 64k live; 16 / 32 / 64 decode rows, 128 /
# 256 verify rows) and gives its block size's output bit for bit
# (benchmarks/results/h200/dsa_ops_tune_fp8_sparse_mla_slot_loads.md). Then the gathers through
# registers at 64 slots (no staging stage, the bf16 kernel's two ring slots, so a block is
# dequantized while the one before is on the tensor cores; quarter-block steps at 104 gather
# registers): the staged 64-slot tiles' output bit for bit, 4 - 8% faster than them in launches
# of one split (127.8 / 126.9 / 126.4 µs against 137.5 / 137.9 / 131.9 at 16 / 32 / 64 decode
# rows, 129.7 / 252.2 against 135.4 / 265.4 at 128 / 256 verify rows) and 3 - 7% slower in
# launches of several (32.4 / 50.0 / 81.5 against 30.6 / 46.6 / 78.8 at 16 / 32 / 64 decode rows,
# 8 / 4 / 2 splits), so sparse_mla.sparse_mla_config takes them for launches of one split
# (benchmarks/results/h200/dsa_ops_tune_fp8_sparse_mla_registers.json, H200, same shapes). Last, the
# dequantizing in the ring slot (in_slot: the block's bytes copied into its own ring slot by
# cp.async in two commit groups and dequantized there, a 64-column chunk a step, the first half
# while the second lands; the bf16 kernel's two ring slots, no staging stage): the 64-slot output bit
# for bit, and 3 - 11% faster than the staged and register forms at every point from 4 rows (GLM-5,
# 64 heads, 64k live, H200: 70.3 against 79.3 us at 64 decode rows, 118.2 / 226.6 against 130.7 /
# 254.2 at 128 / 256 verify rows; benchmarks/results/h200/logs/sparse_mla_fp8_in_slot_session20.md
# against logs/sparse_mla_fp8_in_slot_before_session20.md), so sparse_mla's default on FP8 caches.
FP8_TILES = (FP8Tiles(64, 1, dequant_steps=2, slot_loads="per_layout"),
             FP8Tiles(32, 2, gather_registers=96, dequant_steps=1),
             FP8Tiles(64, 2, staging=0, gather_registers=104, dequant_steps=4, slot_loads="per_layout"),
             FP8Tiles(64, 2, staging=0, dequant_steps=8, slot_loads="per_layout", in_slot=True))
# Candidates for ``bench dsa-ops --tune --kv-cache-dtype fp8_e4m3`` (issue 28), each compiled for
# sm_90 without spills (scripts/compile_sparse_mla_gluon.py), with GPU tests like the defaults'
# (tests/test_sparse_mla_fp8.py); docs/dsa-kernels.md says what each is meant to test: the former
# defaults of both block sizes, more staging or ring slots at 32, and at 64 slots the block's slot
# ids converted through shared memory (the former default) and the staging refilled per
# dequantizing step, each and both (more gather registers where 88 spilled), the loads per layout
# at the 32-slot default; then the gathers through registers at 64 slots in eighth-block steps at
# 88 gather registers (the quarter-block steps at 104 are a default; at 88 and 96 they spilled 16
# and 12 B; half-block steps spilled at 104 and 120); and the dequantizing in the ring slot at 104
# gather registers (the default has 88), and in scale-group steps (two chunks a step: fewer
# alternations of loads from and stores to the slot, so fewer of the compiler's barriers).
FP8_TUNE_TILES = (
    FP8Tiles(64, 1),
    FP8Tiles(32, 2),
    FP8Tiles(32, 2, staging=3),
    FP8Tiles(32, 3, staging=2),
    FP8Tiles(32, 2, staging=3, gather_registers=96, dequant_steps=1),
    FP8Tiles(32, 3, staging=2, gather_registers=96, dequant_steps=1),
    FP8Tiles(64, 1, dequant_steps=2),
    FP8Tiles(64, 1, gather_registers=96, dequant_steps=2, refill="step"),
    FP8Tiles(64, 1, gather_registers=104, dequant_steps=2, slot_loads="per_layout", refill="step"),
    FP8Tiles(32, 2, gather_registers=96, dequant_steps=1, slot_loads="per_layout"),
    FP8Tiles(64, 2, staging=0, dequant_steps=8, slot_loads="per_layout"),
    FP8Tiles(64, 2, staging=0, gather_registers=104, dequant_steps=8, slot_loads="per_layout",
             in_slot=True),
    FP8Tiles(64, 2, staging=0, dequant_steps=4, slot_loads="per_layout", in_slot=True),
)


# What the ``trace`` of :func:`launch_sparse_mla_gluon` holds per program, in this order: the SM
# clock (``%clock64``) and the global timer (``%globaltimer``, ns) at each of these points.
TRACE_STAMPS = ("program start", "attend partition start", "attend partition's scan done",
                "first block in shared memory", "blocks done", "result stored",
                "gather partition's scan done", "first block's copies issued")


@gluon.jit
def _stamp(trace_ptr, index: gl.constexpr, TRACE: gl.constexpr):
    """With ``TRACE``: the SM clock and the global timer into the program's stamp ``index``
    (:data:`TRACE_STAMPS`); without it, nothing."""
    if TRACE:
        clock = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64,
                                          is_pure=False, pack=1)
        timer = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64,
                                          is_pure=False, pack=1)
        gl.store(trace_ptr + 2 * index, clock)
        gl.store(trace_ptr + 2 * index + 1, timer)


@gluon.jit
def _slot_ids(row_slots, topk, start, SCAN: gl.constexpr, WARPS: gl.constexpr):
    """Positions ``start .. start + SCAN`` of the row's slot list and their slot ids (-1 past
    ``topk``)."""
    scan_layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    index = start + gl.arange(0, SCAN, layout=scan_layout)
    return index, gl.load(row_slots + index, mask=index < topk, other=-1)


@gluon.jit
def _split_blocks(row_slots, topk, first_index, first_ids, BLOCK_N: gl.constexpr,
                  SCAN: gl.constexpr, WARPS: gl.constexpr):
    """The program's run of the row's slot blocks ``[first, stop)``: the blocks up to the row's last
    valid slot, split ``gl.num_programs(2)`` ways in equal runs. ``first_index, first_ids``: the
    scan's first step (:func:`_slot_ids` at 0), loaded by the caller."""
    last_valid = gl.max(gl.where(first_ids >= 0, first_index, -1), 0)
    for start in range(SCAN, topk, SCAN):
        index, slot = _slot_ids(row_slots, topk, start, SCAN, WARPS)
        last_valid = gl.maximum(last_valid, gl.max(gl.where(slot >= 0, index, -1), 0))
    num_blocks = gl.cdiv(last_valid + 1, BLOCK_N)
    per_split = gl.cdiv(num_blocks, gl.num_programs(2))
    first_block = gl.minimum(gl.program_id(2) * per_split, num_blocks)
    return first_block, gl.minimum(first_block + per_split, num_blocks)


@gluon.jit
def _copy_fp8_rows(codes, scales, rope, kv_ptr, kv_stride, row_slots, topk, block, stop_block,
                   FIRST: gl.constexpr, ROWS: gl.constexpr, LATENT: gl.constexpr,
                   ROPE: gl.constexpr, GROUPS: gl.constexpr, BLOCK_N: gl.constexpr,
                   PER_LAYOUT: gl.constexpr, WARPS: gl.constexpr):
    """``cp.async`` of the ``fp8_ds_mla`` cache rows (codes, scales, rope bytes) of block
    ``block``'s slots ``FIRST .. FIRST + ROWS`` into ``codes, scales, rope`` (``ROWS`` rows of a
    staging stage); invalid slots, and every slot when ``block >= stop_block``, zero-filled. The
    slot ids are loaded in the codes' layout and converted for the other two copies, or with
    ``PER_LAYOUT`` loaded from global memory in each copy's layout."""
    # 16-byte copies of the codes (a warp a row) and the rope values (a warp four rows); a row's
    # 16 scale bytes by the threads of one row
    code_layout: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [WARPS, 1], [1, 0])
    rope_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    ROW_THREADS: gl.constexpr = 32 * WARPS // ROWS
    scale_layout: gl.constexpr = gl.BlockedLayout([1, GROUPS // ROW_THREADS],
                                                  [32 // ROW_THREADS, ROW_THREADS],
                                                  [WARPS, 1], [1, 0])
    code_index = block * BLOCK_N + FIRST + gl.arange(0, ROWS,
                                                     layout=gl.SliceLayout(1, code_layout))
    slot = gl.load(row_slots + code_index, mask=(code_index < topk) & (block < stop_block),
                   other=-1)
    if PER_LAYOUT:  # all three loads in flight at once
        scale_index = block * BLOCK_N + FIRST + gl.arange(
            0, ROWS, layout=gl.SliceLayout(1, scale_layout))
        scale_slot = gl.load(row_slots + scale_index,
                             mask=(scale_index < topk) & (block < stop_block), other=-1)
        rope_index = block * BLOCK_N + FIRST + gl.arange(0, ROWS,
                                                         layout=gl.SliceLayout(1, rope_layout))
        rope_slot = gl.load(row_slots + rope_index,
                            mask=(rope_index < topk) & (block < stop_block), other=-1)
    row = kv_ptr + gl.where(slot >= 0, slot, 0).to(gl.int64) * kv_stride
    code_columns = gl.arange(0, LATENT, layout=gl.SliceLayout(0, code_layout))
    async_copy.async_copy_global_to_shared(codes, row[:, None] + code_columns[None, :],
                                           mask=(slot >= 0)[:, None])
    if not PER_LAYOUT:  # each conversion after the copies before it are issued
        scale_slot = gl.convert_layout(slot, gl.SliceLayout(1, scale_layout))
    scale_row = (kv_ptr + LATENT + gl.where(scale_slot >= 0, scale_slot, 0).to(gl.int64)
                 * kv_stride).to(gl.pointer_type(gl.float32), bitcast=True)
    scale_columns = gl.arange(0, GROUPS, layout=gl.SliceLayout(0, scale_layout))
    async_copy.async_copy_global_to_shared(scales, scale_row[:, None] + scale_columns[None, :],
                                           mask=(scale_slot >= 0)[:, None])
    if not PER_LAYOUT:
        rope_slot = gl.convert_layout(slot, gl.SliceLayout(1, rope_layout))
    _copy_fp8_rope(rope, kv_ptr, kv_stride, rope_slot, LATENT, ROPE, GROUPS, WARPS)


@gluon.jit
def _copy_fp8_rope(rope, kv_ptr, kv_stride, rope_slot, LATENT: gl.constexpr, ROPE: gl.constexpr,
                   GROUPS: gl.constexpr, WARPS: gl.constexpr):
    """``cp.async`` of the bf16 rope values of the ``fp8_ds_mla`` cache rows ``rope_slot`` (slot
    ids in the rope copies' row layout) into the rows of ``rope``; rows of invalid slots
    zero-filled."""
    rope_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    rope_row = (kv_ptr + LATENT + 4 * GROUPS + gl.where(rope_slot >= 0, rope_slot, 0).to(gl.int64)
                * kv_stride).to(gl.pointer_type(gl.bfloat16), bitcast=True)
    rope_columns = gl.arange(0, ROPE, layout=gl.SliceLayout(0, rope_layout))
    async_copy.async_copy_global_to_shared(rope, rope_row[:, None] + rope_columns[None, :],
                                           mask=(rope_slot >= 0)[:, None])


@gluon.jit
def _copy_fp8_stage(codes, scales, rope, kv_ptr, kv_stride, row_slots, topk, block, stop_block,
                    LATENT: gl.constexpr, ROPE: gl.constexpr, GROUPS: gl.constexpr,
                    BLOCK_N: gl.constexpr, COPY_ROWS: gl.constexpr, PER_LAYOUT: gl.constexpr,
                    WARPS: gl.constexpr):
    """Block ``block``'s cache rows into a whole staging stage (:func:`_copy_fp8_rows`), one commit
    group per ``COPY_ROWS`` rows (the block's, or a dequantizing step's)."""
    for c in gl.static_range(BLOCK_N // COPY_ROWS):
        _copy_fp8_rows(codes.slice(c * COPY_ROWS, COPY_ROWS, dim=0),
                       scales.slice(c * COPY_ROWS, COPY_ROWS, dim=0),
                       rope.slice(c * COPY_ROWS, COPY_ROWS, dim=0), kv_ptr, kv_stride, row_slots,
                       topk, block, stop_block, c * COPY_ROWS, COPY_ROWS, LATENT, ROPE, GROUPS,
                       BLOCK_N, PER_LAYOUT, WARPS)
        async_copy.commit_group()


@gluon.jit
def _dequantize_rows(codes, scales, latent_out, FIRST: gl.constexpr, ROWS: gl.constexpr,
                     LATENT: gl.constexpr, GROUPS: gl.constexpr, BLOCK_N: gl.constexpr,
                     WARPS: gl.constexpr):
    """Rows ``FIRST .. FIRST + ROWS`` of a staging stage's codes times their group's scale, as
    bf16 into the same rows of a latent ring slot (exact: a power-of-two scale times an e4m3 code
    is a bf16 value, as in the Triton kernel's ``_gather_latent``)."""
    GROUP: gl.constexpr = LATENT // GROUPS
    layout: gl.constexpr = _dequant_layout(GROUPS, WARPS)
    code = codes.reshape([BLOCK_N, GROUPS, GROUP]).slice(FIRST, ROWS, dim=0).load(layout)
    scale = scales.reshape([BLOCK_N, GROUPS, 1]).slice(FIRST, ROWS, dim=0).load(layout)
    _store_dequantized(code, scale, latent_out, FIRST, ROWS, LATENT)


@gluon.constexpr_function
def _dequant_layout(GROUPS, WARPS):
    """The register layout of dequantized ``[rows, GROUPS, group]`` codes: 16 consecutive codes of
    one group a thread, a warp a row."""
    return gl.BlockedLayout([1, 1, 16], [1, GROUPS, 32 // GROUPS], [WARPS, 1, 1], [2, 1, 0])


@gluon.jit
def _dequantized(code, scale):
    """uint8 e4m3 ``code`` times the fp32 ``scale`` broadcast against it, as bf16 (e4m3 -> fp32,
    the product in fp32, then bf16; exact: a power-of-two scale times an e4m3 code is a bf16
    value, as in the Triton kernel's ``_gather_latent``)."""
    return (code.to(gl.float8e4nv, bitcast=True).to(gl.float32) * scale).to(gl.bfloat16)


@gluon.jit
def _store_dequantized(code, scale, latent_out, FIRST: gl.constexpr, ROWS: gl.constexpr,
                       LATENT: gl.constexpr):
    """uint8 e4m3 ``code`` ``[ROWS, groups, group]`` times its group's fp32 ``scale`` ``[ROWS,
    groups, 1]`` (:func:`_dequantized`), as bf16 ``[ROWS, LATENT]`` into rows ``FIRST .. FIRST +
    ROWS`` of the latent ring slot ``latent_out``."""
    latent_out.slice(FIRST, ROWS, dim=0).store(gl.reshape(_dequantized(code, scale), [ROWS, LATENT]))


@gluon.jit
def _copy_rope_rows(rope, rope_out, FIRST: gl.constexpr, ROWS: gl.constexpr,
                    WARPS: gl.constexpr):
    """Rows ``FIRST .. FIRST + ROWS`` of a staging stage's rope values into the rope ring slot."""
    rope_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    rope_out.slice(FIRST, ROWS, dim=0).store(rope.slice(FIRST, ROWS, dim=0).load(rope_layout))


@gluon.jit
def _gather_fp8_blocks(kv_ptr, kv_stride, row_slots, topk, first_block, stop_block, codes,
                       scales, rope, latent_ring, rope_ring, full, empty, trace_ptr,
                       LATENT: gl.constexpr, ROPE: gl.constexpr, GROUPS: gl.constexpr,
                       BLOCK_N: gl.constexpr, STAGES: gl.constexpr, STAGING: gl.constexpr,
                       STEPS: gl.constexpr, PER_LAYOUT: gl.constexpr, STEP_REFILL: gl.constexpr,
                       WARPS: gl.constexpr, TRACE: gl.constexpr):
    """The split's blocks from an ``fp8_ds_mla`` cache: ``cp.async`` into ``STAGING`` staging
    stages (``STAGING`` blocks ahead; the first commit groups also hold the queries' copies),
    then block ``first_block + i`` dequantized from staging stage ``i % STAGING`` into ring slot
    ``i % STAGES`` once that is free, in ``STEPS`` steps of ``BLOCK_N // STEPS`` rows, signalled on
    ``full`` by one arrive after every gather thread's stores. The staging stage is refilled with
    block ``i + STAGING``'s copies right after the whole block (one commit group a block), or with
    ``STEP_REFILL`` a step's rows right after that step has read them (one commit group a step)."""
    # rows per dequantizing step; the step's barriers order its stores to the ring slot (fewer
    # steps hold more codes in registers: 4 warps, 16 rows a step at 32-slot blocks spilled 12 B
    # on sm_90)
    ROWS: gl.constexpr = BLOCK_N // STEPS
    COPY_ROWS: gl.constexpr = ROWS if STEP_REFILL else BLOCK_N
    GROUPS_AHEAD: gl.constexpr = STAGING * (BLOCK_N // COPY_ROWS)  # commit groups in flight
    for k in gl.static_range(STAGING):
        _copy_fp8_stage(codes.index(k), scales.index(k), rope.index(k), kv_ptr, kv_stride,
                        row_slots, topk, first_block + k, stop_block, LATENT, ROPE, GROUPS,
                        BLOCK_N, COPY_ROWS, PER_LAYOUT, WARPS)
    if first_block < stop_block:
        _stamp(trace_ptr, 7, TRACE)
    for block in range(first_block, stop_block):
        i = block - first_block
        stage = i % STAGES
        staged = i % STAGING
        if STEP_REFILL:
            for r in gl.static_range(STEPS):
                # the groups after step r's: the block's later steps, the other staging stages'
                # blocks, and block + STAGING's steps before r (issued at this block's earlier steps)
                async_copy.wait_group(GROUPS_AHEAD - 1)  # this thread's copies of the rows landed
                gl.thread_barrier()  # ... and every gather thread's
                if r == 0:
                    mbarrier.wait(empty.index(stage), ((i // STAGES) & 1) ^ 1)
                _dequantize_rows(codes.index(staged), scales.index(staged),
                                 latent_ring.index(stage), r * ROWS, ROWS, LATENT, GROUPS, BLOCK_N,
                                 WARPS)
                _copy_rope_rows(rope.index(staged), rope_ring.index(stage), r * ROWS, ROWS, WARPS)
                if r == STEPS - 1:
                    fence_async_shared()  # the bf16 stores, before the wgmma reads them
                    gl.thread_barrier()  # every gather thread stored (and read the rows)
                    mbarrier.arrive(full.index(stage), count=1)
                else:
                    gl.thread_barrier()  # every gather thread read the step's staged rows
                _copy_fp8_rows(codes.index(staged).slice(r * ROWS, ROWS, dim=0),
                               scales.index(staged).slice(r * ROWS, ROWS, dim=0),
                               rope.index(staged).slice(r * ROWS, ROWS, dim=0), kv_ptr, kv_stride,
                               row_slots, topk, block + STAGING, stop_block, r * ROWS, ROWS,
                               LATENT, ROPE, GROUPS, BLOCK_N, PER_LAYOUT, WARPS)
                async_copy.commit_group()
        else:
            async_copy.wait_group(GROUPS_AHEAD - 1)  # this thread's copies of the block landed
            gl.thread_barrier()  # ... and every gather thread's
            mbarrier.wait(empty.index(stage), ((i // STAGES) & 1) ^ 1)
            staged_codes, staged_scales = codes.index(staged), scales.index(staged)
            staged_rope, latent_slot = rope.index(staged), latent_ring.index(stage)
            rope_slot = rope_ring.index(stage)
            for r in gl.static_range(STEPS):
                _dequantize_rows(staged_codes, staged_scales, latent_slot, r * ROWS, ROWS, LATENT,
                                 GROUPS, BLOCK_N, WARPS)
            _copy_rope_rows(staged_rope, rope_slot, 0, BLOCK_N, WARPS)
            fence_async_shared()  # the bf16 stores, before the wgmma reads them
            gl.thread_barrier()  # every gather thread stored (and is done with the staging stage)
            mbarrier.arrive(full.index(stage), count=1)
            _copy_fp8_stage(codes.index(staged), scales.index(staged), rope.index(staged), kv_ptr,
                            kv_stride, row_slots, topk, block + STAGING, stop_block, LATENT, ROPE,
                            GROUPS, BLOCK_N, COPY_ROWS, PER_LAYOUT, WARPS)


@gluon.jit
def _step_slots(row_slots, topk, block, stop_block, FIRST: gl.constexpr, ROWS: gl.constexpr,
                BLOCK_N: gl.constexpr, GROUPS: gl.constexpr, WARPS: gl.constexpr):
    """The slot ids of block ``block``'s slots ``FIRST .. FIRST + ROWS`` in the row layout of
    :func:`_dequant_layout` (-1 past ``topk``, and for every slot when ``block >= stop_block``)."""
    layout: gl.constexpr = _dequant_layout(GROUPS, WARPS)
    index = block * BLOCK_N + FIRST + gl.arange(
        0, ROWS, layout=gl.SliceLayout(1, gl.SliceLayout(2, layout)))
    return gl.load(row_slots + index, mask=(index < topk) & (block < stop_block), other=-1)


@gluon.jit
def _load_fp8_latent(kv_ptr, kv_stride, slot, LATENT: gl.constexpr, GROUPS: gl.constexpr,
                     WARPS: gl.constexpr):
    """From global memory into registers (:func:`_dequant_layout`): the uint8 e4m3 codes
    ``[rows, GROUPS, LATENT // GROUPS]`` and the fp32 group scales ``[rows, GROUPS, 1]`` of the
    ``fp8_ds_mla`` cache rows ``slot`` (:func:`_step_slots`); zeros for invalid slots (as a
    zero-filled copy), which are not read."""
    GROUP: gl.constexpr = LATENT // GROUPS
    layout: gl.constexpr = _dequant_layout(GROUPS, WARPS)
    valid = (slot >= 0)[:, None, None]
    row = (kv_ptr + gl.where(slot >= 0, slot, 0).to(gl.int64) * kv_stride)[:, None, None]
    group = gl.arange(0, GROUPS, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))[None, :, None]
    column = gl.arange(0, GROUP, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))[None, None, :]
    code = gl.load(row + group * GROUP + column, mask=valid, other=0)
    scale = gl.load((row + LATENT + 4 * group).to(gl.pointer_type(gl.float32), bitcast=True),
                    mask=valid, other=0.0)
    return code, scale


@gluon.jit
def _gather_fp8_registers(kv_ptr, kv_stride, row_slots, topk, first_block, stop_block,
                          latent_ring, rope_ring, full, empty, trace_ptr, LATENT: gl.constexpr,
                          ROPE: gl.constexpr, GROUPS: gl.constexpr, BLOCK_N: gl.constexpr,
                          STAGES: gl.constexpr, STEPS: gl.constexpr, WARPS: gl.constexpr,
                          TRACE: gl.constexpr):
    """The split's blocks from an ``fp8_ds_mla`` cache without staging stages (``staging=0``):
    block ``first_block + i`` into ring slot ``i % STAGES`` once that is free, its rope values by
    ``cp.async`` (the first commit group also holds the queries' copies) and its codes and scales
    in ``STEPS`` steps of ``BLOCK_N // STEPS`` rows loaded from global memory into registers,
    dequantized there and stored into the slot (:func:`_store_dequantized`, the staged path's
    arithmetic); signalled on ``full`` by one arrive after every gather thread's stores and rope
    copies. A block's first step is loaded before the wait for its ring slot (its slot ids during
    the block before), and each later step's loads are issued before the step ahead is converted."""
    ROWS: gl.constexpr = BLOCK_N // STEPS
    rope_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    first_slots = _step_slots(row_slots, topk, first_block, stop_block, 0, ROWS, BLOCK_N, GROUPS,
                              WARPS)
    for block in range(first_block, stop_block):
        i = block - first_block
        stage = i % STAGES
        # the codes stay within a block: carried to the next one (a loop phi) they are held a byte
        # a register, and quarter-block steps spilled at 104 registers
        code, scale = _load_fp8_latent(kv_ptr, kv_stride, first_slots, LATENT, GROUPS, WARPS)
        slots_ahead = _step_slots(row_slots, topk, block, stop_block, ROWS, ROWS, BLOCK_N, GROUPS,
                                  WARPS)
        first_slots = _step_slots(row_slots, topk, block + 1, stop_block, 0, ROWS, BLOCK_N, GROUPS,
                                  WARPS)
        rope_index = block * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, rope_layout))
        rope_slot = gl.load(row_slots + rope_index, mask=rope_index < topk, other=-1)
        mbarrier.wait(empty.index(stage), ((i // STAGES) & 1) ^ 1)
        _copy_fp8_rope(rope_ring.index(stage), kv_ptr, kv_stride, rope_slot, LATENT, ROPE, GROUPS,
                       WARPS)
        async_copy.commit_group()
        if i == 0:
            _stamp(trace_ptr, 7, TRACE)
        for r in gl.static_range(STEPS):
            if r + 1 < STEPS:  # step r + 1's codes (slot ids loaded a step ago)
                next_code, next_scale = _load_fp8_latent(kv_ptr, kv_stride, slots_ahead, LATENT,
                                                         GROUPS, WARPS)
            if r + 2 < STEPS:  # ... and step r + 2's slot ids
                slots_ahead = _step_slots(row_slots, topk, block, stop_block, (r + 2) * ROWS, ROWS,
                                          BLOCK_N, GROUPS, WARPS)
            _store_dequantized(code, scale, latent_ring.index(stage), r * ROWS, ROWS, LATENT)
            if r + 1 < STEPS:
                code, scale = next_code, next_scale
        async_copy.wait_group(0)  # this thread's rope copies (and the queries') landed
        fence_async_shared()  # the bf16 stores, before the wgmma reads them
        gl.thread_barrier()  # every gather thread stored and copied
        mbarrier.arrive(full.index(stage), count=1)


@gluon.jit
def _gather_fp8_in_slot(kv_ptr, kv_stride, row_slots, topk, first_block, stop_block, latent_ring,
                        rope_ring, full, empty, trace_ptr, LATENT: gl.constexpr, ROPE: gl.constexpr,
                        GROUPS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                        STEPS: gl.constexpr, WARPS: gl.constexpr, TRACE: gl.constexpr):
    """The split's blocks from an ``fp8_ds_mla`` cache, each copied into its own ring slot and
    dequantized there (``in_slot``): once ring slot ``i % STAGES`` is free, block ``first_block +
    i``'s codes, scales and rope values go into it by ``cp.async`` in two commit groups (the
    scales and code chunks 0 - 3, then chunks 4 - 7 and the rope values; the first block's first
    group also holds the queries' copies); its 64-column chunks are dequantized in place
    (:func:`_dequantized`), one a step (``STEPS`` 8) or two, one scale group (``STEPS`` 4), the
    first half once every gather thread's first group landed, the second half once the second
    did; then ``full`` is signalled by one arrive.

    The latent slot holds its ``[BLOCK_N, 64]`` bf16 column chunks one after another (8 KiB each:
    the 128-byte swizzle pattern is 64 columns wide). The codes are staged in its upper half,
    code chunk ``j`` (``[BLOCK_N, 64]`` bytes) at byte ``32 Ki + 4 Ki j``, the scales
    (``[BLOCK_N, GROUPS]`` fp32) in its first KiB, once per chunk of a step (with two chunks a
    step twice, so a step's ``[2 BLOCK_N, GROUPS]`` load matches its ``[2 BLOCK_N, 64]`` codes
    row for row). A step stores through the slot's ``[8 BLOCK_N, 64]`` bf16 view (chunk ``c``'s
    rows ``c BLOCK_N ..``: the same bytes and swizzle). Output chunk ``c`` covers bytes ``[8 Ki c,
    8 Ki c + 8 Ki)``: chunk 0 overwrites the scales, chunks 1 - 3 nothing staged, chunk ``c >= 4``
    code chunks ``2 c - 8`` and ``2 c - 7``. A thread loads the scales, then each step's codes a
    step ahead of its stores (chunk 4's once the second group landed), and the gather warps meet
    at a barrier before the stores of chunks 0 (after every thread loaded the scales and code
    chunks 0 - 1), 4 (0 - 5) and 6 (0 - 7), so no store overwrites bytes a gather thread has yet
    to read."""
    CHUNK: gl.constexpr = 64
    CHUNKS: gl.constexpr = LATENT // CHUNK
    HALF: gl.constexpr = CHUNKS // 2
    PER_STEP: gl.constexpr = CHUNKS // STEPS  # chunks a step: 1, or 2 (one scale group)
    gl.static_assert(CHUNKS == 8, "the in-slot order is laid out for 512 latent values")
    gl.static_assert(STEPS == 8 or STEPS == 4, "a chunk or a scale group (two chunks) a step")
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
    plain_2d: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    # the slot as [chunk x row, 64] bf16 rows: the same bytes and swizzle as its [BLOCK_N, LATENT] view
    chunk_rows: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    # 16-byte copies of the codes (a warp 8 rows x 64 bytes of one chunk; the columns of half the
    # chunks, the second half offset by HALF chunks), a row's 4 fp32 scales as
    # two 8-byte copies, the rope values as in the other FP8 paths; a chunk's values 16 a thread in
    # the same rows, the scales of those rows (all groups) in every thread of the row
    copy_layout: gl.constexpr = gl.BlockedLayout([1, 1, 16], [1, 8, 4], [1, WARPS, 1], [2, 1, 0])
    scale_copy_layout: gl.constexpr = gl.BlockedLayout([1, GROUPS // 2], [16, 2], [WARPS, 1], [1, 0])
    rope_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    value_layout: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [WARPS, 1], [1, 0])
    code_rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gl.SliceLayout(2, copy_layout)))
    code_chunks = gl.arange(0, CHUNKS // 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, copy_layout)))
    code_bytes = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, gl.SliceLayout(1, copy_layout)))
    code_columns = code_chunks[:, None, None] * CHUNK + code_bytes[None, None, :]
    scale_rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, scale_copy_layout))
    scale_columns = gl.arange(0, GROUPS, layout=gl.SliceLayout(0, scale_copy_layout))
    rope_rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, rope_layout))
    groups = gl.arange(0, GROUPS, layout=gl.SliceLayout(0, value_layout))
    for block in range(first_block, stop_block):
        i = block - first_block
        stage = i % STAGES
        # the slot ids, in each copy's layout, load while the ring slot may still be in use
        code_index = block * BLOCK_N + code_rows
        code_slot = gl.load(row_slots + code_index, mask=code_index < topk, other=-1)
        scale_index = block * BLOCK_N + scale_rows
        scale_slot = gl.load(row_slots + scale_index, mask=scale_index < topk, other=-1)
        rope_index = block * BLOCK_N + rope_rows
        rope_slot = gl.load(row_slots + rope_index, mask=rope_index < topk, other=-1)
        mbarrier.wait(empty.index(stage), ((i // STAGES) & 1) ^ 1)
        latent_slot = latent_ring.index(stage)
        # the slot's bytes as code chunks ([chunk, row, byte] for the copies, [chunk x row, byte]
        # for the loads) and as fp32 scales
        codes = latent_slot._reinterpret(gl.uint8, [2 * CHUNKS, BLOCK_N, CHUNK], plain).slice(
            CHUNKS, CHUNKS, dim=0)
        code_rows_2d = latent_slot._reinterpret(gl.uint8, [2 * CHUNKS * BLOCK_N, CHUNK], plain_2d)
        # the scales once per chunk of a step (PER_STEP KiB), so that a step's [PER_STEP x BLOCK_N,
        # GROUPS] load gives every row of its codes its scales
        scales = latent_slot._reinterpret(gl.float32, [PER_STEP * BLOCK_N, GROUPS], plain_2d)
        values = latent_slot._reinterpret(gl.bfloat16, [CHUNKS * BLOCK_N, CHUNK], chunk_rows)
        # two commit groups: the scales and the first half of the code chunks, then the second
        # half and the rope values, so that the first half is dequantized while the second lands
        code_row = kv_ptr + gl.where(code_slot >= 0, code_slot, 0).to(gl.int64) * kv_stride
        scale_row = (kv_ptr + LATENT + gl.where(scale_slot >= 0, scale_slot, 0).to(gl.int64)
                     * kv_stride).to(gl.pointer_type(gl.float32), bitcast=True)
        for copy in gl.static_range(PER_STEP):
            async_copy.async_copy_global_to_shared(scales.slice(copy * BLOCK_N, BLOCK_N, dim=0),
                                                   scale_row[:, None] + scale_columns[None, :],
                                                   mask=(scale_slot >= 0)[:, None])
        async_copy.async_copy_global_to_shared(codes.slice(0, HALF, dim=0),
                                               code_row[None, :, None] + code_columns,
                                               mask=(code_slot >= 0)[None, :, None])
        async_copy.commit_group()
        async_copy.async_copy_global_to_shared(codes.slice(HALF, HALF, dim=0),
                                               code_row[None, :, None] + HALF * CHUNK + code_columns,
                                               mask=(code_slot >= 0)[None, :, None])
        _copy_fp8_rope(rope_ring.index(stage), kv_ptr, kv_stride, rope_slot, LATENT, ROPE, GROUPS,
                       WARPS)
        async_copy.commit_group()
        if i == 0:
            _stamp(trace_ptr, 7, TRACE)
        async_copy.wait_group(1)  # this thread's first group (and the queries') landed
        gl.thread_barrier()  # ... and every gather thread's
        row_scales = scales.load(value_layout)  # every scale of the thread's rows
        ROWS: gl.constexpr = PER_STEP * BLOCK_N   # a step's [chunk x row] rows
        SECOND: gl.constexpr = HALF // PER_STEP   # the first step of the second commit group
        next_code = code_rows_2d.slice(CHUNKS * BLOCK_N, ROWS, dim=0).load(value_layout)
        for step in gl.static_range(STEPS):
            if step == SECOND:
                async_copy.wait_group(0)  # the second group landed, for every gather thread
                gl.thread_barrier()
                next_code = code_rows_2d.slice(CHUNKS * BLOCK_N + step * ROWS, ROWS, dim=0).load(
                    value_layout)
            code = next_code
            if step + 1 < STEPS and step + 1 != SECOND:
                next_code = code_rows_2d.slice(CHUNKS * BLOCK_N + (step + 1) * ROWS, ROWS, dim=0).load(
                    value_layout)
            if step == 0 or step == SECOND or step == (CHUNKS - 2) // PER_STEP:
                gl.thread_barrier()  # see the docstring: what the next stores overwrite was read
            group = step * PER_STEP * CHUNK // (LATENT // GROUPS)
            scale = gl.sum(gl.where(groups[None, :] == group, row_scales, 0.0), axis=1)
            values.slice(step * ROWS, ROWS, dim=0).store(_dequantized(code, scale[:, None]))
        fence_async_shared()  # the bf16 stores, before the wgmma reads them
        gl.thread_barrier()  # every gather thread stored
        mbarrier.arrive(full.index(stage), count=1)


@gluon.jit
def _gather_partition(q_ptr, q_stride_head, real_heads, q_latent, q_rope, kv_ptr, kv_stride,
                      row_slots, topk, latent_ring, rope_ring, codes, scales, rope, full, empty,
                      trace_ptr, LATENT: gl.constexpr, ROPE: gl.constexpr, BLOCK_H: gl.constexpr,
                      BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SCAN: gl.constexpr,
                      FP8: gl.constexpr, GROUPS: gl.constexpr, STAGING: gl.constexpr,
                      STEPS: gl.constexpr, PER_LAYOUT: gl.constexpr,
                      STEP_REFILL: gl.constexpr, IN_SLOT: gl.constexpr, WARPS: gl.constexpr,
                      TRACE: gl.constexpr):
    """The queries into shared memory (the first ``real_heads`` of them, zeros in the padding
    head slots), then block ``first_block + i``'s cache rows into ring slot ``i % STAGES`` once
    it is free: by ``cp.async`` from a bf16 cache, through the staging stages ``codes, scales,
    rope`` (:func:`_gather_fp8_blocks`) from an ``fp8_ds_mla`` one, or with ``STAGING == 0``
    through registers (:func:`_gather_fp8_registers`)."""
    # 16-byte copies: a warp covers half a latent row, or four rope rows
    latent_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [WARPS, 1], [1, 0])
    rope_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    latent_columns = gl.arange(0, LATENT, layout=gl.SliceLayout(0, latent_layout))
    rope_columns = LATENT + gl.arange(0, ROPE, layout=gl.SliceLayout(0, rope_layout))
    # the scan's first slot ids, then the queries: both fly at once; the first block's
    # copy-completion arrives (issued after the query copies by the same threads) cover them too
    first_index, first_ids = _slot_ids(row_slots, topk, 0, SCAN, WARPS)
    q_heads = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, latent_layout)).to(gl.int64)
    async_copy.async_copy_global_to_shared(
        q_latent, q_ptr + q_heads[:, None] * q_stride_head + latent_columns[None, :],
        mask=(q_heads < real_heads)[:, None])
    q_rope_heads = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, rope_layout)).to(gl.int64)
    async_copy.async_copy_global_to_shared(
        q_rope, q_ptr + q_rope_heads[:, None] * q_stride_head + rope_columns[None, :],
        mask=(q_rope_heads < real_heads)[:, None])
    first_block, stop_block = _split_blocks(row_slots, topk, first_index, first_ids, BLOCK_N,
                                            SCAN, WARPS)
    _stamp(trace_ptr, 6, TRACE)
    if FP8 and IN_SLOT:
        _gather_fp8_in_slot(kv_ptr, kv_stride, row_slots, topk, first_block, stop_block, latent_ring,
                            rope_ring, full, empty, trace_ptr, LATENT, ROPE, GROUPS, BLOCK_N, STAGES,
                            STEPS, WARPS, TRACE)
    elif FP8 and STAGING == 0:
        _gather_fp8_registers(kv_ptr, kv_stride, row_slots, topk, first_block, stop_block,
                              latent_ring, rope_ring, full, empty, trace_ptr, LATENT, ROPE, GROUPS,
                              BLOCK_N, STAGES, STEPS, WARPS, TRACE)
    elif FP8:
        _gather_fp8_blocks(kv_ptr, kv_stride, row_slots, topk, first_block, stop_block, codes,
                           scales, rope, latent_ring, rope_ring, full, empty, trace_ptr, LATENT,
                           ROPE, GROUPS, BLOCK_N, STAGES, STAGING, STEPS, PER_LAYOUT,
                           STEP_REFILL, WARPS, TRACE)
    else:
        for block in range(first_block, stop_block):
            i = block - first_block
            stage = i % STAGES
            # the slot ids load while the slot may still be in use
            index = block * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, latent_layout))
            slot = gl.load(row_slots + index, mask=index < topk, other=-1)
            rope_index = block * BLOCK_N + gl.arange(0, BLOCK_N,
                                                     layout=gl.SliceLayout(1, rope_layout))
            rope_slot = gl.load(row_slots + rope_index, mask=rope_index < topk, other=-1)
            mbarrier.wait(empty.index(stage), ((i // STAGES) & 1) ^ 1)
            row = kv_ptr + gl.where(slot >= 0, slot, 0).to(gl.int64) * kv_stride
            async_copy.async_copy_global_to_shared(
                latent_ring.index(stage), row[:, None] + latent_columns[None, :],
                mask=(slot >= 0)[:, None])
            rope_row = kv_ptr + gl.where(rope_slot >= 0, rope_slot, 0).to(gl.int64) * kv_stride
            async_copy.async_copy_global_to_shared(
                rope_ring.index(stage), rope_row[:, None] + rope_columns[None, :],
                mask=(rope_slot >= 0)[:, None])
            async_copy.mbarrier_arrive(full.index(stage), increment_count=False)
            if i == 0:
                _stamp(trace_ptr, 7, TRACE)
    # no cp.async in flight at exit (the queries' copies, when the split has no block)
    async_copy.commit_group()
    async_copy.wait_group(0)


@gluon.jit
def _attend_blocks(row_slots, topk, trace_ptr, BLOCK_N: gl.constexpr, SCAN: gl.constexpr,
                   WARPS: gl.constexpr, TRACE: gl.constexpr):
    """For the attend partitions: the program's run of blocks (:func:`_split_blocks`, the scan
    between stamps 1 and 2)."""
    _stamp(trace_ptr, 1, TRACE)
    first_index, first_ids = _slot_ids(row_slots, topk, 0, SCAN, WARPS)
    first_block, stop_block = _split_blocks(row_slots, topk, first_index, first_ids, BLOCK_N,
                                            SCAN, WARPS)
    _stamp(trace_ptr, 2, TRACE)
    return first_block, stop_block


@gluon.jit
def _wait_for_block(row_slots, topk, block, first_block, full, trace_ptr, INDEX_LAYOUT: gl.constexpr,
                    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, TRACE: gl.constexpr):
    """For the attend partitions: block ``block``'s ring slot (``(block - first_block) % STAGES``)
    and which of its ``BLOCK_N`` slot ids are valid (in ``INDEX_LAYOUT``), returned once the
    gathers have filled the slot, the async proxy fenced."""
    i = block - first_block
    stage = i % STAGES
    index = block * BLOCK_N + gl.arange(0, BLOCK_N, layout=INDEX_LAYOUT)
    valid = gl.load(row_slots + index, mask=index < topk, other=-1) >= 0
    mbarrier.wait(full.index(stage), (i // STAGES) & 1)
    if i == 0:
        _stamp(trace_ptr, 3, TRACE)
    fence_async_shared()  # the cp.async writes, before the wgmma reads them
    return stage, valid


@gluon.jit
def _attend_head_major(q_latent, q_rope, latent_ring, rope_ring, probs_smem, full, empty,
                       row_slots, topk, qk_scale_log2, out_ptr, out_stride_head, record_ptr,
                       record_stride_head, real_heads, trace_ptr, SPLIT: gl.constexpr,
                       LATENT: gl.constexpr, ROPE: gl.constexpr, BLOCK_H: gl.constexpr,
                       BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SCAN: gl.constexpr,
                       WARPS: gl.constexpr, TRACE: gl.constexpr):
    """The online softmax over the split's blocks as their slots fill (the queries arrive with
    the first); writes the program's first ``real_heads`` heads."""
    first_block, stop_block = _attend_blocks(row_slots, topk, trace_ptr, BLOCK_N, SCAN, WARPS, TRACE)
    # two warpgroups: each holds half of the score columns and half of the value columns
    score_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16])
    out_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, LATENT // 2, 16])
    # a finite start keeps exp2(running_max - new_max) NaN-free while every slot is masked
    running_max = gl.full([BLOCK_H], -1.0e30, gl.float32, layout=gl.SliceLayout(1, score_layout))
    denominator = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(1, score_layout))
    acc = gl.zeros([BLOCK_H, LATENT], gl.float32, layout=out_layout)
    for block in range(first_block, stop_block):
        stage, valid = _wait_for_block(row_slots, topk, block, first_block, full, trace_ptr,
                                       gl.SliceLayout(0, score_layout), BLOCK_N, STAGES, TRACE)
        scores = warpgroup_mma(q_latent, latent_ring.index(stage).permute((1, 0)),
                               gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=score_layout),
                               is_async=True)
        scores = warpgroup_mma(q_rope, rope_ring.index(stage).permute((1, 0)), scores,
                               is_async=True)
        scores = warpgroup_mma_wait(0, deps=[scores])
        scores = gl.where(valid[None, :], scores * qk_scale_log2, float("-inf"))
        new_max = gl.maximum(running_max, gl.max(scores, 1))
        rescale = gl.exp2(running_max - new_max)
        probs = gl.exp2(scores - new_max[:, None])
        denominator = denominator * rescale + gl.sum(probs, 1)
        running_max = new_max
        acc = acc * gl.convert_layout(rescale, gl.SliceLayout(1, out_layout))[:, None]
        probs_smem.store(probs.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()  # each warpgroup's PV dot reads the other's probabilities too
        acc = warpgroup_mma(probs_smem, latent_ring.index(stage), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        gl.thread_barrier()  # both warpgroups are done with the slot and the probabilities
        mbarrier.arrive(empty.index(stage), count=1)
    _stamp(trace_ptr, 4, TRACE)
    seen = denominator > 0
    result = acc / gl.convert_layout(gl.where(seen, denominator, 1.0),
                                     gl.SliceLayout(1, out_layout))[:, None]
    if SPLIT or BLOCK_N < BLOCK_H:
        # from the wgmma layout: the split's normalised output (staged through shared memory it
        # was slower: the records' DRAM writes bound this store), or the output when a ring slot
        # is too small to stage it
        heads = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, out_layout))
        columns = gl.arange(0, LATENT, layout=gl.SliceLayout(0, out_layout))
        if SPLIT:
            rows = record_ptr + heads.to(gl.int64) * record_stride_head
            gl.store(rows[:, None] + columns[None, :], result,
                     mask=(heads < real_heads)[:, None])
        else:
            rows = out_ptr + heads.to(gl.int64) * out_stride_head
            gl.store(rows[:, None] + columns[None, :], result.to(gl.bfloat16),
                     mask=(heads < real_heads)[:, None])
    if SPLIT:
        # the split's log2-sum-exp2 (-inf when it saw no valid slot)
        log_sum = gl.where(seen, running_max + gl.log2(gl.where(seen, denominator, 1.0)),
                           float("-inf"))
        sum_heads = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, score_layout))
        gl.store(record_ptr + sum_heads.to(gl.int64) * record_stride_head + LATENT, log_sum,
                 mask=sum_heads < real_heads)
    elif BLOCK_N == BLOCK_H:
        # through ring slot 0 (idle now: every issued block was consumed), so that a warp stores
        # 512 contiguous bytes at a time instead of the wgmma layout's 8-row pieces of 4 bytes
        staging = latent_ring.index(0)
        staging.store(result.to(gl.bfloat16))
        gl.thread_barrier()
        rows_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [WARPS, 1], [1, 0])
        heads = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, rows_layout))
        columns = gl.arange(0, LATENT, layout=gl.SliceLayout(0, rows_layout))
        rows = out_ptr + heads.to(gl.int64) * out_stride_head
        gl.store(rows[:, None] + columns[None, :], staging.load(rows_layout),
                 mask=(heads < real_heads)[:, None])
    _stamp(trace_ptr, 5, TRACE)


@gluon.jit
def _attend_slot_major(q_latent, q_rope, latent_ring, rope_ring, probs_smem, full, empty,
                       row_slots, topk, qk_scale_log2, out_ptr, out_stride_head, record_ptr,
                       record_stride_head, real_heads, trace_ptr, SPLIT: gl.constexpr,
                       LATENT: gl.constexpr, ROPE: gl.constexpr, BLOCK_H: gl.constexpr,
                       BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SCAN: gl.constexpr,
                       WARPS: gl.constexpr, TRACE: gl.constexpr):
    """:func:`_attend_head_major` with the dots' roles swapped, on one warpgroup: per block
    ``scores^T [BLOCK_N, BLOCK_H] = slot rows . q^T`` (the ring slot as the wgmma's A operand, the
    queries as B: the heads are N, so 8 - 32 heads need no 64-row padding), the online softmax
    over axis 0, ``acc^T [512, BLOCK_H] += slot rows^T . probs^T`` (the transposed ring slot as A,
    the probabilities as B); writes the program's first ``real_heads`` heads."""
    first_block, stop_block = _attend_blocks(row_slots, topk, trace_ptr, BLOCK_N, SCAN, WARPS, TRACE)
    # one warpgroup, N = the program's heads: the scores [BLOCK_N, BLOCK_H], the accumulator
    # [LATENT, BLOCK_H]
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, BLOCK_H, 16])
    heads_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
    # a finite start keeps exp2(running_max - new_max) NaN-free while every slot is masked
    running_max = gl.full([BLOCK_H], -1.0e30, gl.float32, layout=heads_layout)
    denominator = gl.zeros([BLOCK_H], gl.float32, layout=heads_layout)
    acc = gl.zeros([LATENT, BLOCK_H], gl.float32, layout=mma_layout)
    for block in range(first_block, stop_block):
        stage, valid = _wait_for_block(row_slots, topk, block, first_block, full, trace_ptr,
                                       gl.SliceLayout(1, mma_layout), BLOCK_N, STAGES, TRACE)
        scores = warpgroup_mma(latent_ring.index(stage), q_latent.permute((1, 0)),
                               gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=mma_layout),
                               is_async=True)
        scores = warpgroup_mma(rope_ring.index(stage), q_rope.permute((1, 0)), scores,
                               is_async=True)
        scores = warpgroup_mma_wait(0, deps=[scores])
        scores = gl.where(valid[:, None], scores * qk_scale_log2, float("-inf"))
        new_max = gl.maximum(running_max, gl.max(scores, 0))
        rescale = gl.exp2(running_max - new_max)
        probs = gl.exp2(scores - new_max[None, :])
        denominator = denominator * rescale + gl.sum(probs, 0)
        running_max = new_max
        acc = acc * rescale[None, :]
        probs_smem.store(probs.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()  # every warp's probabilities, before the PV dot reads them all
        acc = warpgroup_mma(latent_ring.index(stage).permute((1, 0)), probs_smem, acc,
                            is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        gl.thread_barrier()  # every warp is done with the slot and the probabilities
        mbarrier.arrive(empty.index(stage), count=1)
    _stamp(trace_ptr, 4, TRACE)
    seen = denominator > 0
    result = acc / gl.where(seen, denominator, 1.0)[None, :]
    # a head's 512 columns contiguous in a thread's registers and across a warp's lanes
    store_layout: gl.constexpr = gl.BlockedLayout([8, 1], [32, 1], [1, WARPS], [0, 1])
    heads = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, store_layout))
    columns = gl.arange(0, LATENT, layout=gl.SliceLayout(1, store_layout))
    real = (heads < real_heads)[None, :]
    if SPLIT:
        rows = record_ptr + heads.to(gl.int64) * record_stride_head
        gl.store(rows[None, :] + columns[:, None], gl.convert_layout(result, store_layout), mask=real)
        # the split's log2-sum-exp2 (-inf when it saw no valid slot)
        log_sum = gl.where(seen, running_max + gl.log2(gl.where(seen, denominator, 1.0)),
                           float("-inf"))
        sum_heads = gl.arange(0, BLOCK_H, layout=heads_layout)
        gl.store(record_ptr + sum_heads.to(gl.int64) * record_stride_head + LATENT, log_sum,
                 mask=sum_heads < real_heads)
    else:
        rows = out_ptr + heads.to(gl.int64) * out_stride_head
        gl.store(rows[None, :] + columns[:, None],
                 gl.convert_layout(result.to(gl.bfloat16), store_layout), mask=real)
    _stamp(trace_ptr, 5, TRACE)


@gluon.jit
def _attend_partition(q_latent, q_rope, latent_ring, rope_ring, probs_smem, full, empty, row_slots, topk,
                      qk_scale_log2, out_ptr, out_stride_head, record_ptr, record_stride_head, real_heads,
                      trace_ptr, SPLIT: gl.constexpr, LATENT: gl.constexpr, ROPE: gl.constexpr,
                      BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SCAN: gl.constexpr,
                      WARPS: gl.constexpr, TRACE: gl.constexpr, SLOT_MAJOR: gl.constexpr):
    """The attend partition: :func:`_attend_slot_major` with ``SLOT_MAJOR``, else
    :func:`_attend_head_major`."""
    if SLOT_MAJOR:
        _attend_slot_major(q_latent, q_rope, latent_ring, rope_ring, probs_smem, full, empty, row_slots, topk,
                           qk_scale_log2, out_ptr, out_stride_head, record_ptr, record_stride_head, real_heads,
                           trace_ptr, SPLIT, LATENT, ROPE, BLOCK_H, BLOCK_N, STAGES, SCAN, WARPS, TRACE)
    else:
        _attend_head_major(q_latent, q_rope, latent_ring, rope_ring, probs_smem, full, empty, row_slots, topk,
                           qk_scale_log2, out_ptr, out_stride_head, record_ptr, record_stride_head, real_heads,
                           trace_ptr, SPLIT, LATENT, ROPE, BLOCK_H, BLOCK_N, STAGES, SCAN, WARPS, TRACE)


@gluon.jit
def _sparse_mla_gluon_kernel(q_ptr, kv_ptr, slots_ptr, out_ptr, workspace_ptr, qk_scale_log2,
                             q_stride_row, q_stride_head, kv_stride, slots_stride,
                             out_stride_row, out_stride_head, num_heads, topk, trace_ptr,
                             LATENT: gl.constexpr, ROPE: gl.constexpr, BLOCK_H: gl.constexpr,
                             BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SCAN: gl.constexpr,
                             SPLIT: gl.constexpr, RECORD: gl.constexpr, FP8: gl.constexpr,
                             GROUPS: gl.constexpr, STAGING: gl.constexpr,
                             GATHER_WARPS: gl.constexpr,
                             GATHER_REGISTERS: gl.constexpr, DEQUANT_STEPS: gl.constexpr,
                             PER_LAYOUT: gl.constexpr, STEP_REFILL: gl.constexpr,
                             IN_SLOT: gl.constexpr, SLOT_MAJOR: gl.constexpr, TRACE: gl.constexpr,
                             STAMPS: gl.constexpr):
    """Program ``(row, head block, split)``: shared memory and its barriers, then the gather and
    attend partitions (each finds the split's blocks itself, so the gathers start at once); with
    ``SLOT_MAJOR`` the attend partition is :func:`_attend_slot_major`."""
    row = gl.program_id(0).to(gl.int64)
    head_start = gl.program_id(1) * BLOCK_H
    split = gl.program_id(2)
    num_splits = gl.num_programs(2)
    row_slots = slots_ptr + row * slots_stride
    trace_ptr += ((row * gl.num_programs(1) + gl.program_id(1)) * num_splits + split) * 2 * STAMPS
    _stamp(trace_ptr, 0, TRACE)
    q_head = q_ptr + row * q_stride_row + head_start.to(gl.int64) * q_stride_head
    real_heads = num_heads - head_start  # of the program's BLOCK_H head slots; the rest is padding

    swizzled: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                                  rank=2)
    q_latent = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, LATENT], swizzled)
    q_rope = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, ROPE], swizzled)
    latent_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, LATENT], swizzled)
    rope_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, ROPE], swizzled)
    # the PV dot's probabilities: its A operand [heads, slots], or slot-major its B [slots, heads]
    PROBS_ROWS: gl.constexpr = BLOCK_N if SLOT_MAJOR else BLOCK_H
    PROBS_COLUMNS: gl.constexpr = BLOCK_H if SLOT_MAJOR else BLOCK_N
    probs_smem = gl.allocate_shared_memory(
        gl.bfloat16, [PROBS_ROWS, PROBS_COLUMNS],
        gl.NVMMASharedLayout.get_default_for([PROBS_ROWS, PROBS_COLUMNS], gl.bfloat16))
    # the FP8 staging stages of the gathered cache rows (the cache's bytes); one row for a bf16
    # cache or an FP8 one gathered through registers (staging 0), never used
    STAGED_STAGES: gl.constexpr = STAGING if FP8 and STAGING > 0 else 1
    STAGED_ROWS: gl.constexpr = BLOCK_N if FP8 and STAGING > 0 else 1
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    codes = gl.allocate_shared_memory(gl.uint8, [STAGED_STAGES, STAGED_ROWS, LATENT], plain)
    scales = gl.allocate_shared_memory(gl.float32, [STAGED_STAGES, STAGED_ROWS, GROUPS], plain)
    rope = gl.allocate_shared_memory(gl.bfloat16, [STAGED_STAGES, STAGED_ROWS, ROPE], plain)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for stage in gl.static_range(STAGES):
        # one copy-completion arrive per gather thread (bf16 cache) or one arrive after the
        # dequantizing stores (FP8); one arrive of the attend partition
        mbarrier.init(full.index(stage), count=1 if FP8 else GATHER_WARPS * 32)
        mbarrier.init(empty.index(stage), count=1)
    fence_async_shared()  # the barrier inits, before the copy-completion arrives use them
    gl.thread_barrier()

    out_row = out_ptr + row * out_stride_row + head_start.to(gl.int64) * out_stride_head
    record = workspace_ptr + ((row * num_heads + head_start) * num_splits + split) * RECORD
    gl.warp_specialize(
        [(_attend_partition, (q_latent, q_rope, latent_ring, rope_ring, probs_smem, full, empty,
                              row_slots, topk, qk_scale_log2, out_row, out_stride_head, record,
                              num_splits * RECORD, real_heads, trace_ptr, SPLIT, LATENT, ROPE,
                              BLOCK_H, BLOCK_N, STAGES, SCAN, gl.num_warps(), TRACE, SLOT_MAJOR)),
         (_gather_partition, (q_head, q_stride_head, real_heads, q_latent, q_rope, kv_ptr,
                              kv_stride, row_slots, topk, latent_ring, rope_ring, codes, scales,
                              rope, full, empty, trace_ptr, LATENT, ROPE, BLOCK_H, BLOCK_N,
                              STAGES, SCAN, FP8, GROUPS, STAGING, DEQUANT_STEPS, PER_LAYOUT,
                              STEP_REFILL, IN_SLOT, GATHER_WARPS, TRACE))],
        [GATHER_WARPS], [GATHER_REGISTERS])


def sparse_mla_gluon_supported(device: torch.device | str, num_heads: int, slot_major: bool = False) -> bool:
    """Whether the Gluon kernel runs on ``device`` for ``num_heads`` heads: a CUDA device of compute
    capability 9.x (wgmma) and a head count in :data:`FEW_HEADS` (one program of 64 head slots,
    padded; slot-major one program of 16 or 32) or, not ``slot_major``, a positive multiple of 64
    (no padding). Those are the head counts a rank holds for GLM-5 (64 heads) and DeepSeek-V3.2
    (128) from TP 1 to TP 8, and the ones the GPU tests cover; any count of at most 64 would pad
    the same way, but is not offered untested."""
    device = torch.device(device)
    return (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
            and (num_heads in FEW_HEADS
                 or (not slot_major and num_heads > 0 and num_heads % HEADS_PER_PROGRAM == 0)))


def slot_major_block_h(num_heads: int) -> int:
    """Heads of a slot-major program (the dots' N): the next power of two of ``num_heads``, at least
    16, at most :data:`SLOT_MAJOR_MAX_HEADS`."""
    return min(SLOT_MAJOR_MAX_HEADS, max(16, triton.next_power_of_2(num_heads)))


def launch_sparse_mla_gluon(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
                            out: torch.Tensor, workspace: torch.Tensor | None,
                            qk_scale_log2: float, *, scan: int, record_width: int,
                            tiles: FP8Tiles = BF16_TILES, slot_major: bool = False,
                            trace: torch.Tensor | None = None) -> None:
    """Launch the kernel over grid ``(R, cdiv(H, 64), num_splits)`` (``slot_major``: ``(R, cdiv(H,
    slot_major_block_h(H)), num_splits)`` programs of :func:`_attend_slot_major`, 4
    attend warps) on a bf16 ``kv_cache``
    ``[slots, 576]`` or an ``fp8_ds_mla`` one (uint8 ``[slots, 656]``, row stride a multiple of 16
    bytes) with the launch shape ``tiles`` (one of :data:`FP8_TILES` or :data:`FP8_TUNE_TILES`
    for FP8; :data:`BF16_TILES` for bf16, where only its ``block_n``, ``stages``, ``gather_warps``
    and ``gather_registers`` apply): with ``workspace`` (fp32
    ``[R, H, num_splits, record_width]``) it writes each split's normalised ``[512]`` output and its
    log2-sum-exp2 at index 512 of the split's record, without it the bf16 ``out`` directly.
    ``qk_scale_log2`` is the softmax scale times ``log2(e)``; ``scan`` the slot ids per step of
    the last-valid scan (a power of two). ``trace`` (int64 ``[programs, 2 * len(TRACE_STAMPS)]``,
    programs in grid order, zeroed by the caller) switches on the phase stamps, for diagnosis
    (``scripts/sweep_sparse_mla.py --timeline``); it compiles a separate kernel, and a program
    that skips a point leaves its stamp 0. The caller has checked the arguments
    (:func:`dsaspec.ops.sparse_mla.sparse_mla_decode`)."""
    num_rows, num_heads, _ = q.shape
    num_splits = 1 if workspace is None else workspace.shape[2]
    block_h = slot_major_block_h(num_heads) if slot_major else HEADS_PER_PROGRAM
    grid = (num_rows, triton.cdiv(num_heads, block_h), num_splits)
    if trace is not None:
        check_tensor("trace", trace, dtype=torch.int64,
                     shape=(grid[0] * grid[1] * grid[2], 2 * len(TRACE_STAMPS)), device=q.device)
        if not trace.is_contiguous():
            raise ValueError("trace: expected a contiguous tensor")
    _sparse_mla_gluon_kernel[grid](
        q, kv_cache, slots, out, out if workspace is None else workspace, qk_scale_log2,
        q.stride(0), q.stride(1), kv_cache.stride(0), slots.stride(0), out.stride(0),
        out.stride(1), num_heads, slots.shape[1], out if trace is None else trace,
        LATENT=out.shape[2], ROPE=q.shape[2] - out.shape[2], BLOCK_H=block_h,
        BLOCK_N=tiles.block_n, STAGES=tiles.stages, SCAN=scan, SPLIT=workspace is not None,
        RECORD=record_width, FP8=is_fp8_cache(kv_cache), GROUPS=MLA_LATENT_DIM // FP8_GROUP,
        STAGING=tiles.stages if tiles.staging is None else tiles.staging,
        GATHER_WARPS=tiles.gather_warps, GATHER_REGISTERS=tiles.gather_registers,
        DEQUANT_STEPS=tiles.dequant_steps, PER_LAYOUT=tiles.slot_loads == "per_layout",
        STEP_REFILL=tiles.refill == "step", IN_SLOT=tiles.in_slot, SLOT_MAJOR=slot_major,
        TRACE=trace is not None, STAMPS=len(TRACE_STAMPS),
        num_warps=SLOT_MAJOR_WARPS if slot_major else ATTEND_WARPS)
