"""Indexer work schedule: split every row's live 64-token KV blocks evenly over the SMs.

The lightning-indexer logits kernel (``dsaspec.ops.indexer``) runs one program per SM; program
``i`` walks the (row, block) pairs from ``schedule[i]`` up to, not including, ``schedule[i + 1]``.
The schedule depends only on the lengths, so it is rebuilt in the graph (one program, no host
sync) whenever the lengths change. Rows no longer than ``skip_len`` (the top-k: there sparse
attention equals dense, so their logits are not needed) get no blocks, decided per row on the
device. With ``rows_per_group = G > 1`` the unit is a group of ``G`` consecutive rows sharing one
page table (the N rows of a target-verify request), so the indexer reads each key block once for
all of them (docs/dsa-kernels.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaspec.ops.checks import check_tensor
from dsaspec.ops.device import sm_count

INDEXER_BLOCK_KV = 64  # KV tokens per indexer block; the schedule and the logits kernel agree on it
_MAX_TILE = 8192  # elements of the (SMs x rows) comparison tile the schedule kernel holds at once
# Resident indexer programs per SM hide each other's key gathers: two took 0.64-0.79x the time of one
# at 8k-64k live tokens (benchmarks/results/h200/dsa_ops_tune_wide.md), three 0.84-0.94x the time of
# two at 16-64 decode rows, on bf16 and FP8 keys (dsa_ops_tune_fp8_indexer.md; H200).
PROGRAMS_PER_SM = 3
SMS_WITHOUT_CUDA = 4  # off-GPU (the interpreter): a small schedule of PROGRAMS_PER_SM * 4 programs


def indexer_programs(device: torch.device | str, programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """Schedule entries, i.e. indexer programs, for ``device``: ``programs_per_sm`` (a launch
    configuration's, ``IndexerConfig.programs_per_sm``; default :data:`PROGRAMS_PER_SM`) times its SM
    count (:data:`SMS_WITHOUT_CUDA` off-GPU). Pass it as ``num_sms`` to :func:`indexer_schedule` and
    size the schedule ``[programs + 1, 2]``."""
    if programs_per_sm < 1:
        raise ValueError(f"programs_per_sm: expected >= 1, got {programs_per_sm}")
    return programs_per_sm * sm_count(device, without_cuda=SMS_WITHOUT_CUDA)


@triton.jit
def _indexer_schedule_kernel(seqlens_ptr, out_ptr, num_rows, num_sms, skip_len,
                             GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
                             BLOCK_KV: tl.constexpr, BLOCK_R: tl.constexpr,
                             BLOCK_S: tl.constexpr):
    # `rows` below are groups of GROUP consecutive query rows (one row each when GROUP == 1); a
    # group's length is its longest member that is longer than skip_len
    rows = tl.arange(0, BLOCK_R)
    real_row = rows < num_rows
    members = tl.arange(0, GROUP_P2)
    member_lengths = tl.load(seqlens_ptr + rows[:, None] * GROUP + members[None, :],
                             mask=real_row[:, None] & (members[None, :] < GROUP), other=0)
    member_lengths = tl.where(member_lengths > skip_len, member_lengths, 0)
    lengths = tl.max(member_lengths, 1)
    blocks = (lengths + BLOCK_KV - 1) // BLOCK_KV
    blocks_through = tl.cumsum(blocks, 0)  # blocks of rows 0..r inclusive
    total = tl.sum(blocks, 0)
    share = total // num_sms
    extra = total % num_sms  # the first `extra` SMs take one block more
    for first_sm in range(0, num_sms + 1, BLOCK_S):
        sms = first_sm + tl.arange(0, BLOCK_S)
        start = sms * share + tl.minimum(sms, extra)  # == total for sms == num_sms
        # A row lies wholly before `start` when all its blocks end at or before it; the SM starts
        # in the first row that does not (zero-length rows there are skipped), or at num_rows.
        before = (blocks_through[None, :] <= start[:, None]) & real_row[None, :]
        start_row = tl.sum(before.to(tl.int32), 1)
        start_block = start - tl.sum(tl.where(before, blocks[None, :], 0), 1)
        on_grid = sms <= num_sms
        tl.store(out_ptr + sms * 2, start_row, mask=on_grid)
        tl.store(out_ptr + sms * 2 + 1, start_block, mask=on_grid)


def indexer_schedule(seqlens: torch.Tensor, num_sms: int, out: torch.Tensor,
                     block_kv: int = INDEXER_BLOCK_KV, skip_len: int = 0,
                     rows_per_group: int = 1) -> torch.Tensor:
    """Split the live KV blocks of the rows longer than ``skip_len`` evenly over ``num_sms`` SMs.

    Units are groups of ``G = rows_per_group`` consecutive rows (rows themselves for ``G = 1``).
    Group ``u`` has ``cdiv(L_u, block_kv)`` blocks, ``L_u`` = the longest of its rows with
    ``seqlens[r] > skip_len`` (0 if none; negative lengths count as 0); ``total`` is their sum.
    SM ``i`` owns global blocks ``[g_i, g_{i+1})`` with
    ``g_i = i * (total // num_sms) + min(i, total % num_sms)``, blocks numbered unit-major over
    (unit, block within unit).

    Parameters
    ----------
    seqlens : int32 ``[R]``, the causal length of each query row (``seqlens_expanded``).
    num_sms : number of indexer programs (one per SM), >= 1.
    out : int32 ``[num_sms + 1, 2]``, written: ``out[i] = (unit, block within unit)`` where SM
        ``i``'s share starts (the first unit that has blocks left at ``g_i``), and
        ``out[num_sms] = (R / G, 0)``.
    block_kv : KV tokens per block (the indexer kernel's block, 64).
    skip_len : rows with ``seqlens[r] <= skip_len`` get no blocks, so ``indexer_logits`` leaves
        their logits unwritten. Pass the top-k (``index_topk``): ``topk_slots`` selects every
        live position of such rows without reading logits. 0 (default): every live row is
        scheduled (the behaviour before the skip; the benchmark's baseline). >= 0.
    rows_per_group : ``G >= 1`` dividing ``R``; pass the same value to ``indexer_logits``. ``G > 1``
        (target verify: N) needs the rows of a group to share their page-table prefix.

    Returns
    -------
    ``out``. One program, no host sync, no allocation: safe inside a CUDA graph.
    """
    if num_sms < 1:
        raise ValueError(f"num_sms: expected >= 1, got {num_sms}")
    if block_kv < 1:
        raise ValueError(f"block_kv: expected >= 1, got {block_kv}")
    if skip_len < 0:
        raise ValueError(f"skip_len: expected >= 0, got {skip_len}")
    check_tensor("seqlens", seqlens, dtype=torch.int32, ndim=1)
    check_rows_per_group(rows_per_group, seqlens.shape[0])
    check_tensor("out", out, dtype=torch.int32, shape=(num_sms + 1, 2), device=seqlens.device)
    if not out.is_contiguous():
        raise ValueError("out: expected a contiguous [num_sms + 1, 2] tensor")
    if seqlens.shape[0] > 1 and seqlens.stride(0) != 1:
        raise ValueError("seqlens: expected a contiguous tensor")
    num_units = seqlens.shape[0] // rows_per_group
    block_r = triton.next_power_of_2(max(num_units, 1))
    block_s = max(1, min(triton.next_power_of_2(num_sms + 1), _MAX_TILE // block_r))
    _indexer_schedule_kernel[(1,)](seqlens, out, num_units, num_sms, skip_len,
                                   GROUP=rows_per_group,
                                   GROUP_P2=triton.next_power_of_2(rows_per_group),
                                   BLOCK_KV=block_kv, BLOCK_R=block_r, BLOCK_S=block_s)
    return out


def check_rows_per_group(rows_per_group: int, num_rows: int) -> None:
    """Raise a ``ValueError`` unless ``rows_per_group`` is >= 1 and divides ``num_rows``."""
    if rows_per_group < 1 or num_rows % rows_per_group:
        raise ValueError(f"rows_per_group: expected a divisor >= 1 of the {num_rows} rows, got "
                         f"{rows_per_group}")
