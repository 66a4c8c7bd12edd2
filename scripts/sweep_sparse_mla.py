"""Where sparse MLA's time goes on one GPU (GLM-5 shapes: 576-wide latent keys, k = 2048; 64 heads a
row, or ``--heads``, a rank's share, except with ``--timeline``; cold L2, CUDA graphs): per point,
the op's total per replay and each of its kernels (the split kernel and the combine) from CUPTI, for
the default launch (the Gluon kernel from two rows on a Hopper GPU), the Triton kernel's default,
the combine with one or two column blocks per head, and other split counts / configs (among them a
deeper Triton pipeline, 5 stages of 32 slots, and the Gluon kernel at 1, 2, 4 and its default
splits); next to them an empty kernel, and a copy of the bytes the point must gather (its bytes
floor). ``--grid`` instead times a grid of tile shapes (heads per program, value columns, warps,
slots per block), by default at the points of one or four rows, each at the split count that fills
the SMs, at half and at a quarter of it. ``--timeline`` instead times the Gluon kernel's phases
inside its programs (its ``trace`` stamps: SM clock, cold L2, the last of 5 launches; medians over
the programs) next to the op's per-kernel times, at the points where the default op runs it.
``--points`` picks the points.

Points: decode and 4-row verify at bs 1 with 1k live tokens (valid slots first, then -1, as the
top-k writes them for short rows), decode bs 1 / 16 / 32 / 64 and verify bs 32 at 64k (2048
random slots), and decode bs 16 without a valid slot (``--timeline`` only, by default). Writes
``sweep_sparse_mla.json`` and ``.md`` (``_grid``, ``_timeline``) into the folder given as the first
argument (the combine's µs, a programmatic dependent launch, include its wait for the split kernel).

    python3 scripts/sweep_sparse_mla.py $OUT           # timings
    python3 scripts/sweep_sparse_mla.py --grid $OUT    # tile shapes at 1-4 rows
    python3 scripts/sweep_sparse_mla.py --grid --heads 8 --points decode_bs1_1k,decode_bs1_64k $OUT
    python3 scripts/sweep_sparse_mla.py --timeline $OUT   # the Gluon kernel's phases
    python3 scripts/sweep_sparse_mla.py --eager POINT  # run one point's default op 5 times (for ncu)
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

import torch
import triton

from dsaspec.bench.timing import L2Flusher, copy_time_us, empty_kernel_us, replay_events, warm_up_gpu
from dsaspec.errors import UserError
from dsaspec.ops import sparse_mla, sparse_mla_gluon
from dsaspec.cli_parsing import Parser, positive_int
from dsaspec.ops.device import sm_count
from dsaspec.ops.sparse_mla import (QK_DIM, SPARSE_MLA_CONFIG, SPARSE_MLA_FEW_ROWS_CONFIG,
                                    SPARSE_MLA_GLUON_CONFIG, SparseMLAConfig, sparse_mla_config,
                                    sparse_mla_decode, sparse_mla_workspace)

K, NUM_SLOTS = 2048, 1 << 20
POINTS = {"decode_bs1_1k": (1, 1024), "verify_bs1_1k": (4, 1024), "decode_bs1_64k": (1, 65536),
          "decode_bs16_64k": (16, 65536), "decode_bs32_64k": (32, 65536),
          "decode_bs64_64k": (64, 65536), "verify_bs32_64k": (128, 65536),
          "decode_bs16_no_valid_slot": (16, 0)}
SWEEP_POINTS = [name for name in POINTS if name != "decode_bs16_no_valid_slot"]
TIMELINE_POINTS = ("verify_bs1_1k", "decode_bs16_64k", "decode_bs32_64k", "decode_bs64_64k",
                   "verify_bs32_64k", "decode_bs16_no_valid_slot")
# (name, from stamp, to stamp), stamps named as in sparse_mla_gluon.TRACE_STAMPS
PHASES = tuple((name, sparse_mla_gluon.TRACE_STAMPS.index(first),
                sparse_mla_gluon.TRACE_STAMPS.index(last)) for name, first, last in (
    ("attend_scan", "attend partition start", "attend partition's scan done"),
    ("gather_scan", "program start", "gather partition's scan done"),
    ("gather_first_copies", "program start", "first block's copies issued"),
    ("first_block_in_smem", "program start", "first block in shared memory"),
    ("blocks", "first block in shared memory", "blocks done"),
    ("store", "blocks done", "result stored"),
    ("program", "program start", "result stored")))
START, END = (sparse_mla_gluon.TRACE_STAMPS.index(name) for name in ("program start", "result stored"))


def _inputs(rows: int, live: int, heads: int, gen) -> dict:
    device = torch.device("cuda")
    if live <= K:
        slots = torch.full((rows, K), -1, dtype=torch.int32, device=device)
        slots[:, :live] = torch.randperm(NUM_SLOTS, device=device, generator=gen)[:live].int()
    else:
        slots = torch.stack([torch.randperm(NUM_SLOTS, device=device, generator=gen)[:K] for _ in range(rows)]).int()
    return dict(q=torch.randn(rows, heads, QK_DIM, device=device, generator=gen).bfloat16(),
                kv=torch.randn(NUM_SLOTS, QK_DIM, device=device, generator=gen).bfloat16(),
                slots=slots, out=torch.empty(rows, heads, 512, device=device, dtype=torch.bfloat16),
                valid=min(live, K) * rows)


def _per_kernel(fn, iters: int = 100) -> dict:
    """Median total span per replay and median duration of each kernel (CUPTI), cold L2."""
    replays = replay_events(fn, iters=iters, warmup=3)
    kernels = {}
    for replay in replays:
        for name, start, end in replay:
            kernels.setdefault(name.split("(")[0][:60], []).append((end - start) / 1e3)
    spans = [(max(e for _, _, e in r) - min(s for _, s, _ in r)) / 1e3 for r in replays]
    return dict(total_us=statistics.median(spans),
                kernels_us={name: statistics.median(d) for name, d in kernels.items()})


def _variants(rows: int, heads: int) -> dict:
    """name -> (config, splits (None: the default workspace), module settings for the run, e.g.
    ``COMBINE_FEW_HEAD_ROWS`` (the combine's column rule))."""
    default = sparse_mla_config(rows, heads, split=True, device="cuda")
    out = {"default": (default, None, {}),
           "triton_default": (sparse_mla_config(rows, heads, split=True), None, {}),
           "default_combine_512_columns": (default, None, {"COMBINE_FEW_HEAD_ROWS": 0}),
           "default_combine_256_columns": (default, None, {"COMBINE_FEW_HEAD_ROWS": 1 << 30})}
    for splits in (4, 8, 16, 32):
        out[f"few_rows_splits{splits}"] = (SPARSE_MLA_FEW_ROWS_CONFIG, splits, {})
        out[f"config_splits{splits}"] = (SPARSE_MLA_CONFIG, splits, {})
    out["dv256_n32_w4_splits16"] = (SparseMLAConfig(64, 32, 4, 2, block_dv=256), 16, {})
    out["n32_w8_stages5_splits8"] = (SparseMLAConfig(64, 32, 8, 5), 8, {})
    for splits in (1, 2, 4):
        out[f"gluon_splits{splits}"] = (SPARSE_MLA_GLUON_CONFIG, splits, {})
    out["gluon_default_splits"] = (SPARSE_MLA_GLUON_CONFIG, None, {})
    out["nosplit"] = (SPARSE_MLA_CONFIG, 1, {})
    out["nosplit_n32_w8_stages5"] = (SparseMLAConfig(64, 32, 8, 5), 1, {})
    return out


GRID_POINTS = ("decode_bs1_1k", "verify_bs1_1k", "decode_bs1_64k")


def _grid_variants(rows: int, heads: int) -> dict:
    """Tile shapes for few rows (block_h, block_dv, num_warps, block_n; a block_h above what
    ``heads`` fills taken once, as the op clamps it), each at the split count that keeps one program
    per SM, at half and at a quarter of it."""
    shapes = ([(16, dv, 4, n) for dv in (256, 512) for n in (16, 32, 64)]
              + [(16, 512, 2, 32), (16, 512, 8, 32), (16, 128, 4, 32)]
              + [(32, dv, w, 32) for dv in (128, 256, 512) for w in (4, 8)]
              + [(64, dv, 4, n) for dv in (128, 256) for n in (16, 32)]
              + [(64, 512, 8, 64)])  # SPARSE_MLA_CONFIG's tiles
    out = {}
    for block_h, block_dv, warps, block_n in shapes:
        block_h = sparse_mla._block_h(heads, SparseMLAConfig(block_h, block_n, warps, 2))
        config = SparseMLAConfig(block_h, block_n, warps, 2, block_dv=block_dv, max_splits=64)
        fill = sparse_mla.sparse_mla_num_splits(rows, heads, sm_count("cuda"), config)
        for splits in sorted({fill, max(1, fill // 2), max(1, fill // 4)}):
            out.setdefault(f"h{block_h}_dv{block_dv}_w{warps}_n{block_n}_splits{splits}", (config, splits, {}))
    return out


def _run(x: dict, config: SparseMLAConfig, splits: int | None):
    rows, heads = x["q"].shape[:2]
    if splits is None:
        workspace = sparse_mla_workspace(rows, heads, x["q"].device, config=config)
    else:
        workspace = None if splits == 1 else sparse_mla_workspace(rows, heads, x["q"].device, num_splits=splits)

    def fn():
        sparse_mla_decode(x["q"], x["kv"], x["slots"], QK_DIM ** -0.5, x["out"], check_values=False,
                          workspace=workspace, config=config)
    return fn, (1 if workspace is None else workspace.shape[2])


def _timeline(x: dict) -> dict:
    """The default op's per-kernel times, and the Gluon kernel's phases (µs, median / max over
    the programs that reached both stamps) in the last of 5 cold-L2 launches."""
    rows = x["q"].shape[0]
    heads = x["q"].shape[1]
    workspace = sparse_mla_workspace(rows, heads, x["q"].device)
    fn, splits = _run(x, sparse_mla_config(rows, heads, workspace is not None, "cuda"), None)
    programs = rows * triton.cdiv(heads, sparse_mla_gluon.HEADS_PER_PROGRAM) * splits
    trace = torch.zeros(programs, 2 * len(sparse_mla_gluon.TRACE_STAMPS), dtype=torch.int64,
                        device="cuda")
    flusher = L2Flusher()
    for _ in range(5):
        trace.zero_()
        flusher()
        sparse_mla_gluon.launch_sparse_mla_gluon(
            x["q"], x["kv"], x["slots"], x["out"], workspace, QK_DIM ** -0.5 * math.log2(math.e),
            scan=K, record_width=sparse_mla.RECORD_WIDTH, trace=trace)
    torch.cuda.synchronize()
    stamps = trace.view(programs, -1, 2).double()
    clock, timer = stamps[..., 0], stamps[..., 1]
    ghz = ((clock[:, END] - clock[:, START])
           / (timer[:, END] - timer[:, START]).clamp(min=1)).median().item()
    phases = {}
    for name, first, last in PHASES:
        reached = (clock[:, first] != 0) & (clock[:, last] != 0)
        if reached.any():
            us = (clock[reached, last] - clock[reached, first]) / ghz / 1e3
            phases[name] = dict(median_us=us.median().item(), max_us=us.max().item())
    return dict(splits=splits, programs=programs, sm_ghz=ghz,
                last_program_end_us=(timer[:, END].max() - timer[:, START].min()).item() / 1e3,
                phases=phases) | _per_kernel(fn)


def _timeline_markdown(results: list[dict]) -> str:
    lines = ["| point | splits | op µs | " + " | ".join(f"{name} µs" for name, _, _ in PHASES)
             + " |", "|---" * (3 + len(PHASES)) + "|"]
    for row in results:
        cells = [f"{row['phases'][name]['median_us']:.2f}" if name in row["phases"] else "–"
                 for name, _, _ in PHASES]
        lines.append(f"| {row['point']} | {row['splits']} | {row['total_us']:.2f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def sweep_markdown(results: list[dict]) -> str:
    """The timings of ``results`` (rows of ``sweep_sparse_mla.json`` / ``_grid.json``) as Markdown: a
    table per point, its bytes floor first, the variants from fastest."""
    lines = []
    for floor in (row for row in results if row["part"] == "copy_floor"):
        lines += [f"## {floor['point']}, {floor.get('heads', 64)} heads: copy of the gathered bytes "
                  f"{floor['us']:.2f} µs ({floor['bytes']} B)", "",
                  "| variant | splits | op µs | op / copy | split kernel µs | combine µs |", "|---" * 6 + "|"]
        rows = sorted((row for row in results if row["part"] == "variant" and row["point"] == floor["point"]
                       and "error" not in row), key=lambda row: row["total_us"])
        for row in rows:
            kernels = row["kernels_us"]
            split = next((us for name, us in kernels.items() if "combine" not in name), float("nan"))
            combine = kernels.get("_sparse_mla_combine_kernel")
            lines.append(f"| {row['variant']} | {row['splits']} | {row['total_us']:.2f} | "
                         f"{row['total_us'] / floor['us']:.2f} | {split:.2f} | "
                         + ("–" if combine is None else f"{combine:.2f}") + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    try:
        args = _parse_args()
    except UserError as err:
        print(f"sweep_sparse_mla: error: {err}", file=sys.stderr)
        return 2
    return _sweep(args)


def _parse_args():
    """The options, checked (a ``UserError`` names the one that is wrong)."""
    parser = Parser(description="Where sparse MLA's time goes (per kernel, CUPTI).")
    parser.add_argument("out", nargs="?", type=Path, default=Path("."), help="folder for sweep_sparse_mla.json")
    parser.add_argument("--eager", choices=sorted(POINTS), help="only run this point's default op 5 times (for ncu)")
    parser.add_argument("--grid", action="store_true", help="time tile shapes instead (sweep_sparse_mla_grid.json)")
    parser.add_argument("--timeline", action="store_true",
                        help="time the Gluon kernel's phases instead (sweep_sparse_mla_timeline.json, .md)")
    parser.add_argument("--points", type=lambda text: text.split(","), default=None,
                        help=f"comma-separated points of {sorted(POINTS)} (default: {','.join(SWEEP_POINTS)}; "
                             f"with --grid {','.join(GRID_POINTS)}; with --timeline {','.join(TIMELINE_POINTS)})")
    parser.add_argument("--heads", type=positive_int, default=64,
                        help="query heads a row (default 64: a GLM-5 row; 8 / 16 / 32: a TP 8 / 4 / 2 rank's share)")
    args = parser.parse_args()
    if args.grid and args.timeline:
        parser.error("--grid and --timeline: expected at most one of them")
    if args.timeline and args.heads != 64:
        parser.error(f"--heads: --timeline stamps the 64-head Gluon kernel only, got {args.heads}")
    names = args.points or (GRID_POINTS if args.grid else TIMELINE_POINTS if args.timeline else SWEEP_POINTS)
    unknown = sorted(set(names) - set(POINTS))
    if unknown:
        parser.error(f"--points: unknown {unknown}; expected some of {sorted(POINTS)}")
    if not torch.cuda.is_available():
        raise UserError("needs a CUDA device")
    if args.timeline:
        off_gluon = [name for name in names if sparse_mla_config(
            POINTS[name][0], args.heads, split=True, device="cuda").kernel != "gluon"]
        if off_gluon:
            parser.error(f"--points: the default op does not run the Gluon kernel at {off_gluon}")
    args.names = names
    return args


def _sweep(args) -> int:
    names = args.names
    points = {name: POINTS[name] for name in names}
    if args.eager:
        rows, live = POINTS[args.eager]
        x = _inputs(rows, live, args.heads, torch.Generator(device="cuda").manual_seed(0))
        fn, _ = _run(x, sparse_mla_config(rows, args.heads, split=True, device="cuda"), None)
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        return 0
    out_dir = args.out
    warm_up_gpu()
    if args.timeline:
        timeline = []
        for point in names:
            rows, live = POINTS[point]
            x = _inputs(rows, live, args.heads, torch.Generator(device="cuda").manual_seed(0))
            timeline.append(dict(point=point, rows=rows, live=live) | _timeline(x))
            print(json.dumps(timeline[-1]), flush=True)
        (out_dir / "sweep_sparse_mla_timeline.json").write_text(json.dumps(timeline, indent=1))
        (out_dir / "sweep_sparse_mla_timeline.md").write_text(_timeline_markdown(timeline))
        print(_timeline_markdown(timeline))
        return 0
    results = [dict(part="empty_kernel", us=empty_kernel_us())]
    for point, (rows, live) in points.items():
        x = _inputs(rows, live, args.heads, torch.Generator(device="cuda").manual_seed(0))
        gathered = x["valid"] * QK_DIM * 2 + x["q"].numel() * 2 + x["out"].numel() * 2
        results.append(dict(part="copy_floor", point=point, heads=args.heads, bytes=gathered,
                            us=copy_time_us(gathered)))
        print(json.dumps(results[-1]), flush=True)
        for name, (config, splits, settings) in (_grid_variants if args.grid else _variants)(rows, args.heads).items():
            defaults = {key: getattr(sparse_mla, key) for key in settings}
            for key, value in settings.items():
                setattr(sparse_mla, key, value)
            try:
                fn, used = _run(x, config, splits)
                row = dict(part="variant", point=point, heads=args.heads, variant=name, splits=used,
                           config=vars(config), settings=settings) | _per_kernel(fn)
            except Exception as error:  # e.g. a tile shape that does not fit in shared memory
                row = dict(part="variant", point=point, heads=args.heads, variant=name, error=repr(error)[:200])
            for key, value in defaults.items():
                setattr(sparse_mla, key, value)
            results.append(row)
            print(json.dumps(row), flush=True)
    name = "sweep_sparse_mla_grid" if args.grid else "sweep_sparse_mla"
    (out_dir / f"{name}.json").write_text(json.dumps(results, indent=1))
    (out_dir / f"{name}.md").write_text(f"# {name} ({torch.cuda.get_device_name()})\n\n" + sweep_markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
