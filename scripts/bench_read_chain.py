"""What a decode layer's kernel count costs by itself: a preset's decode layer (the GLM-5 FP8 rank's by
default, or a dense bf16 preset's such as ``bench``; bs 1, 4, 32) replayed as a chain of pure-read
kernels, one per kernel the runtime launches, each reading as many bytes as its namesake must,
against the same bytes read by one kernel and the bytes floor.

Every link is one launch of a streaming read (int32 loads XOR-folded, one int32 written per program;
no math) over its own buffer, on the best of a few grids for its size (programs, elements a step,
warps: measured alone first). The chain runs in one CUDA graph after an L2 flush, so each link starts
when the one before it ends, as the layer's kernels do. The gap between the chain and the bytes floor
is what launches, ramp-up and tails cost at these sizes before any math: the practical floor of
kernels split as the layer's are, which do more than read.

The chain is timed four ways: plain launches; every link a programmatic dependent launch (PDL,
sm_90) that waits for the link before it before reading (what launching early can hide when every
read depends on the kernel before: the launch and the programs' start); and every link a PDL that
reads its buffer before that wait and waits only before its store (the most early launches can
give: a kernel whose bytes are all weights, none of them written by the kernel before). A fourth
chain has every link prefetch its buffer's lines into L2 (``prefetch.global.L2``) before the wait
and read them after it: what a kernel could keep of that gain without holding its weights in
registers across the wait.

    python3 scripts/bench_read_chain.py OUT [--preset glm5-fp8-tp8-rank] [--live 1032] [--tokens 1,4,32]
                                            [--iters 100]
"""

from __future__ import annotations

import itertools
import sys

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from dsaspec.bench.floors import uniform_experts_hit
from dsaspec.bench.results import markdown_table, write_results
from dsaspec.bench.timing import measured_floors_or_none, time_in_graph
from dsaspec.cli_parsing import Parser, parse_or_exit, positive_int, positive_int_list
from dsaspec.configs.model_config import PRESETS, ModelConfig
from dsaspec.ops.fp8_gemm import BLOCK as FP8_BLOCK, k_group
from dsaspec.ops.fused_moe import sorts_pairs

METHOD = ("CUDA-graph replays after an L2 flush (time_in_graph, cold L2), CUPTI span from the first link's start to "
          "the last link's end, median; chains of plain launches, of PDL links waiting before their reads, of "
          "PDL links waiting only before their store and of PDL links prefetching their lines into L2 before "
          "waiting, then reading; a link = one launch of a Triton streaming read (int32 loads "
          "XOR-folded, one int32 written per program) over its own buffer of the link's bytes, on the grid (programs x elements a "
          "step x warps) fastest for that size alone; floor = bytes / the measured copy bandwidth")
PROGRAMS_PER_SM = (1, 2, 4)
STEP_ELEMENTS = (1024, 4096)
WARPS = (4, 8)


LINE_INTS = tl.constexpr(32)   # int32 elements of a 128-byte cache line


@triton.jit
def _prefetch_l2(ptrs):
    # prefetch.global.L2 of every address in ptrs (a hint: no value, no fault on a valid address); the
    # dummy result only carries the side effect, which is_pure=False keeps from being optimized away
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, per_program, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # XOR of program pid's int32 elements [pid * per_program, (pid + 1) * per_program) written to out[pid].
    # PDL 1: wait for the grid before, then let the next grid launch; PDL 2: let it launch, read, wait, store;
    # PDL 3: let it launch, prefetch the program's lines into L2, wait, read (from L2), store.
    if PDL == 1:
        gdc_wait()
    if PDL != 0:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    start = pid * per_program
    if PDL == 3:
        for off in range(start, tl.minimum(start + per_program, n), BLOCK):
            _prefetch_l2(x_ptr + tl.minimum(off + tl.arange(0, BLOCK // LINE_INTS) * LINE_INTS, n - 1))
        gdc_wait()
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for off in range(start, tl.minimum(start + per_program, n), BLOCK):
        idx = off + tl.arange(0, BLOCK)
        acc ^= tl.load(x_ptr + idx, mask=idx < n, other=0)
    if PDL == 2:
        gdc_wait()
    tl.store(out_ptr + pid, tl.xor_sum(acc, axis=0))


def layer_links(config: ModelConfig, live: int, sms: int, tokens: int = 1) -> list[tuple[str, int]]:
    """The decode layer's launches at ``tokens`` rows of ``live`` keys each, in launch order, and the
    bytes each must move. An FP8 MoE rank preset: FP8 weights at one byte (their fp32 block scales
    left out), the split GEMMs' fp32 partials (their K groups on ``sms`` SMs, written and read inside
    the GEMM's launch), the router in fp32, the MoE's align and combine where it sorts its pairs; the
    experts hit are the expected number under uniform routing, ``E (1 - (1 - k / E) ** T)``, plus the
    shared ones (as bench decode's floors). A dense bf16 preset: bf16 weights, cuBLAS's split-K
    reduce of the fused input and ``o_proj`` GEMMs as launches of their own (reading two fp32
    partials, the fewest a split has: cuBLAS picks the count), SiLU-and-mul between gate/up and down.
    Both: bf16 W_UK (read by ``mla_query``) / W_UV and caches, norms reading and writing the hidden
    rows and residuals, sparse MLA split with its combine."""
    h, heads, t = config.hidden_size, config.num_attention_heads, tokens
    latent, rope, nope, v = config.kv_lora_rank, config.qk_rope_head_dim, config.qk_nope_head_dim, config.v_head_dim
    index_dim, index_heads = config.index_head_dim, config.index_n_heads
    weight_bytes = 1 if config.quantization is not None else 2
    fused_input = config.q_lora_rank + index_dim + latent + rope
    fused_latent = heads * (nope + rope) + index_heads * index_dim
    norm = t * 4 * h * 2 + h * 2                       # x and residual in, both out, the weight

    def gemm(name: str, n: int, k_dim: int, cublas_split: bool = False) -> list[tuple[str, int]]:
        weights = n * k_dim * weight_bytes
        if config.quantization is not None:
            return [(f"{name} GEMM", weights + 2 * t * triton.cdiv(k_dim // FP8_BLOCK, k_group(n, k_dim, sms)) * n * 4)]
        reduce = [(f"{name} split reduce", 2 * t * n * 4 + t * n * 2)] if cublas_split else []
        return [(f"{name} GEMM", weights)] + reduce

    links = [("input_layernorm", norm), *gemm("fused_input", fused_input, h, cublas_split=True),
             ("q_a_layernorm", t * 2 * config.q_lora_rank * 2 + config.q_lora_rank * 2),
             ("index_rope", t * 2 * index_dim * 2 + index_heads * h * 2),
             *gemm("fused_latent", fused_latent, config.q_lora_rank),
             ("mla_latent", t * 3 * (latent + rope) * 2),
             ("mla_query", heads * nope * latent * 2 + t * heads * (nope + rope + latent + rope) * 2),
             # rows no longer than top-k skip the logits (their slots are all selected): the lengths alone
             ("indexer_logits", t * (live * index_dim * 2 + index_heads * index_dim * 2) if live > config.index_topk
              else t * 4),
             ("topk", t * live * 4),
             ("sparse_mla", t * min(live, config.index_topk) * (latent + rope) * 2),
             ("sparse_mla combine", t * 2 * heads * latent * 4),
             ("W_UV bmm", heads * v * latent * 2)]
    if config.quantization is not None:
        links.append(("o_proj act_quant", t * 2 * heads * v * 2))
    links += [*gemm("o_proj", h, heads * v, cublas_split=True), ("post_attention_layernorm", norm)]
    if not config.is_moe:
        inter = config.intermediate_size
        return links + [*gemm("gate_up", 2 * inter, h), ("silu_and_mul", t * 3 * inter * 2),
                        *gemm("down", h, inter)]
    experts, k, inter = config.n_routed_experts, config.num_experts_per_tok, config.moe_intermediate_size
    hit = uniform_experts_hit(config, t) + config.n_shared_experts
    slots = k + config.n_shared_experts
    links += [("router_logits", experts * h * 4), ("router", t * experts * 4 * 2)]
    sort = sorts_pairs(t * slots)
    if sort:
        links.append(("moe align", t * slots * 4 * 4))
    links += [("gate_up", round(hit * 2 * inter * h)), ("down", round(hit * h * inter))]
    if sort:
        links.append(("moe combine", t * slots * h * 4 + t * h * 2))
    return links


PDL_MODES = {"chain": 0, "chain_pdl_wait_first": 1, "chain_pdl_read_first": 2, "chain_pdl_prefetch_first": 3}


def _read(buf: torch.Tensor, out: torch.Tensor, grid: tuple[int, int, int], pdl: int = 0):
    programs, block, warps = grid
    n = buf.numel()
    per_program = triton.cdiv(triton.cdiv(n, programs), block) * block
    programs = triton.cdiv(n, per_program)
    return lambda: _read_kernel[(programs,)](buf, out, n, per_program, BLOCK=block, PDL=pdl, num_warps=warps,
                                             launch_pdl=pdl != 0)


def _grids(n: int, sms: int) -> list[tuple[int, int, int]]:
    """(programs, elements a step, warps) worth trying for ``n`` int32 elements: no program without work."""
    grids = set()
    for per_sm, block, warps in itertools.product(PROGRAMS_PER_SM, STEP_ELEMENTS, WARPS):
        grids.add((max(1, min(per_sm * sms, triton.cdiv(n, block))), block, warps))
    return sorted(grids)


def _chain(links: list[tuple[str, int]], out: torch.Tensor, sms: int, floors, iters: int) -> tuple[dict, list]:
    """Time each link alone on its fastest grid, then the links as one chain (plain and in both PDL
    modes) and their bytes as one read; returns the summary and the per-link rows."""
    rows, links_best = [], []
    for name, nbytes in links:
        buf = torch.randint(-2 ** 31, 2 ** 31 - 1, (triton.cdiv(nbytes, 4),), dtype=torch.int32, device="cuda")
        best = min((time_in_graph(_read(buf, out, g), iters=iters, graph_diff=False).median_us, g)
                   for g in _grids(buf.numel(), sms))
        links_best.append((buf, best[1]))
        rows.append(dict(link=name, bytes=nbytes, floor_us=nbytes / (floors.copy_gbps * 1e3), alone_us=best[0],
                         grid=f"{best[1][0]} x {best[1][1]} x {best[1][2]}w"))
    total = sum(r["bytes"] for r in rows)
    whole = torch.empty(triton.cdiv(total, 4), dtype=torch.int32, device="cuda")
    one_kernel = min(time_in_graph(_read(whole, out, g), iters=iters, graph_diff=False).median_us
                     for g in _grids(whole.numel(), sms))
    floor = total / (floors.copy_gbps * 1e3)
    summary = dict(links=len(rows), bytes=total, floor_us=floor, alone_sum_us=sum(r["alone_us"] for r in rows),
                   one_kernel_us=one_kernel, one_kernel_over_floor=one_kernel / floor)
    for key, pdl in PDL_MODES.items():
        chain = [_read(buf, out, grid, pdl) for buf, grid in links_best]
        summary[f"{key}_us"] = time_in_graph(lambda: [link() for link in chain], iters=iters,
                                             graph_diff=False).median_us
        summary[f"{key}_over_floor"] = summary[f"{key}_us"] / floor
    return summary, rows


def main() -> int:
    parser = Parser(prog="bench_read_chain", description="A decode layer as a chain of pure-read kernels.")
    parser.add_argument("out", help="folder for read_chain_<preset>.json / .md")
    chained = sorted(name for name, c in PRESETS.items()
                     if (c.quantization is not None and c.is_moe) or (c.quantization is None and not c.is_moe))
    parser.add_argument("--preset", default="glm5-fp8-tp8-rank", choices=chained,
                        help="an FP8 MoE rank or a dense bf16 preset")
    parser.add_argument("--live", type=positive_int, default=1032,
                        help="live KV length of the row (bench decode's mean at 1k: 1032 with --steps 16, "
                             "1056 with its default 64)")
    parser.add_argument("--tokens", type=positive_int_list, default=[1, 4, 32],
                        help="decode rows (batch sizes), comma-separated: a chain each")
    parser.add_argument("--iters", type=positive_int, default=100, help="timed replays per point")
    args = parse_or_exit(parser)
    floors = measured_floors_or_none("bench_read_chain")
    if floors is None:
        return 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.empty(8 * sms, dtype=torch.int32, device="cuda")
    summaries, tables = [], []
    for tokens in args.tokens:
        summary, rows = _chain(layer_links(PRESETS[args.preset], args.live, sms, tokens), out, sms, floors, args.iters)
        summaries.append(dict(summary, tokens=tokens, links_rows=rows))
        tables.append(f"### {tokens} token{'s' if tokens > 1 else ''}\n\n" + markdown_table(
            [("link", "link"), ("bytes", "bytes"), ("floor_us", "floor µs"), ("alone_us", "alone µs"),
             ("grid", "grid (programs x step x warps)")], rows))
    head = markdown_table([("tokens", "bs"), ("links", "links"), ("bytes", "bytes"), ("floor_us", "floor µs"),
                           ("one_kernel_us", "one kernel µs"), ("one_kernel_over_floor", "one kernel / floor"),
                           ("chain_us", "chain µs"), ("chain_over_floor", "chain / floor"),
                           ("chain_pdl_wait_first_us", "PDL, wait first µs"),
                           ("chain_pdl_read_first_us", "PDL, read first µs"),
                           ("chain_pdl_read_first_over_floor", "PDL, read first / floor"),
                           ("chain_pdl_prefetch_first_us", "PDL, L2 prefetch first µs"),
                           ("alone_sum_us", "sum alone µs")], summaries)
    write_results(f"read_chain_{args.preset}", dict(
        method=METHOD, params=dict(preset=args.preset, live=args.live, tokens=args.tokens, iters=args.iters),
        copy_gbps=floors.copy_gbps, empty_kernel_us=floors.empty_us, chains=summaries),
        f"{args.preset} decode layer (live {args.live} a row) as read kernels (copy {floors.copy_gbps:.0f} GB/s, "
        f"empty kernel {floors.empty_us:.2f} µs)\n\n{head}\n\n" + "\n\n".join(tables), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
