"""Row-invariant ``linear`` / ``bmm`` / ``rms_norm`` against torch (cuBLAS, eager) at the GLM-5 decode
shapes, in CUDA graphs. H200:

    PYTHONPATH=. python3 scripts/bench_row_invariant.py --out row_invariant.json [--mode main|sweep|both]

Each point is timed with ``dsaspec.bench.timing.compare`` (CUPTI per-replay device time, median of
``--iters`` graph replays, L2 flushed before each replay; floor = bytes / measured copy bandwidth).
After timing, every point checks the op against torch (bf16 tolerance 2**-6) and that its row 0 is
bitwise the M = 1 result; it also reports, for information, whether torch's row 0 is.
``--mode sweep`` times a grid of ``GemmConfig`` variants of ``linear`` at M in (1, 16, 128) and
reports the fastest per point (a tuning aid for ``gemm_config``; every variant is row-invariant).
"""

from __future__ import annotations

import argparse
from pathlib import Path
import dataclasses
import itertools
import json
import sys

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

from dsaspec.bench.results import machine_info, markdown_table
from dsaspec.bench.timing import COLD_L2_METHOD, Floors, compare, time_in_graph, warm_up_gpu
from dsaspec.ops import row_invariant as ri

LINEAR_SHAPES = [(6144, 2048), (6144, 576), (2048, 64 * 256), (6144, 4096), (4096, 6144), (6144, 154880)]
BMM_SHAPES = [(64, 192, 512), (64, 512, 256)]  # (heads, K, N): q_nope @ W_UK, o_latent @ W_UV^T
NORM_DIMS = [6144, 2048, 512]
MS = (1, 4, 16, 64, 128)
SWEEP_MS = (1, 16, 128)
DTYPE = torch.bfloat16


def _randn(*shape, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(DTYPE)


def _checks(ours, theirs, m: int) -> dict:
    """After timing: ``ours()`` close to ``theirs()``; row 0 bitwise equal to the M = 1 row, for both.
    Both take the row count and return ``[m, ...]``."""
    got, want = ours(m), theirs(m)
    torch.testing.assert_close(got.double(), want.double(), rtol=2**-6, atol=2**-6)
    if not torch.equal(ours(1)[0], got[0]):
        raise AssertionError(f"row 0 at M={m} differs from M=1: not row-invariant")
    return {"torch_row0_equals_m1": bool(torch.equal(theirs(1)[0], want[0]))}


def _point(kind: str, shape: dict, m: int, theirs, ours, nbytes: int, floors, iters: int) -> dict:
    """Time ``theirs(m)`` (baseline) against ``ours(m)``, then run :func:`_checks`."""
    row = {"op": kind, **shape, "m": m,
           **compare(lambda: theirs(m), lambda: ours(m), nbytes=nbytes, floors=floors, iters=iters)}
    row["ratio"] = row["new_us"] / row["baseline_us"]
    row.update(_checks(ours, theirs, m))
    print(f"{kind} {shape.get('k', shape.get('d'))} {shape.get('n', '')} M={m}: "
          f"{row['baseline_us']:.1f} -> {row['new_us']:.1f} us", flush=True)
    return row


def _shapes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in item.split("x")) for item in text.split(",") if item.strip()]


def bench_linear(shapes, floors, iters: int) -> list[dict]:
    rows = []
    for k, n in shapes:
        w = _randn(n, k, scale=k ** -0.5)
        x = _randn(max(MS), k)
        out = torch.empty(max(MS), n, dtype=DTYPE, device="cuda")
        shape = {"k": k, "n": n, "config": dataclasses.asdict(ri.gemm_config(n, k, DTYPE, w.device))}
        for m in MS:
            rows.append(_point("linear", shape, m, lambda r: F.linear(x[:r], w),
                               lambda r: ri.linear(x[:r], w, out[:r]), (n * k + m * (k + n)) * 2, floors, iters))
    return rows


def bench_bmm(floors, iters: int) -> list[dict]:
    """The model's views: ``a = rows.transpose(0, 1)`` ``[H, M, K]``; ``b`` a slice (N contiguous) for
    K = 192 and a transposed slice (K contiguous) for K = 512, as ``W_UK`` / ``W_UV^T``."""
    rows = []
    for heads, k, n in BMM_SHAPES:
        kv_b = _randn(heads, 448, 512, scale=512 ** -0.5)
        b = kv_b[:, :192] if k == 192 else kv_b[:, 192:].transpose(1, 2)
        x = _randn(max(MS), heads, k)
        out = torch.empty(heads, max(MS), n, dtype=DTYPE, device="cuda")
        shape = {"heads": heads, "k": k, "n": n,
                 "config": dataclasses.asdict(ri.gemm_config(n, k, DTYPE, x.device, batch=heads))}
        for m in MS:
            rows.append(_point("bmm", shape, m, lambda r: torch.bmm(x[:r].transpose(0, 1), b).transpose(0, 1),
                               lambda r: ri.bmm(x[:r].transpose(0, 1), b, out[:, :r]).transpose(0, 1),
                               (heads * k * n + heads * m * (k + n)) * 2, floors, iters))
    return rows


def _torch_rms_norm(x, w, eps):
    """The runtime's RMSNorm expression (dsaspec.layers.norm.RMSNorm)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def bench_rms_norm(floors, iters: int) -> list[dict]:
    rows = []
    eps = 1e-5
    for d in NORM_DIMS:
        w = _randn(d)
        x = _randn(max(MS), d)
        out = torch.empty_like(x)
        for m in MS:
            rows.append(_point("rms_norm", {"d": d}, m, lambda r: _torch_rms_norm(x[:r], w, eps),
                               lambda r: ri.rms_norm(x[:r], w, eps, out[:r]), (2 * m * d + d) * 2, floors, iters))
    return rows


def _variants(n: int, k: int) -> list[ri.GemmConfig]:
    configs = set()
    for block_m, block_n, block_k in itertools.product((16, 32), (32, 64, 128), (128, 256)):
        auto = ri.split_k_for(n, k, block_n, block_k, "cuda")
        for split in {auto, max(1, auto // 2), min(32, 2 * auto)}:
            configs.add(ri.GemmConfig(block_m, block_n, block_k, split, 4, 4 if block_k == 128 else 3))
    return sorted(configs, key=dataclasses.astuple)


def sweep_linear(shapes, iters: int) -> list[dict]:
    rows = []
    for k, n in shapes:
        w = _randn(n, k, scale=k ** -0.5)
        x = _randn(max(SWEEP_MS), k)
        default = ri.gemm_config(n, k, DTYPE, w.device)
        for m in SWEEP_MS:
            xm = x[:m]
            out = torch.empty(m, n, dtype=DTYPE, device="cuda")
            want = F.linear(xm, w)
            times = []
            for config in [default] + _variants(n, k):
                try:
                    ri.linear(xm, w, out, config=config)
                except OutOfResources as exc:  # a variant over the shared memory is reported, not timed
                    times.append({"config": dataclasses.asdict(config), "error": str(exc)[:200]})
                    continue
                torch.testing.assert_close(out.double(), want.double(), rtol=2**-6, atol=2**-6)
                us = time_in_graph(lambda: ri.linear(xm, w, out, config=config), iters=iters,
                                   graph_diff=False).median_us
                times.append({"config": dataclasses.asdict(config), "us": us})
            best = min((t for t in times if "us" in t), key=lambda t: t["us"])
            rows.append({"k": k, "n": n, "m": m, "default": times[0]["config"], "default_us": times[0]["us"],
                         "best": best["config"], "best_us": best["us"], "variants": times})
            print(f"sweep K={k} N={n} M={m}: default {times[0]['us']:.1f} us, best {best['us']:.1f} us "
                  f"{best['config']}", flush=True)
    return rows


def render_markdown(payload: dict) -> str:
    """The result tables of a results payload (the JSON this script writes)."""
    machine = payload["machine"]
    parts = [f"# row_invariant\n\nMachine: {machine.get('gpu')}, torch {machine['torch']}, triton {machine['triton']}, "
             f"{machine['date']}.\n\nMethod: {payload['method']}\n"]
    columns = [("op", "op"), ("k", "K"), ("n", "N"), ("d", "D"), ("m", "M"), ("baseline_us", "torch µs"),
               ("new_us", "row-invariant µs"), ("ratio", "ratio"), ("floor_us", "floor µs"),
               ("new_over_floor", "new / floor"), ("new_gbps", "new GB/s"),
               ("torch_row0_equals_m1", "torch row 0 = M 1")]
    if payload["rows"]:
        parts.append(markdown_table(columns, payload["rows"]))
    if payload["sweep"]:
        parts.append(markdown_table([("k", "K"), ("n", "N"), ("m", "M"), ("default_us", "default µs"),
                                     ("best_us", "best µs"), ("best", "best config")], payload["sweep"]))
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON results file")
    parser.add_argument("--iters", type=int, default=100, help="timed graph replays per measurement")
    parser.add_argument("--mode", choices=["main", "sweep", "both"], default="main",
                        help="main: the comparison table; sweep: GemmConfig variants of linear; both")
    parser.add_argument("--sweep-iters", type=int, default=30)
    parser.add_argument("--shapes", type=_shapes, default=LINEAR_SHAPES,
                        help="linear shapes as KxN,KxN,... (default: the six GLM-5 decode shapes)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: this benchmark needs a CUDA device", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    warm_up_gpu()
    floors = Floors.measure()
    rows = []
    if args.mode != "sweep":
        rows = (bench_linear(args.shapes, floors, args.iters) + bench_bmm(floors, args.iters)
                + bench_rms_norm(floors, args.iters))
    sweep = sweep_linear(args.shapes, args.sweep_iters) if args.mode != "main" else None
    payload = {"benchmark": "row_invariant", "machine": machine_info(),
               "method": COLD_L2_METHOD.format(iters=args.iters) + " ratio = row-invariant / torch.",
               "params": vars(args), "floors": vars(floors), "rows": rows, "sweep": sweep}
    with open(args.out, "w") as f:
        json.dump(payload, f, indent=2)
    markdown = render_markdown(payload)
    Path(args.out).with_suffix(".md").write_text(markdown)
    print(markdown)
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
