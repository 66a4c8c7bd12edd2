"""Shared machinery of the LM-head step benchmarks (``draft-step``, ``verify-step``): the TP sizes against the
GPUs present, the re-launch under torchrun, one TP group per size on the ranks it needs, CUDA-graph timings
reduced to the max over the ranks, the interpreter run without CUDA, and the gather → exchange summary.

A benchmark module defines its options with ``add_arguments`` (``add_tp_arguments`` plus its own), a
per-TP-size ``Step`` factory and a per-row-count ``measure`` function, and calls ``run``.
"""

from __future__ import annotations

import argparse
from typing import Callable

import torch
from tqdm import tqdm

from dsaspec.bench.results import bench_params, markdown_table, write_results
from dsaspec.distributed.tp_group import TPGroup, init_distributed
from dsaspec.cli_parsing import format_value, positive_int, positive_int_list, use_cpu_sizes
from dsaspec.distributed.launch import check_gpus, relaunch, under_torchrun, visible_gpus
from dsaspec.layers.vocab_parallel import VocabParallelLMHead
from dsaspec.layers.logits_processor import LogitsProcessor

CPU_VOCAB, CPU_HIDDEN = 1000, 64


def add_tp_arguments(parser: argparse.ArgumentParser, rows: list[int], rows_help: str) -> None:
    """``--tp --rows --vocab --hidden --iters --transport --out`` (``rows``: the default row counts)."""
    parser.add_argument("--tp", type=positive_int_list, default=None,
                        help="comma-separated TP sizes; TP N needs N GPUs (default: 1,2 with >= 2 GPUs, else 1)")
    parser.add_argument("--rows", type=positive_int_list, default=rows, help=f"comma-separated row counts ({rows_help})")
    parser.add_argument("--vocab", type=positive_int, default=154880, help="vocabulary size of the LM head")
    parser.add_argument("--hidden", type=positive_int, default=6144, help="hidden size of the LM head")
    parser.add_argument("--iters", type=positive_int, default=200, help="timed graph replays per measurement")
    parser.add_argument("--transport", choices=["auto", "symm_mem", "nccl"], default="auto",
                        help="all-reduce transport of the TP group (nccl: the exchange declines)")
    parser.add_argument("--out", default=None, help="results folder (default: benchmarks/results/<machine>)")


def run(args, *, name: str, add_arguments, interpreter: Callable, worker: Callable) -> int:
    """Check ``--tp`` against the GPUs, then run ``interpreter(args)`` without CUDA, re-launch
    ``dsaspec bench <name>`` (every option of ``add_arguments``) under torchrun for TP > 1 outside
    torchrun, or run ``worker(args)``."""
    gpus = visible_gpus()
    args.tp = args.tp or ([1, 2] if gpus >= 2 else [1])
    need = max(args.tp)
    check_gpus(need)
    if gpus == 0:
        return interpreter(args)
    if need > 1 and not under_torchrun():
        return relaunch(["bench", name], add_arguments, args, need)
    return worker(args)


def run_interpreter(args, *, name: str, add_arguments, unused: tuple[str, ...], check: Callable,
                    columns: list[tuple[str, str]]) -> int:
    """Without CUDA: TP 1 at vocab ``CPU_VOCAB``, hidden ``CPU_HIDDEN`` under the Triton interpreter;
    ``check(group, args)`` returns result rows (correctness only, no time) written as ``<name>``."""
    ignored = use_cpu_sizes(args, add_arguments, {"vocab": CPU_VOCAB, "hidden": CPU_HIDDEN}, unused=unused)
    print(f"No CUDA: Triton interpreter at vocab {args.vocab}, hidden {args.hidden}, TP 1, rows "
          f"{format_value(args.rows)}; correctness is checked, no time is measured (interpreter times mean "
          "nothing).")
    if ignored:
        print(ignored)
    rows = check(TPGroup.single("cpu"), args)
    markdown = markdown_table(columns, rows)
    payload = {"method": "Triton interpreter on CPU: correctness only, no times.", "params": bench_params(args),
               "rows": rows}
    write_results(name, payload, markdown, args.out)
    return 0


def random_head_and_processors(group: TPGroup, vocab: int, hidden: int, max_rows: int, seed: int = 0
                               ) -> tuple[VocabParallelLMHead, LogitsProcessor, LogitsProcessor]:
    """A bf16 vocab-parallel LM head with N(0, 0.02) weights (seeded per rank), and two processors over
    it for ``max_rows`` rows: (head, gathering, exchanging). Each benchmark enables on the exchanging
    processor the exchanges it times."""
    head = VocabParallelLMHead(vocab, hidden, group, dtype=torch.bfloat16)
    gen = torch.Generator(device=group.device).manual_seed(seed + 1 + group.rank)
    head.weight.normal_(0.0, 0.02, generator=gen)
    return head, LogitsProcessor(head, max_rows=max_rows), LogitsProcessor(head, max_rows=max_rows)


def max_over_ranks(group: TPGroup, values: list[float]) -> list[float]:
    """Element-wise maximum of ``values`` over the ranks of ``group`` (collective)."""
    if group.size == 1:
        return values
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=group.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group.process_group)
    return t.tolist()


def time_over_ranks(group: TPGroup, fns: dict[str, Callable[[], object]], iters: int) -> dict[str, dict]:
    """Each function timed in a CUDA graph (CUPTI, warm L2) on every rank; per name the max over the ranks of
    ``us`` (median), ``spread`` and ``graph_diff_us``."""
    from dsaspec.bench.timing import time_in_graph

    names = list(fns)
    timings = {name: time_in_graph(fns[name], iters=iters, cold_l2=False) for name in names}
    medians = max_over_ranks(group, [timings[n].median_us for n in names])
    spreads = max_over_ranks(group, [timings[n].spread for n in names])
    diffs = max_over_ranks(group, [timings[n].graph_diff_us or 0.0 for n in names])
    return {n: {"us": m, "spread": s, "graph_diff_us": d} for n, m, s, d in zip(names, medians, spreads, diffs)}


def run_tp_sizes(args, *, desc: str, make_step: Callable, measure: Callable):
    """The worker: for each TP size, ``make_step(group, args)`` on the ranks < TP, then
    ``measure(args, step, group, rows, floors)`` (a list of result rows) for every ``--rows`` count.

    Returns
    -------
    (result rows, Floors, world size) on rank 0; None on the other ranks.
    """
    from dsaspec.bench.timing import Floors, warm_up_gpu

    distributed = init_distributed()
    import torch.distributed as dist

    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    device = torch.device("cuda", torch.cuda.current_device())
    warm_up_gpu()
    floors = Floors.measure()
    out = []
    for tp in args.tp:
        # new_group is collective over the world even for ranks outside it.
        pg = dist.new_group(list(range(tp))) if distributed and tp > 1 else None
        if rank < tp:
            group = TPGroup(pg, device=device, transport=args.transport) if tp > 1 else TPGroup.single(device)
            step = make_step(group, args)
            for r in tqdm(args.rows, desc=f"{desc} TP{tp}", unit="rows", disable=rank != 0):
                out.extend(measure(args, step, group, r, floors))
            del step
        if distributed:
            dist.barrier()
    return (out, floors, world) if rank == 0 else None


def summary_by_rows(rows: list[dict], label: Callable[[dict], str]) -> str:
    """One line per ``label(row)``: ``baseline_us → new_us`` at every row count."""
    counts = sorted({r["rows"] for r in rows})
    lines = ["| rows | " + " | ".join(map(str, counts)) + " |", "|---|" + "---|" * len(counts)]
    labels = list(dict.fromkeys(label(r) for r in rows))
    for name in labels:
        by_rows = {r["rows"]: r for r in rows if label(r) == name}
        cells = [f"{by_rows[c]['baseline_us']:.1f} → {by_rows[c]['new_us']:.1f}" if c in by_rows else "–"
                 for c in counts]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
