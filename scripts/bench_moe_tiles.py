"""Sweep the fused MoE's gate/up tile on one GPU at the per-rank MoE shapes and small T: for each
(BLOCK_N, split K, warps, stages) the CUPTI time of the gate/up launch and of the split reduction
after it (``_gate_up_kernel`` + ``_split_reduce_kernel``: the part a tile changes) and of the whole
``fused_moe`` call, in CUDA-graph replays with a cold L2 (median per replay), against the gate/up
bytes floor (the e4m3 gate/up codes and scales of the distinct experts hit, at the measured copy
bandwidth). Experts: the preset's routed experts plus its shared expert as expert E (as the model
fuses it), ``k + 1`` slots a token, FP8 weights quantized per 128 x 128 block from random bf16
ones; the default tile and split (``_tile``, ``moe_split_k``) first, every config's output checked
within bf16 rounding of the default's. Writes ``moe_tiles_<preset>.json`` / ``.md`` to the folder
given: where a tile beats the default at every T, ``_tile`` / ``moe_split_k`` should take it.

    python3 scripts/bench_moe_tiles.py OUT [--preset glm5-fp8-tp8-rank] [--tokens 1,2,4]
"""

from __future__ import annotations

import itertools
import statistics
import sys
from unittest import mock

import torch

from dsaspec.bench.moe import quantize_experts
from dsaspec.bench.results import markdown_table, write_results
from dsaspec.bench.timing import Floors, replay_events, warm_up_gpu
from dsaspec.cli_parsing import Parser, parse_or_exit, positive_int, positive_int_list
from dsaspec.configs.model_config import PRESETS
from dsaspec.ops import fused_moe as op

METHOD = ("CUDA-graph replays with a cold L2 (replay_events), per replay the summed CUPTI durations of _gate_up_kernel "
          "and _split_reduce_kernel and the span of the whole fused_moe call, medians; floor = the distinct experts' "
          "gate/up e4m3 codes + fp32 scales at the measured copy bandwidth")
GATE_UP_KERNELS = ("_gate_up_kernel", "_split_reduce_kernel")


def _configs() -> list[tuple[int, int, int, int]]:
    """(BLOCK_N, split K, warps, stages) swept."""
    return list(itertools.product((16, 32, 64), (2, 4, 8), (4, 8), (3, 4)))


def _name(config) -> str:
    block_n, split, warps, stages = config
    return f"n{block_n}s{split}w{warps}p{stages}"


def main() -> int:
    parser = Parser(prog="bench_moe_tiles", description="The fused MoE's gate/up tiles at small T.")
    parser.add_argument("out", help="folder for moe_tiles_<preset>.json / .md")
    fp8_moe = sorted(name for name, c in PRESETS.items() if c.quantization is not None and c.is_moe
                     and c.n_shared_experts == 1)
    parser.add_argument("--preset", default="glm5-fp8-tp8-rank", choices=fp8_moe)
    parser.add_argument("--tokens", type=positive_int_list, default=[1, 2, 4], help="token counts T, comma-separated")
    parser.add_argument("--iters", type=positive_int, default=50, help="timed replays per point")
    args = parse_or_exit(parser)
    if not torch.cuda.is_available():
        print("bench_moe_tiles: error: needs a CUDA device", file=sys.stderr)
        return 2
    config = PRESETS[args.preset]
    experts = config.n_routed_experts + 1                      # the shared expert fused as expert E
    topk = config.num_experts_per_tok + 1
    h, inter = config.hidden_size, config.moe_intermediate_size       # a rank preset's: already split
    scale_fmt = config.quantization.scale_fmt
    warm_up_gpu()
    floors = Floors.measure()
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13, w13_s = quantize_experts((torch.randn(experts, 2 * inter, h, generator=gen, device="cuda") * h ** -0.5)
                                  .bfloat16())
    w2, w2_s = quantize_experts((torch.randn(experts, h, inter, generator=gen, device="cuda") * inter ** -0.5)
                                .bfloat16())
    real_tile = op._tile
    default_split = op.moe_split_k(inter, True)
    results, ok = [], True
    for tokens in args.tokens:
        hidden = torch.randn(tokens, h, generator=gen, device="cuda").bfloat16()
        routed = torch.rand(tokens, experts - 1, generator=gen, device="cuda").argsort(dim=1)[:, :topk - 1]
        ids = torch.cat([routed, torch.full((tokens, 1), experts - 1, device="cuda")], 1).to(torch.int32).contiguous()
        weights = torch.rand(tokens, topk, generator=gen, device="cuda")
        hit = int(torch.unique(ids).numel())
        nbytes = hit * (w13[0].numel() + w13_s[0].numel() * 4)
        point = dict(tokens=tokens, experts_hit=hit, bytes=nbytes, floor_us=floors.floor_us(nbytes))
        default_tile = real_tile(inter, h, topk, torch.bfloat16, hidden.device, weight_tiles=2, fp8=True)
        default = (default_tile.block_n, default_split, default_tile.num_warps, default_tile.num_stages)
        point["default"] = _name(default)
        want = None
        for cfg in [default] + [c for c in _configs() if c != default]:
            block_n, split, warps, stages = cfg

            def tile(n, k_dim, k, dtype, device, weight_tiles=1, fp8=False, cfg=cfg):
                if weight_tiles == 2:
                    return op._Tile(cfg[0], op.FP8_BLOCK, cfg[2], cfg[3])
                return real_tile(n, k_dim, k, dtype, device, weight_tiles=weight_tiles, fp8=fp8)

            workspace = op.fused_moe_workspace(tokens, topk, experts, h, inter, hidden.device, torch.bfloat16,
                                               fp8=True, split_k=split)
            out = torch.empty_like(hidden)

            def call(split=split, workspace=workspace, out=out):
                op.fused_moe(hidden, w13, w2, ids, weights, out, w13_scale=w13_s, w2_scale=w2_s,
                             scale_fmt=scale_fmt, workspace=workspace, split_k=split, check_values=False)

            with mock.patch.object(op, "_tile", tile):
                replays = replay_events(call, iters=args.iters)
            gate_up = statistics.median(sum(e - s for name, s, e in r if name.startswith(GATE_UP_KERNELS)) / 1e3
                                        for r in replays)
            span = statistics.median((max(e for _, _, e in r) - min(s for _, s, _ in r)) / 1e3 for r in replays)
            point[f"{_name(cfg)}_gate_up_us"], point[f"{_name(cfg)}_call_us"] = gate_up, span
            if want is None:
                want = out.float()
            ok &= bool(torch.allclose(out.float(), want, rtol=2 ** -6, atol=2 ** -6 * want.abs().max().item()))
        names = [_name(c) for c in [default] + _configs()]
        best = min(names, key=lambda n: point[f"{n}_gate_up_us"])
        point.update(best=best, best_gate_up_us=point[f"{best}_gate_up_us"],
                     default_gate_up_us=point[f"{_name(default)}_gate_up_us"],
                     best_over_floor=point[f"{best}_gate_up_us"] / point["floor_us"])
        results.append(point)
    columns = ([("tokens", "T"), ("experts_hit", "experts hit"), ("floor_us", "gate/up floor µs"),
                ("default", "default"), ("default_gate_up_us", "default gate/up µs"), ("best", "best"),
                ("best_gate_up_us", "best gate/up µs"), ("best_over_floor", "best / floor")]
               + [(f"{_name(c)}_gate_up_us", f"{_name(c)} µs") for c in _configs()])
    write_results(f"moe_tiles_{args.preset}", dict(
        method=METHOD, params=dict(preset=args.preset, tokens=args.tokens, iters=args.iters,
                                   configs=[_name(c) for c in _configs()]),
        copy_gbps=floors.copy_gbps, empty_kernel_us=floors.empty_us, results=results),
        f"fused MoE gate/up tiles, {args.preset} (E {experts} with the shared expert, k {topk}, H {h}, I {inter}, "
        f"FP8; copy {floors.copy_gbps:.0f} GB/s)\n\n{markdown_table(columns, results)}", args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
