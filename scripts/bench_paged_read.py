"""What the FP8 indexer's key reads cost by themselves: the decode point of ``bench dsa-ops --kv-cache-dtype
fp8_e4m3`` (bs rows of ``live`` keys, every row's pages a slice of one random permutation of the pool) read by a
pure paged-read kernel, against the same kernel over the pages in pool order and against the indexer itself.

The read kernel has the indexer's shape without its math: persistent programs, each walking its share of the page
list, per page one page-list entry, then the page's 8,192 code bytes and 256 scale bytes as int32 loads
(software-pipelined over the pages, ``num_stages``), XOR-folded; one int32 written per program. Random order minus
pool order is what scattering 8.4 KB pages over HBM costs; the indexer minus the random read is what its math and
its feed add on top. All three in CUDA graphs after an L2 flush, medians; floor = bytes / the measured copy
bandwidth.

    python3 scripts/bench_paged_read.py OUT [--bs 16,32,64] [--live 65536] [--iters 100]
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch
import triton
import triton.language as tl

from dsaspec.bench.results import markdown_table, write_results
from dsaspec.bench.timing import measured_floors_or_none, time_in_graph
from dsaspec.cli_parsing import Parser, parse_or_exit, positive_int, positive_int_list
from dsaspec.ops.indexer import default_indexer_programs, indexer_logits
from dsaspec.ops.indexer_schedule import indexer_schedule
from dsaspec.ops.kv_cache_layout import INDEX_FP8_PAGE_BYTES, INDEX_FP8_SCALE_OFFSET, INDEX_HEAD_DIM, PAGE_SIZE

METHOD = ("CUDA-graph replays after an L2 flush (time_in_graph, cold L2), CUPTI, median over --iters; read = a "
          "Triton kernel, persistent programs each walking its share of the page list (one int32 entry, then the "
          "page's codes and scales as int32 loads, software-pipelined, XOR-folded, one int32 written per program), "
          "on the fastest of its grids (programs per SM x stages x warps); indexer = indexer_logits at its defaults "
          "(64 index heads) on the same pool and the same random pages; floor = pool bytes / the measured copy "
          "bandwidth")
PROGRAMS_PER_SM = (2, 3, 4)
STAGES = (4, 8)
WARPS = (4, 8)
INDEX_HEADS = 64
PAGE_WORDS = INDEX_FP8_PAGE_BYTES // 4          # 2112 int32 words a page
CODE_WORDS = INDEX_FP8_SCALE_OFFSET // 4        # 2048 of them codes, then 64 scales


@triton.jit
def _paged_read_kernel(pool_ptr, pages_ptr, out_ptr, num_pages, per_program, NUM_STAGES: tl.constexpr,
                       PAGE_WORDS: tl.constexpr, CODE_WORDS: tl.constexpr, SCALE_WORDS: tl.constexpr):
    # XOR of every int32 word of the pages pages[pid * per_program : (pid + 1) * per_program], into out[pid]
    pid = tl.program_id(0)
    start = pid * per_program
    codes = tl.zeros((CODE_WORDS,), dtype=tl.int32)
    scales = tl.zeros((SCALE_WORDS,), dtype=tl.int32)
    for i in tl.range(start, tl.minimum(start + per_program, num_pages), num_stages=NUM_STAGES):
        page = tl.load(pages_ptr + i).to(tl.int64) * PAGE_WORDS
        codes ^= tl.load(pool_ptr + page + tl.arange(0, CODE_WORDS))
        scales ^= tl.load(pool_ptr + page + CODE_WORDS + tl.arange(0, SCALE_WORDS))
    tl.store(out_ptr + pid, tl.xor_sum(codes, axis=0) ^ tl.xor_sum(scales, axis=0))


def _read(pool: torch.Tensor, pages: torch.Tensor, out: torch.Tensor, grid: tuple[int, int, int], sms: int):
    per_sm, stages, warps = grid
    per_program = triton.cdiv(pages.numel(), per_sm * sms)
    programs = triton.cdiv(pages.numel(), per_program)
    return lambda: _paged_read_kernel[(programs,)](
        pool, pages, out, pages.numel(), per_program, NUM_STAGES=stages, PAGE_WORDS=PAGE_WORDS,
        CODE_WORDS=CODE_WORDS, SCALE_WORDS=PAGE_WORDS - CODE_WORDS, num_warps=warps)


def _fastest_read(pool, pages, out, sms, iters) -> tuple[float, str]:
    best = min((time_in_graph(_read(pool, pages, out, grid, sms), iters=iters, graph_diff=False).median_us, grid)
               for grid in itertools.product(PROGRAMS_PER_SM, STAGES, WARPS))
    return best[0], f"{best[1][0]}/SM x {best[1][1]} stages x {best[1][2]}w"


def _indexer(pool: torch.Tensor, order: torch.Tensor, bs: int, live: int, gen: torch.Generator):
    """indexer_logits at its defaults over ``bs`` rows of ``live`` keys, row r's pages
    ``order[r * live / 64 : (r + 1) * live / 64]``, as one launch of the schedule and the logits."""
    device = pool.device
    pages = order.view(bs, live // PAGE_SIZE)
    table = (pages[:, :, None] * PAGE_SIZE + torch.arange(PAGE_SIZE, device=device)).view(bs, live).to(torch.int32)
    q = torch.randn(bs, INDEX_HEADS, INDEX_HEAD_DIM, generator=gen, device=device).to(torch.bfloat16)
    weights = torch.randn(bs, INDEX_HEADS, generator=gen, device=device)
    seqlens = torch.full((bs,), live, dtype=torch.int32, device=device)
    programs = default_indexer_programs(device, True, 1, INDEX_HEADS)
    schedule = torch.zeros(programs + 1, 2, dtype=torch.int32, device=device)
    out = torch.empty(bs, live, device=device)
    indexer_schedule(seqlens, programs, schedule)
    indexer_logits(q, weights, pool, table, seqlens, schedule, out)  # the eager checks, once

    def run():
        indexer_schedule(seqlens, programs, schedule)
        indexer_logits(q, weights, pool, table, seqlens, schedule, out, check_values=False)
    return run


def _whole_pages(text: str) -> int:
    """argparse type: a positive multiple of the page size (64)."""
    value = positive_int(text)
    if value % PAGE_SIZE:
        raise argparse.ArgumentTypeError(f"expected a multiple of {PAGE_SIZE}, got {text!r}")
    return value


def main() -> int:
    parser = Parser(prog="bench_paged_read", description="The FP8 indexer's page reads alone, random and in order.")
    parser.add_argument("out", help="folder for paged_read.json / .md")
    parser.add_argument("--bs", type=positive_int_list, default=[16, 32, 64], help="decode rows, comma-separated")
    parser.add_argument("--live", type=_whole_pages, default=65536, help="live keys a row (a multiple of 64)")
    parser.add_argument("--iters", type=positive_int, default=100, help="timed replays per point")
    args = parse_or_exit(parser)
    floors = measured_floors_or_none("bench_paged_read")
    if floors is None:
        return 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.empty(max(PROGRAMS_PER_SM) * sms, dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for bs in args.bs:
        num_pages = bs * args.live // PAGE_SIZE
        pool = torch.randint(0, 256, (num_pages, INDEX_FP8_PAGE_BYTES), generator=gen, device="cuda",
                             dtype=torch.uint8)
        words = pool.view(torch.int32).view(-1)
        in_order = torch.arange(num_pages, dtype=torch.int32, device="cuda")
        shuffled = torch.randperm(num_pages, generator=gen, device="cuda").to(torch.int32)
        floor = pool.numel() / (floors.copy_gbps * 1e3)
        ordered_us, ordered_grid = _fastest_read(words, in_order, out, sms, args.iters)
        random_us, random_grid = _fastest_read(words, shuffled, out, sms, args.iters)
        indexer_us = time_in_graph(_indexer(pool, shuffled, bs, args.live, gen), iters=args.iters,
                                   graph_diff=False).median_us
        rows.append(dict(bs=bs, live=args.live, bytes=pool.numel(), floor_us=floor, in_order_us=ordered_us,
                         in_order_grid=ordered_grid, random_us=random_us, random_grid=random_grid,
                         indexer_us=indexer_us, random_over_floor=random_us / floor,
                         indexer_over_random=indexer_us / random_us, indexer_over_floor=indexer_us / floor))
        del pool, words
    table = markdown_table([("bs", "bs"), ("live", "live"), ("bytes", "bytes"), ("floor_us", "floor µs"),
                            ("in_order_us", "read in order µs"), ("random_us", "read random µs"),
                            ("random_over_floor", "random / floor"), ("indexer_us", "indexer µs"),
                            ("indexer_over_random", "indexer / random read"),
                            ("indexer_over_floor", "indexer / floor"), ("in_order_grid", "in-order grid"),
                            ("random_grid", "random grid")], rows)
    write_results("paged_read", dict(method=METHOD, params=dict(bs=args.bs, live=args.live, iters=args.iters),
                                     copy_gbps=floors.copy_gbps, rows=rows),
                  f"FP8 indexer pages read alone (copy {floors.copy_gbps:.0f} GB/s)\n\n{table}", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
