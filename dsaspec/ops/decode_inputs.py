"""A decode step's inputs from its rows in one kernel (Triton), bit for bit the torch ops of
:meth:`dsaspec.executor.decode_worker.DecodeWorker._gather` (two ``index_select``, an add, the
``req_to_token`` gather and its int64 copy: five launches). For each of the ``n`` rows ``i``, with
``r = rows[i]`` a ``req_to_token`` row:

    positions[i]     = carry_lens[r]                 (the pending token's position ``L``)
    input_ids[i]     = carry_tokens[r]               (the pending token)
    seq_lens[i]      = positions[i] + 1
    out_cache_loc[i] = int64(req_to_token[r, positions[i]])

Precondition, not checked on the device: every ``rows[i]`` is a row of the table and every
``carry_lens[rows[i]]`` a column of it (the workers check the rows on the host before a step;
``check_values=True`` checks both here, with a host sync, for eager and test callers). Out-of-range
values read out of bounds. No host sync otherwise, nothing allocated: CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaspec.ops.checks import check_tensor

_BLOCK = 128   # rows per program
_TABLE_DTYPES = (torch.int32, torch.int64)


@triton.jit(do_not_specialize=["n"])
def _decode_inputs_kernel(rows_ptr, lens_ptr, tokens_ptr, table_ptr, positions_ptr, input_ids_ptr, seq_lens_ptr,
                          loc_ptr, n, stride_table, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = i < n
    row = tl.load(rows_ptr + i, mask=live, other=0)
    position = tl.load(lens_ptr + row, mask=live, other=0)
    token = tl.load(tokens_ptr + row, mask=live, other=0)
    slot = tl.load(table_ptr + row * stride_table + position, mask=live, other=0)
    tl.store(positions_ptr + i, position, mask=live)
    tl.store(input_ids_ptr + i, token, mask=live)
    tl.store(seq_lens_ptr + i, position + 1, mask=live)
    tl.store(loc_ptr + i, slot.to(tl.int64), mask=live)


def decode_inputs(rows: torch.Tensor, carry_lens: torch.Tensor, carry_tokens: torch.Tensor,
                  req_to_token: torch.Tensor, positions: torch.Tensor, input_ids: torch.Tensor,
                  seq_lens: torch.Tensor, out_cache_loc: torch.Tensor, *, check_values: bool = False) -> None:
    """One launch writing a decode step's ``positions``, ``input_ids``, ``seq_lens`` and
    ``out_cache_loc`` (int64 ``[n]`` each, contiguous) from ``rows`` (int64 ``[n]``, rows of
    ``req_to_token``): the formulas of the module docstring. ``carry_lens`` / ``carry_tokens``:
    int64 ``[table_rows]``, the rows' committed lengths and pending tokens; ``req_to_token``: int32
    or int64 ``[table_rows, W]``, last dimension contiguous; all on one device. ``rows`` must not
    alias an output. ``check_values``: raise ``ValueError`` naming ``rows`` / ``carry_lens`` when a
    row or a position is out of the table (a host sync); otherwise they are a device-side
    precondition."""
    check_tensor("rows", rows, dtype=torch.int64, ndim=1)
    device, n = rows.device, rows.shape[0]
    check_tensor("req_to_token", req_to_token, dtype=_TABLE_DTYPES, ndim=2, device=device)
    table_rows, width = req_to_token.shape
    for name, tensor in (("carry_lens", carry_lens), ("carry_tokens", carry_tokens)):
        check_tensor(name, tensor, dtype=torch.int64, shape=(table_rows,), device=device)
    for name, tensor in (("positions", positions), ("input_ids", input_ids), ("seq_lens", seq_lens),
                         ("out_cache_loc", out_cache_loc)):
        check_tensor(name, tensor, dtype=torch.int64, shape=(n,), device=device)
    if check_values and n:
        if not bool(((rows >= 0) & (rows < table_rows)).all()):
            raise ValueError(f"rows: every row must lie in [0, {table_rows}) (the req_to_token rows), got "
                             f"{rows.min().item()} .. {rows.max().item()}")
        lens = carry_lens[rows]
        if not bool(((lens >= 0) & (lens < width)).all()):
            raise ValueError(f"carry_lens: the rows' positions must lie in [0, {width}) (the req_to_token "
                             f"width), got {lens.min().item()} .. {lens.max().item()}")
    if n:
        _decode_inputs_kernel[(triton.cdiv(n, _BLOCK),)](
            rows, carry_lens, carry_tokens, req_to_token, positions, input_ids, seq_lens, out_cache_loc, n,
            req_to_token.stride(0), BLOCK=_BLOCK)
