"""Decode TPOT and tok/s/user: bounded vs context-wide replay metadata, 1M vs 4k context configured.

Model: the ``bench`` preset (GLM-5 attention, indexer and vocab shapes, 2 layers, dense FFN),
seeded random weights, bf16, Triton ops. Per KV cache dtype (``--kv-cache-dtype``: bf16 and/or
fp8_e4m3, one after the other, the first one's pools freed before the next is built) and for every
configured context (default 1M and 4k tokens) one ``req_to_token`` table and a KV pool in that
dtype sized for the live tokens only; ``max(bs)`` requests are prefilled once with a
``--live``-token random prompt (eager, chunked; the same prompts for every dtype). Every
configuration {context-wide, bounded metadata} x {context} has its own backend and a
:class:`~dsaspec.executor.decode_worker.DecodeWorker` with one CUDA graph per batch size.

A decode step is what an engine runs: input prep and the backend's metadata replay (eager, right
before the graph), the graph replay (model forward + LM head + greedy argmax, the greedy token
fed back as the next input through the rows' carry; no host sync between steps). A run decodes
``--steps`` steps from the same prefilled state; a CUDA event is recorded between consecutive
steps, so a step's time is its wall time on the GPU's timeline (launch gaps included). TPOT = the
median step time over all timed runs; runs are interleaved over the configurations (order
reversed every other run); spread = (max - min) / median of the per-run medians. tok/s/user =
1e6 / TPOT[µs]. Greedy tokens must be identical across metadata kernels within a cache dtype (and
are reported across contexts); an FP8 cache's tokens may differ from the bf16 cache's (quantized
keys): each FP8 row reports the first step where they differ (``vs_bf16``, as bench kv-accuracy).

Per-phase breakdown (:mod:`dsaspec.bench.phases`): a second runner per configuration is captured
with an empty marker kernel launched at module boundaries (forward hooks on the phase modules and on
every leaf module), so the
graph's kernels can be attributed to the module that launched them; DSA kernels are attributed by
name (``PHASE_PATTERNS``). Phase time = the GPU time its kernels add in one step (CUPTI,
torch.profiler), median over ``--profile-steps`` steps: each kernel counts from the later of its
start and the end of every earlier kernel, so a kernel that starts early and waits (a programmatic
dependent launch, e.g. sparse MLA's combine) counts only the time after its predecessor; the phases
of a step add up to its GPU busy time (``kernel_sum_us``, column "GPU busy"). The marker kernels
themselves are excluded. Per phase the kernels by name and innermost module (``layers.*``: summed
over the layers), with their launches and median µs per step, the ``TOP_KERNELS`` largest
(``kernel_table``, ``short_kernel_name``).

Without CUDA: the ``tiny`` preset in fp32 with the torch reference ops (the metadata kernels run under the
Triton interpreter), small contexts, a few steps; only token identity is checked, no time is
reported.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from dsaspec.layers.attention.backend import BOUNDED, CONTEXT_WIDE, DSAAttnBackend
from dsaspec.configs.runtime_options import RuntimeOptions
from dsaspec.errors import UserError
from dsaspec.cli_parsing import choice_list, format_value, nonnegative_int, positive_int, positive_int_list, use_cpu_sizes
from dsaspec.bench.experts_hit import ExpertsHitCounter
from dsaspec.bench.presets import add_preset_arguments, preset_config
from dsaspec.bench.floors import LAYER_PHASES, PER_LAYER, STEP, FloorModel, Rates, floor_markdown, floor_rows
from dsaspec.executor.decode_worker import DecodeWorker
from dsaspec.executor.worker import indexer_programs_for
from dsaspec.memory import KV_CACHE_DTYPES, PAGE_SIZE, KVPool, PageAllocator, ReqToTokenPool, RequestSlots, \
    resolve_kv_cache_dtype
from dsaspec.bench.phases import (PHASE_PATTERNS, TOP_KERNELS, PhaseMarkers, attribute_kernels, kernel_table,
                                  phase_sums)
from dsaspec.models.dsa_model import DSAModel

FULL_CONTEXT = 1 << 20
KERNELS = (CONTEXT_WIDE, BOUNDED)            # baseline first
TPOT_TARGET = 1.05                           # bounded TPOT at a long context / at the reference context


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_preset_arguments(p, default="bench")
    p.add_argument("--bs", type=positive_int_list, default=[1, 4, 16, 32],
                   help="comma-separated batch sizes (= graph buckets)")
    p.add_argument("--contexts", type=positive_int_list, default=[FULL_CONTEXT, 4096],
                   help="comma-separated configured context lengths; the smallest is the reference for the "
                        "TPOT target")
    p.add_argument("--live", type=positive_int, default=1024, help="prompt tokens per request (live KV at the first step)")
    p.add_argument("--kv-cache-dtype", type=choice_list(KV_CACHE_DTYPES), default=["bf16"],
                   help="KV cache dtypes, comma-separated: bf16 (the model's dtype; auto is bf16) and/or fp8_e4m3")
    p.add_argument("--steps", type=positive_int, default=64, help="decode steps per run")
    p.add_argument("--runs", type=positive_int, default=4, help="timed runs per point (interleaved over configurations)")
    p.add_argument("--profile-steps", type=nonnegative_int, default=8,
                   help="profiled steps per point for the phase breakdown (0: no breakdown)")
    p.add_argument("--budget", type=positive_int, default=None,
                   help="bounded metadata program budget (default: DSASPEC_METADATA_BUDGET, else 2048; 8 on CPU)")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="seed of the weights and the prompts")
    p.add_argument("--out", default=None, help="results folder (default: benchmarks/results/<machine>)")


@dataclass
class _Context:
    """One configured context: its table, KV pool, the prefilled requests and their carry."""

    context_len: int
    pool: ReqToTokenPool
    kv: KVPool
    rows: list[int] = field(default_factory=list)
    snapshot: dict = field(default_factory=dict)
    runners: dict = field(default_factory=dict)






def _build_context(model, context_len: int, prompts: list[torch.Tensor], args, device,
                   kv_cache_dtype: str = "bf16") -> _Context:
    max_bs = max(args.bs)
    pool = ReqToTokenPool(max_bs, context_len, device=device)
    pages_per_request = -(-(args.live + args.steps) // PAGE_SIZE)
    allocator = PageAllocator(PAGE_SIZE * (1 + max_bs * pages_per_request))
    slots = RequestSlots(pool, allocator)
    kv = KVPool.for_model(model.config, allocator.num_slots, dtype=model.lm_head.weight.dtype, device=device,
                          kv_cache_dtype=kv_cache_dtype)
    context = _Context(context_len, pool, kv)
    for kernel in KERNELS:
        backend = DSAAttnBackend(pool.req_to_token, index_topk=model.config.index_topk, page_size=PAGE_SIZE,
                                 bucket_sizes=args.bs, num_sms=indexer_programs_for(model, kv, device),
                                 budget=args.budget,
                                 force_kernel=kernel)
        context.runners[kernel] = DecodeWorker(model, kv, backend).capture()
    first = context.runners[KERNELS[0]]
    for prompt in prompts:
        row = slots.admit(args.live, reserve=args.steps)
        first.prefill(row, prompt.tolist())
        context.rows.append(row)
    context.snapshot = first.state.snapshot(context.rows)
    return context


@torch.no_grad()
def decode_run(runner: DecodeWorker, context: _Context, bs: int, steps: int, *, events=None,
               markers: PhaseMarkers | None = None) -> torch.Tensor:
    """``steps`` greedy decode steps of requests ``[0, bs)`` from their prefilled state (the carry
    restored), the tokens fed back on the device. Records ``events[i]`` before step ``i`` and
    ``events[steps]`` after the last. Returns the int64 ``[steps, bs]`` tokens (device)."""
    bucket = runner.bucket_for(bs)
    runner.state.restore(context.rows, context.snapshot)
    runner.load(context.rows[:bs], bucket)
    tokens = torch.empty(steps, bs, dtype=torch.int64, device=runner.next_tokens.device)
    if events is not None:
        events[0].record()
    for i in range(steps):
        if markers is not None:
            markers.mark("metadata")
        out = runner.run(bucket)[:bs]
        if markers is not None:
            markers.mark("feedback")
        tokens[i].copy_(out)
        if events is not None:
            events[i + 1].record()
    return tokens


def _timed_run(runner, context, bs, args) -> tuple[list[float], torch.Tensor]:
    events = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps + 1)]
    tokens = decode_run(runner, context, bs, args.steps, events=events)
    torch.cuda.synchronize()
    return [1e3 * events[i].elapsed_time(events[i + 1]) for i in range(args.steps)], tokens


def _profile(model, context: _Context, kernel: str, args) -> dict[int, dict]:
    """Median per-phase µs of one step for every bs of one configuration (a marker runner)."""
    from dsaspec.bench.timing import device_events

    markers = PhaseMarkers(model)
    backend = context.runners[kernel].backend
    with markers.installed():
        runner = DecodeWorker(model, context.kv, backend).capture()
        markers.labels.clear()
        runner.run(backend.bucket_sizes[0], use_graph=False)     # all-padding inputs from capture
        graph_sequence = list(markers.labels)
    sequence = [("metadata", None)] + graph_sequence + [("feedback", None)]
    out = {}
    for bs in args.bs:
        decode_run(runner, context, bs, 2, markers=markers)   # warm
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            decode_run(runner, context, bs, args.profile_steps, markers=markers)
            torch.cuda.synchronize()
        kernels = attribute_kernels(device_events(prof), sequence, args.profile_steps)
        per_step = [phase_sums(s) for s in kernels]
        phases = {p: statistics.median(s.get(p, 0.0) for s in per_step) for p in PHASE_PATTERNS}
        out[bs] = {"phases_us": phases,
                   "kernel_sum_us": statistics.median(sum(s.values()) for s in per_step),
                   "kernels": kernel_table(kernels)}
    del runner
    return out


@dataclass
class _Measured:
    """Per ``(kv_cache_dtype, context_len, kernel, bs)``: the per-run step times (GPU), the first
    run's tokens, whether every run gave them, the profiled phases; the failed attributions."""

    times: dict = field(default_factory=lambda: defaultdict(list))
    tokens: dict = field(default_factory=dict)
    consistent: dict = field(default_factory=lambda: defaultdict(lambda: True))
    phases: dict = field(default_factory=dict)
    phase_errors: list = field(default_factory=list)
    experts_hit: dict = field(default_factory=dict)      # (kv_cache_dtype, bs) -> experts_hit_in_step


def _measure(model, prompts, kv_cache_dtype: str, args, device, out: _Measured) -> None:
    """Builds every context's pools (``kv_cache_dtype``) and runners, runs every point (warm-up,
    then timed on a GPU, interleaved over the configurations) and profiles the phases (GPU,
    ``--profile-steps``); writes the results into ``out``. The pools and graphs are dropped on
    return."""
    on_gpu = device.type == "cuda"
    contexts = [_build_context(model, c, prompts, args, device, kv_cache_dtype)
                for c in tqdm(args.contexts, desc=f"prefill + capture ({kv_cache_dtype})", unit="context")]
    configs = [(context, kernel) for context in contexts for kernel in KERNELS]
    total = len(args.bs) * len(configs) * (args.runs + 1)
    with tqdm(total=total, desc=f"decode runs ({kv_cache_dtype})", unit="run") as bar:
        for bs in args.bs:
            for r in range(-1, args.runs):   # run -1: warm-up, tokens only
                order = configs if r % 2 == 0 else configs[::-1]
                for context, kernel in order:
                    key = (kv_cache_dtype, context.context_len, kernel, bs)
                    runner = context.runners[kernel]
                    if on_gpu and r >= 0:
                        step_times, tokens = _timed_run(runner, context, bs, args)
                        out.times[key].append(step_times)
                    else:
                        tokens = decode_run(runner, context, bs, args.steps)
                    tokens = tokens.cpu()
                    if key not in out.tokens:
                        out.tokens[key] = tokens
                    elif not torch.equal(tokens, out.tokens[key]):
                        out.consistent[key] = False
                    bar.update(1)
    if model.routed_experts():
        context = contexts[0]
        for bs in args.bs:
            out.experts_hit[(kv_cache_dtype, bs)] = experts_hit_in_step(model, context.runners[BOUNDED], context, bs)
    if on_gpu and args.profile_steps > 0:
        for context, kernel in tqdm(configs, desc=f"profile ({kv_cache_dtype})", unit="config"):
            try:
                for bs, result in _profile(model, context, kernel, args).items():
                    out.phases[(kv_cache_dtype, context.context_len, kernel, bs)] = result
            except RuntimeError as err:      # keep the timings if the attribution fails
                out.phase_errors.append(f"{kv_cache_dtype}, context {context.context_len}, {kernel}: {err}")
                print(f"warning: phase breakdown failed: {out.phase_errors[-1]}")


@torch.no_grad()
def experts_hit_in_step(model, runner: DecodeWorker, context: _Context, bs: int) -> float:
    """The routed experts a MoE layer reads in one decode step of requests ``[0, bs)`` from their
    prefilled state: :class:`~dsaspec.bench.experts_hit.ExpertsHitCounter` over one eager step of
    the bucket (its padding rows included), averaged over the MoE layers. The step writes what a
    decode step writes; every run restores the rows' carry first."""
    bucket = runner.bucket_for(bs)
    runner.state.restore(context.rows, context.snapshot)
    runner.load(context.rows[:bs], bucket)
    with ExpertsHitCounter(model) as counter:
        runner.run(bucket, use_graph=False)
    return counter.by_rows()[bucket]


def token_agreement(reference: torch.Tensor, other: torch.Tensor) -> dict:
    """``other``'s greedy tokens against ``reference``'s (int ``[steps, bs]`` each, from the same
    prefilled state): the first step where any request's token differs (None if none) and the
    fraction of tokens that agree. Raises ``ValueError`` on different shapes."""
    if reference.shape != other.shape:
        raise ValueError(f"token tensors of different shapes: {tuple(reference.shape)} and {tuple(other.shape)}")
    differs = (reference != other).any(dim=1).nonzero()
    return {"first_difference": differs[0].item() if len(differs) else None,
            "agreement": (reference == other).double().mean().item()}


def _summary(run_times: list[list[float]]) -> dict:
    steps = sorted(t for run in run_times for t in run)
    run_medians = [statistics.median(run) for run in run_times]
    median = statistics.median(steps)
    return {"median_us": median, "p10_us": steps[len(steps) // 10], "p90_us": steps[(9 * len(steps)) // 10],
            "run_medians_us": run_medians, "spread": (max(run_medians) - min(run_medians)) / median,
            "tok_s_user": 1e6 / median, "n": len(steps)}


def _apply_cpu_sizes(args) -> None:
    ignored = use_cpu_sizes(args, add_arguments, {"preset": "tiny", "contexts": [1024, 128], "live": 70,
                                                  "bs": [1, 2], "steps": 3, "runs": 1, "budget": args.budget or 8},
                            unused=("profile_steps", "layers"))
    args.layers = None
    print(f"No CUDA: tiny preset (fp32) with the torch reference ops, metadata kernels under the Triton "
          f"interpreter, contexts {format_value(args.contexts)}, bs {format_value(args.bs)}, {args.steps} steps. "
          "Token identity is checked; no time is measured (interpreter times mean nothing).")
    if ignored:
        print(ignored)


def run(args) -> int:
    from dsaspec.bench.results import bench_params, markdown_table, write_results

    options = RuntimeOptions.from_environment()
    if args.budget is None:
        args.budget = options.metadata_program_budget
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        _apply_cpu_sizes(args)
    args.bs = sorted(set(args.bs))
    args.contexts = sorted(set(args.contexts), reverse=True)
    args.kv_cache_dtype = list(dict.fromkeys(map(resolve_kv_cache_dtype, args.kv_cache_dtype)))
    if args.contexts[-1] < args.live + args.steps:
        raise UserError(f"--contexts {args.contexts[-1]} cannot hold --live {args.live} + --steps {args.steps} = "
                        f"{args.live + args.steps} tokens")
    config = preset_config(args)
    device = torch.device("cuda" if on_gpu else "cpu")
    if on_gpu:
        from dsaspec.bench.timing import warm_up_gpu

        warm_up_gpu()
    rates = Rates.measure(device)
    model = DSAModel(config, device=device, dtype=torch.bfloat16 if on_gpu else torch.float32,
                     use_triton=on_gpu, options=options).init_weights(args.seed)
    generator = torch.Generator().manual_seed(args.seed + 1)
    prompts = [torch.randint(0, model.config.vocab_size, (args.live,), generator=generator)
               for _ in range(max(args.bs))]
    measured = _Measured()
    for kv_dtype in args.kv_cache_dtype:     # one dtype's pools and graphs at a time
        _measure(model, prompts, kv_dtype, args, device, measured)
        if on_gpu:
            torch.cuda.empty_cache()
    times, tokens, consistent, phases = measured.times, measured.tokens, measured.consistent, measured.phases

    reference_context = args.contexts[-1]
    rows = []
    for kv_dtype in args.kv_cache_dtype:
        hits = {bs: hit for (dtype, bs), hit in measured.experts_hit.items() if dtype == kv_dtype}
        floor_model = FloorModel(model.config, act_bytes=model.lm_head.weight.element_size(), kv_cache_dtype=kv_dtype,
                                 experts_hit=hits)
        for context_len in args.contexts:
            for bs in args.bs:
                costs = floor_model.decode_step(bs, args.live + args.steps // 2)
                keys = {kernel: (kv_dtype, context_len, kernel, bs) for kernel in KERNELS}
                identical = (torch.equal(tokens[keys[CONTEXT_WIDE]], tokens[keys[BOUNDED]])
                             and all(consistent[k] for k in keys.values()))
                bf16 = ("bf16", context_len, BOUNDED, bs)
                row = {"kv_cache_dtype": kv_dtype, "context_len": context_len, "bs": bs, "live_kv": args.live,
                       "steps": args.steps, "runs": args.runs, "tokens_identical": identical,
                       "tokens_identical_to_reference_context": all(
                           torch.equal(tokens[keys[k]], tokens[(kv_dtype, reference_context, k, bs)]) for k in KERNELS),
                       "vs_bf16": (token_agreement(tokens[bf16], tokens[keys[BOUNDED]])
                                   if kv_dtype != "bf16" and bf16 in tokens else None),
                       "experts_hit": hits.get(bs),
                       "baseline_us": None, "new_us": None, "speedup": None, "spread": None,
                       "floor_table": floor_rows(costs, rates, None, layers=model.config.num_hidden_layers,
                                                 step_us=None)}
                row["floor_us"] = row["floor_table"][-1]["floor_us"]
                if on_gpu:
                    base, new = _summary(times[keys[CONTEXT_WIDE]]), _summary(times[keys[BOUNDED]])
                    row.update(baseline_us=base["median_us"], new_us=new["median_us"],
                               speedup=base["median_us"] / new["median_us"],
                               spread={"baseline": base["spread"], "new": new["spread"]},
                               tpot_ms={"baseline": base["median_us"] / 1e3, "new": new["median_us"] / 1e3},
                               tok_s_user={"baseline": base["tok_s_user"], "new": new["tok_s_user"]},
                               detail={"baseline": base, "new": new},
                               phases={k: phases.get(keys[k]) for k in KERNELS})
                    bounded = phases.get(keys[BOUNDED])
                    row["floor_table"] = floor_rows(costs, rates, bounded and bounded["phases_us"],
                                                    layers=model.config.num_hidden_layers, step_us=new["median_us"])
                rows.append(row)
    if on_gpu:
        _add_context_ratios(rows, reference_context)

    method = (f"Each step: input prep + backend.replay (eager) + CUDA graph replay (forward, LM head, argmax) "
              f"+ on-device token feedback; a CUDA event between consecutive steps, {args.steps} steps per "
              f"run, {args.runs} timed runs per point interleaved over the configurations (order reversed "
              f"every other run) after one warm-up run; TPOT = median step time over all runs, spread = "
              f"(max - min) / median of the per-run medians. floor = the floor model of dsaspec/bench/floors.py "
              f"(per phase: max(bytes read + written / measured copy bandwidth, FLOPs / measured bf16 and FP8 "
              f"matmul rates, one empty kernel a layer) at the mean live length {args.live + args.steps // 2}; "
              f"MoE layers: the routed experts hit as counted in one eager step per batch size, "
              f"experts_hit_in_step), summed over the phases; measured / floor per phase from the bounded runs' phases. Phases: "
              f"CUPTI kernel durations of {args.profile_steps} profiled steps of a marker-instrumented graph "
              f"(median per step), attributed as in phase_patterns. KV caches: {', '.join(args.kv_cache_dtype)}, "
              f"one dtype's pools and graphs at a time."
              if on_gpu else "Triton interpreter on CPU (metadata), torch reference ops (model): token identity only.")
    params = bench_params(args)
    payload = {"method": method, "params": params, "floors": vars(rates),
               "phase_patterns": PHASE_PATTERNS, "phase_errors": measured.phase_errors, "kernels": {"baseline": CONTEXT_WIDE, "new": BOUNDED},
               "rows": rows}
    markdown = _markdown(rows, on_gpu, reference_context, markdown_table)
    write_results("decode", payload, markdown, args.out)
    failed = [r for r in rows if not r["tokens_identical"]]
    if failed:
        print(f"error: bounded and context-wide tokens differ at (KV cache, context, bs) "
              f"{[(r['kv_cache_dtype'], r['context_len'], r['bs']) for r in failed]}")
        return 1
    return 0


def _add_context_ratios(rows: list[dict], reference_context: int) -> None:
    """TPOT at each context over the reference context's (same cache dtype, bs and kernel), and
    whether the per-run ranges overlap."""
    reference = {(r["kv_cache_dtype"], r["bs"]): r for r in rows if r["context_len"] == reference_context}
    for row in rows:
        ref = reference[(row["kv_cache_dtype"], row["bs"])]
        ratios, overlap = {}, {}
        for side in ("baseline", "new"):
            ratios[side] = row["detail"][side]["median_us"] / ref["detail"][side]["median_us"]
            a, b = row["detail"][side]["run_medians_us"], ref["detail"][side]["run_medians_us"]
            overlap[side] = min(a) <= max(b) and min(b) <= max(a)
        row["vs_reference_context"] = {"reference_context_len": reference_context, "tpot_ratio": ratios,
                                       "run_ranges_overlap": overlap,
                                       "new_within_target": ratios["new"] <= TPOT_TARGET}


KV_NOTE = ("Tokens are compared within a KV cache dtype (bounded == context-wide must hold); an FP8 cache's "
           "greedy tokens may differ from the bf16 cache's (quantized keys and latents; random weights give "
           "small top-2 margins): its rows give the first step where a token differs from the bf16 run's "
           "(bounded metadata, same context and bs; 'none': identical) and the fraction that agree.")


def _vs_bf16(row: dict) -> dict:
    """The row's FP8-against-bf16 cells: first differing step ('none' when identical; None for a
    bf16 row or a run without bf16) and the agreeing fraction."""
    vs = row["vs_bf16"]
    if vs is None:
        return {"bf16_first_diff": None, "bf16_agreement": None}
    first = vs["first_difference"]
    return {"bf16_first_diff": "none" if first is None else first, "bf16_agreement": vs["agreement"]}


VS_BF16_COLUMNS = [("bf16_first_diff", "first step != bf16"), ("bf16_agreement", "agreement with bf16")]


def _markdown(rows, on_gpu, reference_context, markdown_table) -> str:
    compared = any(r["vs_bf16"] is not None for r in rows)
    vs_cols = VS_BF16_COLUMNS if compared else []
    note = f"{KV_NOTE}\n\n" if compared else ""
    if not on_gpu:
        cols = [("kv_cache_dtype", "KV cache"), ("context_len", "context"), ("bs", "bs"), ("live_kv", "live KV"),
                ("steps", "steps"), ("tokens_identical", "bounded == context-wide"),
                ("tokens_identical_to_reference_context", f"== context {reference_context}")] + vs_cols
        table = markdown_table(cols, [dict(r, **_vs_bf16(r)) for r in rows])
        return f"{table}\n\n{note}{_floor_markdown(rows, markdown_table)}"
    flat = []
    for r in rows:
        vs = r["vs_reference_context"]
        flat.append(dict(r, **_vs_bf16(r), cw_ms=r["tpot_ms"]["baseline"], b_ms=r["tpot_ms"]["new"],
                         cw_tps=r["tok_s_user"]["baseline"], b_tps=r["tok_s_user"]["new"],
                         cw_spread=r["spread"]["baseline"], b_spread=r["spread"]["new"],
                         floor_ms=r["floor_us"] / 1e3, cw_ratio=vs["tpot_ratio"]["baseline"],
                         b_ratio=vs["tpot_ratio"]["new"], b_overlap=vs["run_ranges_overlap"]["new"],
                         target=vs["new_within_target"]))
    tpot = markdown_table([
        ("kv_cache_dtype", "KV cache"), ("context_len", "context"), ("bs", "bs"), ("cw_ms", "context-wide TPOT ms"),
        ("b_ms", "bounded TPOT ms"),
        ("speedup", "speedup"), ("cw_tps", "context-wide tok/s/user"), ("b_tps", "bounded tok/s/user"),
        ("cw_spread", "spread cw"), ("b_spread", "spread bounded"), ("floor_ms", "floor ms"),
        ("tokens_identical", "tokens identical")] + vs_cols, flat)
    target = markdown_table([
        ("kv_cache_dtype", "KV cache"), ("context_len", "context"), ("bs", "bs"),
        ("cw_ratio", f"context-wide / {reference_context}"),
        ("b_ratio", f"bounded / {reference_context}"), ("b_overlap", "bounded run ranges overlap"),
        ("target", f"bounded within {TPOT_TARGET - 1:.0%}"),
        ("tokens_identical_to_reference_context", "tokens == reference context")], flat)
    phase_rows = []
    for r in rows:
        for side, kernel in (("baseline", CONTEXT_WIDE), ("new", BOUNDED)):
            result = r["phases"][kernel]
            if result is None:
                continue
            phase_rows.append({"kv_cache_dtype": r["kv_cache_dtype"], "context_len": r["context_len"],
                               "bs": r["bs"], "kernel": kernel,
                               **result["phases_us"], "kernel_sum_us": result["kernel_sum_us"],
                               "tpot_us": r[f"{side}_us"]})
    phase_table = markdown_table([("kv_cache_dtype", "KV cache"), ("context_len", "context"), ("bs", "bs"),
                                  ("kernel", "metadata")]
                                 + [(p, f"{p} µs") for p in PHASE_PATTERNS]
                                 + [("kernel_sum_us", "GPU busy µs"), ("tpot_us", "TPOT µs")], phase_rows)
    patterns = "\n".join(f"- **{phase}**: {text}" for phase, text in PHASE_PATTERNS.items())
    return (f"## TPOT (median step, CUDA events)\n\n{tpot}\n\n{note}## Cost follows live work: TPOT over the "
            f"{reference_context}-token context (target: bounded <= {TPOT_TARGET:.2f})\n\n{target}\n\n"
            f"## Per-phase breakdown (CUPTI kernel durations per step, median)\n\n{phase_table}\n\n"
            f"Phase attribution:\n\n{patterns}\n\n{_kernel_markdown(rows, markdown_table)}"
            f"{_floor_markdown(rows, markdown_table)}")


def _kernel_markdown(rows, markdown_table) -> str:
    """The bounded runs' kernel table (:func:`kernel_table`) of every cache dtype at bs 1 and the
    largest bs of the first row's context; empty without one."""
    context = rows[0]["context_len"]
    sizes = sorted({r["bs"] for r in rows if r["context_len"] == context})
    shown = [dict(k, bs=r["bs"], kv_cache_dtype=r["kv_cache_dtype"]) for r in rows
             if r["context_len"] == context and r["bs"] in (sizes[0], sizes[-1])
             and r["phases"][BOUNDED] is not None for k in r["phases"][BOUNDED]["kernels"]]
    if not shown:
        return ""
    table = markdown_table([("kv_cache_dtype", "KV cache"), ("bs", "bs"), ("phase", "phase"), ("module", "module"),
                            ("kernel", "kernel"),
                            ("count", "launches / step"), ("us", "µs / step")], shown)
    return (f"## Kernels per phase (bounded, context {context}, bs {sizes[0]} and {sizes[-1]}; median per step, "
            f"top {TOP_KERNELS} a phase; full names in the JSON)\n\n{table}\n\n")


def _floor_markdown(rows, markdown_table) -> str:
    """Per layer and whole step against their floors at every point, then the per-phase floor
    table of every cache dtype and bs at the longest context (the floors use that dtype's KV
    entry bytes)."""
    summary = []
    for r in rows:
        table = {t["phase"]: t for t in r["floor_table"]}
        summary.append({"kv_cache_dtype": r["kv_cache_dtype"], "context_len": r["context_len"], "bs": r["bs"],
                        **{f"{key}_{field}": table[phase][field] for key, phase in (("layer", PER_LAYER), ("step", STEP))
                           for field in ("measured_us", "floor_us", "measured_over_floor", "measured_over_bytes_floor")}})
    cols = [("kv_cache_dtype", "KV cache"), ("context_len", "context"), ("bs", "bs")]
    for key, title in (("layer", "per layer"), ("step", "step")):
        cols += [(f"{key}_measured_us", f"{title} µs"), (f"{key}_floor_us", f"{title} floor µs"),
                 (f"{key}_measured_over_floor", f"{title} / floor"),
                 (f"{key}_measured_over_bytes_floor", f"{title} / bytes floor")]
    longest = max(r["context_len"] for r in rows)
    detail = [dict(t, bs=r["bs"], kv_cache_dtype=r["kv_cache_dtype"]) for r in rows if r["context_len"] == longest
              for t in r["floor_table"]]
    return (f"## Floors (dsaspec/bench/floors.py; measured: bounded metadata, CUPTI phases, TPOT for the step)\n\n"
            f"Per layer = {', '.join(LAYER_PHASES)} summed over the layers / layers.\n\n"
            f"{markdown_table(cols, summary)}\n\n### Per phase, context {longest}\n\n"
            f"{floor_markdown(detail, markdown_table, keys=(('kv_cache_dtype', 'KV cache'), ('bs', 'bs')))}\n")
