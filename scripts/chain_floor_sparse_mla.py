"""What the sparse MLA split path costs without its math (GLM-5 shapes: 64 heads, 576-wide keys,
k = 2048, cold L2, CUDA graphs), at one row (decode) and at one verify request (4 rows sharing
their prefix): a skeleton split kernel with the op's default launch for that many rows (grid
``(R, heads / block_h, splits)``, the same warps) that loads what a split program loads, in the
same order and with the same dependences (its heads' queries, the row's slot ids for the
last-valid scan, its block's ids, the gathered cache rows) and writes a record of the same size,
then the real combine kernel as a programmatic dependent launch. No dots, no softmax: its time
is what this split + combine decomposition costs in memory steps and launches alone, the bound
for any kernel pair of this shape at the point. The verify point runs at several split counts,
the op beside the skeleton at each. Next to it: the real op, an empty kernel and a copy of the
point's bytes. Writes ``chain_floor_sparse_mla.json`` into the folder given.

    python3 scripts/chain_floor_sparse_mla.py $OUT    # on a GPU
    python3 scripts/chain_floor_sparse_mla.py         # without one: run both kernels once (interpreter)
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

if not torch.cuda.is_available():  # Triton's interpreter, which must be chosen before its import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.language.extra.cuda import gdc_launch_dependents  # noqa: E402

from dsaspec.bench.timing import copy_time_us, empty_kernel_us, time_in_graph, warm_up_gpu  # noqa: E402
from dsaspec.ops import sparse_mla  # noqa: E402
from dsaspec.ops.device import supports_pdl  # noqa: E402
from dsaspec.ops.sparse_mla import (LATENT_DIM, QK_DIM, RECORD_WIDTH, ROPE_DIM,  # noqa: E402
                                    sparse_mla_config, sparse_mla_decode, sparse_mla_workspace)

HEADS, K = 64, 2048
# point -> (rows, live tokens, split counts to run; None: the op's default)
POINTS = {"decode_bs1_1k": (1, 1024, (None,)), "decode_bs1_64k": (1, 65536, (None,)),
          "verify_bs1_1k": (4, 1024, (None, 4, 8, 32))}


@triton.jit
def _skeleton_split_kernel(q_ptr, kv_ptr, slots_ptr, workspace_ptr, q_stride_row, q_stride_head,
                           kv_stride, slots_stride, num_heads, topk, LATENT: tl.constexpr,
                           ROPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                           SCAN: tl.constexpr, RECORD: tl.constexpr, PDL: tl.constexpr):
    """Row ``pid(0)``, heads ``pid(1) * BLOCK_H ..``, split ``pid(2)``: the split program's loads
    and its record store; the record holds column sums of the gathered rows plus each head's
    query sum (a value that needs every load), the log-sum 0. Only the first of the split's slot
    blocks is gathered: at most what the op loads, so the skeleton's time is a lower bound,
    tight where a split has one block (at 1k live with 16 or more splits)."""
    if PDL:
        gdc_launch_dependents()
    row = tl.program_id(0)
    q_ptr += row * q_stride_row
    slots_ptr += row * slots_stride
    workspace_ptr += row * num_heads * tl.num_programs(2) * RECORD
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    latent = tl.arange(0, LATENT)
    q_row = q_ptr + heads[:, None] * q_stride_head
    q_latent = tl.load(q_row + latent[None, :])
    q_rope = tl.load(q_row + LATENT + tl.arange(0, ROPE)[None, :])
    index = tl.arange(0, SCAN)
    ids = tl.load(slots_ptr + index, mask=index < topk, other=-1)
    last_valid = tl.max(tl.where(ids >= 0, index, -1), 0)
    split = tl.program_id(2)
    num_blocks = tl.cdiv(last_valid + 1, BLOCK_N)
    block = split * tl.cdiv(num_blocks, tl.num_programs(2))
    position = block * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + position, mask=(position < topk) & (block < num_blocks), other=-1)
    valid = slot >= 0
    kv_row = kv_ptr + tl.where(valid, slot, 0).to(tl.int64)[:, None] * kv_stride
    kv_latent = tl.load(kv_row + latent[None, :], mask=valid[:, None], other=0.0)
    kv_rope = tl.load(kv_row + LATENT + tl.arange(0, ROPE)[None, :], mask=valid[:, None],
                      other=0.0)
    per_head = tl.sum(q_latent.to(tl.float32), 1) + tl.sum(q_rope.to(tl.float32), 1)
    columns = tl.sum(kv_latent.to(tl.float32), 0) + tl.sum(tl.sum(kv_rope.to(tl.float32), 0), 0)
    record = workspace_ptr + (heads * tl.num_programs(2) + split) * RECORD
    tl.store(record[:, None] + latent[None, :], per_head[:, None] + columns[None, :])
    tl.store(record + LATENT, tl.zeros((BLOCK_H,), dtype=tl.float32))


def _inputs(rows: int, live: int, device) -> dict:
    """``rows`` rows of one request: row ``r`` sees ``live - rows + 1 + r`` tokens, and every row
    selects the same slots for the prefix they share (as top-k does while live <= k)."""
    gen = torch.Generator(device=device).manual_seed(live)
    num_slots = 1 << 20
    slots = torch.full((rows, K), -1, dtype=torch.int32, device=device)
    count = min(live, K)
    shared = torch.randperm(num_slots, device=device, generator=gen)[:count].int()
    for row in range(rows):
        seen = min(live - rows + 1 + row, K)
        slots[row, :seen] = shared[:seen]
    return dict(q=torch.randn(rows, HEADS, QK_DIM, device=device, generator=gen).bfloat16(),
                kv=torch.randn(num_slots, QK_DIM, device=device, generator=gen).bfloat16(),
                slots=slots, out=torch.empty(rows, HEADS, LATENT_DIM, device=device,
                                             dtype=torch.bfloat16), count=count)


def _skeleton(x: dict, workspace: torch.Tensor):
    """The skeleton split kernel, then the real combine, launched as the op launches them."""
    rows = x["q"].shape[0]
    config = sparse_mla_config(rows, HEADS, split=True)
    if config.block_dv != LATENT_DIM:
        raise ValueError(f"the skeleton loads every value column; {rows} rows take block_dv "
                         f"{config.block_dv}")
    pdl = supports_pdl(x["q"].device)

    def run():
        _skeleton_split_kernel[(rows, HEADS // config.block_h, workspace.shape[2])](
            x["q"], x["kv"], x["slots"], workspace, x["q"].stride(0), x["q"].stride(1),
            x["kv"].stride(0), x["slots"].stride(0), HEADS, K, LATENT=LATENT_DIM, ROPE=ROPE_DIM,
            BLOCK_H=config.block_h, BLOCK_N=config.block_n, SCAN=K, RECORD=RECORD_WIDTH, PDL=pdl,
            num_warps=config.num_warps)
        sparse_mla._combine(workspace, x["out"], pdl)
    return run


def _total_us(fn) -> float:
    return time_in_graph(fn, iters=100, graph_diff=False).median_us


def main() -> int:
    parser = argparse.ArgumentParser(description="The sparse MLA split path without its math.")
    parser.add_argument("out", nargs="?", type=Path, default=Path("."),
                        help="folder for chain_floor_sparse_mla.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        for rows in (1, 2):
            x = _inputs(rows, 64, "cpu")
            _skeleton(x, sparse_mla_workspace(rows, HEADS, "cpu"))()
        print("chain_floor_sparse_mla: both kernels ran under the interpreter (no timing without CUDA)")
        return 0
    warm_up_gpu()
    results = [dict(part="empty_kernel", us=empty_kernel_us())]
    for point, (rows, live, split_counts) in POINTS.items():
        x = _inputs(rows, live, torch.device("cuda"))
        moved = x["count"] * QK_DIM * 2 + x["q"].numel() * 2 + x["out"].numel() * 2
        copy_us = copy_time_us(moved)
        for splits in split_counts:
            workspace = sparse_mla_workspace(rows, HEADS, x["q"].device, num_splits=splits)

            def real():
                sparse_mla_decode(x["q"], x["kv"], x["slots"], QK_DIM ** -0.5, x["out"],
                                  check_values=False, workspace=workspace)
            row = dict(part="point", point=point, rows=rows, splits=workspace.shape[2],
                       default_splits=splits is None, bytes=moved, copy_us=copy_us,
                       skeleton_us=_total_us(_skeleton(x, workspace)), op_us=_total_us(real))
            results.append(row)
            print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "chain_floor_sparse_mla.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
