"""Time ``fp8_linear`` (``act_quant``, then the GEMM) on one GPU at the FP8 GEMM shapes of one layer of
a per-rank preset and M rows, in its two forms: unsplit (one program per 16 x 64 tile over all of K)
or split (a program per tile and K group, the last of a tile adding the groups). Per shape and M:
the median per-replay span of a cold-L2 CUDA-graph replay (first to last device activity, so the
gaps between launches count) of each form, the form the defaults pick (``rule``), and each against
the bytes floor (weight codes and scales, the bf16 rows read and written, at the measured copy
bandwidth; no launch beats an empty kernel node); every form's bits checked equal.
``--programs-per-sm`` also times the split form with other ``SPLIT_PROGRAMS_PER_SM`` (other K
groups: other bits, not compared across values), ``--stages`` both forms with other pipeline depths
of 16-row tiles (``_GEMM_STAGES``: the same bits), and ``--block-m`` both forms with other tile
heights (``_GEMM_BLOCK_M``: 64 rows a tile give the tensor cores' warpgroup MMA and read the weights
M / 64 times instead of M / 16, but make each row's bits a function of the tile; other bits, not
compared across values). Writes ``fp8_linear_<preset>.json`` and ``.md`` to the folder given and
prints the table: where split stops winning sets the split threshold, where a taller tile starts
winning whether the default (not row-invariant) mode should take it from some M on.

    python3 scripts/bench_fp8_linear.py OUT [--preset deepseek-v32-fp8-tp8-rank] [--rows 1,4,16,64,128]
        [--programs-per-sm 2,4] [--stages 4,6] [--block-m 32,64]
"""

from __future__ import annotations

import contextlib
import sys

import torch

from dsaspec.bench.results import markdown_table, write_results
from dsaspec.bench.timing import Floors, time_in_graph, warm_up_gpu
from dsaspec.cli_parsing import Parser, parse_or_exit, positive_int, positive_int_list
from dsaspec.configs.model_config import PRESETS
from dsaspec.distributed.tp_group import TPGroup
from dsaspec.layers.attention.mla import MLAAttention
from dsaspec.ops import fp8_gemm as op

METHOD = ("CUDA-graph replays with a cold L2 (time_in_graph), median per-replay device span; the two forms of "
          "fp8_linear (act_quant, then the unsplit / split GEMM) on the same inputs, their bits compared; "
          "floor = max((weight codes + scales + rows read + rows written) / measured copy bandwidth, empty kernel)")


def linear_shapes(config) -> dict[str, tuple[int, int]]:
    """``(N, K)`` of the FP8 GEMMs of one layer of ``config`` (a layer with an indexer): the fused
    attention GEMMs as :meth:`~dsaspec.layers.attention.mla.MLAAttention.fuse_projections` builds
    them (``fused_input``: ``q_a_proj`` + the indexer's ``wk`` + ``kv_a_proj_with_mqa``;
    ``fused_latent``: ``q_b_proj`` + the indexer's ``wq_b``), ``q_b_proj`` alone (seeded draft
    steps skip the indexer), ``o_proj`` and the shared expert's gate/up and down."""
    attn = MLAAttention(config, 0, TPGroup.single(), torch.device("meta"), torch.bfloat16)
    attn.fuse_projections()
    shapes = {name: tuple(linear.weight.shape) for name, linear in (
        ("fused_input", attn.fused_input.gemm), ("fused_latent", attn.fused_latent.gemm),
        ("q_b_proj", attn.q_b_proj), ("o_proj", attn.o_proj))}
    shared = config.moe_intermediate_size * config.n_shared_experts
    if shared:
        shapes |= {"shared_gate_up": (2 * shared, config.hidden_size), "shared_down": (config.hidden_size, shared)}
    return shapes


@contextlib.contextmanager
def overridden(name: str, value: int | None):
    """The ``fp8_gemm`` module constant ``name`` set to ``value`` (None: unchanged) while active."""
    default = getattr(op, name)
    setattr(op, name, default if value is None else value)
    try:
        yield
    finally:
        setattr(op, name, default)


def main() -> int:
    parser = Parser(prog="bench_fp8_linear", description="fp8_linear: split / unsplit.")
    parser.add_argument("out", help="folder for fp8_linear_<preset>.json / .md")
    fp8_presets = sorted(name for name, config in PRESETS.items() if config.quantization is not None)
    parser.add_argument("--preset", default="deepseek-v32-fp8-tp8-rank", choices=fp8_presets)
    parser.add_argument("--rows", type=positive_int_list, default=[1, 4, 16, 64, 128], help="M values, comma-separated")
    parser.add_argument("--iters", type=positive_int, default=100, help="timed replays per point")
    parser.add_argument("--programs-per-sm", type=positive_int_list, default=[],
                        help=f"also time the split form at these SPLIT_PROGRAMS_PER_SM (default "
                             f"{op.SPLIT_PROGRAMS_PER_SM} only), comma-separated")
    parser.add_argument("--stages", type=positive_int_list, default=[],
                        help=f"also time both forms with these many pipeline stages in 16-row tiles (default "
                             f"{op._GEMM_STAGES} only), comma-separated")
    parser.add_argument("--block-m", type=positive_int_list, default=[],
                        help=f"also time both forms with tiles of these many rows, powers of two >= 16 "
                             f"(default {op._GEMM_BLOCK_M} only), comma-separated")
    args = parse_or_exit(parser)
    bad = [v for v in args.block_m if v < 16 or v & (v - 1)]
    if bad:
        print(f"bench_fp8_linear: error: --block-m: expected powers of two >= 16, got {bad[0]}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_fp8_linear: error: needs a CUDA device", file=sys.stderr)
        return 2
    config = PRESETS[args.preset]
    scale_fmt = config.quantization.scale_fmt
    sweep = [v for v in args.programs_per_sm if v != op.SPLIT_PROGRAMS_PER_SM]
    tiles = [v for v in args.block_m if v != op._GEMM_BLOCK_M]
    stages = [v for v in args.stages if v != op._GEMM_STAGES]
    # form -> (split, the constant it overrides, its value); a form's name tags the value
    tags = {"SPLIT_PROGRAMS_PER_SM": "", "_GEMM_BLOCK_M": "m", "_GEMM_STAGES": "s"}
    variants = ([(False, None, None), (True, None, None)] + [(True, "SPLIT_PROGRAMS_PER_SM", v) for v in sweep]
                + [(split, "_GEMM_STAGES", v) for v in stages for split in (False, True)]
                + [(split, "_GEMM_BLOCK_M", v) for v in tiles for split in (False, True)])
    forms = {("split" if split else "unsplit") + ("" if const is None else f"@{tags[const]}{v}"): (split, const, v)
             for split, const, v in variants}
    warm_up_gpu()
    floors = Floors.measure()
    device = torch.device("cuda")
    results = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in linear_shapes(config).items():
        w, w_s = op.quantize_weight(torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5)
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            plan = op.gemm_plan(m, n, k, device)
            rule = "split" if plan[2] else "unsplit"
            nbytes = n * k + 4 * -(-n // op.BLOCK) * (k // op.BLOCK) + 2 * m * (k + n)
            point = dict(layer=name, n=n, k=k, m=m, group=plan[0], groups=plan[1], rule=rule, bytes=nbytes,
                         floor_us=floors.floor_us(nbytes), bytes_floor_us=nbytes / (floors.copy_gbps * 1e3))
            outs = {}
            for form, (split, const, value) in forms.items():
                out = outs[form] = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
                with overridden(const or "SPLIT_PROGRAMS_PER_SM", value):
                    timing = time_in_graph(lambda: op.fp8_linear(x, w, w_s, scale_fmt, out=out, split=split),
                                           iters=args.iters)
                point[form] = timing.summary()
                point[f"{form}_us"] = timing.median_us
                point[f"{form}_over_floor"] = timing.median_us / point["floor_us"]
            same_groups = [outs[form].view(torch.int16) for form, (_, const, _) in forms.items()
                           if const in (None, "_GEMM_STAGES")]
            point["bitwise_equal"] = all(torch.equal(bits, same_groups[0]) for bits in same_groups)
            point["rule_us"] = point[f"{rule}_us"]
            point["rule_over_floor"] = point["rule_us"] / point["floor_us"]
            point["split_speedup"] = point["unsplit_us"] / point["split_us"]
            results.append(point)
    columns = ([("layer", "layer"), ("n", "N"), ("k", "K"), ("m", "M"), ("group", "G"), ("groups", "groups"),
                ("floor_us", "floor µs")] + [(f"{form}_us", f"{form} µs") for form in forms]
               + [("split_speedup", "split speedup"), ("rule", "rule"), ("rule_over_floor", "rule / floor"),
                  ("bitwise_equal", "bitwise")])
    table = markdown_table(columns, results)
    write_results(f"fp8_linear_{args.preset}", dict(
        method=METHOD, params=dict(preset=args.preset, scale_fmt=scale_fmt, rows=args.rows, iters=args.iters,
                                   programs_per_sm=[op.SPLIT_PROGRAMS_PER_SM] + sweep,
                                   stages=[op._GEMM_STAGES] + stages,
                                   block_m=[op._GEMM_BLOCK_M] + tiles),
        copy_gbps=floors.copy_gbps, empty_kernel_us=floors.empty_us,
        split_programs_per_sm=op.SPLIT_PROGRAMS_PER_SM, results=results),
        f"fp8_linear, {args.preset} (scale_fmt {scale_fmt}, copy {floors.copy_gbps:.0f} GB/s): "
        f"split / unsplit\n\n{table}", args.out)
    return 0 if all(p["bitwise_equal"] for p in results) else 1


if __name__ == "__main__":
    sys.exit(main())
