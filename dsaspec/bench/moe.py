"""Fused MoE (routed experts) at decode / verify token counts: fused op vs a baseline and the bytes floor.

A point is (T tokens, intermediate size I, expert weight dtype): ``E`` experts of ``[2I, H]``
gate/up and ``[H, I]`` down weights, ``k`` distinct experts per token drawn uniformly at random
(seeded), fp32 routing weights. ``--weight-dtype bf16``: bf16 weights; new: ``fused_moe`` with a
workspace (four launches sorted, two in the pair layout); baseline: the gather form of the
torch-native MoE fallbacks: each token's k expert matrices gathered by id (``w13[topk_ids]``,
``w2[topk_ids]``) and contracted with ``einsum`` (graph-safe, no host sync; skipped, recorded as
``baseline_skipped``, where its gathered weights exceed ``--baseline-max-gb``). ``--weight-dtype
fp8``: the same bf16 weights quantized per expert per 128 x 128 block
(:func:`dsaspec.ops.fp8_gemm.quantize_weight`: e4m3 codes, fp32 scales); new: ``fused_moe`` on
them (FP8 workspace, six launches sorted, four in the pair layout); baseline: the bf16 fused op on
the bf16 weights at the same point, since the question an FP8 row answers is whether FP8 experts
beat the bf16 ones in the same op (a torch dequantize-and-gather form would only add passes to the
bf16 gather baseline, so beating it would say nothing). Times are per layer, from CUDA-graph
replays with a cold L2 (dsaspec/bench/timing.py: CUPTI, median and spread).

Floor: the bytes a call must move at the measured copy bandwidth: the weights of the experts the
routing hits (each distinct expert's gate/up and down matrices once: 2 bytes a bf16 weight; 1 byte
an FP8 code plus its blocks' fp32 scales), the hidden rows read, the output written and the ids
and weights; for FP8 also the e4m3 codes and fp32 scales of the quantized hidden rows and of the
``T * k`` activation rows, each written and read once (at most 0.1% of the floor at the default
sizes); ``floor_us = max(bytes floor, empty kernel node)``. Next to it a same-bytes
device-to-device copy timed the same way. Target (issue 33), for both weight dtypes: within 1.3x
of the bytes floor from 1 to 64 tokens; and never slower than the baseline. After timing, a bf16
fused output is compared with the gather baseline's (bf16 rounding) and, at T <= 8, with the fp64
reference; an FP8 one, at T <= 8, with the fp64 FP8 reference (dequantized weights, quantized
activations; normwise within 2**-4 in bf16), its normwise distance to the bf16 output recorded.
Gate/up K splits: by default the MoE layer's rule per point (``moe_split_k(I, fp8)``: 4 for FP8
experts of I <= 256, else 1), so a row times the path the model runs; ``--split-k 1,4``: each point
and weight dtype once per split count instead (``fused_moe``'s ``split_k``), every one checked as
above. Rows carry ``split_k``; the FP8 baseline stays the bf16 fused op at split 1. ``--layout
sorted,pairs``: likewise a row per block layout (``fused_moe``'s
``sort_pairs``: True, False; ``auto``, the default, is its own choice by T * k; rows carry
``layout``), the FP8 baseline at ``auto``. Row blocks: by default the MoE layer's rule per T
(``moe_block_m``: 16 below 512 tokens, ``TALL_BLOCK_M`` from there, unsplit on tall blocks);
``--block-m 16,64,128``: a row per height instead (``fused_moe``'s ``block_m``; the pair layout,
16 rows only, is skipped at taller ones), the FP8 baseline at the same height; rows carry
``block_m``. ``--shared-experts S``: S more experts, each in every token's last S slots at
weight 1.0, as the MoE layer runs its shared expert (GLM-5 / DeepSeek-V3.2 ranks: 1). Without CUDA:
fixed small sizes under the Triton interpreter at fp32, every output checked against its reference, no times.
"""

from __future__ import annotations

import argparse
import time

import torch
from tqdm import tqdm

from dsaspec.bench.timing import COLD_L2_METHOD
from dsaspec.cli_parsing import (choice_list, format_value, nonnegative_int, positive_int, positive_int_list,
                                 use_cpu_sizes)
from dsaspec.errors import UserError
from dsaspec.ops.fp8_gemm import BLOCK as FP8_BLOCK, quantize_weight
from dsaspec.ops.fused_moe import (BLOCK_M, BLOCK_MS, FP8, fused_moe, fused_moe_workspace, moe_block_m,
                                   moe_split_k)
from dsaspec.reference.fused_moe import fused_moe as reference_fused_moe, fused_moe_fp8 as reference_fused_moe_fp8

FLOOR_FACTOR, NOISE = 1.3, 1.05
TARGET_MAX_TOKENS = 64
REFERENCE_MAX_TOKENS = 8
WEIGHT_DTYPES = ("bf16", "fp8")
LAYOUTS = {"auto": None, "sorted": True, "pairs": False}  # --layout: fused_moe's sort_pairs
BASELINES = {"bf16": "torch gather", "fp8": "bf16 fused"}
# Without CUDA: tokens, experts, k, H, I (FP8 blocks need H and I multiples of 128).
CPU_SIZES = dict(tokens=[1, 3, 8], experts=8, topk=2, hidden=128, intermediate=[128])


def _block_m_list(text: str) -> list[int]:
    """argparse type of ``--block-m``: comma-separated heights from :data:`BLOCK_MS`."""
    try:
        values = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        values = []
    if not values or any(v not in BLOCK_MS for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated values from {','.join(map(str, BLOCK_MS))}, "
                                         f"got {text!r}")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=positive_int_list, default=[1, 2, 4, 8, 16, 32, 64],
                   help="token counts T, comma-separated")
    p.add_argument("--experts", type=positive_int, default=256, help="routed experts E")
    p.add_argument("--topk", type=positive_int, default=8, help="experts per token k")
    p.add_argument("--hidden", type=positive_int, default=7168, help="hidden size H")
    p.add_argument("--intermediate", type=positive_int_list, default=[256, 2048],
                   help="expert intermediate sizes I, comma-separated (256: one rank of 2048 split over TP 8)")
    p.add_argument("--weight-dtype", type=choice_list(WEIGHT_DTYPES), default=list(WEIGHT_DTYPES),
                   help="expert weights, comma-separated: bf16, fp8 (e4m3 + fp32 scale per 128 x 128 block, "
                        "quantized from the same bf16 weights; H and I multiples of 128)")
    p.add_argument("--split-k", type=positive_int_list, default=None,
                   help="gate/up K splits of the fused op, comma-separated (each a row; 1: no split); default: "
                        "the MoE layer's rule per point (4 for FP8 experts of I <= 256, else 1)")
    p.add_argument("--layout", type=choice_list(LAYOUTS), default=["auto"],
                   help="block layouts of the fused op, comma-separated (each a row): sorted (align, combine), "
                        "pairs (no align, the combine in the down launch), auto (the op's choice by T * k)")
    p.add_argument("--block-m", type=_block_m_list, default=None,
                   help="row-block heights of the fused op, comma-separated from 16,64,128 (each a row); default: "
                        "the MoE layer's rule per T (16 below 512 tokens, else 64)")
    p.add_argument("--shared-experts", type=nonnegative_int, default=0,
                   help="shared experts run as extra experts in every token's last slots at weight 1.0 (as the MoE "
                        "layer runs them; GLM-5 / DeepSeek-V3.2: 1); --experts and --topk count the routed ones")
    p.add_argument("--baseline-max-gb", type=positive_int, default=16,
                   help="skip the baseline where its gathered expert weights exceed this many GB")
    p.add_argument("--iters", type=positive_int, default=100, help="timed graph replays per measurement")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="seed of the random inputs")
    p.add_argument("--out", default=None, help="results folder (default: benchmarks/results/<machine>)")


def _inputs(tokens: int, args, inter: int, device, dtype) -> tuple:
    gen = torch.Generator(device=device).manual_seed(args.seed + tokens + inter)
    h, e, k, shared = args.hidden, args.experts, args.topk, args.shared_experts
    if k > e:
        raise ValueError(f"--topk {k}: more than the {e} experts")
    hidden = torch.randn(tokens, h, generator=gen, device=device).to(dtype)
    w13 = (torch.randn(e + shared, 2 * inter, h, generator=gen, device=device) * h ** -0.5).to(dtype)
    w2 = (torch.randn(e + shared, h, inter, generator=gen, device=device) * inter ** -0.5).to(dtype)
    ids = torch.rand(tokens, e, generator=gen, device=device).argsort(dim=1)[:, :k].to(torch.int32)
    weights = torch.rand(tokens, k, generator=gen, device=device)
    if shared:  # the shared experts' slots: ids E .. E + S - 1 at weight 1.0
        slots = torch.arange(e, e + shared, dtype=torch.int32, device=device).expand(tokens, shared)
        ids = torch.cat([ids, slots], dim=1)
        weights = torch.cat([weights, weights.new_ones(tokens, shared)], dim=1)
    return hidden, w13, w2, ids.contiguous(), weights.contiguous()


def baseline_moe(hidden, w13, w2, ids, weights, out) -> torch.Tensor:
    """The gather form: ``w13[ids]`` ``[T, k, 2I, H]`` and ``w2[ids]`` contracted by ``einsum``,
    ``silu(gate) * up`` in the hidden dtype, the weighted sum over k in fp32; written to ``out``."""
    inter = w13.shape[1] // 2
    gate_up = torch.einsum("th,tkoh->tko", hidden, w13[ids.long()])
    act = torch.nn.functional.silu(gate_up[..., :inter]) * gate_up[..., inter:]
    down = torch.einsum("tki,tkhi->tkh", act, w2[ids.long()])
    out.copy_((down.float() * weights[..., None]).sum(1))
    return out


def quantize_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert's matrix of ``w [E, N, K]`` quantized per 128 x 128 block
    (:func:`~dsaspec.ops.fp8_gemm.quantize_weight`): e4m3 ``[E, N, K]``, fp32 ``[E, N / 128, K / 128]``."""
    experts, n, k = w.shape
    codes = torch.empty(w.shape, dtype=FP8, device=w.device)
    scales = torch.empty(experts, -(-n // FP8_BLOCK), k // FP8_BLOCK, dtype=torch.float32, device=w.device)
    for e in range(experts):
        codes[e], scales[e] = quantize_weight(w[e])
    return codes, scales


def bytes_moved(hidden, w13, w2, ids, weights, w13_scale=None, w2_scale=None) -> int:
    """Weights of the distinct experts hit (at their element size, plus their block scales with
    FP8), the hidden rows, the output, the ids and weights; with FP8 scales also the e4m3 codes and
    fp32 scales (one per 128 columns) of the hidden rows and the ``T * k`` activation rows, each
    written and read once."""
    hit = int(torch.unique(ids).numel())
    expert_bytes = w13[0].numel() * w13.element_size() + w2[0].numel() * w2.element_size()
    total = 2 * hidden.numel() * hidden.element_size() + ids.numel() * 4 + weights.numel() * 4
    if w13_scale is not None:
        expert_bytes += (w13_scale[0].numel() + w2_scale[0].numel()) * 4
        rows_cols = hidden.numel() + ids.numel() * w2.shape[2]  # [T, H] and [T * k, I]
        total += 2 * (rows_cols + rows_cols // FP8_BLOCK * 4)
    return hit * expert_bytes + total


def _normwise(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def _check_fp8(new_out, base_out, fp8_in, tokens: int, on_gpu: bool) -> dict:
    """FP8 output vs the fp64 FP8 reference (fp32: within 1e-3; bf16: normwise 2**-4, an activation
    one ulp off the reference's can move to the neighbouring e4m3 code) at T <= 8 or on CPU, and
    normwise within 2**-2 of the bf16 output (the e4m3 rounding of weights and activations: about
    6% at the CPU sizes)."""
    checks = {"normwise_diff_baseline": _normwise(new_out, base_out)}
    if checks["normwise_diff_baseline"] > 2**-2:
        raise AssertionError(f"FP8 fused MoE at T {tokens}: normwise distance to the bf16 output "
                             f"{checks['normwise_diff_baseline']:.3g} > 2**-2")
    if tokens <= REFERENCE_MAX_TOKENS or not on_gpu:
        want = reference_fused_moe_fp8(*fp8_in)
        if new_out.dtype == torch.float32:
            torch.testing.assert_close(new_out.double(), want.double(), rtol=1e-3, atol=1e-3)
        elif (error := _normwise(new_out, want)) > 2**-4:
            raise AssertionError(f"FP8 fused MoE at T {tokens}: normwise error {error:.3g} > 2**-4")
        checks["matches_reference"] = True
    return checks


def _check(new_out, base_out, args_in, tokens: int, on_gpu: bool) -> dict:
    checks = {}
    if base_out is not None:
        torch.testing.assert_close(new_out.float(), base_out.float(), rtol=2**-5, atol=2**-5)
        checks["max_abs_diff_baseline"] = float((new_out.float() - base_out.float()).abs().max())
    if tokens <= REFERENCE_MAX_TOKENS or not on_gpu:
        want = reference_fused_moe(*args_in).double()
        torch.testing.assert_close(new_out.double(), want, rtol=2**-5, atol=2**-5)
        if base_out is not None and not on_gpu:
            torch.testing.assert_close(base_out.double(), want, rtol=1e-5, atol=1e-5)
        checks["matches_reference"] = True
    return checks


def _targets(rows: list[dict]) -> list[dict]:
    """Within FLOOR_FACTOR of the floor at T <= 64; not slower than the baseline where it ran."""
    out = []
    for r in rows:
        if "new_us" not in r:
            continue
        where = {"tokens": r["tokens"], "intermediate": r["intermediate"], "weight_dtype": r["weight_dtype"],
                 "split_k": r["split_k"], "layout": r["layout"], "block_m": r.get("block_m", BLOCK_M)}
        if r["tokens"] <= TARGET_MAX_TOKENS:
            out.append(dict(where, target=f"<= {FLOOR_FACTOR:g}x bytes floor", value=r["new_over_floor"],
                            met=r["new_over_floor"] <= FLOOR_FACTOR))
        if r.get("baseline_us") is not None:
            out.append(dict(where, target=f"not slower than {r['baseline']} (x{NOISE:g} noise)",
                            value=r["speedup"], met=r["new_us"] <= NOISE * r["baseline_us"]))
    return out


def _time(new, baseline, nbytes: int, floors, iters: int) -> dict:
    from dsaspec.bench.timing import compare, copy_time_us, time_in_graph

    if baseline is not None:
        return compare(baseline, new, nbytes=nbytes, floors=floors, iters=iters)
    timing = time_in_graph(new, iters=iters, cold_l2=True)
    copy = copy_time_us(nbytes, iters=iters)
    floor = floors.floor_us(nbytes)
    return {"baseline_us": None, "new_us": timing.median_us, "floor_us": floor,
            "bytes_floor_us": nbytes / (floors.copy_gbps * 1e3), "empty_kernel_us": floors.empty_us,
            "new_gbps": nbytes / (timing.median_us * 1e3), "new_over_floor": timing.median_us / floor,
            "bytes": nbytes, "copy_us": copy, "new_over_copy": timing.median_us / copy,
            "spread": {"new": timing.spread}, "detail": {"new": timing.summary()}}


def _row(args, weight_dtype: str, split_k: int, layout: str, args_in: tuple, floors,
         block_m: int = BLOCK_M) -> dict:
    """One point with ``weight_dtype`` experts made from ``args_in`` (``_inputs``) and the fused
    op at ``split_k`` in ``layout`` (a :data:`LAYOUTS` key) on ``block_m``-row blocks: timed against
    its baseline where ``floors`` (CUDA) is given, then checked."""
    hidden, w13, w2, ids, weights = args_in
    tokens, inter = hidden.shape[0], w2.shape[2]
    shape = (tokens, ids.shape[1], w13.shape[0], args.hidden, inter, hidden.device, hidden.dtype)
    # the FP8 baseline: the bf16 op unsplit, its own layout, the same block height
    bf16_split, bf16_sort = (1, None) if weight_dtype == "fp8" else (split_k, LAYOUTS[layout])
    bf16_workspace = fused_moe_workspace(*shape, split_k=bf16_split, block_m=block_m)
    bf16_out, base_out = torch.empty_like(hidden), torch.empty_like(hidden)

    def bf16_fused():
        fused_moe(*args_in, bf16_out, workspace=bf16_workspace, split_k=bf16_split, sort_pairs=bf16_sort,
                  check_values=False, block_m=block_m)

    if weight_dtype == "fp8":
        (w13_q, w13_s), (w2_q, w2_s) = quantize_experts(w13), quantize_experts(w2)
        fp8_in = (hidden, w13_q, w13_s, w2_q, w2_s, ids, weights)
        fp8_workspace = fused_moe_workspace(*shape, fp8=True, split_k=split_k, block_m=block_m)
        new_out = torch.empty_like(hidden)
        fp8_args = (hidden, w13_q, w2_q, ids, weights, new_out)
        fp8_kwargs = dict(w13_scale=w13_s, w2_scale=w2_s, workspace=fp8_workspace, split_k=split_k,
                          sort_pairs=LAYOUTS[layout], block_m=block_m)
        fused_moe(*fp8_args, **fp8_kwargs)  # eager checks once

        def new():
            fused_moe(*fp8_args, **fp8_kwargs, check_values=False)

        baseline, nbytes = bf16_fused, bytes_moved(hidden, w13_q, w2_q, ids, weights, w13_s, w2_s)
    else:
        fused_moe(*args_in, bf16_out, workspace=bf16_workspace, split_k=split_k,
                  sort_pairs=bf16_sort, block_m=block_m)  # eager checks once
        new, new_out, baseline = bf16_fused, bf16_out, None
        gathered = tokens * ids.shape[1] * (w13[0].numel() + w2[0].numel()) * w13.element_size()
        if gathered <= args.baseline_max_gb * 1e9:
            def baseline():
                baseline_moe(*args_in, base_out)
        nbytes = bytes_moved(*args_in)
    row = {"tokens": tokens, "intermediate": inter, "weight_dtype": weight_dtype, "split_k": split_k,
           "layout": layout, "block_m": block_m, "baseline": BASELINES[weight_dtype],
           "experts_hit": int(torch.unique(ids).numel()),
           "baseline_skipped": baseline is None}
    if floors is not None:
        row.update(_time(new, baseline, nbytes, floors, args.iters))
    new()
    if baseline is not None:
        baseline()
    on_gpu = floors is not None
    if weight_dtype == "fp8":
        row.update(_check_fp8(new_out, bf16_out, fp8_in, tokens, on_gpu))
    else:
        row.update(_check(new_out, base_out if baseline is not None else None, args_in, tokens, on_gpu))
    return row


def run(args) -> int:
    from dsaspec.bench.results import bench_params, markdown_table, write_results

    on_gpu = torch.cuda.is_available()
    dtype = torch.bfloat16 if on_gpu else torch.float32
    if not on_gpu:
        ignored = use_cpu_sizes(args, add_arguments, CPU_SIZES, unused=("iters", "baseline_max_gb"))
        print(f"No CUDA: the Triton interpreter at fp32, T {format_value(args.tokens)}, E {args.experts}, "
              f"k {args.topk}, H {args.hidden}, I {format_value(args.intermediate)}. Outputs are checked "
              "against the reference; no time is measured (interpreter times mean nothing).")
        if ignored:
            print(ignored)
    args.weight_dtype = list(dict.fromkeys(args.weight_dtype))
    args.split_k = list(dict.fromkeys(args.split_k or []))
    args.layout = list(dict.fromkeys(args.layout))
    args.block_m = list(dict.fromkeys(args.block_m or []))
    if "fp8" in args.weight_dtype:
        bad = [f"--{name} {value}" for name, value in [("hidden", args.hidden)]
               + [("intermediate", i) for i in args.intermediate] if value % FP8_BLOCK]
        if bad:
            raise UserError(f"--weight-dtype fp8 needs multiples of {FP8_BLOCK} (the weight blocks), got "
                            + ", ".join(bad))
    device = torch.device("cuda" if on_gpu else "cpu")
    floors = None
    if on_gpu:
        from dsaspec.bench.timing import Floors, warm_up_gpu

        warm_up_gpu()
        floors = Floors.measure()
    started = time.monotonic()
    rows = []
    points = [(inter, tokens) for inter in args.intermediate for tokens in args.tokens]
    for inter, tokens in tqdm(points, desc="moe", unit="point"):
        args_in = _inputs(tokens, args, inter, device, dtype)
        rows.extend(_row(args, weight_dtype, split_k, layout, args_in, floors, block_m)
                    for weight_dtype in args.weight_dtype
                    for block_m in (args.block_m or [moe_block_m(tokens)])
                    for split_k in (args.split_k or [moe_split_k(inter, weight_dtype == "fp8", block_m)])
                    for layout in args.layout if not (layout == "pairs" and block_m > BLOCK_M))
        del args_in
    if on_gpu:
        torch.cuda.synchronize()
    targets = _targets(rows)
    method = (COLD_L2_METHOD.format(iters=args.iters) if on_gpu
              else "Triton interpreter on CPU: outputs checked against the reference, no times.")
    payload = {"method": method, "params": bench_params(args), "floors": vars(floors) if floors else None,
               "elapsed_s": time.monotonic() - started, "rows": rows, "targets": targets}
    if on_gpu:
        cols = [("tokens", "T"), ("intermediate", "I"), ("weight_dtype", "weights"), ("split_k", "split-K"),
                ("layout", "layout"), ("block_m", "block M"), ("experts_hit", "experts hit"), ("baseline", "baseline"),
                ("baseline_us", "baseline µs"), ("new_us", "fused µs"), ("speedup", "speedup"),
                ("floor_us", "floor µs"), ("new_over_floor", "fused / floor"), ("copy_us", "same-bytes copy µs"),
                ("new_gbps", "fused GB/s"), ("spread_new", "spread fused")]
        table = [dict(r, spread_new=r["spread"]["new"]) for r in rows]
    else:
        cols = [("tokens", "T"), ("intermediate", "I"), ("weight_dtype", "weights"), ("split_k", "split-K"),
                ("layout", "layout"), ("block_m", "block M"), ("experts_hit", "experts hit"),
                ("matches_reference", "== reference")]
        table = rows
    md = markdown_table(cols, table)
    if targets:
        met = sum(t["met"] for t in targets)
        md += (f"\n\n## Targets: {met} of {len(targets)} met\n\n"
               + markdown_table([("tokens", "T"), ("intermediate", "I"), ("weight_dtype", "weights"),
                                 ("split_k", "split-K"), ("layout", "layout"), ("block_m", "block M"),
                                 ("target", "target"),
                                 ("value", "value"), ("met", "met")],
                                [t for t in targets if not t["met"]] or [{"tokens": "(all met)"}]))
    write_results("moe", payload, md, args.out)
    return 0 if all(t["met"] for t in targets) else 1
