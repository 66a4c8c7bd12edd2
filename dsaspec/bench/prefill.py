"""Prefill of one request (TTFT): its time by chunk size, the phases its kernels take, its floor.

Model: ``--preset`` (default ``glm5-fp8-tp8-rank``, one TP 8 rank of GLM-5 with FP8 weights;
``--layers`` cuts it to its first layers, for an 80 GB GPU), seeded random weights, bf16, Triton
ops. Per KV cache dtype (``--kv-cache-dtype``) and chunk size (``--chunk-sizes``: 512, the engine's
former default, and 4,096, its default), one request with a ``--prompt-len``-token random prompt is
prefilled the way the engine prefills it
(:meth:`~dsaspec.speculative.spec_worker.SpecWorker.prefill`: the target over the prompt in chunks,
eagerly, its greedy token from the last row; then the MTP layer over the prompt shifted by one, its
greedy draft), ``--runs`` times after one warm-up run (the Triton compiles). TTFT = the median wall
time of a run (host: from the call until its token is on the host); spread = (max - min) / median;
prefill tok/s = prompt tokens / TTFT.

Phases: one more run under torch.profiler with the phase markers of
:mod:`dsaspec.bench.phases` (DSA kernels by name, every other kernel by the module that launched
it; a kernel between two modules counts to the phase of the one before it). GPU busy = the time
the kernels cover; TTFT - GPU busy is time the GPU waits on the host (launches, and the eager
ops' value checks, which sync). Floor: :meth:`~dsaspec.bench.floors.FloorModel.prefill` (target
and MTP layer, a forward a chunk) at the rates measured in the same run, by phase.

Without CUDA: the ``tiny`` preset in fp32 with the torch reference ops, a short prompt and small
chunks; no time is measured. Every run reports its first token and draft and how far the MTP
layer's output on the last row lies from the largest chunk's (max abs difference): chunking changes
GEMM shapes, not the math.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tqdm import tqdm

from dsaspec.bench.floors import FloorModel, Rates, add_costs, floor_markdown, floor_rows
from dsaspec.bench.presets import add_preset_arguments, preset_config
from dsaspec.bench.phases import PHASE_PATTERNS, PhaseMarkers, attribute_kernels, kernel_table, phase_sums
from dsaspec.cli_parsing import choice_list, format_value, nonnegative_int, positive_int, positive_int_list, \
    use_cpu_sizes
from dsaspec.configs.runtime_options import RuntimeOptions
from dsaspec.memory import KV_CACHE_DTYPES, PAGE_SIZE, KVPool, PageAllocator, ReqToTokenPool, RequestSlots, \
    resolve_kv_cache_dtype
from dsaspec.models.dsa_model import DSAModel
from dsaspec.speculative.spec_worker import SpecConfig, build_spec_worker


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_preset_arguments(p, default="glm5-fp8-tp8-rank")
    p.add_argument("--prompt-len", type=positive_int, default=16384, help="prompt tokens")
    p.add_argument("--chunk-sizes", type=positive_int_list, default=[512, 4096],
                   help="comma-separated prefill chunk sizes (rows a forward)")
    p.add_argument("--kv-cache-dtype", type=choice_list(KV_CACHE_DTYPES), default=["bf16", "fp8_e4m3"],
                   help="KV cache dtypes, comma-separated: bf16 (the model's dtype; auto is bf16) and/or fp8_e4m3")
    p.add_argument("--runs", type=positive_int, default=3, help="timed prefills per point, after one warm-up")
    p.add_argument("--no-profile", action="store_true",
                   help="skip the profiled run (no phases, no kernel table; default: one profiled run a point)")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="seed of the weights and the prompt")
    p.add_argument("--out", default=None, help="results folder (default: benchmarks/results/<machine>)")


def _apply_cpu_sizes(args) -> None:
    ignored = use_cpu_sizes(args, add_arguments, {"preset": "tiny", "prompt_len": 150, "chunk_sizes": [32, 150],
                                                  "runs": 1, "no_profile": True},
                            unused=("layers",))
    args.layers = None
    print(f"No CUDA: tiny preset (fp32) with the torch reference ops, prompt {args.prompt_len} tokens, chunks "
          f"{format_value(args.chunk_sizes)}. The first token and draft and the MTP layer's last-row output against "
          "the largest chunk's are reported; no time is measured.")
    if ignored:
        print(ignored)


class _Request:
    """One request's table row, KV pools and a prefill-only worker (no graphs) in one cache dtype."""

    def __init__(self, model: DSAModel, prompt_len: int, kv_cache_dtype: str, device: torch.device):
        spec = SpecConfig(num_steps=1)
        pages = -(-(prompt_len + spec.num_draft_tokens) // PAGE_SIZE)
        pool = ReqToTokenPool(1, pages * PAGE_SIZE, num_draft_tokens=spec.num_draft_tokens, device=device)
        allocator = PageAllocator(PAGE_SIZE * (1 + pages))
        pools = dict(dtype=model.lm_head.weight.dtype, device=device, kv_cache_dtype=kv_cache_dtype)
        target_kv = KVPool.for_model(model.config, allocator.num_slots, **pools)
        mtp_kv = KVPool.for_model(model.config, allocator.num_slots, mtp=True, **pools)
        self.worker = build_spec_worker(model, pool, target_kv, mtp_kv, spec, bucket_sizes=[1],
                                        use_cuda_graph=False)
        self.row = RequestSlots(pool, allocator).admit(prompt_len)

    def prefill(self, prompt: list[int], chunk: int) -> tuple[int, int]:
        """One prefill of ``prompt``: (first token, first draft)."""
        token = self.worker.prefill(self.row, prompt, chunk_size=chunk)
        return token, int(self.worker.state.draft_first[self.row])

    def draft_hidden(self) -> torch.Tensor:
        """The MTP layer's output on the prompt's last row (fp32 copy)."""
        return self.worker.state.draft_hidden[self.row].float().clone()


def _timed(request: _Request, prompt: list[int], chunk: int, runs: int, on_gpu: bool) -> tuple[list[float], tuple]:
    times, tokens = [], None
    for _ in range(runs):
        if on_gpu:
            torch.cuda.synchronize()
        began = time.perf_counter()
        tokens = request.prefill(prompt, chunk)
        times.append(1e3 * (time.perf_counter() - began))
    return times, tokens


def _profile(model: DSAModel, request: _Request, prompt: list[int], chunk: int) -> dict:
    """The phases (µs), GPU busy time and kernel table of one marker-instrumented prefill."""
    from dsaspec.bench.timing import device_events

    markers = PhaseMarkers(model)
    with markers.installed():
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            markers.mark("other")
            request.prefill(prompt, chunk)
            torch.cuda.synchronize()
    kernels = attribute_kernels(device_events(prof), list(markers.labels), 1)
    phases = phase_sums(kernels[0])
    return {"phases_us": {p: phases.get(p, 0.0) for p in PHASE_PATTERNS},
            "kernel_sum_us": sum(phases.values()), "kernels": kernel_table(kernels)}


def run(args) -> int:
    from dsaspec.bench.results import bench_params, markdown_table, write_results

    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        _apply_cpu_sizes(args)
    args.chunk_sizes = sorted(set(args.chunk_sizes))
    args.kv_cache_dtype = list(dict.fromkeys(map(resolve_kv_cache_dtype, args.kv_cache_dtype)))
    device = torch.device("cuda" if on_gpu else "cpu")
    if on_gpu:
        from dsaspec.bench.timing import warm_up_gpu

        warm_up_gpu()
    rates = Rates.measure(device)
    model = DSAModel(preset_config(args), device=device, dtype=torch.bfloat16 if on_gpu else torch.float32,
                     use_triton=on_gpu, options=RuntimeOptions.from_environment()).init_weights(args.seed, progress=True)
    generator = torch.Generator().manual_seed(args.seed + 1)
    prompt = torch.randint(0, model.config.vocab_size, (args.prompt_len,), generator=generator).tolist()
    layers = model.config.num_hidden_layers + 1                       # the target's and the MTP layer
    rows, hidden = [], {}
    points = [(dtype, chunk) for dtype in args.kv_cache_dtype for chunk in args.chunk_sizes]
    progress = tqdm(total=len(points), desc="prefill", unit="point")
    for kv_dtype in args.kv_cache_dtype:            # one dtype's pools at a time
        request = _Request(model, args.prompt_len, kv_dtype, device)
        floor_model = FloorModel(model.config, act_bytes=model.lm_head.weight.element_size(), kv_cache_dtype=kv_dtype)
        for chunk in args.chunk_sizes:
            request.prefill(prompt, chunk)                              # warm-up: Triton compiles
            times, (token, draft) = _timed(request, prompt, chunk, args.runs, on_gpu)
            costs = add_costs(*floor_model.prefill(args.prompt_len, chunk).values())
            row = {"kv_cache_dtype": kv_dtype, "chunk": chunk, "prompt_len": args.prompt_len, "runs": args.runs,
                   "first_token": token, "first_draft": draft, "ttft_ms": None, "spread": None,
                   "prefill_tok_s": None, "gpu_busy_ms": None, "profile": None}
            measured = None
            if on_gpu:
                ttft = statistics.median(times)
                row.update(ttft_ms=ttft, spread=(max(times) - min(times)) / ttft, times_ms=times,
                           prefill_tok_s=args.prompt_len / ttft * 1e3)
                if not args.no_profile:
                    row["profile"] = _profile(model, request, prompt, chunk)
                    row["gpu_busy_ms"] = row["profile"]["kernel_sum_us"] / 1e3
                    measured = row["profile"]["phases_us"]
            shown = {p: c for p, c in costs.items() if c.bytes or c.flops or c.fp8_flops or (measured or {}).get(p)}
            row["floor_table"] = floor_rows(shown, rates, measured, layers=layers,
                                            step_us=None if row["ttft_ms"] is None else row["ttft_ms"] * 1e3)
            row["floor_ms"] = row["floor_table"][-1]["floor_us"] / 1e3
            rows.append(row)
            hidden[kv_dtype, chunk] = request.draft_hidden()
            progress.update()
        del request
        if on_gpu:
            torch.cuda.empty_cache()
    progress.close()
    for row in rows:     # against the largest chunk's prefill in the same cache dtype
        dtype, largest = row["kv_cache_dtype"], args.chunk_sizes[-1]
        reference = next(r for r in rows if r["kv_cache_dtype"] == dtype and r["chunk"] == largest)
        row["tokens_as_largest_chunk"] = (row["first_token"], row["first_draft"]) == (
            reference["first_token"], reference["first_draft"])
        row["draft_hidden_max_diff"] = float((hidden[dtype, row["chunk"]] - hidden[dtype, largest]).abs().max())

    method = (f"SpecWorker.prefill of one {args.prompt_len}-token random prompt (target in chunks, its greedy "
              f"token, the MTP layer over the shifted prompt, its greedy draft), eager; {args.runs} timed runs per "
              f"point after one warm-up; TTFT = median wall time of a run, spread = (max - min) / median. Phases: "
              f"one run under torch.profiler with module markers (dsaspec/bench/phases.py), CUPTI kernel time "
              f"each kernel adds; GPU busy = their sum. Floor: FloorModel.prefill (dsaspec/bench/floors.py) at the "
              f"rates measured in the run; per layer over the {layers - 1} target layers and the MTP layer."
              if on_gpu else "torch reference ops on CPU: first tokens and the MTP output's agreement across "
              "chunk sizes only, no time.")
    payload = {"method": method, "params": bench_params(args), "floors": vars(rates),
               "phase_patterns": PHASE_PATTERNS, "rows": rows}
    write_results("prefill", payload, _markdown(rows, on_gpu, markdown_table), args.out)
    return 0


def _markdown(rows: list[dict], on_gpu: bool, markdown_table) -> str:
    head = markdown_table([("kv_cache_dtype", "KV cache"), ("chunk", "chunk"), ("prompt_len", "prompt"),
                           ("ttft_ms", "TTFT ms"), ("spread", "spread"), ("prefill_tok_s", "prefill tok/s"),
                           ("gpu_busy_ms", "GPU busy ms"), ("floor_ms", "floor ms"), ("over_floor", "TTFT / floor"),
                           ("first_token", "first token"), ("first_draft", "first draft"),
                           ("tokens_as_largest_chunk", "tokens as the largest chunk's"),
                           ("draft_hidden_max_diff", "MTP hidden max diff to it")],
                          [dict(r, over_floor=r["ttft_ms"] / r["floor_ms"] if r["ttft_ms"] else None) for r in rows])
    out = [f"## Prefill of one request\n\n{head}\n"]
    for r in rows:
        title = f"KV cache {r['kv_cache_dtype']}, chunk {r['chunk']}"
        out.append(f"## Against the floor: {title} (ms)\n\n"
                   + floor_markdown(r["floor_table"], markdown_table, unit="ms") + "\n")
        if on_gpu and r["profile"]:
            table = markdown_table([("phase", "phase"), ("module", "module"), ("kernel", "kernel"),
                                    ("count", "launches"), ("ms", "ms")],
                                   [dict(k, ms=k["us"] / 1e3) for k in r["profile"]["kernels"]])
            out.append(f"## Kernels by phase: {title}\n\n{table}\n")
    return "\n".join(out)
