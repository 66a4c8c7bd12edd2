"""Time the decode step's RMSNorms on one GPU at the per-rank presets' widths and few rows: each row's
outputs from one program (the layout before, ``_NORM_TILE`` set to the row's block) against
programs of ``_NORM_TILE`` columns each (the default up to ``_NORM_TILED_PROGRAMS_PER_SM`` programs
per SM; here at every row count), side by side in one run. Norms: the input / post-attention norm (residual add, hidden width, FP8 codes written),
``q_a_layernorm`` (q latent width, FP8 codes) and ``kv_a_layernorm`` (the 512 latent, no codes).
Per point: the median per-replay span of a cold-L2 CUDA-graph replay (time_in_graph) against the
bytes floor (rows, residual, weight read; outputs, new residual, codes, scales written, at the
measured copy bandwidth; no launch beats an empty kernel node), and the two layouts' outputs
compared bitwise. Writes ``norms.json`` and ``.md`` to the folder given.

    python3 scripts/bench_norms.py OUT [--rows 1,4,32,128]
"""

from __future__ import annotations

import sys
from unittest import mock

import torch

from dsaspec.bench.results import markdown_table, write_results
from dsaspec.bench.timing import measured_floors_or_none, time_in_graph
from dsaspec.cli_parsing import Parser, parse_or_exit, positive_int, positive_int_list
from dsaspec.configs.model_config import PRESETS
from dsaspec.ops import row_invariant as ri

METHOD = ("CUDA-graph replays with a cold L2 (time_in_graph), median per-replay device span; the same inputs "
          "through both layouts (one program a row; programs of _NORM_TILE columns); floor = max(bytes read + "
          "written / measured copy bandwidth, empty kernel)")
PRESET_NAMES = ("glm5-fp8-tp8-rank", "deepseek-v32-fp8-tp8-rank")
# (_NORM_TILE, _NORM_TILED_PROGRAMS_PER_SM) of each layout
LAYOUTS = {"row": (ri._NORM_MAX_BLOCK, 0), "tiles": (ri._NORM_TILE, 1 << 30)}


def _norms(config):
    """(name, width, residual add, FP8 codes) of a layer's norms."""
    return [("input", config.hidden_size, True, True), ("q_a", config.q_lora_rank, False, True),
            ("kv_a", config.kv_lora_rank, False, False)]


def main() -> int:
    parser = Parser(prog="bench_norms", description="The decode RMSNorms: one program a row vs column tiles.")
    parser.add_argument("out", help="folder for norms.json / .md")
    parser.add_argument("--rows", type=positive_int_list, default=[1, 4, 32, 128], help="rows, comma-separated")
    parser.add_argument("--iters", type=positive_int, default=100, help="timed replays per point")
    args = parse_or_exit(parser)
    floors = measured_floors_or_none("bench_norms")
    if floors is None:
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    results, ok = [], True
    for preset in PRESET_NAMES:
        config = PRESETS[preset]
        fmt = config.quantization.scale_fmt
        for norm, d, add, quant in _norms(config):
            w = (torch.randn(d, device="cuda", generator=gen) * 0.1 + 1).bfloat16()
            for m in args.rows:
                x = torch.randn(m, d, device="cuda", generator=gen).bfloat16()
                r = torch.randn(m, d, device="cuda", generator=gen).bfloat16()
                outs = {}
                point = dict(preset=preset, norm=norm, d=d, rows=m)
                for layout, (tile, programs_per_sm) in LAYOUTS.items():
                    y, s = torch.empty_like(x), torch.empty_like(x)
                    codes = torch.empty(m, d, dtype=torch.float8_e4m3fn, device="cuda")
                    scales = torch.empty(m, d // 128, device="cuda")
                    fp8 = dict(q_out=codes, scale_out=scales, scale_fmt=fmt) if quant else {}

                    def launch(y=y, s=s, fp8=fp8):
                        if add:
                            ri.add_rms_norm(x, r, w, 1e-6, out=y, residual_out=s, **fp8)
                        else:
                            ri.rms_norm(x, w, 1e-6, out=y, **fp8)

                    with (mock.patch.object(ri, "_NORM_TILE", tile),
                          mock.patch.object(ri, "_NORM_TILED_PROGRAMS_PER_SM", programs_per_sm)):
                        timing = time_in_graph(launch, iters=args.iters)
                        launch()
                    outs[layout] = [y, s, codes, scales] if add else [y, codes, scales] if quant else [y]
                    point[f"{layout}_us"] = timing.median_us
                    point[layout] = timing.summary()
                ok &= all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                          for a, b in zip(outs["row"], outs["tiles"]))
                nbytes = 2 * m * d * (2 if add else 1) + 2 * d + 2 * m * d * (2 if add else 1)
                nbytes += (m * d + 4 * m * d // 128) if quant else 0
                point.update(bytes=nbytes, floor_us=floors.floor_us(nbytes),
                             speedup=point["row_us"] / point["tiles_us"])
                point["tiles_over_floor"] = point["tiles_us"] / point["floor_us"]
                results.append(point)
    columns = [("preset", "preset"), ("norm", "norm"), ("d", "D"), ("rows", "rows"), ("floor_us", "floor µs"),
               ("row_us", "one program a row µs"), ("tiles_us", f"{ri._NORM_TILE}-column programs µs"),
               ("speedup", "speedup"), ("tiles_over_floor", "tiles / floor")]
    write_results("norms", dict(
        method=METHOD, params=dict(rows=args.rows, iters=args.iters, tile=ri._NORM_TILE),
        copy_gbps=floors.copy_gbps, empty_kernel_us=floors.empty_us, bitwise_equal=ok, results=results),
        f"decode RMSNorms (copy {floors.copy_gbps:.0f} GB/s): one program a row vs {ri._NORM_TILE}-column "
        f"programs; outputs bitwise equal: {ok}\n\n{markdown_table(columns, results)}", args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
