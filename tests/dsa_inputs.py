"""Random inputs for the DSA decode ops' tests (indexer, top-k, sparse MLA)."""

from __future__ import annotations

import torch

POISON_SLOT = 2**30  # a slot id far out of range: page-table entries that must never be read


def random_indexer_inputs(seqlens: list[int], num_heads: int, width: int, num_slots: int,
                          device, seed: int = 0, poison: int = POISON_SLOT,
                          rows_per_group: int = 1) -> dict:
    """Random inputs for ``indexer_logits``: bf16 queries and keys, fp32 weights (scale folded
    in), a page table whose live prefixes hold random (repeating) slots and whose tails hold
    ``poison`` (an out-of-range slot id that must never be read). With ``rows_per_group`` G the
    rows of each group share one random prefix; the group's first row holds it up to the longest
    member (what the kernel reads), the others only up to their own length."""
    gen = torch.Generator().manual_seed(seed)
    rows = len(seqlens)
    page_table = torch.full((rows, width), poison, dtype=torch.int32)
    for first in range(0, rows, rows_per_group):
        members = [max(length, 0) for length in seqlens[first:first + rows_per_group]]
        shared = torch.randint(0, num_slots, (max(members),), generator=gen, dtype=torch.int32)
        page_table[first, :shared.numel()] = shared
        for offset, length in enumerate(members[1:], start=1):
            page_table[first + offset, :length] = shared[:length]
    return dict(
        q=torch.randn(rows, num_heads, 128, generator=gen).to(torch.bfloat16).to(device),
        weights=(torch.randn(rows, num_heads, generator=gen)
                 * (128 * num_heads) ** -0.5).to(device),
        k_cache=torch.randn(num_slots, 128, generator=gen).to(torch.bfloat16).to(device),
        page_table_1=page_table.to(device),
        seqlens=torch.tensor(seqlens, dtype=torch.int32, device=device),
    )


def random_sparse_mla_inputs(num_rows: int, num_heads: int, num_slots: int, k: int,
                             valid_counts: list[int], device, seed: int = 0) -> dict:
    """Random inputs for ``sparse_mla_decode``: bf16 queries and cache, and per row
    ``valid_counts[r]`` random (repeating) slots followed by ``-1``."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.full((num_rows, k), -1, dtype=torch.int32)
    for row, count in enumerate(valid_counts):
        slots[row, :count] = torch.randint(0, num_slots, (count,), generator=gen,
                                           dtype=torch.int32)
    return dict(
        q=torch.randn(num_rows, num_heads, 576, generator=gen).to(torch.bfloat16).to(device),
        kv_cache=torch.randn(num_slots, 576, generator=gen).to(torch.bfloat16).to(device),
        slots=slots.to(device),
        sm_scale=576 ** -0.5,
    )


def poison_unselected(inputs: dict) -> dict:
    """The same ``sparse_mla_decode`` inputs with NaN in every cache row no slot points at:
    reading one would poison the output."""
    kv_cache = inputs["kv_cache"].clone()
    selected = torch.zeros(kv_cache.shape[0], dtype=torch.bool, device=kv_cache.device)
    selected[inputs["slots"][inputs["slots"] >= 0].long()] = True
    kv_cache[~selected] = float("nan")
    return dict(inputs, kv_cache=kv_cache)


def production_sparse_mla_inputs(num_rows: int, num_heads: int, seed: int, k: int = 2048,
                                 num_slots: int = 1 << 17) -> dict:
    """CUDA ``sparse_mla_decode`` inputs of production width: random valid counts in ``[0, k]``,
    the first row full, the last (when ``num_rows > 1``) a one-slot padding row."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, k + 1, (num_rows,), generator=gen)
    counts[0] = k
    if num_rows > 1:
        counts[-1] = 1
    return random_sparse_mla_inputs(num_rows, num_heads, num_slots=num_slots, k=k,
                                    valid_counts=counts.tolist(), device="cuda", seed=num_heads)


def to_cpu(inputs: dict) -> dict:
    """The same inputs with every tensor on the CPU (for the references)."""
    return {name: value.cpu() if torch.is_tensor(value) else value
            for name, value in inputs.items()}


SENTINEL = 12345.0  # what the indexer tests' ``out`` holds before the call


def launch_indexer(inputs: dict, num_sms: int, out_width: int, skip_len=0, config=None, check_values=True,
                   rows_per_group=1) -> torch.Tensor:
    """``indexer_logits`` over ``inputs`` (bf16 or FP8 keys) with its schedule for ``num_sms``
    programs, into ``[rows, out_width]`` logits prefilled with :data:`SENTINEL`; ``config`` None:
    the op's default for the cache dtype."""
    from dsaspec.ops.indexer import indexer_logits
    from dsaspec.ops.indexer_schedule import indexer_schedule

    seqlens = inputs["seqlens"]
    schedule = torch.zeros(num_sms + 1, 2, dtype=torch.int32, device=seqlens.device)
    indexer_schedule(seqlens, num_sms, schedule, skip_len=skip_len, rows_per_group=rows_per_group)
    out = torch.full((seqlens.numel(), out_width), SENTINEL, device=seqlens.device)
    indexer_logits(**inputs, schedule=schedule, out=out, skip_len=skip_len,
                   rows_per_group=rows_per_group, check_values=check_values, config=config)
    return out


def random_tiny_indexer(dtype: torch.dtype, seed: int, rows: int):
    """The ``tiny`` preset's Indexer with parameters drawn normal (std 0.1) and its inputs ``x``
    ``[rows, hidden]`` and ``q_latent`` ``[rows, q_lora_rank]`` standard normal, all in ``dtype``,
    from one generator seeded ``seed`` (in that order). Returns ``(config, indexer, x, q_latent,
    generator)``; the generator continues the stream for the caller's further draws."""
    from dsaspec.configs.model_config import get_config
    from dsaspec.layers.attention.mla import Indexer

    config = get_config("tiny")
    gen = torch.Generator().manual_seed(seed)
    indexer = Indexer(config, dtype=dtype)
    for param in indexer.parameters():
        param.data.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    x = torch.randn(rows, config.hidden_size, generator=gen).to(dtype)
    q_latent = torch.randn(rows, config.q_lora_rank, generator=gen).to(dtype)
    return config, indexer, x, q_latent, gen


OUT_SENTINEL = 7.0  # what a wide output buffer holds where no head of the launch may write


def sentinel_out_and_workspace(rows: int, num_heads: int, num_splits: int | None, record_width: int,
                               heads: int = 64, device="cuda"):
    """A sparse-MLA launch's buffers that show stray writes: ``out`` a view of the first
    ``num_heads`` heads of a bf16 ``[rows, max(heads, num_heads), 512]`` buffer filled with
    :data:`OUT_SENTINEL`, and (``num_splits`` not None) the workspace the first ``rows`` rows of a
    NaN fp32 buffer one row longer. Returns ``(wide_out, out, workspace, tail)`` (``workspace``,
    ``tail`` None without splits); :func:`assert_nothing_written_outside` checks them after."""
    wide_out = torch.full((rows, max(heads, num_heads), 512), OUT_SENTINEL, dtype=torch.bfloat16, device=device)
    workspace = tail = None
    if num_splits is not None:
        records = torch.full((rows + 1, num_heads, num_splits, record_width), float("nan"), device=device)
        workspace, tail = records[:rows], records[rows:]
    return wide_out, wide_out[:, :num_heads], workspace, tail


def assert_nothing_written_outside(wide_out: torch.Tensor, num_heads: int, tail: torch.Tensor | None) -> None:
    """The heads beyond ``num_heads`` still hold the sentinel and the row after the workspace is
    still NaN."""
    assert torch.equal(wide_out[:, num_heads:], torch.full_like(wide_out[:, num_heads:], OUT_SENTINEL))
    if tail is not None:
        assert tail.isnan().all()
