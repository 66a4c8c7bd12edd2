"""Sweep the fused MoE's tiles on one GPU at the per-rank MoE shapes and small T, one kernel at a
time with the other on its default tile:

- gate/up: (BLOCK_N, split K, warps, stages); timed: the gate/up launch (``_gate_up_kernel``, its
  last programs also adding the K splits); floor: the gate/up codes and scales
  of the distinct experts hit;
- down: (BLOCK_N, warps, stages); timed: ``_down_kernel`` (the pair layout's, which also combines,
  up to ``PAIR_LAYOUT_MAX_PAIRS`` pairs; the sorted layout's above); floor: the down codes and
  scales of the distinct experts hit;

each the CUPTI time per CUDA-graph replay with a cold L2 (median), against its bytes floor at the
measured copy bandwidth. Experts: the preset's routed experts plus its shared expert as expert E
(as the model fuses it), ``k + 1`` slots a token, FP8 weights quantized per 128 x 128 block from
random bf16 ones; the default tiles and split (``_tile``, ``moe_split_k``) first, every config's
output checked within bf16 rounding of the default's. Writes ``moe_tiles_<preset>.json`` / ``.md``
to the folder given: where a tile beats the default at every T, ``_tile`` / ``moe_split_k``
should take it.

    python3 scripts/bench_moe_tiles.py OUT [--preset glm5-fp8-tp8-rank] [--tokens 1,2,4,32,128]
                                           [--kernels gate_up,down] [--block-n 32,64] [--splits 2,4]
                                           [--warps 4] [--stages 4,6,8]
"""

from __future__ import annotations

import itertools
import statistics
import sys
from unittest import mock

import torch

from dsaspec.bench.moe import quantize_experts
from dsaspec.bench.results import markdown_table, write_results
from dsaspec.bench.timing import measured_floors_or_none, replay_events
from dsaspec.cli_parsing import Parser, choice_list, parse_or_exit, positive_int, positive_int_list
from dsaspec.configs.model_config import PRESETS
from dsaspec.ops import fused_moe as op

METHOD = ("CUDA-graph replays with a cold L2 (replay_events), per replay the summed CUPTI durations of the swept "
          "kernel's launches (gate/up: _gate_up_kernel, which also reduces its K splits; down: _down_kernel), medians; one "
          "kernel swept at a time, the other on its default tile; floor = the distinct experts' e4m3 codes + fp32 "
          "scales of that kernel's weights at the measured copy bandwidth")
KERNELS = {"gate_up": ("_gate_up_kernel",), "down": ("_down_kernel",)}


# the swept values of each tile parameter by default (--block-n, --splits, --warps, --stages narrow or widen them)
GRID = {"gate_up": dict(block_n=(16, 32, 64), splits=(2, 4, 8), warps=(4, 8), stages=(3, 4)),
        "down": dict(block_n=(16, 32, 64, 128), warps=(2, 4, 8), stages=(2, 3, 4))}


def _configs(kernel: str, grid: dict | None = None) -> list[tuple[int, ...]]:
    """gate/up: (BLOCK_N, split K, warps, stages); down: (BLOCK_N, warps, stages); each parameter's values
    from ``grid`` where it names them, else :data:`GRID`'s."""
    values = dict(GRID[kernel], **{k: v for k, v in (grid or {}).items() if v and k in GRID[kernel]})
    return list(itertools.product(*(values[k] for k in GRID[kernel])))


def _name(kernel: str, config: tuple[int, ...]) -> str:
    if kernel == "gate_up":
        block_n, split, warps, stages = config
        return f"n{block_n}s{split}w{warps}p{stages}"
    block_n, warps, stages = config
    return f"n{block_n}w{warps}p{stages}"


def _sweep(kernel, configs, tokens, hidden, ids, weights, w13, w13_s, w2, w2_s, scale_fmt, iters, nbytes, floors):
    """One T's row of ``kernel``'s sweep; returns (row, every output within bf16 rounding of the default's)."""
    real_tile = op._tile
    topk, (experts, inter2, h) = ids.shape[1], w13.shape
    inter = inter2 // 2
    default_split = op.moe_split_k(inter, True)
    sort = op.sorts_pairs(tokens * topk)
    if kernel == "gate_up":
        t = real_tile(inter, h, topk, torch.bfloat16, hidden.device, weight_tiles=2, fp8=True, split_k=default_split)
        default = (t.block_n, default_split, t.num_warps, t.num_stages)
    else:
        t = real_tile(h, inter, topk, torch.bfloat16, hidden.device, fp8=True, per_token=not sort)
        default = (t.block_n, t.num_warps, t.num_stages)
    row = dict(tokens=tokens, layout="sorted" if sort else "pairs", bytes=nbytes, floor_us=floors.floor_us(nbytes),
               default=_name(kernel, default))
    want, ok = None, True
    for cfg in [default] + [c for c in configs if c != default]:
        split = cfg[1] if kernel == "gate_up" else default_split

        def tile(n, k_dim, k, dtype, device, weight_tiles=1, fp8=False, split_k=1, per_token=False,
                 block_m=op.BLOCK_M, cfg=cfg):
            if (weight_tiles == 2) == (kernel == "gate_up"):
                block_n, warps, stages = (cfg[0], cfg[2], cfg[3]) if kernel == "gate_up" else cfg
                return op._Tile(block_n, op.FP8_BLOCK, warps, stages)
            return real_tile(n, k_dim, k, dtype, device, weight_tiles=weight_tiles, fp8=fp8, split_k=split_k,
                             per_token=per_token, block_m=block_m)

        workspace = op.fused_moe_workspace(tokens, topk, experts, h, inter, hidden.device, torch.bfloat16,
                                           fp8=True, split_k=split)
        out = torch.empty_like(hidden)

        def call(split=split, workspace=workspace, out=out):
            op.fused_moe(hidden, w13, w2, ids, weights, out, w13_scale=w13_s, w2_scale=w2_s, scale_fmt=scale_fmt,
                         workspace=workspace, split_k=split, check_values=False)

        with mock.patch.object(op, "_tile", tile):
            replays = replay_events(call, iters=iters)
        row[f"{_name(kernel, cfg)}_us"] = statistics.median(
            sum(e - s for name, s, e in r if name.startswith(KERNELS[kernel])) / 1e3 for r in replays)
        if want is None:
            want = out.float()
        ok &= bool(torch.allclose(out.float(), want, rtol=2 ** -6, atol=2 ** -6 * want.abs().max().item()))
    best = min((_name(kernel, c) for c in [default] + configs), key=lambda n: row[f"{n}_us"])
    row.update(best=best, best_us=row[f"{best}_us"], default_us=row[f"{row['default']}_us"],
               best_over_floor=row[f"{best}_us"] / row["floor_us"])
    return row, ok


def main() -> int:
    parser = Parser(prog="bench_moe_tiles", description="The fused MoE's gate/up and down tiles at small T.")
    parser.add_argument("out", help="folder for moe_tiles_<preset>.json / .md")
    fp8_moe = sorted(name for name, c in PRESETS.items() if c.quantization is not None and c.is_moe
                     and c.n_shared_experts == 1)
    parser.add_argument("--preset", default="glm5-fp8-tp8-rank", choices=fp8_moe)
    parser.add_argument("--tokens", type=positive_int_list, default=[1, 2, 4, 32, 128],
                        help="token counts T, comma-separated")
    parser.add_argument("--kernels", type=choice_list(tuple(KERNELS)), default=list(KERNELS),
                        help="kernels to sweep, comma-separated: gate_up, down")
    parser.add_argument("--iters", type=positive_int, default=50, help="timed replays per point")
    for name, what in (("block_n", "BLOCK_N"), ("splits", "gate/up K splits"), ("warps", "warps"),
                       ("stages", "pipeline stages")):
        parser.add_argument(f"--{name.replace('_', '-')}", type=positive_int_list, default=None,
                            help=f"{what} to sweep, comma-separated (default: gate/up "
                                 f"{','.join(map(str, GRID['gate_up'][name]))}"
                                 + (f"; down {','.join(map(str, GRID['down'][name]))}" if name in GRID["down"] else "")
                                 + ")")
    args = parse_or_exit(parser)
    if args.splits and "gate_up" not in args.kernels:
        print(f"{parser.prog}: error: --splits: K splits are gate/up's; --kernels does not include gate_up",
              file=sys.stderr)
        return 2
    grid = dict(block_n=args.block_n, splits=args.splits, warps=args.warps, stages=args.stages)
    configs = {kernel: _configs(kernel, grid) for kernel in args.kernels}
    floors = measured_floors_or_none("bench_moe_tiles")
    if floors is None:
        return 2
    config = PRESETS[args.preset]
    experts = config.n_routed_experts + 1                      # the shared expert fused as expert E
    topk = config.num_experts_per_tok + 1
    h, inter = config.hidden_size, config.moe_intermediate_size       # a rank preset's: already split
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13, w13_s = quantize_experts((torch.randn(experts, 2 * inter, h, generator=gen, device="cuda") * h ** -0.5)
                                  .bfloat16())
    w2, w2_s = quantize_experts((torch.randn(experts, h, inter, generator=gen, device="cuda") * inter ** -0.5)
                                .bfloat16())
    weights_of = {"gate_up": (w13, w13_s), "down": (w2, w2_s)}
    results, ok = {kernel: [] for kernel in args.kernels}, True
    for tokens in args.tokens:
        hidden = torch.randn(tokens, h, generator=gen, device="cuda").bfloat16()
        routed = torch.rand(tokens, experts - 1, generator=gen, device="cuda").argsort(dim=1)[:, :topk - 1]
        ids = torch.cat([routed, torch.full((tokens, 1), experts - 1, device="cuda")], 1).to(torch.int32).contiguous()
        weights = torch.rand(tokens, topk, generator=gen, device="cuda")
        hit = int(torch.unique(ids).numel())
        for kernel in args.kernels:
            codes, scales = weights_of[kernel]
            nbytes = hit * (codes[0].numel() + scales[0].numel() * 4)
            row, row_ok = _sweep(kernel, configs[kernel], tokens, hidden, ids, weights, w13, w13_s, w2, w2_s,
                                 config.quantization.scale_fmt, args.iters, nbytes, floors)
            results[kernel].append(dict(row, experts_hit=hit))
            ok &= row_ok
    tables = []
    for kernel, rows in results.items():
        columns = ([("tokens", "T"), ("layout", "layout"), ("experts_hit", "experts hit"), ("floor_us", "floor µs"),
                    ("default", "default"), ("default_us", "default µs"), ("best", "best"), ("best_us", "best µs"),
                    ("best_over_floor", "best / floor")]
                   + [(f"{_name(kernel, c)}_us", f"{_name(kernel, c)} µs") for c in configs[kernel]])
        tables.append(f"### {kernel}\n\n{markdown_table(columns, rows)}")
    write_results(f"moe_tiles_{args.preset}", dict(
        method=METHOD, params=dict(preset=args.preset, tokens=args.tokens, iters=args.iters,
                                   configs={k: [_name(k, c) for c in configs[k]] for k in args.kernels}),
        copy_gbps=floors.copy_gbps, empty_kernel_us=floors.empty_us, results=results),
        f"fused MoE tiles, {args.preset} (E {experts} with the shared expert, k {topk}, H {h}, I {inter}, FP8; copy "
        f"{floors.copy_gbps:.0f} GB/s)\n\n" + "\n\n".join(tables), args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
