"""``dsaspec serve``: an OpenAI-compatible HTTP server over the runtime Engine (docs/serving.md).

``/v1/completions`` and ``/v1/chat/completions`` (streamed as server-sent events with
``"stream": true``), ``/v1/models``, ``/health``, ``/metrics`` (Prometheus) and
``/get_server_info``. Greedy decoding with continuous batching, plain or speculative
(``--speculative-algorithm NEXTN``); the engine steps in a process of its own (``--engine-process``,
the default; ``--no-engine-process``: on a thread of the HTTP process) and admits requests between
steps. Text goes through the checkpoint's ``tokenizer.json`` (``--tokenizer DIR``
overrides; without one, prompts and outputs are token ids). Every option is checked before the
model is built. Needs the ``serve`` extra. Ctrl-C (SIGINT) or SIGTERM stops it: no new
connections, requests in flight get ``--shutdown-timeout`` seconds to finish, then the rest are
cancelled and every KV page is freed.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from dsaspec.cli_parsing import nonnegative_int, positive_int
from dsaspec.commands.generate import add_model_arguments
from dsaspec.errors import UserError

SERVE_PACKAGES = {"starlette": "starlette", "uvicorn": "uvicorn", "prometheus_client": "prometheus-client",
                  "tokenizers": "tokenizers", "jinja2": "jinja2"}


def port(text: str) -> int:
    """argparse type: a TCP port, 0 (any free one) to 65535."""
    value = nonnegative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a port in [0, 65535], got {text!r}")
    return value


def nonnegative_float(text: str) -> float:
    """argparse type: a number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``dsaspec serve``."""
    add_model_arguments(p)
    p.add_argument("--tokenizer", default=None,
                   help="directory with tokenizer.json (and tokenizer_config.json, generation_config.json) "
                        "(default: the --checkpoint directory; none with --preset: token ids in and out)")
    p.add_argument("--served-model-name", default=None,
                   help="model id of /v1/models (default: the checkpoint directory's name, or the preset's)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=port, default=30000, help="TCP port (0: any free one, printed)")
    p.add_argument("--max-waiting", type=positive_int, default=256,
                   help="requests that may wait for a row and KV pages; beyond it a request gets 503")
    p.add_argument("--shutdown-timeout", type=nonnegative_float, default=10.0,
                   help="seconds requests in flight get to finish at shutdown before they are cancelled")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine (model, CUDA graphs, scheduler) in a process of its own, spawned, which "
                        "the HTTP process talks to over a pipe (default); --no-engine-process: on a thread of "
                        "the HTTP process, sharing its GIL")


def check_packages() -> None:
    """UserError naming the ``serve`` extra's packages that are not installed."""
    missing = [pip for module, pip in SERVE_PACKAGES.items() if importlib.util.find_spec(module) is None]
    if missing:
        raise UserError(f"dsaspec serve needs {', '.join(missing)}: pip install 'dsaspec[serve]' "
                        "(scripts/install.sh installs it)")


def check_num_slots(args, page_size: int, draft_tokens: int) -> int:
    """The KV slots to use: ``--num-slots`` (a multiple of the page size, room for one request of
    one token) or the engine's default."""
    from dsaspec.engine.engine import Engine

    if args.num_slots is None:
        return Engine.default_num_slots(args.max_batch, args.context_len, draft_tokens)
    least = page_size * (1 + -(-draft_tokens // page_size))
    if args.num_slots % page_size or args.num_slots < least:
        raise UserError(f"--num-slots {args.num_slots}: expected a multiple of {page_size} of at least {least}")
    return args.num_slots


@dataclass
class EnginePlan:
    """What :func:`build_server` checked and :func:`build_engine` builds from (with the parsed
    options): picklable, so a spawned engine process gets it as it is."""

    config: object                                   # ModelConfig
    device: object                                   # torch.device
    dtype: object                                    # torch.dtype
    use_triton: bool
    options: object                                  # RuntimeOptions, read once in the parent
    spec: object                                     # SpecConfig or None
    num_slots: int
    source: str                                      # model_config's: where the config comes from


def build_engine(args, plan: EnginePlan):
    """Check that the model and its KV cache fit the device (UserError), then build the model
    (``--checkpoint``'s weights or seeded random ones) and its Engine, as ``plan`` and the options
    say. In the engine process this is the first use of the device."""
    from dsaspec.commands.generate import build_model, check_fits, required_bytes
    from dsaspec.engine.engine import Engine

    check_fits(plan.source, required_bytes(plan.config, plan.dtype, max_batch=args.max_batch,
                                           context_len=args.context_len, num_slots=plan.num_slots,
                                           mtp=plan.spec is not None, kv_cache_dtype=args.kv_cache_dtype),
               plan.device, args.dtype)
    model, _ = build_model(args, plan.config, plan.device, plan.dtype, plan.use_triton, plan.options)
    return Engine(model, context_len=args.context_len, max_batch=args.max_batch, num_slots=plan.num_slots,
                  use_cuda_graph=False if args.no_cuda_graph else None, progress=False, speculative=plan.spec,
                  kv_cache_dtype=args.kv_cache_dtype, prefill_chunk=args.chunked_prefill_size)


def build_server(args):
    """Check the options, then build the engine (in its process with ``--engine-process``, else
    here, with its engine loop) and the Server; UserError for what cannot be honoured."""
    from dsaspec.commands.generate import (device_and_ops, model_config, runtime_options, speculative_config,
                                           weights_source)
    from dsaspec.memory import PAGE_SIZE
    from dsaspec.serving.api import Server
    from dsaspec.serving.engine_loop import EngineLoop
    from dsaspec.serving.engine_process import EngineFailed, EngineProcess
    from dsaspec.serving.metrics import ServerMetrics
    from dsaspec.serving.text import load_text

    check_packages()
    options = runtime_options(args)
    device, use_triton, dtype = device_and_ops(args)
    config, source = model_config(args)
    spec = speculative_config(args, config, options)
    num_slots = check_num_slots(args, PAGE_SIZE, spec.num_draft_tokens if spec else 1)
    tokenizer_dir = args.tokenizer or args.checkpoint
    text = None
    if tokenizer_dir is not None:
        if not Path(tokenizer_dir).is_dir():
            raise UserError(f"--tokenizer {tokenizer_dir}: no such directory")
        text = load_text(tokenizer_dir)
        if text is None and args.tokenizer:
            raise UserError(f"--tokenizer {tokenizer_dir}: no tokenizer.json there")
        if text is not None and text.vocab_size > config.vocab_size:
            raise UserError(f"{tokenizer_dir}/tokenizer.json has {text.vocab_size} tokens, more than the model's "
                            f"vocabulary ({config.vocab_size})")
        if text is not None and any(t >= config.vocab_size for t in text.eos_token_ids):
            raise UserError(f"{tokenizer_dir}: eos token ids {sorted(text.eos_token_ids)} are outside the model's "
                            f"vocabulary [0, {config.vocab_size})")
    plan = EnginePlan(config, device, dtype, use_triton, options, spec, num_slots, source)
    if args.engine_process:
        try:
            loop = EngineProcess(functools.partial(build_engine, args, plan), max_waiting=args.max_waiting)
        except EngineFailed as err:
            raise UserError(str(err)) from None
        built = loop.info
    else:
        engine = build_engine(args, plan)
        loop = EngineLoop(engine, max_waiting=args.max_waiting, metrics=ServerMetrics())
        built = {"cuda_graphs": engine.use_cuda_graph, "kv_cache_dtype": engine.kv.kv_cache_dtype,
                 "chunked_prefill_size": engine.prefill_chunk}
    name = args.served_model_name or (Path(args.checkpoint).resolve().name if args.checkpoint else args.preset)
    info = {"source": weights_source(args), "device": str(device), "dtype": args.dtype,
            "kv_cache_dtype": built["kv_cache_dtype"], "ops": "triton" if use_triton else "torch",
            "engine_process": args.engine_process,
            "cuda_graphs": built["cuda_graphs"], "context_len": args.context_len, "max_batch": args.max_batch,
            "num_slots": num_slots, "chunked_prefill_size": built["chunked_prefill_size"], "tokenizer": text is not None,
            "speculative_algorithm": args.speculative_algorithm,
            "speculative_num_steps": spec.num_steps if spec else None,
            "speculative_num_draft_tokens": spec.num_draft_tokens if spec else None,
            "simulated_accept_length": spec.simulate_accept_len if spec else None}
    return Server(loop, model_name=name, text=text, info=info)


def run(args) -> int:
    """Build the server and serve until SIGINT / SIGTERM; returns 0."""
    server = build_server(args)
    import uvicorn

    from dsaspec.serving.api import build_app

    config = uvicorn.Config(build_app(server), host=args.host, port=args.port, log_level="info",
                            timeout_graceful_shutdown=args.shutdown_timeout, access_log=False)
    info = server.info
    print(f"dsaspec serve: {info['source']}; device {info['device']}, {info['dtype']}, ops {info['ops']}, "
          f"CUDA graphs {'on' if info['cuda_graphs'] else 'off'}; engine in "
          f"{'a process of its own' if info['engine_process'] else 'a thread'}; model id {server.model_name!r}; "
          f"{'text through the tokenizer' if server.text else 'token ids in and out (no tokenizer)'}", flush=True)
    uvicorn.Server(config).run()
    return 0
