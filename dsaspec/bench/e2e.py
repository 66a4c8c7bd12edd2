"""End-to-end MTP speculative decoding: tok/s/user by concurrency, baseline vs new, 1M vs 4k context.

baseline = ``DSASPEC_BOUNDED_REPLAY_METADATA=0``, ``DSASPEC_SPEC_DRAFT_ARGMAX_EXCHANGE=0`` and
``DSASPEC_SPEC_VERIFY_ARGMAX_EXCHANGE=0`` (context-wide replay metadata, precompute + copies for the
draft steps, logits gather for the draft and verify tokens); new = all on (the defaults). Per model preset and configured context, one
``req_to_token`` table, the target and MTP KV pools, and two captured
:class:`~dsaspec.speculative.spec_worker.SpecWorker` (baseline, new) over them. ``max(concurrency)``
requests with ``--prompt-len``-token random prompts are prefilled once (eager, in chunks of at most
the engine's default chunk, ``DEFAULT_PREFILL_CHUNK`` tokens; that prefill time per request is the TTFT reported; each path's graph capture, first Triton compiles included, is timed
once per setup and reported in seconds); every run restores that state and runs ``--iterations``
speculative iterations of the first ``concurrency`` requests, exactly as the Engine does
(metadata, draft / verify / extend graphs, one device-to-host copy). Positions past the prompt are
rewritten by every run before they are read, as rejected positions are in a run.

Per point and path: iteration wall time (host, each iteration ends with its tokens on the host),
the device time of each phase (CUDA events), the mean accept length, per-token latency =
median iteration time / mean accept length, tok/s/user = 1000 / per-token latency [ms], output
tok/s = concurrency x tok/s/user. Floors (new path, :mod:`dsaspec.bench.floors`) take, for a MoE
layer, the distinct routed experts its calls hit in one eager iteration of the point
(:class:`~dsaspec.bench.experts_hit.ExpertsHitCounter`), not uniform routing's expectation. Runs are
interleaved baseline / new / new / baseline; the two
paths must commit identical tokens. Accept modes: a simulated mean accept length (default 3.0,
every iteration forced to it) and the real acceptance of the weights (seeded random weights: the
MTP layer drafts noise, so about 1.0).

Chains: ``--num-steps`` takes several draft lengths S (topk 1, S + 1 tokens verified), each run
over the same model: S = 3 (the default) and the upstream PR's S = 4 (EAGLE 4/1/5) and S = 5
(EAGLE 5/1/6). Rows carry ``num_steps``; the Markdown opens with the upstream PR's table form
(:func:`upstream_tables`) per preset, chain, accept mode and context.

Presets: the dense surrogates (``e2e``, ``bench``) and one rank of the FP8 deployments at TP 8
(``glm5-fp8-tp8-rank``, ``deepseek-v32-fp8-tp8-rank``,
:func:`~dsaspec.configs.model_config.tp_rank_config`): on one GPU the rank's compute is what is
timed, without the collectives one GPU cannot run (two all-reduces per layer, the embedding's, and
the argmax exchange or logits gather of every LM head), so a TP 8 iteration is at least this long.
A preset the runtime cannot build yet (:func:`~dsaspec.configs.model_config.check_implemented`)
is refused before anything runs.

``--tp N`` (N GPUs; the command starts N processes under torchrun): the same table with the model
sharded over N GPUs, plus a third path, ``gather`` = new with only
``DSASPEC_SPEC_DRAFT_ARGMAX_EXCHANGE=0`` (the draft tokens by the logits gather), which isolates the
argmax exchange; its per-iteration gain is set against ``bench draft-step``'s saving per draft step
(``draft_step.json`` in the same results folder) times the S draft LM-head evaluations of an
iteration. Rows carry ``tp``; rank 0 writes ``e2e_tp{N}.{json,md,png}``.

KV caches: ``--kv-cache-dtype`` takes ``bf16`` (the model's dtype), ``fp8_e4m3`` (FlashMLA's
``fp8_ds_mla`` and the paged FP8 indexer keys, docs/fp8-kv-cache.md) or both, comma-separated: each
point runs on each, rows carry ``kv_cache_dtype``, the tokens are compared within a cache dtype
(FP8 caches change the model's numerics). The capacity table gives, per preset and cache dtype,
the KV bytes a token (every target layer and the MTP layer: 1,408 or 788 bytes a slot and layer
for a bf16 model) and how many tokens fit a stated budget: ``--kv-budget-gb``, else the device's
free memory after the weights (measured once the model is built; activations, workspaces and
graphs come on top), with the requests of each configured context that fit it.

``--row-invariant``: the model in the row-invariant mode (``generate --row-invariant``'s: a row's
logits do not depend on the other rows, so speculative output equals plain greedy output), the mode
whose iteration the floor targets also cover; rows carry ``row_invariant`` and the tables say so.

Without CUDA: the ``tiny`` preset in fp32 with the torch ops, small sizes; only token identity is
checked, no time is reported.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from dsaspec.layers.attention.backend import BOUNDED, CONTEXT_WIDE
from dsaspec.configs.runtime_options import RuntimeOptions
from dsaspec.errors import UserError
from dsaspec.cli_parsing import choice_list, format_value, nonnegative_int, positive_int, positive_int_list, use_cpu_sizes
from dsaspec.models.footprint import available_bytes, required_bytes
from dsaspec.bench.experts_hit import ExpertsHitCounter
from dsaspec.bench.floors import ITERATION, FloorModel, Rates, iteration_rows
from dsaspec.configs.model_config import PRESETS, check_implemented, get_config
from dsaspec.memory import KV_CACHE_DTYPES, PAGE_SIZE, KVPool, PageAllocator, ReqToTokenPool, RequestSlots, \
    resolve_kv_cache_dtype
from dsaspec.models.dsa_model import DSAModel
from dsaspec.speculative.spec_worker import PHASES, SpecConfig, SpecWorker, build_spec_worker

FULL_CONTEXT = 1 << 20
BOUNDED_SWITCH, EXCHANGE_SWITCH, VERIFY_SWITCH = KILL_SWITCHES = (
    "DSASPEC_BOUNDED_REPLAY_METADATA", "DSASPEC_SPEC_DRAFT_ARGMAX_EXCHANGE", "DSASPEC_SPEC_VERIFY_ARGMAX_EXCHANGE")
# path -> the kill switches it is built with; "gather" (TP > 1) differs from "new" in the draft exchange only
SWITCHES = {"baseline": {BOUNDED_SWITCH: False, EXCHANGE_SWITCH: False, VERIFY_SWITCH: False},
            "new": {BOUNDED_SWITCH: True, EXCHANGE_SWITCH: True, VERIFY_SWITCH: True},
            "gather": {BOUNDED_SWITCH: True, EXCHANGE_SWITCH: False, VERIFY_SWITCH: True}}
# the RuntimeOptions field each switch sets
OPTION_OF = {BOUNDED_SWITCH: "bounded_replay_metadata", EXCHANGE_SWITCH: "draft_argmax_exchange",
             VERIFY_SWITCH: "verify_argmax_exchange"}
PATHS = ("baseline", "new")
REAL = "real"
NOISE = 0.99                   # new / baseline speed below this counts as slower
CHAINS = (3, 4, 5)             # S: the default, and the upstream PR's EAGLE 4/1/5 and 5/1/6
CONTEXT_TARGET = 1.02          # bounded per-token latency at a long context over the short one


def _accept_modes(text: str) -> list[str]:
    modes = [v.strip() for v in text.split(",") if v.strip()]
    for mode in modes:
        if mode != REAL:
            try:
                if not 1 <= float(mode) < math.inf:              # nan and inf too
                    raise ValueError
            except ValueError:
                raise argparse.ArgumentTypeError(f"accept modes are finite numbers >= 1 or '{REAL}', "
                                                 f"got {mode!r}") from None
    if not modes:
        raise argparse.ArgumentTypeError("expected at least one accept mode")
    return modes


_accept_modes.__name__ = "accept mode list"


def _budget_gb(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a positive number of GB, got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--presets", type=choice_list(sorted(PRESETS)), default=["e2e", "bench"],
                   help="model presets, comma-separated (random weights); the first is the headline table")
    p.add_argument("--concurrency", type=positive_int_list, default=[1, 2, 4, 8, 16, 32],
                   help="requests decoding together, comma-separated (each is a graph bucket)")
    p.add_argument("--contexts", type=positive_int_list, default=[FULL_CONTEXT, 4096],
                   help="configured context lengths; the smallest is the reference for the context target")
    p.add_argument("--prompt-len", type=positive_int, default=1024, help="prompt tokens per request")
    p.add_argument("--iterations", type=positive_int, default=24, help="speculative iterations per run")
    p.add_argument("--runs", type=positive_int, default=4, help="timed runs per point and path (interleaved)")
    p.add_argument("--accept", type=_accept_modes, default=["3.0", REAL],
                   help=f"accept modes, comma-separated: simulated mean accept lengths in [1, smallest "
                        f"--num-steps + 1] and/or '{REAL}'")
    p.add_argument("--num-steps", type=positive_int_list, default=[CHAINS[0]],
                   help="draft steps S of the chains to run, comma-separated (N = S + 1 verified tokens, topk 1); "
                        "the upstream PR's: 4 (EAGLE 4/1/5), 5 (EAGLE 5/1/6)")
    p.add_argument("--kv-cache-dtype", type=choice_list(KV_CACHE_DTYPES), default=["bf16"],
                   help="KV cache dtypes, comma-separated: bf16 (the model's dtype; auto is bf16) and/or fp8_e4m3")
    p.add_argument("--kv-budget-gb", type=_budget_gb, default=None,
                   help="memory budget of the capacity table, GB (default: the device's free memory after the "
                        "weights)")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="seed of the weights, prompts and simulated draws")
    p.add_argument("--row-invariant", action="store_true",
                   help="the model in the row-invariant mode: its own GEMM, bmm and norm kernels, so speculative "
                        "output equals plain greedy output (default: cuBLAS and the default norms)")
    p.add_argument("--tp", type=positive_int, default=1,
                   help="tensor-parallel size: the model sharded over this many GPUs, one process each (started "
                        "under torchrun); adds the exchange-only path")
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results/<machine>)")


def path_options(options: RuntimeOptions, path: str) -> RuntimeOptions:
    """``options`` with the kill switches of ``path`` (``SWITCHES``) applied; the rest (top-k launch,
    sparse MLA kernel, metadata budget) as the environment set them, the same for every path."""
    return options.replace(**{OPTION_OF[name]: on for name, on in SWITCHES[path].items()})


@dataclass
class _Setup:
    """One configured context: the workers of both paths over one table and pool pair, the
    prefilled requests and their carry right after prefill."""

    context_len: int
    workers: dict
    rows: list[int]
    snapshot: dict
    ttft_ms: float | None
    capture_s: dict


def _build(model: DSAModel, context_len: int, prompts: list[list[int]], args, device, paths,
           options: RuntimeOptions, num_steps: int, kv_cache_dtype: str, progress: bool) -> _Setup:
    spec = SpecConfig(num_steps=num_steps)
    count = len(prompts)
    pool = ReqToTokenPool(count, context_len, num_draft_tokens=spec.num_draft_tokens, device=device)
    written = args.prompt_len + args.iterations * spec.num_draft_tokens + spec.num_draft_tokens
    allocator = PageAllocator(PAGE_SIZE * (1 + count * -(-written // PAGE_SIZE)))
    slots = RequestSlots(pool, allocator)
    dtype = model.lm_head.weight.dtype
    pools = dict(dtype=dtype, device=device, kv_cache_dtype=kv_cache_dtype)
    target_kv = KVPool.for_model(model.config, allocator.num_slots, **pools)
    mtp_kv = KVPool.for_model(model.config, allocator.num_slots, mtp=True, **pools)
    workers = {}
    if device.type != "cuda":
        options = options.replace(metadata_program_budget=8)     # few bounded programs under the interpreter
    capture_s = {}
    for path in tqdm(paths, desc="capture", unit="path", disable=not progress):
        began = time.perf_counter()
        workers[path] = build_spec_worker(
            model, pool, target_kv, mtp_kv, spec, bucket_sizes=args.concurrency,
            force_kernel=BOUNDED if SWITCHES[path][BOUNDED_SWITCH] else CONTEXT_WIDE,
            options=path_options(options, path))
        capture_s[path] = time.perf_counter() - began      # capture() ends with a device sync
    rows = [slots.admit(args.prompt_len, reserve=written - args.prompt_len) for _ in prompts]
    times = []
    for row, prompt in tqdm(list(zip(rows, prompts)), desc="prefill", unit="request", disable=not progress):
        began = time.perf_counter()
        workers["new"].prefill(row, prompt)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - began))
    return _Setup(context_len, workers, rows, workers["new"].state.snapshot(rows),
                  statistics.median(times) if device.type == "cuda" else None, capture_s)


@torch.no_grad()
def _run(worker: SpecWorker, setup: _Setup, concurrency: int, accept: str, args, *, timed: bool,
         iterations: int | None = None) -> dict:
    """One run from the prefilled state: ``iterations`` (default ``--iterations``) iterations of the
    first ``concurrency`` requests. Returns per-iteration wall ms, phase ms, accept lengths and
    committed tokens."""
    rows = setup.rows[:concurrency]
    worker.state.restore(setup.rows, setup.snapshot)
    worker.simulate_accept_len = None if accept == REAL else float(accept)
    worker.rng.seed(args.seed)
    out = {"iter_ms": [], "phase_ms": [], "accept_lens": [], "tokens": []}
    if timed:
        torch.cuda.synchronize()
    for _ in range(args.iterations if iterations is None else iterations):
        began = time.perf_counter()
        result = worker.step(rows, timed=timed)
        out["iter_ms"].append(1e3 * (time.perf_counter() - began))
        out["phase_ms"].append(result.phase_ms)
        out["accept_lens"].extend(result.accept_lens)
        out["tokens"].append(result.committed)
    return out


def _experts_hit(worker: SpecWorker, setup: _Setup, concurrency: int, accept: str, args) -> dict[int, float]:
    """Rows of a MoE call -> the routed experts it reads, counted in the first iteration of a run
    of ``concurrency`` requests, its phases run eagerly over the graphs' static buffers: the MTP
    draft steps' rows (one a request) and the verify's and extend's (S + 1 a request)."""
    enabled = {phase: graphs.enabled for phase, graphs in worker.graphs.items()}
    try:
        for graphs in worker.graphs.values():
            graphs.enabled = False
        with ExpertsHitCounter(worker.model) as counter:
            _run(worker, setup, concurrency, accept, args, timed=False, iterations=1)
    finally:
        for phase, graphs in worker.graphs.items():
            graphs.enabled = enabled[phase]
    return counter.by_rows()


def _summary(runs: list[dict], concurrency: int) -> dict:
    iters = sorted(t for run in runs for t in run["iter_ms"])
    run_medians = [statistics.median(run["iter_ms"]) for run in runs]
    median = statistics.median(iters)
    accept = statistics.fmean(a for run in runs for a in run["accept_lens"])
    per_token = median / accept
    phases = {phase: statistics.median(p[phase] for run in runs for p in run["phase_ms"]) for phase in PHASES}
    return {"ms_per_iter": median, "run_medians_ms": run_medians, "spread": (max(run_medians) - min(run_medians)) / median,
            "accept_len": accept, "ms_per_token": per_token, "tok_s_user": 1e3 / per_token,
            "output_tok_s": concurrency * 1e3 / per_token, "phases_ms": phases, "iterations": len(iters)}


def _apply_cpu_sizes(args) -> None:
    ignored = use_cpu_sizes(args, add_arguments, {"presets": ["tiny"], "contexts": [1024, 128], "concurrency": [1, 2],
                                                  "prompt_len": 70, "iterations": 3, "runs": 1})
    print(f"No CUDA: tiny preset (fp32) with the torch ops, metadata and draft-argmax kernels under the Triton "
          f"interpreter, contexts {format_value(args.contexts)}, concurrency {format_value(args.concurrency)}, "
          f"prompt {args.prompt_len}, {args.iterations} iterations, one run, accept modes "
          f"{format_value(args.accept)}. Token identity is checked; no time is measured (interpreter times mean "
          "nothing).")
    if ignored:
        print(ignored)


def run(args) -> int:
    from dsaspec.bench.results import bench_params, markdown_table, results_dir, write_results
    from dsaspec.distributed.launch import check_gpus, check_world, relaunch, under_torchrun

    options = RuntimeOptions.from_environment()
    args.num_steps = sorted(set(args.num_steps))
    verified = args.num_steps[0] + 1
    too_long = [mode for mode in args.accept if mode != REAL and float(mode) > verified]
    if too_long:
        raise UserError(f"--accept {format_value(too_long)}: a simulated mean accept length lies in [1, {verified}] "
                        f"(--num-steps {args.num_steps[0]} drafts + the bonus token)")
    if args.row_invariant and options.fp8_fast_accum:
        raise UserError("--row-invariant needs the FP8 GEMMs' exact tiles: unset DSASPEC_FP8_FAST_ACCUM")
    if options.simulate_accept_len is not None:
        raise UserError(f"DSASPEC_SIMULATE_ACCEPT_LEN is not used by bench e2e, whose accept modes are --accept "
                        f"({format_value(args.accept)}): unset it")
    if args.tp > 1:
        check_gpus(args.tp)
    if under_torchrun():
        check_world(args.tp)
    for preset in args.presets:
        try:
            check_implemented(get_config(preset).to_hf_dict())
        except ValueError as refusal:
            raise UserError(f"--presets {preset}: {refusal}") from None
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        _apply_cpu_sizes(args)
    args.concurrency = sorted(set(args.concurrency))
    args.kv_cache_dtype = list(dict.fromkeys(map(resolve_kv_cache_dtype, args.kv_cache_dtype)))
    args.contexts = sorted(set(args.contexts), reverse=True)
    written = args.prompt_len + (args.iterations + 1) * (args.num_steps[-1] + 1)
    if args.contexts[-1] < written:
        raise UserError(f"--contexts {args.contexts[-1]} cannot hold --prompt-len {args.prompt_len} and "
                        f"--iterations {args.iterations} of {args.num_steps[-1] + 1} tokens ({written} positions)")
    if args.tp > 1 and not under_torchrun():
        return relaunch(["bench", "e2e"], add_arguments, args, args.tp)
    group = None
    if args.tp > 1:
        from dsaspec.distributed.tp_group import init_tp_group

        group = init_tp_group()
    leader = group is None or group.rank == 0
    device = group.device if group else torch.device("cuda" if on_gpu else "cpu")
    paths = PATHS + (("gather",) if args.tp > 1 else ())
    if on_gpu:
        from dsaspec.bench.timing import warm_up_gpu

        warm_up_gpu()
    rates = Rates.measure(device)
    rows, mismatches, capacity = [], [], []
    for preset in args.presets:
        model = DSAModel(get_config(preset), device=None if group else device,
                         dtype=torch.bfloat16 if on_gpu else torch.float32, use_triton=on_gpu,
                         row_invariant=args.row_invariant, tp_group=group,
                         options=options).init_weights(args.seed, progress=leader)
        generator = torch.Generator().manual_seed(args.seed + 1)
        prompts = [torch.randint(0, model.config.vocab_size, (args.prompt_len,), generator=generator).tolist()
                   for _ in range(max(args.concurrency))]
        capacity += capacity_rows(preset, model, args, device)
        for num_steps, context_len, kv_dtype in [(s, c, d) for s in args.num_steps for c in args.contexts
                                                 for d in args.kv_cache_dtype]:
            setup = _build(model, context_len, prompts, args, device, paths, options, num_steps, kv_dtype,
                           progress=leader)
            points = [(accept, c) for accept in args.accept for c in args.concurrency]
            for accept, concurrency in tqdm(points, desc=f"{preset} S {num_steps} context {context_len} {kv_dtype}",
                                            unit="point", disable=not leader):
                runs = {path: [] for path in paths}
                tokens = {path: _run(setup.workers[path], setup, concurrency, accept, args, timed=False)["tokens"]
                          for path in paths}                      # warm-up, and the tokens to compare
                identical = all(tokens[path] == tokens["baseline"] for path in paths)
                hits = _experts_hit(setup.workers["new"], setup, concurrency, accept, args) \
                    if model.routed_experts() else {}
                floors = (FloorModel(model.config, act_bytes=model.lm_head.weight.element_size(),
                                     kv_cache_dtype=kv_dtype, tp=args.tp, experts_hit=hits), rates)
                if on_gpu:
                    for r in range(args.runs):
                        for path in (paths if r % 2 == 0 else paths[::-1]):
                            result = _run(setup.workers[path], setup, concurrency, accept, args, timed=True)
                            identical &= result["tokens"] == tokens[path]
                            runs[path].append(result)
                if not identical:
                    mismatches.append((preset, num_steps, context_len, kv_dtype, accept, concurrency))
                rows.append(_row(preset, num_steps, context_len, accept, concurrency, runs, identical, setup, on_gpu,
                                 args, floors, kv_dtype))
            del setup
        del model
        if on_gpu:
            torch.cuda.empty_cache()
    if not leader:
        return 1 if mismatches else 0
    if on_gpu:
        _add_targets(rows, args.contexts[-1])
        if args.tp > 1:
            _add_exchange_prediction(rows, results_dir(args.out) / "draft_step.json")
    order = "/".join(paths) + "/" + "/".join(paths[::-1])
    method = (f"{args.iterations} speculative iterations per run (S = {format_value(args.num_steps)}, topk 1) from the "
              "same prefilled state "
              f"(prompt {args.prompt_len} tokens), {args.runs} timed runs per point and path interleaved "
              f"{order} after one warm-up run each; iteration = host wall time of "
              "SpecWorker.step (metadata + draft/verify/extend graph replays + one device-to-host copy); phases "
              "from CUDA events; per-token latency = median iteration time / mean accept length; spread = "
              "(max - min) / median of the per-run medians." if on_gpu else
              "Triton interpreter on CPU (metadata, draft argmax), torch ops (model): token identity only.")
    if args.row_invariant:
        method += " Row-invariant mode: a row's logits do not depend on the batch (the model's own GEMM, bmm and norms)."
    if args.tp > 1 and on_gpu:
        method += (f" TP {args.tp}: {args.tp} processes under torchrun, times of rank 0; 'gather' = new with "
                   f"{EXCHANGE_SWITCH}=0; predicted exchange saving per iteration = S x (gather - exchange) µs "
                   "per draft step from bench draft-step at this TP and rows = concurrency.")
    method += (" Floors (new path): dsaspec/bench/floors.py at the run's mean live length, rates measured in the "
               "same run; MoE layers read the routed experts counted in one eager iteration of the point (rows of a "
               "MoE call -> distinct experts, the rows' experts_hit).")
    payload = {"method": method, "params": bench_params(args), "floors": vars(rates), "kill_switches": list(KILL_SWITCHES),
               "paths": {path: SWITCHES[path] for path in paths}, "capacity": capacity, "rows": rows}
    markdown = _markdown(rows, on_gpu, args, markdown_table) + "\n\n" + capacity_markdown(capacity, markdown_table)
    name = "e2e" if args.tp == 1 else f"e2e_tp{args.tp}"
    write_results(name, payload, markdown, args.out, figure=_figure(rows, args) if on_gpu else None)
    if mismatches:
        print(f"error: the paths ({', '.join(paths)}) committed different tokens at {mismatches}")
        return 1
    return 0


def _row(preset, num_steps, context_len, accept, concurrency, runs, identical, setup, on_gpu, args, floors,
         kv_cache_dtype="bf16") -> dict:
    row = {"preset": preset, "tp": args.tp, "num_steps": num_steps, "concurrency": concurrency, "context": context_len,
           "kv_cache_dtype": kv_cache_dtype, "accept": accept, "row_invariant": args.row_invariant,
           "tokens_identical": identical, "accept_len": None, "baseline_tok_s_user": None, "new_tok_s_user": None,
           "speedup": None, "baseline_ms_per_iter": None, "new_ms_per_iter": None, "ttft_ms": setup.ttft_ms,
           "capture_s": setup.capture_s, "experts_hit": floors[0].experts_hit or None}
    new = _summary(runs["new"], concurrency) if on_gpu else None
    accept_len = new["accept_len"] if on_gpu else (1.0 if accept == REAL else float(accept))
    live = args.prompt_len + round(args.iterations * accept_len / 2)     # the mean over the run
    row["floor_live"] = live
    row["floor_table"], row["floor_detail"] = iteration_rows(
        floors[0], concurrency, live, num_steps, floors[1],
        new and {p: 1e3 * ms for p, ms in new["phases_ms"].items()}, new and 1e3 * new["ms_per_iter"])
    if not on_gpu:
        return row
    base = _summary(runs["baseline"], concurrency)
    saved_metadata = base["phases_ms"]["metadata"] - new["phases_ms"]["metadata"]
    saved_phases = sum(base["phases_ms"][p] - new["phases_ms"][p] for p in PHASES)
    row.update(accept_len=new["accept_len"], baseline_tok_s_user=base["tok_s_user"], new_tok_s_user=new["tok_s_user"],
               speedup=new["tok_s_user"] / base["tok_s_user"], baseline_ms_per_iter=base["ms_per_iter"],
               new_ms_per_iter=new["ms_per_iter"],
               runs_overlap=min(base["run_medians_ms"]) <= max(new["run_medians_ms"])
               and min(new["run_medians_ms"]) <= max(base["run_medians_ms"]),
               predicted_speedup_metadata=base["ms_per_iter"] / (base["ms_per_iter"] - saved_metadata),
               predicted_speedup_phases=base["ms_per_iter"] / (base["ms_per_iter"] - saved_phases),
               baseline=base, new=new)
    if "gather" in runs:
        gather = _summary(runs["gather"], concurrency)
        row.update(gather_tok_s_user=gather["tok_s_user"], gather_ms_per_iter=gather["ms_per_iter"],
                   exchange_speedup=new["tok_s_user"] / gather["tok_s_user"],
                   exchange_saved_ms_per_iter=gather["ms_per_iter"] - new["ms_per_iter"],
                   exchange_saved_phase_ms={p: gather["phases_ms"][p] - new["phases_ms"][p] for p in PHASES},
                   gather=gather)
    return row


def _add_exchange_prediction(rows: list[dict], draft_step_json: Path) -> None:
    """``predicted_exchange_saved_ms``: an iteration evaluates the draft LM head S times at ``rows =
    concurrency`` (S - 1 draft steps, then the draft extend's next first draft), so the exchange
    should save S x (gather - exchange) µs of ``bench draft-step`` at the same TP and rows; None
    where that file has no such point. ``exchange_saved_vs_predicted``: measured / predicted."""
    saving = {}
    if draft_step_json.is_file():
        for r in json.loads(draft_step_json.read_text()).get("rows", []):
            if r.get("baseline_us") is not None and r.get("new_us") is not None:
                saving[r["tp"], r["rows"]] = (r["baseline_us"] - r["new_us"]) / 1e3
    for row in rows:
        per_step = saving.get((row["tp"], row["concurrency"]))
        predicted = None if per_step is None else row["num_steps"] * per_step
        row["predicted_exchange_saved_ms"] = predicted
        row["exchange_saved_vs_predicted"] = (row["exchange_saved_ms_per_iter"] / predicted
                                              if predicted else None)


def _add_targets(rows: list[dict], reference_context: int) -> None:
    """new / baseline >= 0.99 everywhere; new per-token latency at each context over the reference
    context's (same preset, cache dtype, chain, accept mode and concurrency) <= 1.02."""
    def key(r):
        return r["preset"], r["kv_cache_dtype"], r["num_steps"], r["accept"], r["concurrency"]

    reference = {key(r): r for r in rows if r["context"] == reference_context}
    for row in rows:
        ref = reference[key(row)]
        row["new_not_slower"] = row["speedup"] >= NOISE
        row["new_vs_reference_context"] = row["new"]["ms_per_token"] / ref["new"]["ms_per_token"]
        row["baseline_vs_reference_context"] = row["baseline"]["ms_per_token"] / ref["baseline"]["ms_per_token"]
        row["context_target_met"] = row["new_vs_reference_context"] <= CONTEXT_TARGET


def chain_label(num_steps: int) -> str:
    """``S = 4 (EAGLE 4/1/5)``: the chain as SGLang's steps / topk / draft tokens."""
    return f"S = {num_steps} (EAGLE {num_steps}/1/{num_steps + 1})"


def run_label(preset: str, tp: int, row_invariant: bool, num_steps: int) -> str:
    """``glm5-fp8-tp8-rank at TP 2, row-invariant, S = 3 (EAGLE 3/1/4)``: what a table's rows ran (TP
    and the mode only where they are not the defaults)."""
    return f"{preset}{f' at TP {tp}' if tp > 1 else ''}{', row-invariant' if row_invariant else ''}, " \
           f"{chain_label(num_steps)}"


def upstream_tables(rows: list[dict]) -> list[str]:
    """The upstream PR's table form, one Markdown table per preset, chain, KV cache dtype, accept mode and context
    of a GPU run's rows (in their order), one line per concurrency (ascending): tok/s/user baseline,
    new, gain = new / baseline - 1, spread baseline / new, output tok/s baseline → new, the median
    TTFT (one prefill serves both paths) and the accept length (``baseline / new`` where they
    differ at two decimals)."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["preset"], r["tp"], r["num_steps"], r["kv_cache_dtype"], r["accept"], r["context"]),
                          []).append(r)
    tables = []
    for (preset, tp, num_steps, kv_dtype, accept, context), mine in groups.items():
        lines = [f"## {run_label(preset, tp, mine[0]['row_invariant'], num_steps)}, KV cache {kv_dtype}, "
                 f"accept {accept}, context {context}: tok/s/user, baseline → new", "",
                 "| concurrency | tok/s/user baseline | new | gain | spread baseline / new "
                 "| output tok/s baseline → new | median TTFT ms | accept length |", "|---|---|---|---|---|---|---|---|"]
        for r in sorted(mine, key=lambda r: r["concurrency"]):
            base, new = r["baseline"], r["new"]
            accepts = [f"{base['accept_len']:.2f}", f"{new['accept_len']:.2f}"]
            lines.append(f"| {r['concurrency']} | {base['tok_s_user']:.1f} | {new['tok_s_user']:.1f} | "
                         f"{new['tok_s_user'] / base['tok_s_user'] - 1:+.1%} | "
                         f"{base['spread']:.2%} / {new['spread']:.2%} | "
                         f"{base['output_tok_s']:.0f} → {new['output_tok_s']:.0f} | {r['ttft_ms']:.0f} | "
                         f"{' / '.join(dict.fromkeys(accepts))} |")
        tables.append("\n".join(lines))
    return tables


def _markdown(rows, on_gpu, args, markdown_table) -> str:
    if not on_gpu:
        return markdown_table([("preset", "preset"), ("num_steps", "S"), ("context", "context"),
                               ("kv_cache_dtype", "KV cache"), ("accept", "accept"),
                               ("concurrency", "concurrency"), ("tokens_identical", "baseline == new tokens")], rows)
    parts = upstream_tables(rows)
    for preset, num_steps in [(p, s) for p in args.presets for s in args.num_steps]:
        mine = [r for r in rows if r["preset"] == preset and r["num_steps"] == num_steps]
        flat = [dict(r, b_tps=r["baseline_tok_s_user"], n_tps=r["new_tok_s_user"], al=r["accept_len"],
                     b_out=r["baseline"]["output_tok_s"], n_out=r["new"]["output_tok_s"],
                     b_spread=r["baseline"]["spread"], n_spread=r["new"]["spread"],
                     capture=" / ".join(f"{r['capture_s'][p]:.1f}" for p in r["capture_s"])) for r in mine]
        tp = mine[0]["tp"] if mine else 1
        name = run_label(preset, tp, args.row_invariant, num_steps)
        title = f"## {name}: all columns, baseline → new\n\n"
        parts.append(title + markdown_table([
            ("context", "context"), ("kv_cache_dtype", "KV cache"), ("accept", "accept mode"),
            ("concurrency", "concurrency"), ("al", "accept len"),
            ("b_tps", "baseline tok/s/user"), ("n_tps", "new tok/s/user"), ("speedup", "speedup"),
            ("baseline_ms_per_iter", "baseline ms/iter"), ("new_ms_per_iter", "new ms/iter"),
            ("b_out", "baseline output tok/s"), ("n_out", "new output tok/s"), ("ttft_ms", "TTFT ms"),
            ("capture", f"graph capture s ({' / '.join(mine[0]['capture_s']) if mine else ''})"),
            ("b_spread", "spread b"), ("n_spread", "spread n"), ("runs_overlap", "run ranges overlap"),
            ("tokens_identical", "tokens identical")], flat))
        if tp > 1:
            parts.append(f"### {name}: the argmax exchange alone (gather = new with "
                         f"{EXCHANGE_SWITCH}=0)\n\n" + markdown_table([
                             ("context", "context"), ("kv_cache_dtype", "KV cache"), ("accept", "accept"),
                             ("concurrency", "concurrency"), ("gather_tok_s_user", "gather tok/s/user"), ("new_tok_s_user", "new tok/s/user"),
                             ("exchange_speedup", "new / gather"), ("gather_ms_per_iter", "gather ms/iter"),
                             ("new_ms_per_iter", "new ms/iter"), ("exchange_saved_ms_per_iter", "saved ms/iter"),
                             ("saved_draft", "saved in draft ms"), ("saved_extend", "saved in extend ms"),
                             ("predicted_exchange_saved_ms", "predicted by draft-step ms"),
                             ("exchange_saved_vs_predicted", "measured / predicted")],
                             [dict(r, saved_draft=r["exchange_saved_phase_ms"]["draft"],
                                   saved_extend=r["exchange_saved_phase_ms"]["extend"]) for r in mine]))
        phase_rows = [dict(r, path=path, **{f"{p}_ms": r[path]["phases_ms"][p] for p in PHASES},
                           iter_ms=r[path]["ms_per_iter"]) for r in mine for path in SWITCHES if path in r]
        parts.append(f"### {name}: iteration split by phase (device time, CUDA events, median ms)\n\n" + markdown_table(
            [("context", "context"), ("kv_cache_dtype", "KV cache"), ("accept", "accept"), ("concurrency", "concurrency"),
             ("path", "path")]
            + [(f"{p}_ms", p) for p in PHASES] + [("iter_ms", "iteration (host wall)")], phase_rows))
        parts.append(f"### {name}: new path against its floor (dsaspec/bench/floors.py; phases: CUDA events, "
                     "iteration: host wall)\n\n" + _floor_markdown(mine, markdown_table))
        parts.append(f"### {name}: targets\n\n" + markdown_table(
            [("context", "context"), ("kv_cache_dtype", "KV cache"), ("accept", "accept"), ("concurrency", "concurrency"),
             ("speedup", "new / baseline"),
             ("new_not_slower", f">= {NOISE}"), ("predicted_speedup_metadata", "predicted by metadata phase"),
             ("predicted_speedup_phases", "predicted by all phases"),
             ("new_vs_reference_context", f"new / context {args.contexts[-1]}"),
             ("baseline_vs_reference_context", f"baseline / context {args.contexts[-1]}"),
             ("context_target_met", f"new within {CONTEXT_TARGET - 1:.0%}")], mine))
    return "\n\n".join(parts)


def _floor_markdown(rows, markdown_table) -> str:
    """One line a point: each iteration phase's measured / floor, the iteration's ms, floor ms and
    ratios."""
    flat = []
    for r in rows:
        table = {t["phase"]: t for t in r["floor_table"]}
        total = table[ITERATION]
        flat.append(dict(r, **{f"{p}_ratio": table[p]["measured_over_floor"] for p in PHASES},
                         iter_ms=total["measured_us"] / 1e3, floor_ms=total["floor_us"] / 1e3,
                         ratio=total["measured_over_floor"], bytes_ratio=total["measured_over_bytes_floor"]))
    return markdown_table([("context", "context"), ("kv_cache_dtype", "KV cache"), ("accept", "accept"),
                           ("concurrency", "concurrency"), ("floor_live", "live KV")] + [(f"{p}_ratio", f"{p} / floor") for p in PHASES]
                          + [("iter_ms", "iteration ms"), ("floor_ms", "iteration floor ms"),
                             ("ratio", "iteration / floor"), ("bytes_ratio", "iteration / bytes floor")], flat)


def _figure(rows, args):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(p, s) for p in args.presets for s in args.num_steps]
    accepts = args.accept
    fig, axes = plt.subplots(len(panels), len(accepts), figsize=(5.5 * len(accepts), 4 * len(panels)), squeeze=False)
    for i, (preset, num_steps) in enumerate(panels):
        for j, accept in enumerate(accepts):
            ax = axes[i][j]
            for context, kv_dtype in [(c, d) for c in args.contexts for d in args.kv_cache_dtype]:
                mine = sorted((r for r in rows if r["preset"] == preset and r["num_steps"] == num_steps
                               and r["accept"] == accept and r["context"] == context
                               and r["kv_cache_dtype"] == kv_dtype), key=lambda r: r["concurrency"])
                xs = [r["concurrency"] for r in mine]
                label = f"context {context}, {kv_dtype}"
                ax.plot(xs, [r["baseline_tok_s_user"] for r in mine], "o--", label=f"baseline, {label}")
                ax.plot(xs, [r["new_tok_s_user"] for r in mine], "o-", label=f"new, {label}")
                if mine and "gather" in mine[0]:
                    ax.plot(xs, [r["gather_tok_s_user"] for r in mine], "x:", label=f"gather, {label}")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency")
            ax.set_ylabel("tok/s/user")
            ax.set_title(f"{preset}{f' at TP {args.tp}' if args.tp > 1 else ''}, S = {num_steps}, accept {accept}")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def capacity_rows(preset: str, model: DSAModel, args, device: torch.device) -> list[dict]:
    """Per cache dtype of ``args.kv_cache_dtype``: the KV bytes a token of ``model`` (target layers
    + MTP layer, in its pools' layouts; :func:`~dsaspec.models.footprint.required_bytes`), the
    budget (``--kv-budget-gb``, else ``device``'s free memory now, after the weights), the tokens
    that fit it and, per configured context, the requests that fit at that context."""
    if args.kv_budget_gb is not None:
        budget, source = int(args.kv_budget_gb * 1e9), "--kv-budget-gb"
    else:
        free = available_bytes(device)
        if free is None:
            raise UserError(f"the free memory of {device} is unknown: give --kv-budget-gb")
        budget, source = free[0], f"free on {device} after the weights"
    config = model.config
    layers = config.num_hidden_layers + config.num_nextn_predict_layers
    rows = []
    for kv_dtype in args.kv_cache_dtype:
        per_page = required_bytes(config, model.lm_head.weight.dtype, max_batch=1, context_len=1,
                                  num_slots=PAGE_SIZE, mtp=config.num_nextn_predict_layers > 0,
                                  kv_cache_dtype=kv_dtype)["kv"]
        tokens = budget // per_page * PAGE_SIZE                                 # whole pages
        rows.append({"preset": preset, "kv_cache_dtype": kv_dtype, "layers": layers,
                     "bytes_per_slot_and_layer": per_page / PAGE_SIZE / layers, "bytes_per_token": per_page / PAGE_SIZE,
                     "budget_bytes": budget, "budget": source, "tokens": tokens,
                     "tokens_per_gb": 1e9 * PAGE_SIZE / per_page,
                     "requests_at_context": {context: tokens // context for context in args.contexts}})
    return rows


def capacity_markdown(rows: list[dict], markdown_table) -> str:
    """The capacity table: one line a preset and cache dtype."""
    contexts = sorted({c for r in rows for c in r["requests_at_context"]}, reverse=True)
    flat = [dict(r, budget_gb=f"{r['budget_bytes'] / 1e9:.2f} ({r['budget']})",
                 per_slot=f"{r['bytes_per_slot_and_layer']:.0f}", per_token=f"{r['bytes_per_token']:.0f}",
                 per_gb=f"{r['tokens_per_gb']:.0f}",
                 **{f"at_{c}": r["requests_at_context"][c] for c in contexts}) for r in rows]
    return "## KV capacity\n\n" + markdown_table(
        [("preset", "preset"), ("kv_cache_dtype", "KV cache"), ("per_slot", "bytes a slot and layer"),
         ("layers", "layers (+ MTP)"), ("per_token", "bytes a token"), ("per_gb", "tokens per GB"),
         ("budget_gb", "budget GB"), ("tokens", "tokens that fit")]
        + [(f"at_{c}", f"requests at context {c}") for c in contexts], flat)
