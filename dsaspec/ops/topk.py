"""Exact top-k over ragged live lengths, mapped through the page table to KV slots.

Logits become order-preserving uint32 keys; a radix select (8-bit digits, most significant
first, one histogram pass over the live range per digit, stopping early once the threshold bin
holds exactly the entries still needed) finds the k-th largest key; one last pass writes the
selected positions' slots in ascending position order. Every pass reads only
``logits[r, :seqlens[r]]``, so the cost follows the live length. A row no longer than ``k``
(sparse == dense) takes every live position: its slots are copied and no logit is read.

Two launch forms, same result bit for bit:

- without a workspace, one program per row does every pass (grid ``(R,)``); with candidate
  lists (:func:`topk_candidates`, for rows that fill the GPU) a long row's passes run over a
  list instead: a sample of every 32nd logit bounds it, one read of the row writes it (the
  positions and copies of their logits, so the passes over the list read in order), and a row
  whose list would hold fewer than ``k`` or too many positions takes the whole-row passes;
- with a workspace (:func:`topk_workspace`, for few rows) each row's live range is split into
  up to ``P`` chunks, one program each (grid ``(R, P)``), and every pass is a launch of its own:
  pass ``l`` (0..3) histograms digit ``l`` of its chunk into the workspace; the next launch's
  programs each sum their row's chunk histograms, derive the same digit, and carry the search
  state in the workspace; the last launch turns the chunk histograms into each chunk's output
  offset and writes its chunk's selection there (docs/dsa-kernels.md). On the GPU, when the
  grid fits on the device at once, the five passes run in one cooperative launch instead: a
  row's programs meet at a barrier (a counter in the workspace) where the launches had a
  boundary, and a row no longer than ``k`` is copied without any barrier. With candidate lists
  (:func:`topk_candidates`, for rows whose chunks are long) each chunk of a long row lists its
  own candidates against the row's sample bound first and the chunk passes run over the lists:
  in the launched form the list pass is a launch of its own; the single launch is then one
  cooperative kernel that takes every row (copy, passes over the range, or list, barrier and
  passes over the lists).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaspec.ops.checks import check_count, check_live_width, check_tensor
from dsaspec.ops.device import enter_chain, interpreted, resident_registers, sm_count, supports_pdl

_GPU_BLOCK = 4096  # logits per loop step on the GPU (one program per row)
_CPU_BLOCK = 128  # small under the interpreter, so short test rows still take several steps
# Sampled form of the one-program form (with a candidate list, ``topk_candidates``): the sample is
# every SAMPLE_STRIDE-th position; its rank ``ceil(1.5 k / stride) + SAMPLE_MARGIN`` makes the
# candidates about 1.5 k + 16 strides on rows in random order (the count of a rank-r sample bound
# is about r * stride, relative spread 1 / sqrt(r): below k or above capacity is > 4 sigma at
# k = 2048); capacity is twice that, and rows shorter than twice the capacity take the whole-row
# form.
_GPU_SAMPLE_STRIDE, _CPU_SAMPLE_STRIDE = 32, 4
_GPU_LIST_BLOCK, _CPU_LIST_BLOCK = 2048, 32  # step of the passes over the sample and the list
# With lists the kernel takes 152 registers a thread (8 warps): one program per SM, so more rows
# than SMs ran in two waves where the kernel without lists (118) runs two programs per SM in one
# (ncu, H200: 256 rows of 8k 58 against 47 µs). Capped at 128 it runs two per SM (48 µs; 256 rows
# of 64k 178 against 192 uncapped), but spills: up to one row per SM it stays uncapped (128 rows
# of 64k: 104 against 114 capped). benchmarks/results/h200/logs/topk_lists_maxnreg_128.json
_LISTS_CAPPED_REGISTERS = 128
SAMPLE_MARGIN = 16
# The sample bound is the radix bin of the top 16 bits of the sample's rank-r key (2 digits, not
# 4: half the passes over the sample). The bin holds about 2^-7 of a key's magnitude, so it admits
# a few dozen more candidates than the key itself on rows of normal logits; the list stays closed
# upwards, so the selection stays exact.
_SAMPLE_LEVELS = tl.constexpr(2)
_VECTOR = tl.constexpr(4)  # neighbouring logits a thread takes in the list and write passes
# Chunked form: logits per loop step, the shortest chunk (a multiple of _ALIGN) and chunk
# histograms summed per step, on the GPU / under the interpreter (tiny, so tests cover chunks
# shorter than a step and several summing steps).
_GPU_CHUNK_BLOCK, _GPU_MIN_CHUNK, _GPU_TILE = 1024, 1024, 16
_CPU_CHUNK_BLOCK, _CPU_MIN_CHUNK, _CPU_TILE = 32, 16, 4
_ALIGN = tl.constexpr(16)  # chunk lengths are multiples of this (chunks start 64 B aligned)
# Chunk count: about PROGRAMS_PER_SM programs per SM, at most MAX_CHUNKS per row (at most
# TOPK_LISTS_MAX_CHUNKS from num_sms // TOPK_LISTS_MAX_CHUNKS rows on), and none below MIN_CHUNKS
# (the five launches then cost more than they save: one program per row instead). From the H200
# sweep (benchmarks/results/h200/dsa_ops_tune.md): 32 chunks beat 64 at one and four rows of 64k;
# 2 chunks at 256 rows were 1.2x slower than one.
MAX_CHUNKS = 32
MIN_CHUNKS = 4
PROGRAMS_PER_SM = 2
# The single launch needs every program of the grid resident at once; the compiled single-launch
# kernels (4 warps, 2 KB of shared memory for sm_90 with Triton 3.6; 118 registers a thread, the
# one with lists capped at 128) fit four per SM each, so a grid of up to four per SM is tried as
# one (a GPU test launches one that large). The driver is the authority: it refuses a cooperative
# grid the SMs it lets this process use cannot hold (fewer SMs under MPS or in a green context,
# another occupancy on another device or compiler), and the call then takes the five launches.
SINGLE_LAUNCH_PROGRAMS_PER_SM = 4
_CHUNK_WARPS = 4  # warps of a chunked-form program
# ... which holds for the kernel with lists (155 registers uncapped: three per SM) when each of its
# programs gets at most a quarter of an SM's 64K registers: 128
_SINGLE_LAUNCH_MAX_REGISTERS = resident_registers(SINGLE_LAUNCH_PROGRAMS_PER_SM, _CHUNK_WARPS)
_PASSES = 5  # histograms of digits 0..3, then the write
_LIST_PASS = tl.constexpr(5)  # the launched form's first pass with candidate lists
# Candidate lists in the chunked form only up to this many chunks a row: with more, every chunk's
# derivation of the sample bound costs more than its shorter range saves. From 16 rows on (H200:
# num_sms // 8) a row takes no more chunks than this, so long rows take lists: 16 rows of 64k in 8
# chunks with lists 35.4 µs against 16 chunks without 42.7; with fewer rows the 32 chunks without
# lists are faster (4 rows: 24.8 against 31.1 in 8 chunks with lists;
# benchmarks/results/h200/logs/topk_chunks_lists_few_rows.json).
TOPK_LISTS_MAX_CHUNKS = 8
# ... and in rows whose chunks are at least this long (on the GPU / under the interpreter): in
# shorter ones the list pass costs more than the shorter passes save (H200, one kernel for every
# row, against no lists: 33 rows of 16k in 8 chunks of 2048, 34.4 against 33.6 µs, in chunks of
# 1024 37.7; 64 rows of 14.4k in 4 chunks 41.3 against 48.5, 40 rows of 32k in 6 chunks 46.1
# against 66.8; benchmarks/results/h200/logs/topk_one_kernel_min_chunk.json).
_GPU_LISTS_MIN_CHUNK, _CPU_LISTS_MIN_CHUNK = 2048, 64
# Workspace words per (row, chunk): 4 digit histograms of 256 counts, then the search state
# (below), padded to 8 words. Chunk 0's state also holds the row's barrier counter of the
# single-launch form (zero between calls).
_STATE = tl.constexpr(4 * 256)
_ABOVE, _PREFIX, _NEED, _LEVELS, _SEARCHING, _ARRIVED, _LISTED = (tl.constexpr(i)
                                                                   for i in range(7))
TOPK_COUNTER_WORDS = slice(4 * 256 + 5, 4 * 256 + 6)  # [row, 0, TOPK_COUNTER_WORDS]: the counter
TOPK_WORKSPACE_WORDS = 4 * 256 + 8
_WORDS = tl.constexpr(TOPK_WORKSPACE_WORDS)


@triton.jit
def _order_key(values):
    """uint32 keys with the order of the fp32 ``values`` (by bit pattern: -0.0 below +0.0,
    NaNs with the sign bit below -inf, the others above +inf): ``ops.order_key.fp32_order_key``
    in-kernel."""
    bits = values.to(tl.int32, bitcast=True)
    flip = (bits >> 31) | -2147483648  # negative: flip every bit; positive: only the sign bit
    return (bits ^ flip).to(tl.uint32, bitcast=True)


@triton.jit
def _vector_offsets(BLOCK: tl.constexpr):
    """int32 ``[BLOCK // 4, 4]``: ``0 .. BLOCK - 1`` in row-major order. Triton gives each thread
    whole rows of four neighbours (one 16-byte load), so a block's ranks (``_block_ranks``) need
    one scan over ``BLOCK // 4`` row counts; a scan over all ``BLOCK`` entries took 2.4x the
    instructions (sm_90 SASS of the list pass: 552 against 1320, 5 barriers against 11)."""
    return tl.arange(0, BLOCK // _VECTOR)[:, None] * _VECTOR + tl.arange(0, _VECTOR)[None, :]


@triton.jit
def _block_ranks(flags):
    """For 0/1 int32 ``flags`` ``[N, V]`` taken in row-major order: (int32 ``[N, V]``, the set
    flags before each entry; the number set in all)."""
    per_row = tl.sum(flags, 1)
    rows_before = tl.cumsum(per_row, 0) - per_row
    return rows_before[:, None] + tl.cumsum(flags, 1) - flags, tl.sum(per_row, 0)


@triton.jit
def _list_logits(out_list, capacity):
    """The fp32 logits half of a candidate list: ``capacity`` positions at ``out_list``, then
    their logits (the int32 buffer's next ``capacity`` words)."""
    return (out_list + capacity).to(tl.pointer_type(tl.float32), bitcast=True)


@triton.jit
def _logit_index(indices, stride):
    """Where source index ``indices`` finds its logit: ``indices * stride`` in a sample of the row
    (``stride > 1``), else ``indices`` (the row itself, 1, or a list's own copies, 0). A runtime
    value, so one compiled loop serves every source; where a caller passes the constant 1 the
    arithmetic folds away."""
    index = indices
    if stride != 1:
        index = indices * tl.maximum(stride, 1)
    return index


@triton.jit
def _source_positions(source_positions, indices, wanted, stride):
    """The row positions of source ``indices``: the list's (``stride`` 0; loaded where
    ``wanted``, through L2: written by this program or its row's), else ``indices * stride``."""
    positions = indices
    if stride != 1:
        listed = tl.load(source_positions + indices, mask=wanted & (stride == 0), other=0,
                         cache_modifier=".cg")
        positions = tl.where(stride == 0, listed, indices * stride)
    return positions


@triton.jit
def _first_values(source_logits, offsets, start, end, stride, PREFETCH: tl.constexpr):
    """What a block loop over source indices ``[start, end)`` (``start + offsets`` a step)
    carries into its first step: with ``PREFETCH`` the first block's logits (loaded now), else
    nothing to carry (zeros, never read)."""
    if PREFETCH:
        indices = start + offsets
        return tl.load(source_logits + _logit_index(indices, stride), mask=indices < end,
                       other=0.0)
    else:
        return tl.zeros(offsets.shape, dtype=tl.float32)


@triton.jit
def _source_values(source_logits, indices, end, carried, stride, PREFETCH: tl.constexpr,
                   BLOCK: tl.constexpr):
    """(logits of source ``indices`` (``< end``; ``stride``: see ``_logit_index``), what to
    carry). With ``PREFETCH`` the logits were carried in and the next block's loads are issued
    now, before this block's work, so two blocks are in flight; without, this block is loaded
    now."""
    if PREFETCH:
        ahead = indices + BLOCK
        return carried, tl.load(source_logits + _logit_index(ahead, stride), mask=ahead < end,
                                other=0.0)
    else:
        return tl.load(source_logits + _logit_index(indices, stride), mask=indices < end,
                       other=0.0), carried


@triton.jit
def _digit_histogram(source_logits, start, end, prefix, level, stride, BLOCK: tl.constexpr,
                     PREFETCH: tl.constexpr):
    """int32 ``[256]``: counts of digit ``level`` (0..3: key bits ``31 - 8 level .. 24 - 8
    level``) over the source indices ``[start, end)`` (logits at ``source_logits``, ``stride``:
    see ``_logit_index``) whose higher digits equal ``prefix``."""
    offsets = tl.arange(0, BLOCK)
    histogram = tl.zeros((256,), dtype=tl.int32)
    carried = _first_values(source_logits, offsets, start, end, stride, PREFETCH)
    for block_start in range(start, end, BLOCK):
        indices = block_start + offsets
        values, carried = _source_values(source_logits, indices, end, carried, stride, PREFETCH,
                                         BLOCK)
        keys = _order_key(values)
        # the digits above this one (none at level 0: shifted out in two steps, each below 32)
        higher = (keys >> (31 - 8 * level)) >> 1
        in_range = (indices < end) & (higher == prefix)
        digits = ((keys >> (24 - 8 * level)) & 255).to(tl.int32)
        histogram += tl.histogram(digits, 256, mask=in_range)
    return histogram


@triton.jit
def _choose_digit(histogram, need):
    """The threshold digit of a histogram: the largest ``b`` with at least ``need`` entries at
    digits ``>= b``. Returns (digit, entries at it, entries above it)."""
    bins = tl.arange(0, 256)
    at_or_above = tl.sum(histogram, 0) - tl.cumsum(histogram, 0) + histogram
    digit = tl.max(tl.where(at_or_above >= need, bins, -1), 0)
    in_digit = tl.sum(tl.where(bins == digit, histogram, 0), 0)
    above = tl.sum(tl.where(bins == digit, at_or_above, 0), 0) - in_digit
    return digit, in_digit, above


@triton.jit
def _write_selected(source_logits, source_positions, row_table, row_out, row_positions, start,
                    end, stride, threshold, shift, need, written, ties_seen,
                    WRITE_POSITIONS: tl.constexpr, BLOCK: tl.constexpr, PREFETCH: tl.constexpr):
    """Write the selected positions of source indices ``[start, end)`` (logits at
    ``source_logits``, positions at ``source_positions`` for a list; ``stride``: see
    ``_logit_index``): ``key >> shift`` above ``threshold``, or equal to it with fewer than
    ``need`` such ties before, counting ``ties_seen`` earlier ones; in the source's order
    (ascending positions) from output index ``written``. Returns the next index."""
    offsets = _vector_offsets(BLOCK)
    carried = _first_values(source_logits, offsets, start, end, stride, PREFETCH)
    for block_start in range(start, end, BLOCK):
        indices = block_start + offsets
        in_range = indices < end
        values, carried = _source_values(source_logits, indices, end, carried, stride, PREFETCH,
                                         BLOCK)
        keys = _order_key(values) >> shift
        above = in_range & (keys > threshold)
        tie = in_range & (keys == threshold)
        ties_before, ties = _block_ranks(tie.to(tl.int32))
        selected = above | (tie & (ties_seen + ties_before < need))
        selected_before, count = _block_ranks(selected.to(tl.int32))
        index = written + selected_before
        positions = _source_positions(source_positions, indices, selected, stride)
        slots = tl.load(row_table + positions, mask=selected, other=-1)
        tl.store(row_out + index, slots, mask=selected)
        if WRITE_POSITIONS:
            tl.store(row_positions + index, positions, mask=selected)
        written += count
        ties_seen += ties
    return written


@triton.jit
def _copy_slots(row_table, row_out, row_positions, start, end, WRITE_POSITIONS: tl.constexpr,
                BLOCK: tl.constexpr):
    """Every position of ``[start, end)`` is selected: copy its slot to the same index."""
    for block_start in range(start, end, BLOCK):
        positions = block_start + tl.arange(0, BLOCK)
        in_range = positions < end
        tl.store(row_out + positions, tl.load(row_table + positions, mask=in_range),
                 mask=in_range)
        if WRITE_POSITIONS:
            tl.store(row_positions + positions, positions, mask=in_range)


@triton.jit
def _fill_empty(row_out, row_positions, start, end, WRITE_POSITIONS: tl.constexpr,
                BLOCK: tl.constexpr):
    """``-1`` at output indices ``[start, end)``."""
    for block_start in range(start, end, BLOCK):
        index = block_start + tl.arange(0, BLOCK)
        empty = index < end
        tl.store(row_out + index, -1, mask=empty)
        if WRITE_POSITIONS:
            tl.store(row_positions + index, -1, mask=empty)


# ---------------------------------------------------------------------------------------------
# one program per row


@triton.jit
def _topk_slots_kernel(logits_ptr, seqlens_ptr, page_table_ptr, out_ptr, positions_ptr,
                       candidates_ptr, logits_stride, page_table_stride, out_stride,
                       positions_stride, candidates_stride, k, copy_len, capacity, sample_rank,
                       sample_stride, sampled_min_live, WRITE_POSITIONS: tl.constexpr,
                       BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, SAMPLED: tl.constexpr,
                       LIST_BLOCK: tl.constexpr, CHAINED: tl.constexpr):
    enter_chain(CHAINED)
    row = tl.program_id(0).to(tl.int64)
    live = tl.maximum(tl.load(seqlens_ptr + row), 0)
    row_logits = logits_ptr + row * logits_stride
    row_table = page_table_ptr + row * page_table_stride
    row_out = out_ptr + row * out_stride
    row_positions = positions_ptr + row * positions_stride
    row_candidates = candidates_ptr + row * candidates_stride
    if live <= copy_len:
        # every live position is selected (copy_len <= k): copy the slots, read no logit
        _copy_slots(row_table, row_out, row_positions, 0, live, WRITE_POSITIONS, BLOCK)
        written = live
    else:
        written = tl.full((), -1, dtype=tl.int32)
        if SAMPLED:
            if live >= sampled_min_live:
                written = _select_from_candidates(row_logits, row_candidates, row_table, row_out,
                                                  row_positions, live, k, capacity, sample_rank,
                                                  sample_stride, WRITE_POSITIONS, BLOCK,
                                                  LIST_BLOCK)
        if written < 0:
            # the whole row (source stride 1, a constant here: no list reads, no index
            # arithmetic per element)
            written = _select_and_write(row_logits, row_candidates, row_table, row_out,
                                        row_positions, live, k, 1, WRITE_POSITIONS, BLOCK)
    _fill_empty(row_out, row_positions, written, k, WRITE_POSITIONS, BLOCK_K)


@triton.jit
def _select_and_write(source_logits, source_positions, row_table, row_out, row_positions, end,
                      k, stride, WRITE_POSITIONS: tl.constexpr, BLOCK: tl.constexpr):
    """Radix-select the top ``min(end, k)`` of source indices ``[0, end)`` (``source_logits``,
    ``source_positions``, ``stride``: see ``_write_selected``) and write their slots (and
    positions) in ascending position order; returns how many were written."""
    threshold, shift, need = _radix_threshold(source_logits, end, k, stride, BLOCK)
    none = tl.zeros((), dtype=tl.int32)
    return _write_selected(source_logits, source_positions, row_table, row_out, row_positions, 0,
                           end, stride, threshold, shift, need, none, none, WRITE_POSITIONS,
                           BLOCK, False)


@triton.jit
def _select_from_candidates(row_logits, row_candidates, row_table, row_out, row_positions, live,
                            k, capacity, sample_rank, sample_stride,
                            WRITE_POSITIONS: tl.constexpr, BLOCK: tl.constexpr,
                            LIST_BLOCK: tl.constexpr):
    """The sampled form of a long row: list its candidates (``_list_candidates``) and select its
    top ``k`` from them; returns how many were written, or -1 when the list holds fewer than
    ``k`` or more than ``capacity`` positions (the caller then selects from the whole row). The
    sample's and the list's passes step ``LIST_BLOCK`` entries at a time (they are short: a
    ``BLOCK``-wide step would mostly histogram masked lanes, which cost as much as live ones)."""
    count = _list_candidates(row_logits, row_candidates, live, capacity, sample_rank,
                             sample_stride, BLOCK, LIST_BLOCK)
    written = tl.full((), -1, dtype=tl.int32)
    if (count >= k) & (count <= capacity):
        tl.debug_barrier()  # the list's stores, before any thread of the program reads it
        written = _select_and_write(_list_logits(row_candidates, capacity), row_candidates,
                                    row_table, row_out, row_positions, count, k, 0,
                                    WRITE_POSITIONS, LIST_BLOCK)
    return written


@triton.jit
def _radix_threshold(source_logits, end, k, stride, BLOCK: tl.constexpr,
                     LEVELS: tl.constexpr = 4):
    """Radix-select the ``min(end, k)``-th largest key of source indices ``[0, end)`` (logits at
    ``source_logits``, ``stride``: see ``_logit_index``): returns (threshold, shift, need) such
    that the source's top ``k`` are the keys with ``key >> shift > threshold``, then the first
    ``need`` with ``key >> shift == threshold`` (with ``end <= k``: shift 0, threshold 0, need k,
    which takes every index). With ``LEVELS`` below 4 the search stops after that many digits:
    the threshold is then the top ``8 * LEVELS`` bits of that key (a bin, as the candidate bound
    needs). The digit loop is a runtime loop, so each call site compiles one histogram loop, not
    four."""
    threshold = tl.zeros((), dtype=tl.uint32)
    shift = tl.zeros((), dtype=tl.uint32)
    need = tl.zeros((), dtype=tl.int32) + k  # a tensor even when k is specialised to a constant
    searching = end > k
    for level in range(LEVELS):
        if searching:
            histogram = _digit_histogram(source_logits, 0, end, threshold, level, stride, BLOCK,
                                         False)
            digit, in_digit, above = _choose_digit(histogram, need)
            need -= above
            threshold = (threshold << 8) | digit.to(tl.uint32)
            shift = tl.zeros((), dtype=tl.uint32) + (24 - 8 * level)
            searching = in_digit != need
    return threshold, shift, need


@triton.jit
def _list_candidates(row_logits, row_candidates, live, capacity, sample_rank, sample_stride,
                     BLOCK: tl.constexpr, LIST_BLOCK: tl.constexpr):
    """The sampled form's candidate list: the ``sample_rank``-th largest key of every
    ``sample_stride``-th position bounds it (its radix bin), and every position ``t < live`` whose
    key reaches that bin is listed in ascending order (``_list_range``: at most ``capacity``);
    returns ``count`` (all of them). The set is closed upwards in key order, so when it holds at
    least ``k`` positions it holds the row's whole top ``k`` and every tie of the ``k``-th key:
    selecting from it is exact."""
    threshold, shift = _sample_bound(row_logits, live, sample_rank, sample_stride, LIST_BLOCK)
    return _list_range(row_logits, row_candidates, 0, live, capacity, threshold, shift, BLOCK)


@triton.jit
def _sample_bound(row_logits, live, sample_rank, sample_stride, LIST_BLOCK: tl.constexpr):
    """(threshold, shift): the radix bin of the ``sample_rank``-th largest key of every
    ``sample_stride``-th position ``< live``; a key reaches it when ``key >> shift >=
    threshold``."""
    sample_end = (live + sample_stride - 1) // sample_stride
    threshold, shift, _ = _radix_threshold(row_logits, sample_end, sample_rank, sample_stride,
                                           LIST_BLOCK, _SAMPLE_LEVELS)
    return threshold, shift


@triton.jit
def _list_range(row_logits, out_list, start, end, capacity, threshold, shift,
                BLOCK: tl.constexpr):
    """List every position of ``[start, end)`` whose key reaches the bound (``key >> shift >=
    threshold``), in ascending order: positions at ``out_list[0 : min(count, capacity)]``, their
    logits beside them (``_list_logits``), so the passes over the list read both in order instead
    of gathering logits from the row; returns ``count`` (all of them). The only full read of a
    long row, so two blocks are in flight."""
    offsets = _vector_offsets(BLOCK)
    list_logits = _list_logits(out_list, capacity)
    count = tl.zeros((), dtype=tl.int32)
    ahead = tl.load(row_logits + start + offsets, mask=start + offsets < end, other=0.0)
    for block_start in range(start, end, BLOCK):
        positions = block_start + offsets
        values = ahead
        ahead = tl.load(row_logits + positions + BLOCK, mask=positions + BLOCK < end, other=0.0)
        keep = (positions < end) & ((_order_key(values) >> shift) >= threshold)
        before, kept = _block_ranks(keep.to(tl.int32))
        index = count + before
        stored = keep & (index < capacity)
        tl.store(out_list + index, positions, mask=stored)
        tl.store(list_logits + index, values, mask=stored)
        count += kept
    return count


# ---------------------------------------------------------------------------------------------
# chunked: several programs per row, one launch per pass


@triton.jit
def _chunk_range(live, chunk, num_chunks, MIN_CHUNK: tl.constexpr):
    """Positions ``[start, end)`` of ``chunk`` in a row of ``live``, and the row's number of
    non-empty chunks: ``cdiv(live, num_chunks)`` rounded up to ``MIN_CHUNK`` and ``_ALIGN``."""
    # (plain integer arithmetic: tl.cdiv is a function call, slow under the interpreter)
    length = tl.maximum((live + num_chunks - 1) // num_chunks, MIN_CHUNK)
    length = (length + _ALIGN - 1) // _ALIGN * _ALIGN
    start = chunk * length
    return start, tl.minimum(start + length, live), (live + length - 1) // length


@triton.jit
def _sum_histograms(row_workspace, level, num, TILE: tl.constexpr):
    """The sum of the digit-``level`` histograms of chunks ``0 .. num - 1``."""
    bins = tl.arange(0, 256)
    total = tl.zeros((256,), dtype=tl.int32)
    for first in range(0, num, TILE):
        chunks = first + tl.arange(0, TILE)
        # other programs' words: read through L2 (.cg), never a stale L1 line in the single launch
        tile = tl.load(row_workspace + chunks[:, None] * _WORDS + level * 256 + bins[None, :],
                       mask=(chunks < num)[:, None], other=0, cache_modifier=".cg")
        total += tl.sum(tile, 0)
    return total


@triton.jit
def _advance(row_workspace, chunk, num_active, k, LEVEL: tl.constexpr, TILE: tl.constexpr):
    """The search state after digit ``LEVEL``: the state the previous launch stored (the
    initial one for ``LEVEL`` 0), moved on by the row's digit-``LEVEL`` histograms if it was
    still searching. Returns (entries of this chunk above the prefix, prefix, need, digits
    found, still searching, whether digit ``LEVEL`` was found here)."""
    state = row_workspace + chunk * _WORDS + _STATE
    if LEVEL == 0:
        above = tl.zeros((), dtype=tl.int32)
        prefix = tl.zeros((), dtype=tl.int32)
        need = tl.zeros((), dtype=tl.int32) + k
        levels = tl.zeros((), dtype=tl.int32)
        searching = need > 0  # (true: rows that search have live > k >= 1)
    else:
        above = tl.load(state + _ABOVE)
        prefix = tl.load(state + _PREFIX)
        need = tl.load(state + _NEED)
        levels = tl.load(state + _LEVELS)
        searching = tl.load(state + _SEARCHING) != 0
    found = searching
    if searching:
        total = _sum_histograms(row_workspace, LEVEL, num_active, TILE)
        digit, in_digit, digit_above = _choose_digit(total, need)
        bins = tl.arange(0, 256)
        own = tl.load(row_workspace + chunk * _WORDS + LEVEL * 256 + bins)
        above += tl.sum(tl.where(bins > digit, own, 0), 0)
        need -= digit_above
        prefix = (prefix << 8) | digit
        levels = tl.full((), LEVEL + 1, dtype=tl.int32)
        searching = in_digit != need
    return above, prefix, need, levels, searching, found


@triton.jit
def _chunk_setup(logits_ptr, seqlens_ptr, page_table_ptr, out_ptr, positions_ptr, workspace_ptr,
                 logits_stride, page_table_stride, out_stride, positions_stride, num_chunks,
                 MIN_CHUNK: tl.constexpr):
    """Program (row, chunk)'s live length, chunk range, the row's non-empty chunk count and row
    pointers."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    live = tl.maximum(tl.load(seqlens_ptr + row), 0)
    start, end, num_active = _chunk_range(live, chunk, num_chunks, MIN_CHUNK)
    start = tl.multiple_of(start, _ALIGN)
    return (chunk, live, start, end, num_active, logits_ptr + row * logits_stride,
            page_table_ptr + row * page_table_stride, out_ptr + row * out_stride,
            positions_ptr + row * positions_stride, workspace_ptr + row * num_chunks * _WORDS)


@triton.jit
def _copy_chunk(row_table, row_out, row_positions, start, end, chunk, num_chunks, live, k,
                WRITE_POSITIONS: tl.constexpr, BLOCK: tl.constexpr):
    """A row with ``live <= k``: copy the chunk's slots (every live position is selected, no
    logit is read) and this program's share of the ``-1`` fill of ``[live, k)``."""
    _copy_slots(row_table, row_out, row_positions, start, end, WRITE_POSITIONS, BLOCK)
    fill = tl.cdiv(k, num_chunks)
    _fill_empty(row_out, row_positions, tl.maximum(chunk * fill, live),
                tl.minimum(chunk * fill + fill, k), WRITE_POSITIONS, BLOCK)


@triton.jit
def _search_pass(source_logits, row_workspace, start, end, stride, chunk, num_active, k,
                 PASS: tl.constexpr, PREFETCH: tl.constexpr, BLOCK: tl.constexpr,
                 TILE: tl.constexpr):
    """Pass ``PASS`` (1..3) of a searching row: move the chunk's search state past digit
    ``PASS - 1`` and store it (if the row was still searching), then histogram digit ``PASS``
    of the chunk's source indices ``[start, end)`` (its range, or its candidate list: logits at
    ``source_logits``, ``stride`` and ``PREFETCH`` as ``_source_values`` takes them) if it still
    is. Returns whether it still is."""
    above, prefix, need, levels, searching, found = _advance(row_workspace, chunk, num_active,
                                                              k, PASS - 1, TILE)
    if found:
        state = row_workspace + chunk * _WORDS + _STATE
        tl.store(state + _ABOVE, above)
        tl.store(state + _PREFIX, prefix)
        tl.store(state + _NEED, need)
        tl.store(state + _LEVELS, levels)
        tl.store(state + _SEARCHING, searching.to(tl.int32))
    if searching:
        histogram = _digit_histogram(source_logits, start, end,
                                     prefix.to(tl.uint32, bitcast=True), PASS, stride, BLOCK,
                                     PREFETCH)
        tl.store(row_workspace + chunk * _WORDS + PASS * 256 + tl.arange(0, 256), histogram)
    return searching


@triton.jit
def _chunk_pass(source_logits, source_positions, row_table, row_out, row_positions,
                row_workspace, start, end, stride, chunk, num_active, k, PASS: tl.constexpr,
                WRITE_POSITIONS: tl.constexpr, PREFETCH: tl.constexpr, BLOCK: tl.constexpr,
                TILE: tl.constexpr):
    """Pass ``PASS`` of a searching row's chunk over its source indices ``[start, end)``
    (``source_logits``, ``source_positions``, ``stride``, ``PREFETCH``: as ``_write_chunk``): 0
    histograms digit 0, 1..3 move the search state on and histogram the next digit, 4 writes."""
    if PASS == 0:
        histogram = _digit_histogram(source_logits, start, end, 0, 0, stride, BLOCK, PREFETCH)
        tl.store(row_workspace + chunk * _WORDS + tl.arange(0, 256), histogram)
    elif PASS < 4:
        _search_pass(source_logits, row_workspace, start, end, stride, chunk, num_active, k,
                     PASS, PREFETCH, BLOCK, TILE)
    else:
        _write_chunk(source_logits, source_positions, row_table, row_out, row_positions,
                     row_workspace, start, end, stride, chunk, num_active, k, WRITE_POSITIONS,
                     PREFETCH, BLOCK, TILE)


@triton.jit
def _chunk_list(candidates_ptr, candidates_stride, chunk, region):
    """Program (row, chunk)'s candidate list, its ``region`` entries of the row's, and how many
    positions it holds: half of them (then their logits, ``_list_logits``)."""
    own_list = (candidates_ptr + tl.program_id(0).to(tl.int64) * candidates_stride
                + chunk * region)
    return own_list, region // 2


@triton.jit
def _list_chunk(row_logits, own_list, row_workspace, chunk, live, start, end, capacity,
                sample_rank, sample_stride, BLOCK: tl.constexpr, LIST_BLOCK: tl.constexpr):
    """A sampled row's chunk lists its candidates: the row's sample bound (every program of the
    row derives the same one), then the chunk's positions that reach it, ascending, with their
    logits, at ``own_list`` (``capacity`` entries at most, ``_list_range``); the count (all of
    them) goes to the chunk's state."""
    threshold, shift = _sample_bound(row_logits, live, sample_rank, sample_stride, LIST_BLOCK)
    count = _list_range(row_logits, own_list, start, end, capacity, threshold, shift, BLOCK)
    tl.store(row_workspace + chunk * _WORDS + _STATE + _LISTED, count)


@triton.jit
def _row_listed(row_workspace, num_active, k, capacity, TILE: tl.constexpr):
    """Whether a sampled row selects from its chunks' lists: together they hold at least ``k``
    positions (else the sample misled: the bound admits too few) and none overflowed its
    ``capacity``. Every program of the row reads the same counts, so all decide alike."""
    total = tl.zeros((), dtype=tl.int32)
    largest = tl.zeros((), dtype=tl.int32)
    for first in range(0, num_active, TILE):
        chunks = first + tl.arange(0, TILE)
        counts = tl.load(row_workspace + chunks * _WORDS + _STATE + _LISTED,
                         mask=chunks < num_active, other=0, cache_modifier=".cg")
        total += tl.sum(counts, 0)
        largest = tl.maximum(largest, tl.max(counts, 0))
    return (total >= k) & (largest <= capacity)


@triton.jit
def _topk_chunk_pass_kernel(logits_ptr, seqlens_ptr, page_table_ptr, out_ptr, positions_ptr,
                            workspace_ptr, candidates_ptr, logits_stride, page_table_stride,
                            out_stride, positions_stride, candidates_stride, k, num_chunks,
                            region, sample_rank, sample_stride, sampled_min_live,
                            PASS: tl.constexpr, WRITE_POSITIONS: tl.constexpr,
                            MIN_CHUNK: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr,
                            SAMPLED: tl.constexpr, LIST_BLOCK: tl.constexpr,
                            CHAINED: tl.constexpr):
    """Pass ``PASS`` of the chunked form for program (row, chunk): ``_LIST_PASS`` (first, with
    ``SAMPLED``) lists a long row's candidates per chunk; 0..3 histogram digit ``PASS`` of the
    chunk's range, or of its list where the row selects from lists (after moving the search
    state past digit ``PASS - 1``); 4 writes. ``CHAINED``: ``enter_chain``."""
    enter_chain(CHAINED)
    (chunk, live, start, end, num_active, row_logits, row_table, row_out, row_positions,
     row_workspace) = _chunk_setup(logits_ptr, seqlens_ptr, page_table_ptr, out_ptr,
                                   positions_ptr, workspace_ptr, logits_stride, page_table_stride,
                                   out_stride, positions_stride, num_chunks, MIN_CHUNK)
    if live <= k:
        if PASS == 4:
            _copy_chunk(row_table, row_out, row_positions, start, end, chunk, num_chunks, live,
                        k, WRITE_POSITIONS, BLOCK)
    elif chunk < num_active:
        own_list, capacity = _chunk_list(candidates_ptr, candidates_stride, chunk, region)
        sampled = SAMPLED & (live >= sampled_min_live)
        if PASS == _LIST_PASS:
            if sampled:
                _list_chunk(row_logits, own_list, row_workspace, chunk, live, start, end,
                            capacity, sample_rank, sample_stride, BLOCK, LIST_BLOCK)
        else:
            listed = sampled
            if sampled:
                listed = _row_listed(row_workspace, num_active, k, capacity, TILE)
            if listed:
                listed_count = tl.load(row_workspace + chunk * _WORDS + _STATE + _LISTED)
                _chunk_pass(_list_logits(own_list, capacity), own_list, row_table, row_out,
                            row_positions, row_workspace, 0, listed_count, 0, chunk, num_active,
                            k, PASS, WRITE_POSITIONS, False, BLOCK, TILE)
            else:
                _chunk_pass(row_logits, own_list, row_table, row_out, row_positions,
                            row_workspace, start, end, 1, chunk, num_active, k, PASS,
                            WRITE_POSITIONS, True, BLOCK, TILE)


@triton.jit
def _row_barrier(arrived, target, last):
    """Count this program in at the row's arrival counter and wait until ``target`` programs
    have arrived. The CTA barrier before makes every thread's stores part of the release (the
    arrival is an acq_rel add); the one after lets no thread read on before the acquire. At the
    ``last`` barrier of the call the last program to arrive puts the counter back to zero (a
    release); a waiting program then sees a count below its own ticket, which also means done."""
    tl.debug_barrier()
    ticket = tl.atomic_add(arrived, 1, sem="acq_rel", scope="gpu") + 1
    if ticket == target:
        if last:
            tl.atomic_xchg(arrived, 0, sem="release", scope="gpu")
    else:
        seen = ticket
        while (seen < target) & (seen >= ticket):
            seen = tl.atomic_add(arrived, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _topk_chunk_single_launch_kernel(logits_ptr, seqlens_ptr, page_table_ptr, out_ptr,
                                     positions_ptr, workspace_ptr, logits_stride,
                                     page_table_stride, out_stride, positions_stride, k,
                                     num_chunks, WRITE_POSITIONS: tl.constexpr,
                                     MIN_CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                                     TILE: tl.constexpr):
    """The chunked form's passes over the chunk ranges in one launch (cooperative: every
    program resident at once), without candidate lists. The programs of a searching row meet at
    a barrier after pass 0 and after every pass it entered still searching, where the launched
    form has a launch boundary; the last barrier leaves the row's counter at zero. A row with
    ``live <= k`` is copied, no barrier."""
    (chunk, live, start, end, num_active, row_logits, row_table, row_out, row_positions,
     row_workspace) = _chunk_setup(logits_ptr, seqlens_ptr, page_table_ptr, out_ptr,
                                   positions_ptr, workspace_ptr, logits_stride, page_table_stride,
                                   out_stride, positions_stride, num_chunks, MIN_CHUNK)
    if live <= k:
        _copy_chunk(row_table, row_out, row_positions, start, end, chunk, num_chunks, live, k,
                    WRITE_POSITIONS, BLOCK)
    elif chunk < num_active:
        _single_launch_passes(row_logits, row_logits, row_table, row_out, row_positions,
                              row_workspace, start, end, 1, chunk, num_active, k, 0,
                              WRITE_POSITIONS, True, BLOCK, TILE)


@triton.jit
def _topk_chunk_lists_kernel(logits_ptr, seqlens_ptr, page_table_ptr, out_ptr, positions_ptr,
                             workspace_ptr, candidates_ptr, logits_stride, page_table_stride,
                             out_stride, positions_stride, candidates_stride, k, num_chunks,
                             region, sample_rank, sample_stride, sampled_min_live,
                             WRITE_POSITIONS: tl.constexpr, MIN_CHUNK: tl.constexpr,
                             BLOCK: tl.constexpr, TILE: tl.constexpr, LIST_BLOCK: tl.constexpr):
    """The single launch with candidate lists (cooperative): a row with ``live <= k`` is
    copied; a row of at least ``sampled_min_live`` lists each chunk's candidates first and its
    programs meet, then the passes run over the lists where they serve; every other searching
    row, and a sampled row whose lists cannot serve, runs them over the chunk ranges. One copy
    of the passes serves both sources (a runtime stride, no prefetch: with the range kernel's
    prefetching passes compiled beside them the listing rows ran 12-24% slower on the H200), and
    one launch serves every row: two kernels, one for the sampled rows after one for the others,
    cost 1.5-28 µs more (``docs/dsa-kernels.md``)."""
    (chunk, live, start, end, num_active, row_logits, row_table, row_out, row_positions,
     row_workspace) = _chunk_setup(logits_ptr, seqlens_ptr, page_table_ptr, out_ptr,
                                   positions_ptr, workspace_ptr, logits_stride, page_table_stride,
                                   out_stride, positions_stride, num_chunks, MIN_CHUNK)
    if live <= k:
        _copy_chunk(row_table, row_out, row_positions, start, end, chunk, num_chunks, live, k,
                    WRITE_POSITIONS, BLOCK)
    elif chunk < num_active:
        own_list, capacity = _chunk_list(candidates_ptr, candidates_stride, chunk, region)
        # the chunk's range (source indices [start, end) of the row's logits, stride 1), or its
        # list (stride 0, the list's own copies of the logits)
        first, last, stride, source_logits = start, end, tl.full((), 1, tl.int32), row_logits
        barriers = tl.zeros((), dtype=tl.int32)
        if live >= sampled_min_live:
            _list_chunk(row_logits, own_list, row_workspace, chunk, live, start, end, capacity,
                        sample_rank, sample_stride, BLOCK, LIST_BLOCK)
            _row_barrier(row_workspace + _STATE + _ARRIVED, num_active, False)
            barriers += 1
            if _row_listed(row_workspace, num_active, k, capacity, TILE):
                first, stride = tl.zeros_like(start), tl.zeros_like(stride)
                last = tl.load(row_workspace + chunk * _WORDS + _STATE + _LISTED,
                               cache_modifier=".cg")
                source_logits = _list_logits(own_list, capacity)
        _single_launch_passes(source_logits, own_list, row_table, row_out, row_positions,
                              row_workspace, tl.multiple_of(first, _ALIGN), last, stride, chunk,
                              num_active, k, barriers, WRITE_POSITIONS, False, BLOCK, TILE)


@triton.jit
def _single_launch_passes(source_logits, source_positions, row_table, row_out, row_positions,
                          row_workspace, start, end, stride, chunk, num_active, k, barriers,
                          WRITE_POSITIONS: tl.constexpr, PREFETCH: tl.constexpr,
                          BLOCK: tl.constexpr, TILE: tl.constexpr):
    """A searching row's passes over the chunk's source indices ``[start, end)``
    (``source_logits``, ``source_positions``, ``stride``, ``PREFETCH``: as ``_write_chunk``),
    meeting at the row's pass counter, which ``barriers``
    earlier meetings of this launch left at ``barriers * num_active`` (zero again after the last
    barrier)."""
    arrived = row_workspace + _STATE + _ARRIVED
    _chunk_pass(source_logits, source_positions, row_table, row_out, row_positions,
                row_workspace, start, end, stride, chunk, num_active, k, 0, WRITE_POSITIONS,
                PREFETCH, BLOCK, TILE)
    barriers = tl.zeros((), dtype=tl.int32) + barriers + 1
    _row_barrier(arrived, num_active * barriers, False)
    searching = num_active > 0  # true here; every program of the row derives the same values
    for level in tl.static_range(1, 4):
        if searching:
            searching = _search_pass(source_logits, row_workspace, start, end, stride, chunk,
                                     num_active, k, level, PREFETCH, BLOCK, TILE)
            barriers += 1
            # the last barrier: the search ended here, or this was the last digit
            _row_barrier(arrived, num_active * barriers, (searching == 0) | (level == 3))
    _write_chunk(source_logits, source_positions, row_table, row_out, row_positions,
                 row_workspace, start, end, stride, chunk, num_active, k, WRITE_POSITIONS,
                 PREFETCH, BLOCK, TILE)


@triton.jit
def _write_chunk(source_logits, source_positions, row_table, row_out, row_positions,
                 row_workspace, start, end, stride, chunk, num_active, k,
                 WRITE_POSITIONS: tl.constexpr, PREFETCH: tl.constexpr, BLOCK: tl.constexpr,
                 TILE: tl.constexpr):
    """The last pass of a row that searches: its output offset from the chunks before it (the
    entries above the final prefix, plus the ties up to ``need``), then the selection among its
    source indices ``[start, end)`` (the chunk's range: the row's logits, stride 1; or its list:
    the list's logits and positions, stride 0; ``PREFETCH`` as ``_source_values`` takes it)."""
    _, prefix, need, levels, _, found = _advance(row_workspace, chunk, num_active, k, 3, TILE)
    # chunks before this one: entries above the prefix as stored by the earlier passes (without
    # digit 3 when that was found in this pass), then ties and the rest from the last digit
    bins = tl.arange(0, 256)
    digit = prefix & 255
    before = _sum_histograms(row_workspace, levels - 1, chunk, TILE)
    ties_before = tl.sum(tl.where(bins == digit, before, 0), 0)
    above_before = tl.where(found, tl.sum(tl.where(bins > digit, before, 0), 0), 0)
    for first in range(0, chunk, TILE):
        chunks = first + tl.arange(0, TILE)
        above_before += tl.sum(tl.load(row_workspace + chunks * _WORDS + _STATE + _ABOVE,
                                       mask=chunks < chunk, other=0, cache_modifier=".cg"), 0)
    _write_selected(source_logits, source_positions, row_table, row_out, row_positions, start,
                    end, stride, prefix.to(tl.uint32, bitcast=True), (32 - 8 * levels).to(tl.uint32), need,
                    above_before + tl.minimum(ties_before, need), ties_before, WRITE_POSITIONS,
                    BLOCK, PREFETCH)


# ---------------------------------------------------------------------------------------------
# host side


def topk_num_chunks(num_rows: int, num_sms: int) -> int:
    """Chunks per row of the chunked form for ``R = num_rows`` rows: about
    ``PROGRAMS_PER_SM`` programs per SM, ``P = min(PROGRAMS_PER_SM * num_sms // R,
    MAX_CHUNKS)``, at most ``TOPK_LISTS_MAX_CHUNKS`` once ``R >= num_sms //
    TOPK_LISTS_MAX_CHUNKS`` (rows enough to fill the GPU in chunks that take candidate lists), or
    1 (one program per row) when that is below ``MIN_CHUNKS``."""
    num_rows = max(num_rows, 1)
    chunks = min(MAX_CHUNKS, PROGRAMS_PER_SM * num_sms // num_rows)
    if num_rows >= num_sms // TOPK_LISTS_MAX_CHUNKS:
        chunks = min(chunks, TOPK_LISTS_MAX_CHUNKS)
    return chunks if chunks >= MIN_CHUNKS else 1


def topk_workspace(num_rows: int, device, num_chunks: int | None = None,
                   num_sms: int | None = None) -> torch.Tensor | None:
    """Allocate the workspace of :func:`topk_slots`'s chunked form for a bucket of
    ``num_rows`` rows (once, before capture; reuse it for every call with that many rows, one
    call at a time: each call writes every entry it reads).

    ``num_chunks`` (``P``) defaults to :func:`topk_num_chunks` with ``num_sms`` (default: the
    device's count; 132 without CUDA); when that is 1 (the rows already fill the GPU) None is
    returned: the one-program-per-row form. An explicit ``num_chunks >= 1`` always gets a
    workspace.

    Returns
    -------
    int32 ``[num_rows, P, TOPK_WORKSPACE_WORDS]`` (zeros; per (row, chunk): the chunk's four
    digit histograms, 256 counts each, then the search state; chunk 0's also holds the row's
    barrier counter, ``TOPK_COUNTER_WORDS``, which must stay zero between calls), or None.
    ``num_rows``, ``num_chunks`` and ``num_sms`` must be ints >= 1 (else a ``TypeError`` /
    ``ValueError`` naming the argument).
    """
    check_count("num_rows", num_rows)
    if num_chunks is None:
        if num_sms is None:
            num_sms = sm_count(device)
        check_count("num_sms", num_sms)
        num_chunks = topk_num_chunks(num_rows, num_sms)
        if num_chunks == 1:
            return None
    check_count("num_chunks", num_chunks)
    return torch.zeros(num_rows, num_chunks, TOPK_WORKSPACE_WORDS, dtype=torch.int32,
                       device=device)


def topk_slots(logits: torch.Tensor, seqlens: torch.Tensor, page_table_1: torch.Tensor, k: int,
               out: torch.Tensor, *, check_values: bool = True,
               out_positions: torch.Tensor | None = None, baseline_read_short_rows: bool = False,
               workspace: torch.Tensor | None = None,
               single_launch: bool | None = None,
               candidates: torch.Tensor | None = None) -> torch.Tensor:
    """Exact per-row top-k of the live logits, mapped to KV slots.

    For row ``r``: ``S_r`` = the ``min(seqlens[r], k)`` positions ``t < seqlens[r]`` with the
    largest ``logits[r, t]``; ``out[r]`` = ``page_table_1[r, t]`` for ``t`` in ``S_r`` in
    ascending ``t``, then ``-1``. Ties at the k-th value go to the lowest positions, so the
    result is deterministic (and the same with and without a workspace, for any chunk count).
    Comparison is by the fp32 bit pattern's order (``-0.0 < +0.0``; NaNs with the sign bit clear
    rank above ``+inf``, with it set below ``-inf``). A row with ``seqlens[r] <= k`` selects
    every live position, so its logits are never read (they may be unwritten:
    ``indexer_schedule(..., skip_len=k)`` skips such rows).

    Parameters
    ----------
    logits : fp32 ``[R, W_out]``; only ``[r, :seqlens[r]]`` of rows with ``seqlens[r] > k`` is
        read (last dim contiguous).
    seqlens : int32 ``[R]``, live length of each row; negative counts as 0.
    page_table_1 : int32 ``[R, W]``, logical position -> slot; only selected entries are read.
    k : number of entries per row, >= 1.
    out : int32 ``[R, k]``, written (every entry).
    check_values : also check (a host sync, so not inside CUDA graphs) that every length fits
        ``W_out`` and ``W`` and, before a single launch, that the workspace's barrier counters
        are zero. Shapes, dtypes, devices and strides are always checked. With ``False`` the
        caller guarantees both.
    out_positions : optional int32 ``[R, k]``, written with the logical positions (``-1`` past
        the selection) in the same order as ``out``.
    baseline_read_short_rows : run rows with ``seqlens[r] <= k`` through the selection passes too, reading
        their logits (same result; the earlier kernel, kept as the benchmark's baseline). Only
        without a workspace.
    workspace : None, or contiguous int32 ``[R, P, TOPK_WORKSPACE_WORDS]`` from
        :func:`topk_workspace`: split each row over ``P`` programs (written; no value needed on
        entry except the barrier counter ``workspace[:, 0, TOPK_COUNTER_WORDS]``). The single
        launch needs the counter at zero on entry, else every program of the row waits forever
        (a hang, inside a graph replay too), and leaves it at zero: the caller allocates the
        workspace with ``topk_workspace`` (zeros), writes nothing else into it and runs one call
        at a time on it. ``check_values`` checks it before a single launch.
    single_launch : run the chunked form as one cooperative launch (True), as five launches
        (False), or as one where :func:`topk_single_launch_fits` and the driver accepts the
        cooperative grid (None: a refused grid takes the five launches, and so do later calls
        with at least that many programs). True needs it to fit (a refusal is then an error).
        (The runtime passes False when ``DSASPEC_TOPK_SINGLE_LAUNCH`` is off.)
    candidates : None, or int32 ``[R, C]`` (last dim contiguous) from :func:`topk_candidates`
        (with a workspace of ``P`` chunks: ``num_chunks=P``), ``C >= 2 P k``; not with
        ``baseline_read_short_rows``. Rows at least :func:`topk_sampled_min_live` long (with
        ``num_chunks=P``) select from candidate lists written there: a sample of every
        ``stride``-th logit bounds them, the row's full read happens once, to list the candidates
        (positions, then copies of their logits; with a workspace each chunk lists its own in its
        own ``C / P`` entries, and the chunk passes run over the lists). A row whose lists hold
        fewer than ``k`` positions in all, or more than ``C / (2 P)`` in one, falls back to the
        passes over the whole row (chunks). Same result bit for bit.

    Returns
    -------
    ``out``. Without a workspace: grid ``(R,)``, one launch; one program per row walks the live
    range at most five times (once, without reading logits, when ``seqlens[r] <= k``); with
    candidates, a long row's live range once, plus passes over its sample and its candidates. With
    one: five launches of grid ``(R, P)`` (six with candidates: the list pass first), or one (with
    candidates, of the kernel that also lists); a row's chunks are
    ``cdiv(seqlens[r], P)`` long (at least 1024 on the GPU, so short rows use fewer programs) and
    each program walks its chunk at most five times (once, without reading logits, when
    ``seqlens[r] <= k``; a sampled row's chunk once, then its list).
    """
    _check_inputs(logits, seqlens, page_table_1, k, out, out_positions, workspace, candidates)
    if candidates is not None and baseline_read_short_rows:
        raise ValueError("candidates: not with baseline_read_short_rows (the baseline form)")
    if candidates is not None and workspace is not None and (
            candidates.shape[1] < workspace.shape[1] * 2 * k):
        raise ValueError(f"candidates: expected at least 2 k = {2 * k} columns per chunk (k "
                         f"positions and their logits), {workspace.shape[1] * 2 * k} for "
                         f"{workspace.shape[1]} chunks "
                         f"(topk_candidates(..., num_chunks={workspace.shape[1]})), got shape "
                         f"{tuple(candidates.shape)}")
    if workspace is not None and baseline_read_short_rows:
        raise ValueError("baseline_read_short_rows: only without a workspace (the baseline form)")
    if single_launch is not None and workspace is None:
        raise ValueError("single_launch: only with a workspace (the chunked form)")
    required = single_launch is True  # a refused cooperative launch is an error
    if workspace is not None:
        fits = topk_single_launch_fits(logits.shape[0], workspace.shape[1], logits.device)
        if single_launch and not fits:
            raise ValueError(f"single_launch: needs a CUDA device, compiled kernels (not the "
                             f"Triton interpreter) and at most {SINGLE_LAUNCH_PROGRAMS_PER_SM} "
                             f"programs per SM, got {logits.shape[0]} rows x "
                             f"{workspace.shape[1]} chunks on {logits.device}")
        single_launch = fits if single_launch is None else single_launch
        if single_launch and check_values:
            _check_counters(workspace)
    if check_values:
        check_live_width(seqlens, logits=logits, page_table_1=page_table_1)
    write_positions = out_positions is not None
    positions = out_positions if write_positions else out
    on_gpu = logits.is_cuda
    args = (logits, seqlens, page_table_1, out, positions)
    strides = (logits.stride(0), page_table_1.stride(0), out.stride(0), positions.stride(0))
    # (without candidates the list pointer is never read and the sampling values unused)
    listed, stride, rank, min_live = out, 0, 0, 0
    if candidates is not None:
        stride = _sample_stride(logits.device)
        listed, rank, min_live = (candidates, topk_sample_rank(k, stride),
                                  topk_sampled_min_live(k, logits.device,
                                                        1 if workspace is None else workspace.shape[1]))
    sampled = dict(SAMPLED=candidates is not None,
                   LIST_BLOCK=_GPU_LIST_BLOCK if on_gpu else _CPU_LIST_BLOCK)
    if workspace is None:
        block = _GPU_BLOCK if on_gpu else _CPU_BLOCK
        # more rows than SMs: two programs per SM, so at most 128 registers a thread
        capped = on_gpu and candidates is not None and logits.shape[0] > sm_count(logits.device)
        chained = supports_pdl(logits.device)
        _topk_slots_kernel[(logits.shape[0],)](
            *args, listed, *strides, listed.stride(0), k, -1 if baseline_read_short_rows else k,
            listed.shape[1] // 2, rank, stride, min_live,  # positions, then their logits
            WRITE_POSITIONS=write_positions, BLOCK=block,
            BLOCK_K=min(block, triton.next_power_of_2(k)), **sampled, CHAINED=chained, launch_pdl=chained,
            num_warps=8 if on_gpu else 4, **({"maxnreg": _LISTS_CAPPED_REGISTERS} if capped else {}))
        return out
    num_chunks = workspace.shape[1]
    chunked = dict(MIN_CHUNK=_GPU_MIN_CHUNK if on_gpu else _CPU_MIN_CHUNK,
                   BLOCK=_GPU_CHUNK_BLOCK if on_gpu else _CPU_CHUNK_BLOCK,
                   TILE=_GPU_TILE if on_gpu else _CPU_TILE, WRITE_POSITIONS=write_positions,
                   num_warps=_CHUNK_WARPS)
    grid = (logits.shape[0], num_chunks)
    # each chunk of a sampled row lists its candidates (positions, then their logits) in its own
    # region of the row's list
    region = listed.shape[1] // num_chunks
    list_args = (listed, *strides, listed.stride(0), k, num_chunks, region, rank, stride, min_live)
    if single_launch:
        if candidates is None:
            kernel, kernel_args, options = (_topk_chunk_single_launch_kernel,
                                            (*args, workspace, *strides, k, num_chunks), chunked)
        else:
            cap = {"maxnreg": _SINGLE_LAUNCH_MAX_REGISTERS} if on_gpu else {}
            kernel, kernel_args, options = (_topk_chunk_lists_kernel,
                                            (*args, workspace, *list_args),
                                            dict(chunked, LIST_BLOCK=sampled["LIST_BLOCK"], **cap))
        if _cooperative_launch(kernel, grid, kernel_args, options, logits.device, required):
            return out
    chained = supports_pdl(logits.device)
    for pass_index in ([int(_LIST_PASS)] if candidates is not None else []) + list(range(_PASSES)):
        _topk_chunk_pass_kernel[grid](*args, workspace, *list_args, PASS=pass_index, CHAINED=chained,
                                      launch_pdl=chained, **sampled, **chunked)
    return out


# per (kernel name, device index): the smallest cooperative grid (programs) the driver refused
_REFUSED_GRIDS: dict[tuple[str, int | None], int] = {}


def _cooperative_launch(kernel, grid, args, options, device, required: bool) -> bool:
    """Launch ``kernel`` over ``grid`` as one cooperative grid. Unless ``required``, a grid the
    driver refuses (this one, or one no larger before on this device) launches nothing and
    returns False, so the caller takes the five launches; the refusal recorded in the eager
    warm-up keeps a later graph capture off the cooperative launch."""
    key, programs = (kernel.__name__, torch.device(device).index), grid[0] * grid[1]
    if not required and programs >= _REFUSED_GRIDS.get(key, programs + 1):
        return False
    try:
        kernel[grid](*args, launch_cooperative_grid=True, **options)
    except RuntimeError as error:  # CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE
        if required or "cooperative launch" not in str(error):
            raise
        _REFUSED_GRIDS[key] = min(programs, _REFUSED_GRIDS.get(key, programs))
        return False
    return True


def _check_counters(workspace: torch.Tensor) -> None:
    """Value check (host sync) of the single launch's entry condition: every row's barrier
    counter is zero."""
    counters = workspace[:, 0, TOPK_COUNTER_WORDS].flatten()
    if bool(counters.any()):
        row = int(counters.nonzero()[0])
        raise ValueError(f"workspace: the barrier counter workspace[{row}, 0, "
                         f"TOPK_COUNTER_WORDS] is {int(counters[row])}, expected 0 on entry to "
                         f"the single launch (topk_workspace allocates it zero and every call "
                         f"leaves it zero; the workspace was written elsewhere or used by two "
                         f"calls at once)")


def _sample_stride(device) -> int:
    return _GPU_SAMPLE_STRIDE if torch.device(device).type == "cuda" else _CPU_SAMPLE_STRIDE


def topk_sample_rank(k: int, stride: int) -> int:
    """Rank of the sample key that bounds the candidates: ``ceil(1.5 k / stride) + SAMPLE_MARGIN``
    (about ``1.5 k + SAMPLE_MARGIN * stride`` candidates on a row in random order)."""
    return -(-3 * k // (2 * stride)) + SAMPLE_MARGIN


def topk_list_capacity(k: int, device) -> int:
    """Positions a candidate list holds for ``k`` on ``device``: twice the expected candidates,
    ``2 * topk_sample_rank(k, stride) * stride`` (stride 32 on CUDA, 4 under the interpreter)."""
    stride = _sample_stride(device)
    return 2 * topk_sample_rank(k, stride) * stride


def topk_candidates_width(k: int, device) -> int:
    """int32 entries of one candidate list: :func:`topk_list_capacity` positions, then as many
    fp32 logits (their copies, so the passes over the list read them in order)."""
    return 2 * topk_list_capacity(k, device)


def topk_sampled_min_live(k: int, device, num_chunks: int = 1) -> int:
    """Shortest row that takes the sampled form with ``num_chunks`` chunks a row (1: the
    one-program form): twice the capacity (candidates then expected to be at most a quarter of the
    row; shorter rows take the whole-row passes, which were faster on the H200 at 8k with k =
    2048: 26.0 against 35.4 µs at 4 rows), and with chunks, chunks of at least 2048 positions
    (64 under the interpreter)."""
    min_chunk = _GPU_LISTS_MIN_CHUNK if torch.device(device).type == "cuda" else _CPU_LISTS_MIN_CHUNK
    return max(2 * topk_list_capacity(k, device), min_chunk * num_chunks if num_chunks > 1 else 0)


def topk_candidates(num_rows: int, k: int, device,
                    num_chunks: int = 1) -> torch.Tensor | None:
    """Allocate the candidate lists of :func:`topk_slots` (``candidates``) for a bucket of
    ``num_rows`` rows, this ``k`` and ``num_chunks`` (the workspace's chunks per row; 1: the
    one-program form), once, before capture; calls with that many rows may reuse it, one at a
    time. None above :data:`TOPK_LISTS_MAX_CHUNKS` chunks (few rows: there the lists cost more
    than they save).

    Returns
    -------
    int32 ``[num_rows, num_chunks * topk_candidates_width(k, device)]`` (uninitialised: each
    call writes the entries it reads): a list of that width per chunk; or None. ``num_rows``,
    ``k`` and ``num_chunks`` must be ints >= 1 (else a ``TypeError`` / ``ValueError`` naming the
    argument).
    """
    for name, value in (("num_rows", num_rows), ("k", k), ("num_chunks", num_chunks)):
        check_count(name, value)
    if num_chunks > TOPK_LISTS_MAX_CHUNKS:
        return None
    return torch.empty(num_rows, num_chunks * topk_candidates_width(k, device),
                       dtype=torch.int32, device=device)


def topk_single_launch_fits(num_rows: int, num_chunks: int, device) -> bool:
    """Whether the chunked form of ``num_rows`` rows of ``num_chunks`` chunks may run as one
    cooperative launch on ``device``: a CUDA device, compiled kernels (the Triton interpreter
    runs one program after another, so a program waiting at a barrier for its row's next one
    would wait forever), and at most ``SINGLE_LAUNCH_PROGRAMS_PER_SM`` programs per SM (so every
    program can be resident at once; the driver may still refuse the grid, see
    :func:`topk_slots`). With compiled kernels on CUDA the default chunk count
    (:func:`topk_num_chunks`) always passes."""
    device = torch.device(device)
    return (device.type == "cuda" and not interpreted(_topk_chunk_single_launch_kernel)
            and num_rows * num_chunks <= SINGLE_LAUNCH_PROGRAMS_PER_SM * sm_count(device))


def _check_inputs(logits, seqlens, page_table_1, k, out, out_positions, workspace,
                 candidates) -> None:
    if k < 1:
        raise ValueError(f"k: expected >= 1, got {k}")
    check_tensor("logits", logits, dtype=torch.float32, ndim=2)
    num_rows = logits.shape[0]
    device = logits.device
    check_tensor("seqlens", seqlens, dtype=torch.int32, shape=(num_rows,), device=device)
    check_tensor("page_table_1", page_table_1, dtype=torch.int32, shape=(num_rows, None),
                 device=device)
    if num_rows > 1 and seqlens.stride(0) != 1:
        raise ValueError("seqlens: expected a contiguous tensor")
    check_tensor("out", out, dtype=torch.int32, shape=(num_rows, k), device=device)
    if out_positions is not None:
        check_tensor("out_positions", out_positions, dtype=torch.int32, shape=(num_rows, k),
                     device=device)
    if workspace is not None:
        check_tensor("workspace", workspace, dtype=torch.int32,
                     shape=(num_rows, None, TOPK_WORKSPACE_WORDS), device=device)
        if not workspace.is_contiguous() or not 1 <= workspace.shape[1] <= 65535:
            raise ValueError(f"workspace: expected a contiguous [R, P, {TOPK_WORKSPACE_WORDS}] "
                             f"tensor with 1 <= P <= 65535 (topk_workspace), got shape "
                             f"{tuple(workspace.shape)}")
    if candidates is not None:
        check_tensor("candidates", candidates, dtype=torch.int32, shape=(num_rows, None),
                     device=device)
        if candidates.shape[1] < 2 * k:
            raise ValueError(f"candidates: expected at least 2 k = {2 * k} columns (k positions "
                             f"and their logits; topk_candidates), got shape "
                             f"{tuple(candidates.shape)}")
