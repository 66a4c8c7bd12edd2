"""``dsaspec generate``: greedy generation of a few seeded random prompts with the runtime Engine.

By default the embedded ``tiny`` preset with seeded random weights (``--checkpoint DIR`` loads a
safetensors checkpoint instead), prompts of different lengths (one longer than the tiny model's
top-k, so the attention is sparse), continuous batching, CUDA graphs on a GPU. Prints each
request's generated ids, its time to first token and time per output token.
"""

from __future__ import annotations

import argparse
import sys

import torch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``dsaspec generate``."""
    from dsaspec.runtime.config import PRESETS

    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model preset (random weights)")
    p.add_argument("--checkpoint", default=None, help="safetensors checkpoint directory (overrides --preset)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the prompts")
    p.add_argument("--prompt-lens", type=_int_list, default=[8, 80], help="comma-separated prompt lengths")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--eos-token-id", type=int, default=None)
    p.add_argument("--max-batch", type=int, default=4, help="requests decoding together")
    p.add_argument("--context-len", type=int, default=2048, help="configured context (page-table width)")
    p.add_argument("--num-slots", type=int, default=None, help="KV slots (default: every row at full context)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--ops", default="auto", choices=["auto", "triton", "torch"],
                   help="DSA ops: Triton kernels or torch references (auto: triton on CUDA)")
    p.add_argument("--no-cuda-graph", action="store_true", help="eager decode steps on CUDA")
    p.add_argument("--no-progress", action="store_true")


def run(args) -> int:
    """Build the model and the engine, generate, print ids and timings. Returns 0."""
    from dsaspec.runtime.config import get_config
    from dsaspec.runtime.engine import Engine
    from dsaspec.runtime.loader import load_checkpoint
    from dsaspec.runtime.model import DSAModel

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    use_triton = args.ops == "triton" or (args.ops == "auto" and device.type == "cuda")
    dtype = DTYPES[args.dtype]
    if use_triton and dtype != torch.bfloat16:
        print("error: the Triton DSA ops need --dtype bf16", file=sys.stderr)
        return 2
    if args.checkpoint:
        model = load_checkpoint(args.checkpoint, device=device, dtype=dtype, use_triton=use_triton)
        source = f"checkpoint {args.checkpoint}"
    else:
        model = DSAModel(get_config(args.preset), device=device, dtype=dtype,
                         use_triton=use_triton).init_weights(args.seed)
        source = f"preset {args.preset}, random weights (seed {args.seed})"
    generator = torch.Generator().manual_seed(args.seed + 1)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=generator).tolist()
               for n in args.prompt_lens]
    engine = Engine(model, context_len=args.context_len, max_batch=args.max_batch, num_slots=args.num_slots,
                    use_cuda_graph=False if args.no_cuda_graph else None, progress=not args.no_progress)
    print(f"model: {source}; device {device}, {args.dtype}, ops {'triton' if use_triton else 'torch'}, "
          f"CUDA graphs {'on' if engine.use_cuda_graph else 'off'}, metadata kernel "
          f"{engine.backend.kernel} ({engine.backend.kernel_reason})")
    results = engine.generate(prompts, args.max_new_tokens, eos_token_id=args.eos_token_id)
    for i, result in enumerate(results):
        tpot = "n/a" if result.tpot_s is None else f"{1e3 * result.tpot_s:.2f} ms"
        print(f"request {i}: prompt {result.prompt_len} tokens, {len(result.token_ids)} generated "
              f"({result.finish_reason}), TTFT {1e3 * result.ttft_s:.1f} ms, TPOT {tpot}")
        print(f"  ids: {result.token_ids}")
    stats = engine.stats
    if stats.decode_steps:
        print(f"decode: {stats.decode_steps} steps, {stats.decode_tokens} tokens, median step "
              f"{stats.median_step_ms:.2f} ms (host wall time per step, batch sizes "
              f"{min(stats.step_batches)}-{max(stats.step_batches)})")
    return 0
