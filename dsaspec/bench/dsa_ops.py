"""DSA decode ops per layer (indexer incl. schedule, top-k, sparse MLA, the three together): new vs baseline kernels.

Shapes from ``--preset`` (GLM-5: 64 heads, a 576-wide MLA cache whose first 512 values are the
latent, 32 index heads x 128, top-k 2048); ``--heads`` times other query head counts (a rank's
share under tensor parallelism, e.g. 64,32,16,8: column ``heads``), the index heads staying the
preset's. A point is (heads, mode, bs, live_kv): ``bs`` requests with
``live_kv`` tokens each, in 64-token pages placed at random in one KV pool allocated for the
point; decode has one row per request (length ``live_kv``), target verify ``--verify-rows`` N rows
per request (lengths ``live_kv - N + 1 .. live_kv``, one page table per request). Times are per
layer (one call of each op), from CUDA-graph replays with a cold L2 (dsaspec/bench/timing.py:
CUPTI kernel time, median and spread).

- ``indexer``: ``indexer_schedule`` + ``indexer_logits``. new: ``skip_len`` = top-k (rows with
  live <= k get no blocks), ``rows_per_group`` = rows per request (the N verify rows share each
  key read where their group fits, ``group_fits``; else 1), the cache's default configuration
  (``default_indexer_config``) at its ``programs_per_sm`` programs per SM; baseline: ``skip_len``
  0, one row per unit and ``INDEXER_BASELINE_CONFIG`` with one program per SM (the earlier kernel).
- ``topk``: ``topk_slots`` on the baseline's logits. new: rows with live <= k copy their slots
  without reading logits, and each row is split over the chunks of the workspace
  ``topk_workspace`` allocates for R rows (about 2 programs per SM, in one cooperative launch;
  none when the rows fill the GPU: one program per row), a long row's top-k selected from the
  candidate lists of ``topk_candidates``; baseline: one program per row with
  ``baseline_read_short_rows=True``.
- ``sparse_mla``: ``sparse_mla_decode`` on the new top-k's slots. new: the default configuration
  (``sparse_mla_config``) with the workspace ``sparse_mla_workspace`` allocates for R rows (split +
  combine; none when the rows fill the GPU); ``new_nosplit``: without a workspace (the row-invariant
  path); ``triton``: the Triton kernel's default configuration (``sparse_mla_config`` without a
  device) with the workspace it allocates, what runs where the Gluon kernel does not (the same as
  new off Hopper); ``slot_major`` (at up to ``SLOT_MAJOR_MAX_HEADS`` heads, on both caches): the
  slot-major configuration at every R (``slot_major_config``: the Gluon kernel's where it runs, else
  ``SPARSE_MLA_SLOT_MAJOR_CONFIG``; new takes it at 8 and 16 heads from 2 rows) with the workspace it
  allocates; ``padded`` (at up to ``SLOT_MAJOR_DEFAULT_MAX_HEADS`` heads, on both caches): what new
  takes without slot-major dots (``sparse_mla_config(..., slot_major=False)``, the runtime's
  ``DSASPEC_SPARSE_MLA_SLOT_MAJOR=0``) with the workspace it allocates; baseline:
  ``SPARSE_MLA_BASELINE_CONFIG`` without a workspace (what the runtime ran).
- ``layer``: the three in sequence, each in its new or baseline form.

``--kv-cache-dtype fp8_e4m3`` adds an indexer and a sparse MLA row on the FP8 caches after each
bf16 one (column ``KV cache``). Indexer: the point's keys quantized into the paged FP8 key cache
(``store_index_k``, 8448-byte pages) and the bf16 keys replaced by their dequantized values; new
is the new form on the FP8 cache, baseline the bf16 row's new (``speedup`` bf16 / FP8); its bytes
floor reads 132 B a key token instead of 256 (the FLOP floor at the measured e4m3 matmul peak),
its logits are checked against the bf16 row's within ``FP8_INDEXER_RTOL`` of their absolute sums
(the query is quantized to e4m3 too), and decode at 64k live with 64 index heads
(``--preset deepseek_v32``; glm5 has 32) has the targets ``FP8_INDEXER_TARGET_US``. Sparse MLA:
the point's cache quantized (``store_mla``) and the bf16 cache replaced
by its dequantized values, so both rows attend over the same values. There new is the default
configuration on the FP8 cache (``GLUON_FP8_DEFAULT_CONFIG`` where the Gluon kernel runs, else a
Triton one) with the point's workspace, ``new_nosplit`` the same without it, where the Gluon kernel runs
``gluon_fp8`` / ``gluon_fp8_narrow`` / ``gluon_fp8_one_split`` the Gluon kernel on the FP8 cache with
the point's workspace (``SPARSE_MLA_GLUON_FP8_CONFIG``, ``SPARSE_MLA_GLUON_FP8_NARROW_CONFIG``,
``SPARSE_MLA_GLUON_FP8_ONE_SPLIT_CONFIG``), and baseline the bf16
row's new (so ``speedup`` is bf16 / FP8); its bytes floor gathers 656 B a distinct selected slot instead of
1,152, and a target of its own applies from 16 rows (``FP8_BYTES_FACTOR``). The top-k and layer
rows stay on the bf16 caches (holding the dequantized values).

With ``--kv-cache-dtype fp8_e4m3``, ``--tune`` times the sparse MLA candidates on the FP8 cache
too (and ``TUNE_SPARSE_MLA_FP8``), each row's ``config`` naming its ``kv_cache``, and the indexer
on the FP8 key cache: the point's default, then ``TUNE_INDEXER_FP8`` at ``TUNE_PROGRAMS_PER_SM`` programs per
SM, each candidate's logits checked against the default's (bitwise under the interpreter, within
``FP8_INDEXER_TUNE_RTOL`` of their absolute sums on the GPU; a mismatch is the row's error); the Gluon
kernel's FP8 gather candidates (``SPARSE_MLA_GLUON_FP8_TUNE_CONFIGS``) and its one-split and in-slot
tiles are checked bitwise against the staged FP8 default of their block size (a mismatch is the row's error).
After timing, ``--tune`` prints and writes the fastest error-free configuration per op and point.
``--tune`` also times the top-k at other chunk counts (``TUNE_TOPK_CHUNKS`` times the default,
``TUNE_TOPK_FEW_CHUNKS``, and 1: one program per row), each in one launch (where it fits) and in five,
each with and without candidate lists (``sampled``).

Floors (per op, what its contract needs; the layer's is the sum of its ops'): bytes at the
measured copy bandwidth, FLOPs at the measured bf16 tensor-core peak (a large matmul), an empty
kernel node; ``floor_us`` is the largest, ``achieved`` = floor_us / new_us. Next to the top-k
(live > k) a same-bytes yardstick timed the same way: ``torch.amax`` of every logits row
(``amax_us``, ``new_over_amax``); an exact select needs several such passes. Next to sparse MLA
(both caches) the same slots' cache entries gathered by themselves
(:func:`~dsaspec.bench.slot_gather.fastest_slot_gather`: each row's selected entries read whole and
XOR-folded, the fastest of its grids; ``gather_us``, ``gather_grid``, ``new_over_gather``), what
the op's gathers cost without its math; on the FP8 cache it has the proposed target
``FP8_GATHER_FACTOR`` from ``FP8_GATHER_MIN_ROWS`` rows. On the FP8 cache also those gathers with
the dequantization the op cannot skip (:func:`~dsaspec.bench.slot_gather.slot_gather_dequant`: the
codes times their group's scale and the rope values widened to fp32, summed, the fastest of the same
grids; ``gather_dequant_us``, ``gather_dequant_grid``, ``new_over_gather_dequant``), no target yet.
Bytes: indexer: for the rows longer than k, their page-table prefixes, the index keys once per
request (the N verify rows share them), q and weights, the logits written; top-k: rows longer than k
read their logits, every row reads its selected page-table entries and writes k slots; sparse MLA:
the distinct selected cache rows of each request (1152 B each), the slot lists, q, the bf16 output.
FLOPs: indexer ``2 * H_index * 128 * live`` per row longer than k; sparse MLA
``2 * H * (576 + 512)`` per valid slot.
After timing, new and baseline outputs are compared (indexer logits and sparse MLA to fp32/bf16
rounding, top-k slots exactly). Without CUDA: fixed small sizes under the Triton interpreter,
outputs checked against the baseline and the plain-torch references, no times.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field, replace

import torch
from tqdm import tqdm

from dsaspec.bench.floors import matmul_tflops
from dsaspec.bench.slot_gather import fastest_slot_gather, slot_gather_dequant
from dsaspec.errors import UserError
from dsaspec.cli_parsing import choice_list, nonnegative_int, positive_int, positive_int_list
from dsaspec.ops.device import sm_count
from dsaspec.ops.fp8_kv import gather_index_k, gather_mla, store_index_k, store_mla
from dsaspec.ops.kv_cache_layout import INDEX_FP8_BYTES, INDEX_FP8_PAGE_BYTES, MLA_FP8_BYTES
from dsaspec.ops.indexer import (INDEXER_BASELINE_CONFIG, INDEXER_CONFIG, INDEXER_FP8_CONFIG,
                                 INDEXER_FP8_GATHER_CONFIG, IndexerConfig, default_indexer_config, group_fits,
                                 indexer_logits)
from dsaspec.ops.indexer_schedule import indexer_schedule
from dsaspec.ops.sparse_mla import (GLUON_FP8_DEFAULT_CONFIG, LATENT_DIM, QK_DIM, SPARSE_MLA_BASELINE_CONFIG,
                                    SPARSE_MLA_CONFIG, SPARSE_MLA_FEW_ROWS_CONFIG, SPARSE_MLA_GLUON_CONFIG,
                                    SPARSE_MLA_GLUON_FP8_SLOT_MAJOR_CONFIG, SPARSE_MLA_GLUON_SLOT_MAJOR_CONFIG,
                                    SPARSE_MLA_GLUON_FP8_CONFIG,
                                    SPARSE_MLA_GLUON_FP8_NARROW_CONFIG, SPARSE_MLA_GLUON_FP8_ONE_SPLIT_CONFIG,
                                    SPARSE_MLA_GLUON_FP8_IN_SLOT_CONFIG,
                                    SPARSE_MLA_GLUON_FP8_TUNE_CONFIGS, SPARSE_MLA_SLOT_MAJOR_CONFIG,
                                    SLOT_MAJOR_DEFAULT_MAX_HEADS, SLOT_MAJOR_MAX_HEADS,
                                    SparseMLAConfig, slot_major_config, sparse_mla_config, sparse_mla_decode,
                                    sparse_mla_workspace)
from dsaspec.ops.sparse_mla_gluon import sparse_mla_gluon_supported
from dsaspec.ops.topk import (TOPK_LISTS_MAX_CHUNKS, topk_candidates, topk_num_chunks,
                              topk_single_launch_fits, topk_slots, topk_workspace)
from dsaspec.configs.model_config import PRESETS, get_config

OPS = ("indexer", "topk", "sparse_mla", "layer")
KV_CACHE_DTYPES = ("bf16", "fp8_e4m3")
FP8_OPS = ("indexer", "sparse_mla")  # the ops with a row on the FP8 cache
MODES = ("decode", "target_verify")
PAGE = 64
INDEX_DIM = 128
NUM_SMS_WITHOUT_CUDA = 8
# Targets (docs/benchmarking.md, "Targets"): bs 1 at 1k live within this many µs per op; bs >= 16 at 64k
# live within this factor of the floor; never slower than the baseline (beyond timing noise).
SMALL_TARGET_US, FLOOR_FACTOR, NOISE = 8.0, 2.0, 1.05
# Sparse MLA on the FP8 cache (issue 28): within this factor of its bytes floor from this many rows.
FP8_BYTES_FACTOR, FP8_BYTES_MIN_ROWS = 1.3, 16
# Proposed in its place (docs/fp8-kv-cache.md: the gathers alone take up to 2x that floor at 16 - 64 rows): within
# this factor of the same slots' entries gathered alone (dsaspec/bench/slot_gather.py) from this many rows, the
# factor the FP8 indexer's proposed target takes over its pure paged read.
FP8_GATHER_FACTOR, FP8_GATHER_MIN_ROWS = 1.3, 64
# The indexer on the FP8 key cache (issue 28): decode at 64k live with 64 index heads, bs -> µs (DeepGEMM's
# FP8 paged MQA logits take 82 / 149 µs there in SGLang's profile).
FP8_INDEXER_TARGET_US, FP8_INDEXER_TARGET_HEADS, FP8_INDEXER_TARGET_LIVE = {32: 70.0, 64: 130.0}, 64, 65536
# FP8 vs bf16 indexer logits on the same keys: the e4m3 query's rounding moves a logit by at most 2**-4
# of its absolute sum (sum_h |w| |q| . |k|), the FP8 MMA's accumulation by about 2**-10; 2**-3 leaves room.
FP8_INDEXER_RTOL = 2.0 ** -3
# Proposed for the top-k in place of FLOOR_FACTOR x its bytes floor (docs/dsa-kernels.md): an exact select
# reads a row up to five times, so at most this many same-bytes torch.amax reads of its logits.
TOPK_AMAX_FACTOR = 5.0
# Without CUDA (interpreter): heads, index heads, top-k, bs, live_kv.
CPU_SIZES = dict(heads=16, index_heads=4, topk=64, bs=[1, 3], live_kv=[66, 200])

# --tune: candidate configurations, timed at TUNE_POINTS.
TUNE_SPARSE_MLA = (
    SPARSE_MLA_CONFIG,
    SPARSE_MLA_FEW_ROWS_CONFIG,
    SparseMLAConfig(block_h=64, block_n=64, num_warps=8, num_stages=3),
    SparseMLAConfig(block_h=64, block_n=64, num_warps=8, num_stages=2, max_splits=32),
    SparseMLAConfig(block_h=64, block_n=32, num_warps=8, num_stages=2),
    SparseMLAConfig(block_h=64, block_n=32, num_warps=4, num_stages=2, block_dv=256),
    SparseMLAConfig(block_h=64, block_n=32, num_warps=4, num_stages=2, block_dv=128, max_splits=32),
    SparseMLAConfig(block_h=64, block_n=64, num_warps=4, num_stages=1, block_dv=128),
    SPARSE_MLA_BASELINE_CONFIG,
)
# Also tried on the FP8 cache (--kv-cache-dtype fp8_e4m3): 64-head tiles that compile for sm_90 without
# spills there (scripts/compile_fp8_dsa.py --sweep), SPARSE_MLA_CONFIG's included: 8 warps with 256
# value columns (173-193 registers), 16 slots a block on 8 warps, and 4 warps with 256 columns (255);
# and the Gluon kernel's FP8 tiles and its gather-partition candidates (SPARSE_MLA_GLUON_FP8_TUNE_CONFIGS,
# docs/dsa-kernels.md; Hopper only: elsewhere their rows record the refusal). A candidate's output (and
# the one-split default's) is checked bitwise against the staged FP8 default of its block size
# (_check_gluon_fp8_candidate); so is the one-split and the in-slot tiles'.
TUNE_SPARSE_MLA_FP8 = (
    SPARSE_MLA_GLUON_FP8_CONFIG,
    SPARSE_MLA_GLUON_FP8_NARROW_CONFIG,
    SPARSE_MLA_GLUON_FP8_ONE_SPLIT_CONFIG,
    SPARSE_MLA_GLUON_FP8_IN_SLOT_CONFIG,
    *SPARSE_MLA_GLUON_FP8_TUNE_CONFIGS,
    SparseMLAConfig(block_h=64, block_n=32, num_warps=8, num_stages=2, block_dv=256),
    SparseMLAConfig(block_h=64, block_n=32, num_warps=8, num_stages=3, block_dv=256),
    SparseMLAConfig(block_h=64, block_n=16, num_warps=8, num_stages=2, block_dv=256),
    SparseMLAConfig(block_h=64, block_n=16, num_warps=8, num_stages=2, block_dv=512),
    SparseMLAConfig(block_h=64, block_n=16, num_warps=4, num_stages=2, block_dv=256),
)
# At up to SLOT_MAJOR_MAX_HEADS heads --tune times sparse MLA's default there (the Gluon kernel, where it
# runs), SPARSE_MLA_CONFIG and these slot-major tiles in place of the 64-head lists above: 16 heads a
# program on 4 warps with 64-, 32- and 16-slot blocks (the QK dots on wgmma at 64 only), 8 warps, 32
# heads on 8 warps, 3 stages; on the FP8 cache the tiles that compile for sm_90 without spills
# (scripts/compile_fp8_dsa.py --sweep).
TUNE_SPARSE_MLA_SLOT_MAJOR = tuple(
    SparseMLAConfig(block_h=h, block_n=n, num_warps=w, num_stages=st, slot_major=True)
    for h, n, w, st in ((16, 64, 4, 2), (16, 32, 4, 2), (16, 32, 4, 3), (16, 16, 4, 3), (16, 64, 8, 2),
                        (32, 64, 8, 2)))
TUNE_SPARSE_MLA_SLOT_MAJOR_FP8 = tuple(
    SparseMLAConfig(block_h=h, block_n=n, num_warps=w, num_stages=st, slot_major=True)
    for h, n, w, st in ((16, 32, 4, 2), (16, 32, 4, 3), (16, 32, 8, 2), (16, 16, 4, 3)))
TUNE_INDEXER = (
    INDEXER_CONFIG,
    IndexerConfig(tokens_as_m=True, num_warps=4, num_stages=2),
    IndexerConfig(tokens_as_m=True, num_warps=4, num_stages=4),
    IndexerConfig(tokens_as_m=True, num_warps=8, num_stages=3),
    IndexerConfig(tokens_as_m=False, num_warps=4, num_stages=1),
    INDEXER_BASELINE_CONFIG,
)
# On the FP8 key cache (--kv-cache-dtype fp8_e4m3), INDEXER_FP8_CONFIG first (a page per block, 4 warps,
# 8 stages, registers capped for 3 programs an SM), then other depths, the compiler's register count and
# other warp counts of both read forms (the point's tables are page-consistent): more stages keep more key
# bytes in flight (a block is 8.4 KB). All compile for sm_90 without spills (scripts/compile_fp8_dsa.py
# --sweep; 64 index heads: 122-128 registers on 8 warps, 185-191 on 4 uncapped).
TUNE_INDEXER_FP8 = (
    INDEXER_FP8_CONFIG,
    replace(INDEXER_FP8_CONFIG, num_stages=6),
    replace(INDEXER_FP8_CONFIG, max_registers=None),
    replace(INDEXER_FP8_CONFIG, num_stages=6, max_registers=None),
    replace(INDEXER_FP8_CONFIG, num_warps=8, num_stages=10, max_registers=None),
    replace(INDEXER_FP8_CONFIG, num_warps=8, max_registers=None),
    INDEXER_FP8_GATHER_CONFIG,
    replace(INDEXER_FP8_GATHER_CONFIG, num_warps=4),
    replace(INDEXER_FP8_GATHER_CONFIG, num_warps=4, num_stages=8),
)
# Indexer programs (schedule entries) per SM, on either cache: more resident programs keep more key
# gathers in flight, as long as all of them fit on the SM at once.
TUNE_PROGRAMS_PER_SM = (1, 2, 3, 4)
# Two FP8 indexer configurations on the GPU: each within the FP8 GPU tests' 2**-10 of a logit's absolute
# sum from the fp8_index reference (tests/test_indexer_fp8.py), so within twice that of each other.
FP8_INDEXER_TUNE_RTOL = 2.0 ** -9
TUNE_TOPK_CHUNKS = (0.25, 0.5, 1, 2)  # top-k chunks per row, as multiples of topk_workspace's count
TUNE_TOPK_FEW_CHUNKS = (2, 4)  # also tried where the rule gives one program per row (many rows)
TUNE_POINTS = (("decode", 1, 1024), ("target_verify", 1, 65536), ("decode", 4, 8192),
               ("decode", 16, 65536), ("target_verify", 64, 1024), ("decode", 1, 65536),
               ("target_verify", 32, 65536), ("target_verify", 64, 65536), ("decode", 32, 65536),
               ("decode", 64, 65536), ("target_verify", 16, 8192), ("decode", 1, 8192),
               ("decode", 16, 8192), ("decode", 32, 8192), ("decode", 64, 8192))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ops", type=choice_list(OPS), default=list(OPS), help="ops, comma-separated")
    p.add_argument("--modes", type=choice_list(MODES), default=list(MODES), help="modes, comma-separated")
    p.add_argument("--bs", type=positive_int_list, default=[1, 4, 16, 32, 64],
                   help="batch sizes (requests), comma-separated")
    p.add_argument("--live-kv", type=positive_int_list, default=[1024, 8192, 65536],
                   help="live KV tokens per request, comma-separated")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="bf16",
                   help="fp8_e4m3: also time the indexer on the paged FP8 key cache and sparse MLA on "
                        "the fp8_ds_mla cache, next to each bf16 row (with --tune: the sparse MLA "
                        "candidates, TUNE_SPARSE_MLA_FP8 too, and TUNE_INDEXER_FP8) (default: bf16 only)")
    p.add_argument("--verify-rows", type=positive_int, default=4, help="N: rows per request in target verify")
    p.add_argument("--preset", choices=sorted(PRESETS), default="glm5",
                   help="model preset giving heads, index heads and top-k")
    p.add_argument("--heads", type=positive_int_list, default=None,
                   help="query heads per rank, comma-separated, each a separate set of points (e.g. "
                        "64,32,16,8: GLM-5 at TP 1 / 2 / 4 / 8); the index heads stay the preset's "
                        "(default: the preset's heads; 16 without CUDA)")
    p.add_argument("--iters", type=positive_int, default=100, help="timed graph replays per measurement")
    p.add_argument("--tune", action="store_true",
                   help="instead: time the candidate kernel configurations (TUNE_* in this module) of "
                        "--ops at the fixed points TUNE_POINTS within --modes, --bs and --live-kv; "
                        "writes dsa_ops_tune.{json,md} (needs CUDA; default: off)")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="seed of the random inputs")
    p.add_argument("--out", default=None, help="results folder (default: benchmarks/results/<machine>)")


@dataclass
class _Shapes:
    heads: int
    index_heads: int
    topk: int
    sm_scale: float
    num_sms: int


@dataclass
class _Point:
    """One (mode, bs, live_kv): inputs in a freshly allocated pool and every output buffer."""

    mode: str
    bs: int
    live: int
    n: int  # rows per request
    shapes: _Shapes
    seqlens: torch.Tensor  # int32 [R]
    page_table: torch.Tensor  # int32 [R, live]
    index_k: torch.Tensor  # bf16 [slots, 128]
    index_fp8: torch.Tensor | None  # uint8 [slots / 64, 8448] holding index_k's values, or None
    mla_cache: torch.Tensor  # bf16 [slots, 576]
    mla_fp8: torch.Tensor | None  # uint8 [slots, 656] holding mla_cache's values, or None
    q_index: torch.Tensor
    weights: torch.Tensor
    q_mla: torch.Tensor
    workspace: torch.Tensor | None  # sparse MLA
    triton_workspace: torch.Tensor | None  # sparse MLA's Triton default configuration
    slot_major_workspace: torch.Tensor | None  # sparse MLA's slot-major configurations (both caches; <= 32 heads)
    padded_workspace: torch.Tensor | None  # the padded configurations' (<= SLOT_MAJOR_DEFAULT_MAX_HEADS heads)
    topk_workspace: torch.Tensor | None
    buffers: dict = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return self.seqlens.shape[0]

    def buffer(self, name: str, shape, dtype) -> torch.Tensor:
        """A named output buffer, allocated on first use (uninitialised)."""
        if name not in self.buffers:
            self.buffers[name] = torch.empty(shape, dtype=dtype, device=self.seqlens.device)
        return self.buffers[name]


def _build_point(mode: str, bs: int, live: int, n: int, shapes: _Shapes, device, seed: int,
                 fp8: bool = False) -> _Point:
    if mode == "decode":
        n = 1
    if live < n:
        raise ValueError(f"--live-kv {live} is shorter than the {n} verify rows per request")
    gen = torch.Generator(device=device).manual_seed(seed)
    pages = -(-live // PAGE)
    page_ids = torch.randperm(bs * pages, generator=gen, device=device).view(bs, pages)
    slots = (page_ids[:, :, None] * PAGE + torch.arange(PAGE, device=device)).view(bs, pages * PAGE)
    page_table = slots[:, :live].to(torch.int32).repeat_interleave(n, dim=0).contiguous()
    lengths = torch.arange(live - n + 1, live + 1, dtype=torch.int32, device=device).repeat(bs)
    num_slots = bs * pages * PAGE
    rows = bs * n

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16)

    mla_cache, mla_fp8 = randn(num_slots, QK_DIM), None
    index_k, index_fp8 = randn(num_slots, INDEX_DIM), None
    if fp8:
        every_slot = torch.arange(num_slots, device=device)
        mla_fp8 = torch.empty(num_slots, MLA_FP8_BYTES, dtype=torch.uint8, device=device)
        store_mla(mla_fp8, every_slot, mla_cache)
        mla_cache = gather_mla(mla_fp8, every_slot, out_dtype=torch.bfloat16)  # exact in bf16
        index_fp8 = torch.empty(pages * bs, INDEX_FP8_PAGE_BYTES, dtype=torch.uint8, device=device)
        store_index_k(index_fp8, every_slot, index_k)
        index_k = gather_index_k(index_fp8, every_slot, out_dtype=torch.bfloat16)  # exact in bf16
    point = _Point(
        mode=mode, bs=bs, live=live, n=n, shapes=shapes, seqlens=lengths, page_table=page_table,
        index_k=index_k, index_fp8=index_fp8, mla_cache=mla_cache, mla_fp8=mla_fp8,
        q_index=randn(rows, shapes.index_heads, INDEX_DIM),
        weights=torch.randn(rows, shapes.index_heads, generator=gen, device=device)
        * (INDEX_DIM * shapes.index_heads) ** -0.5,
        q_mla=randn(rows, shapes.heads, QK_DIM),
        workspace=sparse_mla_workspace(rows, shapes.heads, device, num_sms=shapes.num_sms),
        triton_workspace=sparse_mla_workspace(rows, shapes.heads, device, num_sms=shapes.num_sms,
                                              config=sparse_mla_config(rows, shapes.heads, True)),
        slot_major_workspace=sparse_mla_workspace(rows, shapes.heads, device, num_sms=shapes.num_sms,
                                                  config=slot_major_config(shapes.heads, device))
        if shapes.heads <= SLOT_MAJOR_MAX_HEADS else None,
        padded_workspace=sparse_mla_workspace(rows, shapes.heads, device, num_sms=shapes.num_sms,
                                              config=sparse_mla_config(rows, shapes.heads, True, device,
                                                                       slot_major=False))
        if shapes.heads <= SLOT_MAJOR_DEFAULT_MAX_HEADS else None,
        topk_workspace=topk_workspace(rows, device, num_sms=shapes.num_sms))
    return point


# ---------------------------------------------------------------------------------------------
# the ops, new and baseline, on a point's static buffers


def _indexer(p: _Point, new: bool, config: IndexerConfig | None = None, rows_per_group: int | None = None,
             fp8: bool = False, out: str | None = None):
    """Schedule + logits into buffer ``out`` (default ``logits_new`` / ``logits_baseline``, and
    ``logits_fp8`` with ``fp8``: on the FP8 key cache). The new form skips rows with live <= k and
    reads each key block once per request (``rows_per_group`` = N in verify where ``group_fits``);
    its configuration defaults to the cache's (``default_indexer_config``), the baseline's is
    ``INDEXER_BASELINE_CONFIG``; the schedule has ``config.programs_per_sm`` programs an SM."""
    s = p.shapes
    skip = s.topk if new else 0
    groups = rows_per_group or (p.n if new and group_fits(p.n, s.index_heads) else 1)
    config = config or (default_indexer_config(fp8, groups, s.index_heads) if new else INDEXER_BASELINE_CONFIG)
    programs = config.programs_per_sm * s.num_sms
    schedule = p.buffer(f"schedule_{skip}_{programs}_{groups}", (programs + 1, 2), torch.int32)
    name = out or ("logits_fp8" if fp8 else "logits_new" if new else "logits_baseline")
    logits = p.buffer(name, (p.rows, p.live), torch.float32)
    keys = p.index_fp8 if fp8 else p.index_k

    def run(check_values: bool = False) -> None:
        indexer_schedule(p.seqlens, programs, schedule, skip_len=skip, rows_per_group=groups)
        indexer_logits(p.q_index, p.weights, keys, p.page_table, p.seqlens, schedule, logits,
                       skip_len=skip, rows_per_group=groups, check_values=check_values,
                       config=config)

    return run


def _topk(p: _Point, new: bool, logits: str, out: str, chunks: int | None = None,
          single_launch: bool | None = None, sampled: bool = True):
    """Top-k of buffer ``logits`` into buffer ``out``. new: the point's workspace (``chunks``:
    one of that many chunks per row; 1: none, one program per row; ``single_launch`` as
    ``topk_slots`` takes it) with candidate lists (``topk_candidates``) unless ``sampled`` is
    False; baseline: one program per row reading short rows too."""
    scores = p.buffer(logits, (p.rows, p.live), torch.float32)
    slots = p.buffer(out, (p.rows, p.shapes.topk), torch.int32)
    workspace = None
    if new and chunks is None:
        workspace = p.topk_workspace
    elif new and chunks > 1:
        workspace = topk_workspace(p.rows, p.seqlens.device, num_chunks=chunks)
    candidates = None
    if new and sampled:
        candidates = topk_candidates(p.rows, p.shapes.topk, p.seqlens.device,
                                     num_chunks=1 if workspace is None else workspace.shape[1])

    def run(check_values: bool = False) -> None:
        topk_slots(scores, p.seqlens, p.page_table, p.shapes.topk, slots, check_values=check_values,
                   baseline_read_short_rows=not new, workspace=workspace,
                   single_launch=single_launch if workspace is not None else None,
                   candidates=candidates)

    return run


def _row_amax(p: _Point, logits: str, out: str):
    """``torch.amax`` of every row of buffer ``logits``: one read of the logits the top-k reads
    (the same bytes, give or take the N - 1 shorter verify rows), the yardstick of its passes."""
    scores = p.buffer(logits, (p.rows, p.live), torch.float32)
    result = p.buffer(out, (p.rows,), torch.float32)

    def run(check_values: bool = False) -> None:
        torch.amax(scores, dim=1, out=result)

    return run


def _sparse_mla(p: _Point, slots: str, out: str, config: SparseMLAConfig | None,
                workspace: torch.Tensor | None, fp8: bool = False):
    """Sparse MLA over buffer ``slots`` into buffer ``out`` (``config`` None: the op's default)
    on the bf16 cache, or the FP8 one with ``fp8``."""
    slot_buffer = p.buffer(slots, (p.rows, p.shapes.topk), torch.int32)
    result = p.buffer(out, (p.rows, p.shapes.heads, LATENT_DIM), torch.bfloat16)
    cache = p.mla_fp8 if fp8 else p.mla_cache

    def run(check_values: bool = False) -> None:
        sparse_mla_decode(p.q_mla, cache, slot_buffer, p.shapes.sm_scale, result,
                          check_values=check_values, workspace=workspace, config=config)

    return run


def _layer(p: _Point, new: bool):
    tag = "new" if new else "baseline"
    steps = (_indexer(p, new), _topk(p, new, f"logits_{tag}", f"layer_slots_{tag}"),
             _sparse_mla(p, f"layer_slots_{tag}", f"layer_out_{tag}",
                         None if new else SPARSE_MLA_BASELINE_CONFIG,
                         p.workspace if new else None))

    def run(check_values: bool = False) -> None:
        for step in steps:
            step(check_values)

    return run


# The Gluon kernel's FP8 tiles, timed beside the FP8 default where the Gluon kernel runs.
GLUON_FP8_VARIANTS = {"gluon_fp8": SPARSE_MLA_GLUON_FP8_CONFIG,
                      "gluon_fp8_narrow": SPARSE_MLA_GLUON_FP8_NARROW_CONFIG,
                      "gluon_fp8_one_split": SPARSE_MLA_GLUON_FP8_ONE_SPLIT_CONFIG}


def _head_layout_variants(p: _Point, fp8: bool) -> dict:
    """Sparse MLA on the point's cache (FP8 with ``fp8``) in the two head layouts: ``slot_major``
    (up to ``SLOT_MAJOR_MAX_HEADS`` heads, ``slot_major_config`` at every R) and ``padded`` (up to
    ``SLOT_MAJOR_DEFAULT_MAX_HEADS`` heads, what the default takes without slot-major dots), each
    over its own workspace."""
    heads, device, out = p.shapes.heads, p.q_mla.device, "out_fp8_" if fp8 else "out_"
    variants = {}
    if heads <= SLOT_MAJOR_MAX_HEADS:
        variants["slot_major"] = _sparse_mla(p, "slots_new", out + "slot_major",
                                             slot_major_config(heads, device, fp8_cache=fp8),
                                             p.slot_major_workspace, fp8=fp8)
    if heads <= SLOT_MAJOR_DEFAULT_MAX_HEADS:
        padded = sparse_mla_config(p.rows, heads, True, device, fp8_cache=fp8, slot_major=False)
        variants["padded"] = _sparse_mla(p, "slots_new", out + "padded", padded, p.padded_workspace, fp8=fp8)
    return variants


def _variants(p: _Point, op: str, kv_cache: str = "bf16") -> dict:
    """name -> callable for one op at one point (baseline, new, and for sparse MLA new_nosplit and,
    on the bf16 cache, triton; on the FP8 cache, where the Gluon kernel runs, the
    :data:`GLUON_FP8_VARIANTS`).
    Top-k reads the baseline indexer's logits (every row written); sparse MLA the new top-k's
    slots. On the FP8 caches (indexer, sparse MLA) the baseline is the bf16 cache's new form."""
    if kv_cache == "fp8_e4m3" and op == "indexer":
        return {"baseline": _indexer(p, True), "new": _indexer(p, True, fp8=True)}
    if kv_cache == "fp8_e4m3":
        variants = {"baseline": _sparse_mla(p, "slots_new", "out_fp8_baseline", None, p.workspace),
                    "new": _sparse_mla(p, "slots_new", "out_fp8", None, p.workspace, fp8=True),
                    "new_nosplit": _sparse_mla(p, "slots_new", "out_fp8_nosplit", None, None, fp8=True)}
        if sparse_mla_gluon_supported(p.q_mla.device, p.shapes.heads):
            for name, config in GLUON_FP8_VARIANTS.items():
                variants[name] = _sparse_mla(p, "slots_new", f"out_{name}", config, p.workspace, fp8=True)
        return variants | _head_layout_variants(p, fp8=True)
    if op == "indexer":
        return {"baseline": _indexer(p, False), "new": _indexer(p, True)}
    if op == "topk":
        variants = {"baseline": _topk(p, False, "logits_baseline", "slots_baseline"),
                    "new": _topk(p, True, "logits_baseline", "slots_new")}
        if p.live > p.shapes.topk:
            variants["amax"] = _row_amax(p, "logits_baseline", "amax")
        return variants
    if op == "sparse_mla":
        triton = sparse_mla_config(p.rows, p.shapes.heads, p.triton_workspace is not None)
        variants = {"baseline": _sparse_mla(p, "slots_new", "out_baseline", SPARSE_MLA_BASELINE_CONFIG, None),
                    "new": _sparse_mla(p, "slots_new", "out_new", None, p.workspace),
                    "new_nosplit": _sparse_mla(p, "slots_new", "out_nosplit", None, None),
                    "triton": _sparse_mla(p, "slots_new", "out_triton", triton, p.triton_workspace)}
        return variants | _head_layout_variants(p, fp8=False)
    return {"baseline": _layer(p, False), "new": _layer(p, True)}


def _prepare(p: _Point) -> None:
    """Run the producers once eagerly with the value checks, so every buffer an op reads holds
    what its producer writes: both indexers' logits, the new top-k's slots."""
    for run in (_indexer(p, False), _indexer(p, True), _topk(p, True, "logits_baseline", "slots_new")):
        run(check_values=True)


# ---------------------------------------------------------------------------------------------
# floors


def _floor_terms(p: _Point, op: str, kv_cache: str = "bf16") -> tuple[int, int]:
    """(bytes, FLOPs) the op's contract needs at this point (see the module docstring)."""
    if op == "layer":
        terms = [_floor_terms(p, name) for name in ("indexer", "topk", "sparse_mla")]
        return sum(t[0] for t in terms), sum(t[1] for t in terms)
    s = p.shapes
    lengths = p.seqlens.tolist()
    long_rows = [length for length in lengths if length > s.topk]
    if op == "indexer":
        per_request = [max(lengths[r * p.n:(r + 1) * p.n]) for r in range(p.bs)]
        key_tokens = sum(length for length in per_request if length > s.topk)
        key_bytes = INDEX_FP8_BYTES if kv_cache == "fp8_e4m3" else INDEX_DIM * 2
        nbytes = (sum(long_rows) * (4 + 4) + key_tokens * key_bytes
                  + len(long_rows) * s.index_heads * (INDEX_DIM * 2 + 4))
        return nbytes, 2 * s.index_heads * INDEX_DIM * sum(long_rows)
    if op == "topk":
        selected = sum(min(length, s.topk) for length in lengths)
        return sum(long_rows) * 4 + selected * 4 + p.rows * s.topk * 4, 0
    slots = p.buffers["slots_new"]
    valid = int((slots >= 0).sum())
    ordered = slots.view(p.bs, p.n * s.topk).sort(dim=1).values
    distinct = int((ordered[:, :1] >= 0).sum() + ((ordered[:, 1:] != ordered[:, :-1]) & (ordered[:, 1:] >= 0)).sum())
    entry = MLA_FP8_BYTES if kv_cache == "fp8_e4m3" else QK_DIM * 2
    nbytes = (distinct * entry + p.rows * s.topk * 4
              + p.rows * s.heads * (QK_DIM * 2 + LATENT_DIM * 2))
    return nbytes, 2 * s.heads * (QK_DIM + LATENT_DIM) * valid


# ---------------------------------------------------------------------------------------------
# checks after timing


def _compare_outputs(p: _Point, op: str, on_gpu: bool, kv_cache: str = "bf16") -> dict:
    """New vs baseline outputs of the op (and vs the plain-torch references without CUDA);
    raises on a mismatch, returns the largest differences."""
    s, checks = p.shapes, {}
    if kv_cache == "fp8_e4m3" and op == "indexer":
        return _compare_fp8_indexer(p, on_gpu)
    if kv_cache == "fp8_e4m3":  # the same values in both caches: to summation order
        base = p.buffers["out_fp8_baseline"].float()
        for name in ("out_fp8", "out_fp8_nosplit", "out_fp8_slot_major", "out_fp8_padded",
                     *(f"out_{v}" for v in GLUON_FP8_VARIANTS)):
            if name not in p.buffers:  # the Gluon variants off Hopper, slot-major / padded above 32 / 16 heads
                continue
            got = p.buffers[name].float()
            torch.testing.assert_close(got, base, rtol=2e-2, atol=1e-2)
            checks[f"{name}_max_abs_diff"] = float((got - base).abs().max())
        if not on_gpu:
            from dsaspec.reference.sparse_mla import reference_sparse_mla_decode_fp8

            want = reference_sparse_mla_decode_fp8(p.q_mla, p.mla_fp8, p.buffers["slots_new"], s.sm_scale)
            torch.testing.assert_close(p.buffers["out_fp8"].float(), want, rtol=1e-2, atol=1e-3)
            checks["matches_reference"] = True
        return checks
    if op in ("indexer", "layer"):
        positions = torch.arange(p.live, device=p.seqlens.device)
        written = (positions[None, :] < p.seqlens[:, None]) & (p.seqlens[:, None] > s.topk)
        new, base = p.buffers["logits_new"][written], p.buffers["logits_baseline"][written]
        torch.testing.assert_close(new, base, rtol=1e-4, atol=1e-4)
        checks["logits_max_abs_diff"] = float((new - base).abs().max()) if new.numel() else 0.0
    if op == "topk" and not torch.equal(p.buffers["slots_new"], p.buffers["slots_baseline"]):
        raise AssertionError("topk: new and baseline slots differ on the same logits")
    if op == "sparse_mla":
        base = p.buffers["out_baseline"].float()
        for name in ("out_new", "out_nosplit", "out_triton", "out_slot_major", "out_padded"):
            if name not in p.buffers:  # slot-major / padded above 32 / 16 heads
                continue
            got = p.buffers[name].float()
            torch.testing.assert_close(got, base, rtol=2e-2, atol=1e-2)
            checks[f"{name}_max_abs_diff"] = float((got - base).abs().max())
    if op == "layer":
        # the two indexers round differently, so a near-tie at the k-th logit may select another
        # slot: count such rows, compare the attention output of the others
        same = (p.buffers["layer_slots_new"] == p.buffers["layer_slots_baseline"]).all(1)
        checks["layer_rows_with_other_slots"] = int((~same).sum())
        got, base = p.buffers["layer_out_new"][same].float(), p.buffers["layer_out_baseline"][same].float()
        torch.testing.assert_close(got, base, rtol=2e-2, atol=1e-2)
    if not on_gpu:
        _compare_with_references(p, op)
        checks["matches_reference"] = True
    return checks


def _compare_fp8_indexer(p: _Point, on_gpu: bool) -> dict:
    """The FP8 row's logits (rows longer than k) vs the bf16 row's on the same keys, within
    ``FP8_INDEXER_RTOL`` of each logit's absolute sum; without CUDA also vs the fp8_index
    reference, to fp32 summation order (tests/test_indexer_fp8.py's bound)."""
    from dsaspec.reference.indexer import reference_indexer_logits, reference_indexer_logits_fp8

    s, worst = p.shapes, 0.0
    long_rows = [row for row, length in enumerate(p.seqlens.tolist()) if length > s.topk]
    bounds = reference_indexer_logits(p.q_index[long_rows].abs(), p.weights[long_rows].abs(),
                                      p.index_k.abs(), p.page_table[long_rows], p.seqlens[long_rows])
    for row, bound in zip(long_rows, bounds):
        got = p.buffers["logits_fp8"][row, :bound.numel()]
        error = (got - p.buffers["logits_new"][row, :bound.numel()]).abs()
        if not bool((error <= FP8_INDEXER_RTOL * bound).all()):
            raise AssertionError(f"indexer (FP8 cache): row {row}'s logits differ from the bf16 row's by more "
                                 f"than {FP8_INDEXER_RTOL:g} of their absolute sums")
        worst = max(worst, float((error / bound.clamp_min(1e-30)).max()))
    checks = {"logits_fp8_max_rel_to_abs_sum": worst}
    if not on_gpu:
        cpu = [t.cpu() for t in (p.q_index, p.weights, p.index_fp8, p.page_table, p.seqlens)]
        wants = reference_indexer_logits_fp8(*cpu)
        # twice that test's bound: it sums the quantized query's absolute values, within 2**-4 of these
        relative = 2 * (INDEX_DIM + s.index_heads + 8) * 2.0 ** -24
        for row, bound in zip(long_rows, bounds):
            got = p.buffers["logits_fp8"][row, :bound.numel()].double()
            if not bool(((got - wants[row]).abs() <= relative * bound.double() + 1e-30).all()):
                raise AssertionError(f"indexer (FP8 cache): row {row}'s logits differ from the fp8_index reference")
        checks["matches_reference"] = True
    return checks


def _fp8_indexer_tune_candidates(p: _Point) -> list[tuple[dict, object]]:
    """(config, callable) per FP8 indexer candidate: the point's default (``default_indexer_config``)
    first, then :data:`TUNE_INDEXER_FP8` at :data:`TUNE_PROGRAMS_PER_SM` programs per SM; each
    writes buffer ``logits_fp8_tune`` with the new form's skip and row groups."""
    configs = dict.fromkeys([default_indexer_config(True, p.n, p.shapes.index_heads)]
                            + [replace(config, programs_per_sm=per_sm) for per_sm in TUNE_PROGRAMS_PER_SM
                               for config in TUNE_INDEXER_FP8])
    return [(vars(config) | {"rows_per_group": p.n, "kv_cache": "fp8_e4m3"},
             _indexer(p, True, config, fp8=True, out="logits_fp8_tune"))
            for config in configs]


def _check_fp8_indexer_candidate(p: _Point, candidate, on_gpu: bool) -> float:
    """Run ``candidate`` (from :func:`_fp8_indexer_tune_candidates`) once on a NaN-filled
    ``logits_fp8_tune`` and compare it with ``logits_fp8`` (the default configuration's) wherever
    the contract writes (rows longer than k, up to their 64-token block edge): bitwise without CUDA
    (the interpreter's summation order does not depend on the configuration), else within
    :data:`FP8_INDEXER_TUNE_RTOL` of each logit's absolute sum, ``-inf`` past the live length.
    Raises AssertionError naming the first row that differs; returns the largest absolute
    difference of the live logits."""
    p.buffer("logits_fp8_tune", (p.rows, p.live), torch.float32).fill_(float("nan"))
    candidate()
    got, want, worst = p.buffers["logits_fp8_tune"], p.buffers["logits_fp8"], 0.0
    if on_gpu and "fp8_tune_bounds" not in p.buffers:  # sum_h |w_h| (|q_h| . |k|), once a point
        from dsaspec.reference.indexer import reference_indexer_logits

        bounds = p.buffer("fp8_tune_bounds", (p.rows, p.live), torch.float32)
        for row, bound in enumerate(reference_indexer_logits(p.q_index.abs(), p.weights.abs(), p.index_k.abs(),
                                                             p.page_table, p.seqlens)):
            bounds[row, :bound.numel()] = bound
    for row, length in enumerate(p.seqlens.tolist()):
        if length <= p.shapes.topk:
            continue
        edge = min(-(-length // PAGE) * PAGE, p.live)
        a, b = got[row, :edge], want[row, :edge]
        if on_gpu:
            bound = FP8_INDEXER_TUNE_RTOL * p.buffers["fp8_tune_bounds"][row, :length]
            close = (a[:length] - b[:length]).abs() <= bound
            same = bool(close.all()) and bool(torch.isneginf(a[length:]).all())
        else:
            same = torch.equal(a, b)
        if not same:
            raise AssertionError(f"indexer (FP8 cache): row {row}'s logits differ from INDEXER_FP8_CONFIG's")
        worst = max(worst, float((a[:length] - b[:length]).abs().max()))
    return worst


def _gluon_fp8_twin(config: SparseMLAConfig) -> SparseMLAConfig | None:
    """For one of :data:`SPARSE_MLA_GLUON_FP8_TUNE_CONFIGS`, :data:`SPARSE_MLA_GLUON_FP8_ONE_SPLIT_CONFIG`
    or :data:`SPARSE_MLA_GLUON_FP8_IN_SLOT_CONFIG`,
    the staged FP8 Gluon default of its block size (:data:`SPARSE_MLA_GLUON_FP8_CONFIG` or
    :data:`SPARSE_MLA_GLUON_FP8_NARROW_CONFIG`: the same dots in the same order, only the gather
    partition differs, so the same output bit for bit); else None."""
    if config not in (SPARSE_MLA_GLUON_FP8_ONE_SPLIT_CONFIG, SPARSE_MLA_GLUON_FP8_IN_SLOT_CONFIG,
                      *SPARSE_MLA_GLUON_FP8_TUNE_CONFIGS):
        return None
    return next(default for default in (SPARSE_MLA_GLUON_FP8_CONFIG, SPARSE_MLA_GLUON_FP8_NARROW_CONFIG)
                if default.block_n == config.block_n)


def _check_gluon_fp8_candidate(p: _Point, candidate, twin) -> None:
    """Run ``candidate`` (writing buffer ``out_tune``) on a NaN-filled ``out_tune`` and ``twin`` (its
    :func:`_gluon_fp8_twin`'s launch, writing ``out_tune_twin``, same workspace) once each; raises
    AssertionError unless the two outputs are equal bit for bit."""
    p.buffers["out_tune"].fill_(float("nan"))
    candidate()
    twin()
    if not torch.equal(p.buffers["out_tune"], p.buffers["out_tune_twin"]):
        raise AssertionError("sparse_mla (FP8 cache): the output differs from the FP8 Gluon default's "
                             "of the same block size")


def _tune_winners(rows: list[dict]) -> list[dict]:
    """The fastest error-free row per (op, heads, KV cache, split or not, mode, bs, live_kv), in the order
    the points first appear, with its ``vs_default``."""
    best: dict = {}
    for r in rows:
        if "us" not in r:
            continue
        key = (r["op"], r["heads"], r["config"].get("kv_cache"), r["config"].get("splits", 1) > 1, r["mode"],
               r["bs"], r["live_kv"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    return list(best.values())


def _compare_with_references(p: _Point, op: str) -> None:
    from dsaspec.reference.indexer import reference_indexer_logits
    from dsaspec.reference.sparse_mla import reference_sparse_mla_decode
    from dsaspec.reference.topk import reference_topk_slots

    s = p.shapes
    if op in ("indexer", "layer"):
        reference = reference_indexer_logits(p.q_index, p.weights, p.index_k, p.page_table, p.seqlens)
        for row, want in enumerate(reference):
            torch.testing.assert_close(p.buffers["logits_baseline"][row, :want.numel()], want,
                                       rtol=1e-5, atol=1e-5)
            if want.numel() > s.topk:
                torch.testing.assert_close(p.buffers["logits_new"][row, :want.numel()], want,
                                           rtol=1e-5, atol=1e-5)
    if op == "topk":
        want = reference_topk_slots(p.buffers["logits_baseline"], p.seqlens, p.page_table, s.topk)
        assert torch.equal(p.buffers["slots_new"], want), "topk: new slots differ from the reference"
    if op == "sparse_mla":
        want = reference_sparse_mla_decode(p.q_mla, p.mla_cache, p.buffers["slots_new"], s.sm_scale)
        torch.testing.assert_close(p.buffers["out_new"].float(), want, rtol=1e-2, atol=1e-3)


# ---------------------------------------------------------------------------------------------
# driver


def _shapes(args, on_gpu: bool) -> _Shapes:
    if on_gpu:
        config = get_config(args.preset)
        sms = sm_count("cuda")
        return _Shapes(config.num_attention_heads, config.index_n_heads, config.index_topk,
                       config.softmax_scale, sms)
    return _Shapes(CPU_SIZES["heads"], CPU_SIZES["index_heads"], CPU_SIZES["topk"],
                   QK_DIM ** -0.5, NUM_SMS_WITHOUT_CUDA)


def _time_row(p: _Point, op: str, kv_cache: str, floors, peaks: dict, iters: int) -> dict:
    """Times, floors and ratios of one row; ``peaks``: measured TFLOP/s by dot dtype (``bf16``,
    ``fp8_e4m3`` for the FP8 indexer's e4m3 dots)."""
    from dsaspec.bench.timing import time_in_graph

    timings = {name: time_in_graph(fn, iters=iters, cold_l2=True, graph_diff=False)
               for name, fn in _variants(p, op, kv_cache).items()}
    nbytes, flops = _floor_terms(p, op, kv_cache)
    bytes_floor = nbytes / (floors.copy_gbps * 1e3)
    peak_tflops = peaks["fp8_e4m3" if op == "indexer" and kv_cache == "fp8_e4m3" else "bf16"]
    flop_floor = flops / (peak_tflops * 1e6)
    floor = max(bytes_floor, flop_floor, floors.empty_us)
    new, base = timings["new"].median_us, timings["baseline"].median_us
    row = {
        "new_us": new, "baseline_us": base, "speedup": base / new, "floor_us": floor,
        "bytes_floor_us": bytes_floor, "flop_floor_us": flop_floor, "empty_kernel_us": floors.empty_us,
        "bytes": nbytes, "flops": flops, "achieved": floor / new, "new_gbps": nbytes / (new * 1e3),
        "spread": {name: t.spread for name, t in timings.items()},
        "detail": {name: t.summary() for name, t in timings.items()},
    }
    for name in ("new_nosplit", "triton", "slot_major", "padded", *GLUON_FP8_VARIANTS):
        if name in timings:
            row[f"{name}_us"] = timings[name].median_us
    if "amax" in timings:
        row["amax_us"] = timings["amax"].median_us
        row["new_over_amax"] = new / row["amax_us"]
    if op == "sparse_mla":
        cache = p.mla_fp8 if kv_cache == "fp8_e4m3" else p.mla_cache
        row["gather_us"], row["gather_grid"] = fastest_slot_gather(cache, p.buffers["slots_new"], iters)
        row["new_over_gather"] = new / row["gather_us"]
        if kv_cache == "fp8_e4m3":
            row["gather_dequant_us"], row["gather_dequant_grid"] = fastest_slot_gather(
                cache, p.buffers["slots_new"], iters, gather=slot_gather_dequant)
            row["new_over_gather_dequant"] = new / row["gather_dequant_us"]
    return row


def _targets(rows: list[dict]) -> list[dict]:
    """Each row checked against the targets of docs/benchmarking.md ("Targets") that apply to it,
    the top-k's proposed one included."""
    out = []
    for r in rows:
        if "new_us" not in r:
            continue
        where = ({k: r[k] for k in ("op", "mode", "bs", "live_kv")}
                 | {"kv_cache": r.get("kv_cache", "bf16"), "heads": r.get("heads")})
        if r["op"] != "layer" and r["bs"] == 1 and r["live_kv"] == 1024:
            out.append(dict(where, target=f"<= {SMALL_TARGET_US:g} µs", value=r["new_us"],
                            met=r["new_us"] <= SMALL_TARGET_US))
        if r["op"] != "layer" and r["bs"] >= 16 and r["live_kv"] == 65536:
            out.append(dict(where, target=f"<= {FLOOR_FACTOR:g}x floor", value=r["new_us"] / r["floor_us"],
                            met=r["new_us"] <= FLOOR_FACTOR * r["floor_us"]))
            if "amax_us" in r:
                out.append(dict(where, target=f"(proposed) <= {TOPK_AMAX_FACTOR:g}x same-bytes torch.amax",
                                value=r["new_over_amax"], met=r["new_over_amax"] <= TOPK_AMAX_FACTOR))
        if r.get("kv_cache") == "fp8_e4m3" and r["op"] == "sparse_mla" and r.get("rows", 0) >= FP8_BYTES_MIN_ROWS:
            factor = r["new_us"] / r["bytes_floor_us"]
            out.append(dict(where, target=f"FP8 cache: <= {FP8_BYTES_FACTOR:g}x bytes floor", value=factor,
                            met=factor <= FP8_BYTES_FACTOR))
            if "gather_us" in r and r["rows"] >= FP8_GATHER_MIN_ROWS:
                out.append(dict(where, target=f"(proposed) FP8 cache: <= {FP8_GATHER_FACTOR:g}x same-slots gather",
                                value=r["new_over_gather"], met=r["new_over_gather"] <= FP8_GATHER_FACTOR))
        if (r.get("kv_cache") == "fp8_e4m3" and r["op"] == "indexer" and r["mode"] == "decode"
                and r["live_kv"] == FP8_INDEXER_TARGET_LIVE and r.get("index_heads") == FP8_INDEXER_TARGET_HEADS
                and r["bs"] in FP8_INDEXER_TARGET_US):
            limit = FP8_INDEXER_TARGET_US[r["bs"]]
            out.append(dict(where, target=f"FP8 cache, {FP8_INDEXER_TARGET_HEADS} index heads: <= {limit:g} µs",
                            value=r["new_us"], met=r["new_us"] <= limit))
        out.append(dict(where, target=f"not slower than baseline (x{NOISE:g} noise)", value=r["speedup"],
                        met=r["new_us"] <= NOISE * r["baseline_us"]))
    return out


def run(args) -> int:
    from dsaspec.bench.results import bench_params, markdown_table, write_results

    on_gpu = torch.cuda.is_available()
    if args.tune:
        if not on_gpu:
            raise UserError("--tune needs a CUDA device (it times kernels)")
        return _tune(args)
    shapes = _shapes(args, on_gpu)
    if not on_gpu:
        args.bs, args.live_kv = CPU_SIZES["bs"], CPU_SIZES["live_kv"]
        print(f"No CUDA: the Triton interpreter at fixed small sizes (bs {args.bs}, live KV {args.live_kv}, "
              f"{','.join(map(str, args.heads or [shapes.heads]))} heads, {shapes.index_heads} index heads, top-k {shapes.topk}; --bs, --live-kv, "
              "--preset and --iters are not used; --heads is). Outputs are checked against the baseline and the "
              "references; no time is measured (interpreter times mean nothing).")
    device = torch.device("cuda" if on_gpu else "cpu")
    floors, peaks = None, {}
    if on_gpu:
        from dsaspec.bench.timing import Floors, warm_up_gpu

        warm_up_gpu()
        floors = Floors.measure()
        peaks["bf16"] = matmul_tflops()
        if args.kv_cache_dtype == "fp8_e4m3" and "indexer" in args.ops:
            peaks["fp8_e4m3"] = matmul_tflops(torch.float8_e4m3fn)
    started = time.monotonic()
    rows, failures = [], 0
    points = [(heads, live, bs, mode) for heads in args.heads or [shapes.heads] for live in args.live_kv
              for bs in args.bs for mode in args.modes]
    kinds = [(op, kv_cache) for op in args.ops for kv_cache in KV_CACHE_DTYPES
             if kv_cache == "bf16" or (kv_cache == args.kv_cache_dtype and op in FP8_OPS)]
    for heads, live, bs, mode in tqdm(points, desc="dsa-ops", unit="point"):
        point = _build_point(mode, bs, live, args.verify_rows, replace(shapes, heads=heads), device,
                             args.seed + live + bs, fp8=args.kv_cache_dtype == "fp8_e4m3")
        _prepare(point)
        for op, kv_cache in kinds:
            row = {"op": op, "kv_cache": kv_cache, "mode": mode, "bs": bs, "live_kv": live, "rows": point.rows,
                   "heads": heads, "index_heads": shapes.index_heads,
                   "num_splits": None if point.workspace is None else point.workspace.shape[2],
                   "topk_chunks": 1 if point.topk_workspace is None else point.topk_workspace.shape[1]}
            try:
                if on_gpu:
                    row.update(_time_row(point, op, kv_cache, floors, peaks, args.iters))
                for fn in _variants(point, op, kv_cache).values():
                    fn()
                row.update(_compare_outputs(point, op, on_gpu, kv_cache))
                row["matches_baseline"] = True
            except Exception as err:  # recorded and reported; the other points still run
                failures += 1
                row["error"] = f"{type(err).__name__}: {err}"
                print(f"dsa-ops {op} ({kv_cache} cache) {mode} bs {bs} live {live}: {row['error']}",
                      file=sys.stderr)
            rows.append(row)
        del point
    if on_gpu:
        torch.cuda.synchronize()
    targets = _targets(rows)
    method = (f"CUDA-graph replays with an L2 flush (2x L2) before each timed function; per-replay device time "
              f"from CUPTI (torch.profiler, first to last device activity), median of {args.iters}; spread = "
              f"(max-min)/median; floor = max(bytes / measured copy bandwidth, FLOPs / measured bf16 matmul "
              f"peak, empty kernel node); achieved = floor / new; outputs compared after timing."
              if on_gpu else "Triton interpreter on CPU: outputs checked, no times.")
    payload = {"method": method, "params": bench_params(args),
               "floors": dict(vars(floors), **{f"{k}_tflops": v for k, v in peaks.items()}) if floors else None,
               "configs": {"indexer": vars(INDEXER_CONFIG), "indexer_fp8": vars(INDEXER_FP8_CONFIG),
                           "indexer_baseline": vars(INDEXER_BASELINE_CONFIG),
                           "sparse_mla": vars(SPARSE_MLA_CONFIG),
                           "sparse_mla_few_rows": vars(SPARSE_MLA_FEW_ROWS_CONFIG),
                           "sparse_mla_baseline": vars(SPARSE_MLA_BASELINE_CONFIG),
                           "sparse_mla_slot_major": vars(SPARSE_MLA_SLOT_MAJOR_CONFIG),
                           "sparse_mla_gluon_slot_major": vars(SPARSE_MLA_GLUON_SLOT_MAJOR_CONFIG),
                           "sparse_mla_gluon_fp8_slot_major": vars(SPARSE_MLA_GLUON_FP8_SLOT_MAJOR_CONFIG),
                           **{f"sparse_mla_{name}": vars(config) for name, config in GLUON_FP8_VARIANTS.items()}},
               "elapsed_s": time.monotonic() - started, "rows": rows, "targets": targets}
    if on_gpu:
        cols = [("op", "op"), ("kv_cache", "KV cache"), ("heads", "heads"), ("mode", "mode"), ("bs", "bs"),
                ("live_kv", "live KV"), ("rows", "rows"), ("baseline_us", "baseline µs"), ("new_us", "new µs"),
                ("speedup", "speedup"), ("new_nosplit_us", "new no-split µs"), ("triton_us", "Triton default µs"),
                ("slot_major_us", "slot-major µs"), ("padded_us", "padded µs"),
                ("gluon_fp8_us", "Gluon FP8 µs"), ("gluon_fp8_narrow_us", "Gluon FP8 32-slot µs"),
                ("gluon_fp8_one_split_us", "Gluon FP8 one-split µs"), ("num_splits", "splits"),
                ("topk_chunks", "top-k chunks"), ("floor_us", "floor µs"),
                ("bytes_floor_us", "bytes floor µs"), ("flop_floor_us", "FLOP floor µs"),
                ("achieved", "achieved"), ("amax_us", "same-bytes amax µs"), ("new_over_amax", "new / amax"),
                ("gather_us", "same-slots gather µs"), ("new_over_gather", "new / gather"),
                ("gather_dequant_us", "same-slots gather + dequant µs"),
                ("new_over_gather_dequant", "new / gather + dequant"),
                ("spread_new", "spread new"), ("error", "error")]
        table = [dict(r, spread_new=r.get("spread", {}).get("new")) for r in rows]
    else:
        cols = [("op", "op"), ("kv_cache", "KV cache"), ("heads", "heads"), ("mode", "mode"), ("bs", "bs"),
                ("live_kv", "live KV"), ("rows", "rows"), ("topk_chunks", "top-k chunks"), ("matches_baseline", "new == baseline"), ("matches_reference", "== reference"), ("error", "error")]
        table = rows
    md = markdown_table(cols, table)
    if targets:
        met = sum(t["met"] for t in targets)
        md += (f"\n\n## Targets: {met} of {len(targets)} met\n\n"
               + markdown_table([("op", "op"), ("kv_cache", "KV cache"), ("heads", "heads"), ("mode", "mode"),
                                 ("bs", "bs"),
                                 ("live_kv", "live KV"), ("target", "target"), ("value", "value"), ("met", "met")],
                                [t for t in targets if not t["met"]] or [{"op": "(all met)"}]))
    write_results("dsa_ops", payload, md, args.out)
    print(f"({time.monotonic() - started:.0f} s)")
    return 1 if failures else 0


def _sparse_mla_tune_tries(heads: int, fp8: bool, device) -> list[tuple[str, SparseMLAConfig]]:
    """(KV cache, configuration) pairs --tune times for sparse MLA at ``heads`` heads: the Triton
    lists (``TUNE_SPARSE_MLA``; with ``fp8`` on the FP8 cache too, and ``TUNE_SPARSE_MLA_FP8``), or at
    up to ``SLOT_MAJOR_MAX_HEADS`` heads the Gluon kernel's padded head-major and slot-major forms
    (where the Gluon kernel runs), ``SPARSE_MLA_CONFIG`` and the Triton slot-major tiles of each
    cache."""
    if heads > SLOT_MAJOR_MAX_HEADS:
        tries = [("bf16", config) for config in TUNE_SPARSE_MLA]
        if fp8:
            tries += [("fp8_e4m3", config) for config in TUNE_SPARSE_MLA + TUNE_SPARSE_MLA_FP8]
        return tries
    gluon = sparse_mla_gluon_supported(device, heads)
    caches = [("bf16", (SPARSE_MLA_GLUON_CONFIG, SPARSE_MLA_GLUON_SLOT_MAJOR_CONFIG), TUNE_SPARSE_MLA_SLOT_MAJOR)]
    if fp8:
        caches.append(("fp8_e4m3", (GLUON_FP8_DEFAULT_CONFIG, SPARSE_MLA_GLUON_FP8_SLOT_MAJOR_CONFIG),
                       TUNE_SPARSE_MLA_SLOT_MAJOR_FP8))
    return [(cache, config) for cache, gluon_configs, slot_major in caches
            for config in [c for c in gluon_configs if gluon and c is not None] + [SPARSE_MLA_CONFIG, *slot_major]]


def _tune(args) -> int:
    """Time every TUNE_* configuration at TUNE_POINTS (new forms only), at each of ``--heads``, and
    write the table."""
    from dsaspec.bench.results import bench_params, markdown_table, write_results
    from dsaspec.bench.timing import time_in_graph, warm_up_gpu

    warm_up_gpu()
    preset = _shapes(args, True)
    device = torch.device("cuda")
    rows = []
    points = [(heads, mode, bs, live) for heads in args.heads or [preset.heads] for mode, bs, live in TUNE_POINTS
              if mode in args.modes and bs in args.bs and live in args.live_kv]
    if not points:
        raise UserError("--tune: no tune point (TUNE_POINTS) is within --modes, --bs and --live-kv")
    for heads, mode, bs, live in tqdm(points, desc="dsa-ops tune", unit="point"):
        fp8 = args.kv_cache_dtype == "fp8_e4m3"
        shapes = replace(preset, heads=heads)
        point = _build_point(mode, bs, live, args.verify_rows, shapes, device, args.seed, fp8=fp8)
        _prepare(point)
        # the point's default first, then the other configurations at their own programs an SM,
        # the default's kernel at each of TUNE_PROGRAMS_PER_SM and also without row groups
        indexer_tries = dict.fromkeys(
            [(default_indexer_config(False, point.n, shapes.index_heads), point.n)]
            + [(replace(config, programs_per_sm=per_sm), groups) for config in TUNE_INDEXER
               for per_sm in TUNE_PROGRAMS_PER_SM for groups in dict.fromkeys((point.n, 1))
               if (per_sm == config.programs_per_sm and groups == point.n) or config == INDEXER_CONFIG])
        candidates = [("indexer", vars(config) | {"rows_per_group": groups}, _indexer(point, True, config, groups))
                      for config, groups in indexer_tries]
        twins = {}  # candidate index -> the launch its output must equal (_check_gluon_fp8_candidate)
        for kv_cache, config in _sparse_mla_tune_tries(heads, fp8, device):
            for split in (False, True):
                workspace = sparse_mla_workspace(point.rows, shapes.heads, device, num_sms=shapes.num_sms,
                                                 config=config) if split else None
                if split and workspace is None:
                    continue
                candidates.append(("sparse_mla", vars(config) | {"splits": workspace.shape[2] if split else 1,
                                                                 "kv_cache": kv_cache},
                                   _sparse_mla(point, "slots_new", "out_tune", config, workspace,
                                               fp8=kv_cache == "fp8_e4m3")))
                twin = _gluon_fp8_twin(config) if kv_cache == "fp8_e4m3" else None
                if twin is not None:
                    twins[len(candidates) - 1] = _sparse_mla(point, "slots_new", "out_tune_twin", twin,
                                                             workspace, fp8=True)
        default_chunks = topk_num_chunks(point.rows, shapes.num_sms)
        for chunks in dict.fromkeys([default_chunks] + [max(1, round(default_chunks * factor))
                                                        for factor in TUNE_TOPK_CHUNKS]
                                    + list(TUNE_TOPK_FEW_CHUNKS) + [1]):
            for single in (True, False) if chunks > 1 else (None,):
                if single and not topk_single_launch_fits(point.rows, chunks, device):
                    continue
                # with candidate lists (the default, where topk_candidates gives them) and without
                for sampled in (True, False) if chunks <= TOPK_LISTS_MAX_CHUNKS else (False,):
                    candidates.append(("topk", {"chunks": chunks, "single_launch": single, "sampled": sampled},
                                       _topk(point, True, "logits_baseline", "slots_tune", chunks, single,
                                             sampled=sampled)))
        if fp8 and "indexer" in args.ops:
            _indexer(point, True, fp8=True)(check_values=True)  # logits_fp8: what every candidate must match
            candidates += [("indexer", config, fn) for config, fn in _fp8_indexer_tune_candidates(point)]
        for index, (op, config, fn) in enumerate(candidates):
            if op not in args.ops:
                continue
            row = {"op": op, "heads": heads, "mode": mode, "bs": bs, "live_kv": live, "config": config}
            try:
                timing = time_in_graph(fn, iters=args.iters, cold_l2=True, graph_diff=False)
                row.update(us=timing.median_us, spread=timing.spread)
                if op == "indexer" and config.get("kv_cache") == "fp8_e4m3":
                    row["max_abs_diff"] = _check_fp8_indexer_candidate(point, fn, True)
                if index in twins:
                    _check_gluon_fp8_candidate(point, fn, twins[index])
                    row["max_abs_diff"] = 0.0
            except Exception as err:  # e.g. a configuration that does not fit in shared memory
                row["error"] = f"{type(err).__name__}: {err}"[:300]
            rows.append(row)
        del point
    for r in rows:  # against the default configuration at the same point (split choice and KV cache)
        same = [d for d in rows if (d["op"], d["heads"], d["mode"], d["bs"], d["live_kv"])
                == (r["op"], r["heads"], r["mode"], r["bs"], r["live_kv"])
                and (d["config"].get("splits", 1) > 1) == (r["config"].get("splits", 1) > 1)
                and d["config"].get("kv_cache") == r["config"].get("kv_cache")]
        default = same[0].get("us") if same else None
        r["vs_default"] = r["us"] / default if "us" in r and default else None
    cols = [("op", "op"), ("heads", "heads"), ("mode", "mode"), ("bs", "bs"), ("live_kv", "live KV"),
            ("config", "config"), ("us", "µs"), ("vs_default", "vs default")]
    winners = _tune_winners(rows)
    md = (markdown_table(cols + [("spread", "spread"), ("max_abs_diff", "max abs diff vs default"),
                                 ("error", "error")], rows)
          + "\n\n## Fastest per point\n\n" + markdown_table(cols, winners))
    print(f"Fastest per point:\n{markdown_table(cols, winners)}")
    write_results("dsa_ops_tune", {"method": "new forms only, as in dsa_ops", "params": bench_params(args),
                                   "rows": rows, "winners": winners}, md, args.out)
    return 0
