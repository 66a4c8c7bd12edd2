"""``dsaspec generate``: greedy generation of a few seeded random prompts with the runtime Engine.

By default the embedded ``tiny`` preset with seeded random weights (``--checkpoint DIR`` loads a
safetensors checkpoint instead), prompts of different lengths (one longer than the tiny model's
top-k, so the attention is sparse), continuous batching, CUDA graphs on a GPU; with
``--speculative-algorithm NEXTN`` MTP speculative decoding (SGLang's option names). Prints each
request's generated ids, its time to first token and time per output token (and the mean accept
length). Every option is
checked before the model is built; a model that does not fit the device's free memory (the
machine's available memory on CPU) is refused up front. ``--tp N`` shards the model over N GPUs
(one process per GPU, started under torchrun by the command itself); rank 0 prints.
"""

from __future__ import annotations

import argparse

import torch

from dsaspec import flags
from dsaspec.errors import UserError
from dsaspec.cli_parsing import nonnegative_int, option_name, positive_int, positive_int_list
from dsaspec.models.footprint import available_bytes, required_bytes

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DTYPE_ALIASES = {"bfloat16": "bf16", "float32": "fp32"}       # SGLang's and vLLM's spellings
SPEC_ALGORITHMS = ("NEXTN", "EAGLE")        # both: the MTP layer drafts a chain (EAGLE topk 1)
SPEC_OPTIONS = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")


def device_arg(text: str) -> torch.device:
    """argparse type: ``cpu``, ``cuda`` or ``cuda:N``."""
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return device


def dtype_name(text: str) -> str:
    """argparse type of ``--dtype``: a name of ``DTYPES``, its aliases mapped to it."""
    return DTYPE_ALIASES.get(text, text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``dsaspec generate``."""
    add_model_arguments(p, seed_help="seed of the weights and the prompts")
    p.add_argument("--prompt-lens", type=positive_int_list, default=[8, 80],
                   help="comma-separated prompt lengths, one request each")
    p.add_argument("--max-new-tokens", type=positive_int, default=16, help="tokens generated per request")
    p.add_argument("--eos-token-id", type=nonnegative_int, default=None,
                   help="stop a request at this token (default: none, generate --max-new-tokens)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (default: shown)")
    p.add_argument("--tp", type=positive_int, default=1,
                   help="tensor-parallel size: the model sharded over this many GPUs, one process each "
                        "(started under torchrun)")


def add_model_arguments(p: argparse.ArgumentParser, *, seed_help: str = "seed of the weights") -> None:
    """The model and engine options ``dsaspec generate`` and ``dsaspec serve`` share."""
    from dsaspec.configs.model_config import PRESETS
    from dsaspec.models.dsa_model import DEFAULT_PREFILL_CHUNK

    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model preset (random weights)")
    p.add_argument("--checkpoint", default=None,
                   help="safetensors checkpoint directory (config.json + weights); overrides --preset (default: none)")
    p.add_argument("--seed", type=nonnegative_int, default=0, help=seed_help)
    p.add_argument("--max-batch", type=positive_int, default=4, help="requests decoding together")
    p.add_argument("--context-len", type=positive_int, default=2048,
                   help="configured context: prompt + generated tokens per request (page-table width)")
    p.add_argument("--num-slots", type=positive_int, default=None,
                   help="KV slots, a multiple of 64 (default: every request row at full --context-len)")
    p.add_argument("--device", type=device_arg, default=None,
                   help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    p.add_argument("--dtype", type=dtype_name, default="bf16", choices=sorted(DTYPES),
                   help=f"weight and activation dtype ({', '.join(DTYPE_ALIASES)} are accepted too)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bf16", "fp8_e4m3"],
                   help="KV cache dtype: bf16 (the model's dtype) or fp8_e4m3 (FlashMLA's fp8_ds_mla and the "
                        "paged FP8 indexer keys); auto: bf16")
    p.add_argument("--ops", default="auto", choices=["auto", "triton", "torch"],
                   help="DSA ops: Triton kernels or torch references (auto: triton on CUDA). The two sum in "
                        "different orders, so in bf16 their tokens can differ where two logits nearly tie, "
                        "on CPU (the Triton interpreter) as on a GPU")
    p.add_argument("--no-cuda-graph", action="store_true", help="eager decode steps on CUDA (default: graphs)")
    p.add_argument("--chunked-prefill-size", type=positive_int, default=DEFAULT_PREFILL_CHUNK,
                   help="prompt tokens a prefill forward takes at most (a request's prompt is prefilled "
                        "eagerly in chunks of this many; fewer where their fp32 indexer logits, chunk x "
                        "live positions, would pass 1 GiB): larger chunks read the weights, a MoE layer's "
                        f"experts included, fewer times (default: {DEFAULT_PREFILL_CHUNK})")
    p.add_argument("--row-invariant", action="store_true",
                   help="row-invariant GEMMs and norms: speculative output equals plain greedy output token "
                        "for token (default: cuBLAS and torch norms)")
    p.add_argument("--speculative-algorithm", type=str.upper, choices=SPEC_ALGORITHMS, default=None,
                   help="speculative decoding with the model's MTP layer (default: none, plain greedy decoding)")
    p.add_argument("--speculative-num-steps", type=positive_int, default=None,
                   help="draft tokens per iteration, S (default: 3 with --speculative-algorithm)")
    p.add_argument("--speculative-eagle-topk", type=positive_int, default=None,
                   help="drafts per step; only 1 (a chain) is implemented (default: 1)")
    p.add_argument("--speculative-num-draft-tokens", type=positive_int, default=None,
                   help="tokens verified per request per iteration, S + 1 for a chain (default: S + 1)")


def check_device(device: torch.device, option: str = "--device") -> None:
    """Raise UserError unless ``device`` exists on this machine."""
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        why = "this torch build has no CUDA support" if torch.version.cuda is None else "no CUDA device is visible"
        raise UserError(f"{option} {device}: {why}; use {option} cpu")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise UserError(f"{option} {device}: only {torch.cuda.device_count()} CUDA device(s) are visible")


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def check_fits(source: str, need: dict, device: torch.device, dtype_name: str) -> None:
    """Raise UserError if ``need['total']`` bytes exceed what ``device`` has available."""
    have = available_bytes(device)
    if have is not None and need["total"] > have[0]:
        raise UserError(f"{source} needs at least {_gb(need['total'])} ({_gb(need['weights'])} weights in "
                        f"{dtype_name}, {_gb(need['kv'] + need['table'])} KV cache and tables) but {have[1]} "
                        f"{_gb(have[0])} available; choose a smaller model or --context-len / --max-batch")


def speculative_config(args, config, options):
    """The SpecConfig the options ask for (None without --speculative-algorithm), with the simulated
    accept length of ``options`` (RuntimeOptions); UserError for options that cannot be honoured."""
    from dsaspec.speculative.spec_worker import SpecConfig

    given = [name for name in SPEC_OPTIONS if getattr(args, name) is not None]
    if args.speculative_algorithm is None:
        if given:
            raise UserError(f"{option_name(given[0])} needs --speculative-algorithm "
                            f"({' or '.join(SPEC_ALGORITHMS)})")
        if options.simulate_accept_len is not None:
            raise UserError("DSASPEC_SIMULATE_ACCEPT_LEN simulates speculative acceptance: it needs "
                            f"--speculative-algorithm ({' or '.join(SPEC_ALGORITHMS)}); unset it for plain decoding")
        return None
    if config.num_nextn_predict_layers != 1:
        raise UserError(f"--speculative-algorithm {args.speculative_algorithm} needs a model with its MTP layer "
                        "(num_nextn_predict_layers = 1); this one has none")
    steps = args.speculative_num_steps or 3
    verified = args.speculative_num_draft_tokens or steps + 1
    if options.simulate_accept_len is not None and options.simulate_accept_len > verified:
        raise UserError(f"DSASPEC_SIMULATE_ACCEPT_LEN={options.simulate_accept_len:g} exceeds the {verified} tokens an "
                        "iteration verifies (--speculative-num-draft-tokens): a mean accept length lies in "
                        f"[1, {verified}]")
    try:
        return SpecConfig(num_steps=steps, eagle_topk=args.speculative_eagle_topk or 1,
                          num_draft_tokens=args.speculative_num_draft_tokens or steps + 1,
                          simulate_accept_len=options.simulate_accept_len)
    except ValueError as err:                      # SpecConfig names the option that is out of range
        raise UserError(f"--speculative options: {err}") from None


def check_requests(args, config, page_size: int, draft_tokens: int = 1) -> int:
    """Check the requests against the model and the memory options; return the KV slots to use."""
    if args.eos_token_id is not None and args.eos_token_id >= config.vocab_size:
        raise UserError(f"--eos-token-id {args.eos_token_id} is outside the model's vocabulary "
                        f"[0, {config.vocab_size})")
    from dsaspec.engine.engine import Engine

    positions = max(args.prompt_lens) + args.max_new_tokens - 1  # KV positions of the longest request
    if positions > args.context_len:
        raise UserError(f"--prompt-lens {max(args.prompt_lens)} with --max-new-tokens {args.max_new_tokens} "
                        f"needs {positions} positions, more than --context-len {args.context_len}")
    positions += draft_tokens - 1                                  # the last verify block
    pages = -(-positions // page_size)
    if args.num_slots is None:
        return Engine.default_num_slots(args.max_batch, args.context_len, draft_tokens)
    if args.num_slots % page_size or args.num_slots // page_size < 1 + pages:
        raise UserError(f"--num-slots {args.num_slots}: expected a multiple of {page_size} of at least "
                        f"{page_size * (1 + pages)} (one reserved page + {pages} page(s) for the longest "
                        f"request, {positions} positions)")
    return args.num_slots


def runtime_options(args):
    """The ``RuntimeOptions`` of the ``DSASPEC_*`` variables, checked against the model arguments:
    UserError for ``DSASPEC_FP8_FAST_ACCUM`` with ``--row-invariant``."""
    from dsaspec.configs.runtime_options import RuntimeOptions

    options = RuntimeOptions.from_environment()
    if args.row_invariant and options.fp8_fast_accum:
        raise UserError("--row-invariant needs the FP8 GEMMs' exact tiles: unset DSASPEC_FP8_FAST_ACCUM")
    return options


def device_and_ops(args) -> tuple[torch.device, bool, torch.dtype]:
    """The device (``--device``, default cuda if available), whether the Triton ops run and the
    dtype; UserError for a device, ops and dtype that do not go together."""
    device = args.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    check_device(device)
    use_triton = args.ops == "triton" or (args.ops == "auto" and device.type == "cuda")
    dtype = DTYPES[args.dtype]
    if use_triton and dtype != torch.bfloat16:
        raise UserError(f"--ops triton needs --dtype bf16, got --dtype {args.dtype}")
    if use_triton and device.type == "cpu" and not flags.triton_interpret():
        raise UserError("--ops triton on --device cpu needs the Triton interpreter: set TRITON_INTERPRET=1")
    return device, use_triton, dtype


def model_config(args):
    """(ModelConfig, where it comes from) of ``--checkpoint`` or ``--preset``."""
    from dsaspec.configs.model_config import get_config
    from dsaspec.models.loader import load_config

    if args.checkpoint:
        return load_config(args.checkpoint), f"checkpoint {args.checkpoint}"
    return get_config(args.preset), f"--preset {args.preset}"


def build_model(args, config, device, dtype, use_triton: bool, options, group=None):
    """(the DSAModel of ``config`` with ``--checkpoint``'s weights or seeded random ones, a line
    saying which)."""
    from dsaspec.models.dsa_model import DSAModel
    from dsaspec.models.loader import load_weights

    model = DSAModel(config, device=None if group else device, dtype=dtype, use_triton=use_triton,
                     row_invariant=args.row_invariant, tp_group=group, options=options)
    if args.checkpoint:
        load_weights(model, args.checkpoint)
    else:
        model.init_weights(args.seed)
    return model, weights_source(args)


def weights_source(args) -> str:
    """The line saying where :func:`build_model`'s weights come from."""
    if args.checkpoint:
        return f"checkpoint {args.checkpoint}"
    return f"preset {args.preset}, random weights (seed {args.seed})"


def run(args) -> int:
    """Check the options, build the model and the engine, generate, print ids and timings.
    Returns 0; raises UserError for bad options, checkpoints or a model that does not fit."""
    from dsaspec.engine.engine import Engine
    from dsaspec.distributed.launch import check_gpus, check_world, relaunch, under_torchrun
    from dsaspec.memory import PAGE_SIZE

    options = runtime_options(args)
    if args.tp > 1:
        check_gpus(args.tp)
        if args.device is not None and (args.device.type != "cuda" or args.device.index is not None):
            raise UserError(f"--tp {args.tp} runs one process per GPU (cuda:0 .. cuda:{args.tp - 1}); "
                            f"leave out --device {args.device}")
    if under_torchrun():
        check_world(args.tp)
    device, use_triton, dtype = device_and_ops(args)
    config, source = model_config(args)
    spec = speculative_config(args, config, options)
    num_slots = check_requests(args, config, PAGE_SIZE, spec.num_draft_tokens if spec else 1)
    for name in ("num_attention_heads", "intermediate_size"):
        if getattr(config, name) % args.tp:
            raise UserError(f"--tp {args.tp} must divide the model's {name} ({getattr(config, name)})")
    if args.tp > 1 and not under_torchrun():
        return relaunch(["generate"], add_arguments, args, args.tp)
    group = None
    if args.tp > 1:
        from dsaspec.distributed.tp_group import init_tp_group

        group = init_tp_group()
        device = group.device
    check_fits(source, required_bytes(config, dtype, max_batch=args.max_batch, context_len=args.context_len,
                                      num_slots=num_slots, mtp=spec is not None, tp=args.tp,
                                      kv_cache_dtype=args.kv_cache_dtype), device, args.dtype)

    model, source = build_model(args, config, device, dtype, use_triton, options, group)
    generator = torch.Generator().manual_seed(args.seed + 1)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=generator).tolist() for n in args.prompt_lens]
    leader = group is None or group.rank == 0
    engine = Engine(model, context_len=args.context_len, max_batch=args.max_batch, num_slots=num_slots,
                    use_cuda_graph=False if args.no_cuda_graph else None,
                    progress=leader and not args.no_progress, speculative=spec,
                    kv_cache_dtype=args.kv_cache_dtype, prefill_chunk=args.chunked_prefill_size)
    if leader:
        _print_setup(args, source, device, use_triton, engine, spec, group)
    results = engine.generate(prompts, args.max_new_tokens, eos_token_id=args.eos_token_id)
    if leader:
        _print_results(results, engine.stats, spec, random_weights=not args.checkpoint)
    return 0


def _print_setup(args, source, device, use_triton, engine, spec, group) -> None:
    """What runs: model, TP, device, ops, graphs, metadata kernel, speculative settings."""
    tp = "" if group is None else f"; TP {group.size} over {group.size} GPUs ({group.transport} all-reduce)"
    print(f"model: {source}{tp}; device {device}, {args.dtype}, KV cache {engine.kv.kv_cache_dtype}, "
          f"ops {'triton' if use_triton else 'torch'}, "
          f"CUDA graphs {'on' if engine.use_cuda_graph else 'off'}, metadata kernel "
          f"{engine.backend.kernel} ({engine.backend.kernel_reason}), prefill chunks of "
          f"{engine.prefill_chunk} tokens")
    if spec is not None:
        print(f"speculative decoding: {args.speculative_algorithm}, {spec.num_steps} draft steps, topk 1, "
              f"{spec.num_draft_tokens} tokens verified per iteration")
        if spec.simulated:
            print(f"simulated acceptance (DSASPEC_SIMULATE_ACCEPT_LEN={spec.simulate_accept_len}): the tokens "
                  "below are NOT the model's greedy output")
    if device.type == "cpu":
        print("On CPU the times below mean nothing for GPU performance (host times of reference ops "
              "and the Triton interpreter).")


def _print_results(results, stats, spec, *, random_weights: bool) -> None:
    """Each request's ids and times (or why it was refused), the decode steps and the mean accept
    length (with random weights, the note that the MTP layer drafts noise)."""
    for i, result in enumerate(results):
        if result.error is not None:
            print(f"request {i}: prompt {result.prompt_len} tokens, refused: {result.error}")
            continue
        tpot = "n/a" if result.tpot_s is None else f"{1e3 * result.tpot_s:.2f} ms"
        print(f"request {i}: prompt {result.prompt_len} tokens, {len(result.token_ids)} generated "
              f"({result.finish_reason}), TTFT {1e3 * result.ttft_s:.1f} ms, TPOT {tpot}")
        print(f"  ids: {result.token_ids}")
    if stats.decode_steps:
        what = "iterations" if spec else "steps"
        print(f"decode: {stats.decode_steps} {what}, {stats.decode_tokens} tokens, median step "
              f"{stats.median_step_ms:.2f} ms (host wall time per {what[:-1]}, batch sizes "
              f"{min(stats.step_batches)}-{max(stats.step_batches)})")
    if spec is not None and stats.accept_lens:
        note = (" (simulated)" if spec.simulated else
                " (random weights: the MTP layer drafts noise, so about 1 is expected; load trained "
                "weights with --checkpoint for real acceptance)" if random_weights else "")
        print(f"mean accept length {stats.mean_accept_len:.2f} of {spec.num_draft_tokens}{note}")
