"""Accuracy of FP8 KV caches against bf16 ones: indexer top-k overlap per layer, logit error, greedy agreement.

One model (``--preset``, seeded random weights) and the same ``--prompts`` random prompts of
``--prompt-len`` tokens (longer than the preset's ``index_topk``, so every decode row's indexer
selects) decode in three lanes, step by step, eagerly, all requests of a lane batched in one
forward (a one-token extend per request, as ``DSAModel.prefill`` runs a chunk):

- ``bf16``: caches in the model's dtype, greedy: the reference tokens ``t``;
- ``forced``: FP8 caches (``fp8_e4m3``), fed the reference tokens ``t`` (teacher-forced);
- ``free``: FP8 caches, greedy on its own tokens ``u``.

Measured: per indexer layer, the top-k overlap ``|A ∩ B| / |A|`` of the KV slots the bf16 lane
(``A``) and the forced lane (``B``) select at the same position (both lanes own identical page
tables, so equal slots are equal positions), mean and min over rows and decode steps; the logit
error of the forced lane against the bf16 lane over every generated position (max abs, and RMS,
both over the bf16 logits' std) and their teacher-forced top-1 agreement; the greedy agreement of
``u`` with ``t`` over ``--new-tokens`` tokens: the first generated position where they differ, the
bf16 top-2 logit margin there, and the fraction of positions where they agree. The selections are
the output of the ``topk_slots`` op, recorded by a model subclass that wraps the op (the bench's
only: the model's math and outputs are unchanged).

Then speculative decoding (MTP, ``--spec-steps`` drafts, topk 1) on FP8 caches against plain
greedy decoding on FP8 caches through the Engine, in the row-invariant mode (row-invariant GEMMs and
norms, CUDA graphs on a GPU) on a ``predictable`` copy of the model (residual branches scaled by
``--branch-scale`` so drafts are accepted, as in tests/test_spec_engine.py): the tokens must be
identical; the mean accept length is reported.

Without CUDA: the ``tiny`` preset in fp32 (its "bf16" cache is the model dtype, fp32) with the torch
ops, small sizes; the speculative check without the row-invariant kernels (under the Triton
interpreter they take minutes), as the CPU tests of tests/test_spec_engine.py run it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from dsaspec.cli_parsing import format_value, nonnegative_int, positive_int, use_cpu_sizes
from dsaspec.configs.model_config import PRESETS, check_implemented, get_config
from dsaspec.errors import UserError
from dsaspec.layers.attention.inputs import build_extend_inputs
from dsaspec.memory import PAGE_SIZE, KVPool, PageAllocator, ReqToTokenPool, RequestSlots
from dsaspec.models.dsa_model import DSAModel
from dsaspec.testing.spec_models import random_prompts

LANES = ("bf16", "forced", "free")
LANE_CACHE = {"bf16": "bf16", "forced": "fp8_e4m3", "free": "fp8_e4m3"}


def _branch_scale(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="bench", choices=sorted(PRESETS), help="model preset (random weights)")
    p.add_argument("--prompt-len", type=positive_int, default=4096,
                   help="prompt tokens per request; more than the preset's index_topk")
    p.add_argument("--prompts", type=positive_int, default=4, help="requests, decoded together")
    p.add_argument("--new-tokens", type=positive_int, default=256, help="greedy tokens generated per request")
    p.add_argument("--spec-new-tokens", type=positive_int, default=64,
                   help="tokens per request of the speculative == plain check")
    p.add_argument("--spec-steps", type=positive_int, default=3, help="draft steps S of the speculative check")
    p.add_argument("--branch-scale", type=_branch_scale, default=0.2,
                   help="residual-branch scale of the speculative check's predictable model")
    p.add_argument("--prefill-chunk", type=positive_int, default=512, help="prefill chunk rows")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="seed of the weights and the prompts")
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results/<machine>)")


class RecordingModel(DSAModel):
    """A DSAModel whose forwards append each ``topk_slots`` output (int32 ``[R, index_topk]``, a
    clone) to ``selections``, in layer order; the ops and every result are unchanged."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.selections: list[torch.Tensor] = []

    def _state(self, *args, **kwargs):
        state = super()._state(*args, **kwargs)
        ops = state.ops

        def topk_slots(logits, seqlens, page_table_1, k, out, **options):
            result = ops.topk_slots(logits, seqlens, page_table_1, k, out=out, **options)
            self.selections.append(out.clone())
            return result

        state.ops = SimpleNamespace(**{**vars(ops), "topk_slots": topk_slots})
        return state

    def take_selections(self) -> list[torch.Tensor]:
        """The recorded selections since the last call (and forget them)."""
        taken, self.selections = self.selections, []
        return taken


def selection_overlap(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """Per row ``|A ∩ B| / |A|``: ``A``, ``B`` the valid (``>= 0``) slots of int ``[R, k]`` rows
    (unique within a row); fp32 ``[R]``, 1 where ``A`` is empty."""
    both = torch.sort(torch.cat((reference, other), dim=1), dim=1).values
    common = ((both[:, 1:] == both[:, :-1]) & (both[:, 1:] >= 0)).sum(1)
    size = (reference >= 0).sum(1)
    return torch.where(size > 0, common / size.clamp(min=1), 1.0).float()


def logit_error(reference: torch.Tensor, other: torch.Tensor) -> dict:
    """Error of ``other`` against ``reference`` logits (``[steps, vocab]``, one request): max abs,
    RMS, the reference's std (RMS over steps of each step's std over the vocabulary) and the first
    two over it, and the fraction of steps whose argmax agrees."""
    reference, other = reference.double(), other.double()
    diff = other - reference
    std = reference.var(dim=1, unbiased=False).mean().sqrt().item()
    max_abs, rms = diff.abs().max().item(), diff.square().mean().sqrt().item()
    return {"max_abs": max_abs, "rms": rms, "std": std, "max_abs_rel": max_abs / std, "rms_rel": rms / std,
            "top1_agreement": (other.argmax(1) == reference.argmax(1)).double().mean().item()}


def greedy_agreement(reference: list[int], other: list[int], margins: list[float]) -> dict:
    """``other``'s greedy tokens against ``reference``'s (same length): the first position where
    they differ (None if none), ``margins[position]`` (the reference's top-2 logit margin there)
    and the fraction of positions that agree."""
    if len(reference) != len(other):
        raise ValueError(f"token lists of different lengths: {len(reference)} and {len(other)}")
    first = next((i for i, (a, b) in enumerate(zip(reference, other)) if a != b), None)
    return {"first_difference": first, "margin_at_first_difference": None if first is None else margins[first],
            "agreement": sum(a == b for a, b in zip(reference, other)) / len(reference)}


def overlap_summary(per_step: list[torch.Tensor]) -> dict:
    """Mean and min of the per-row overlaps of every step (``[R]`` each), and the rows counted."""
    values = torch.cat(per_step)
    return {"mean": values.mean().item(), "min": values.min().item(), "rows": values.numel()}


@dataclass
class _Lane:
    """One decoding run: its own table, pages and pool (identical slot ids in every lane)."""

    table: ReqToTokenPool
    kv: KVPool
    rows: list[int]
    lengths: list[int]


def _lane(model: DSAModel, prompts: list[list[int]], new_tokens: int, kv_cache_dtype: str) -> _Lane:
    device = model.lm_head.weight.device
    written = max(map(len, prompts)) + new_tokens
    table = ReqToTokenPool(len(prompts), written, device=device)
    slots = RequestSlots(table, PageAllocator(PAGE_SIZE * (1 + len(prompts) * -(-written // PAGE_SIZE))))
    kv = KVPool.for_model(model.config, slots.allocator.num_slots, dtype=model.lm_head.weight.dtype, device=device,
                          kv_cache_dtype=kv_cache_dtype)
    rows = [slots.admit(len(p), reserve=new_tokens) for p in prompts]
    return _Lane(table, kv, rows, [0] * len(prompts))


def _prefill(model: DSAModel, lane: _Lane, prompts, chunk: int) -> torch.Tensor:
    """The logits fp32 ``[requests, vocab]`` after each prompt."""
    device = model.lm_head.weight.device
    last = []
    for i, (row, prompt) in enumerate(zip(lane.rows, prompts)):
        hidden = model.prefill(torch.tensor(prompt, device=device), lane.table.req_to_token, row, lane.kv,
                               chunk_size=chunk)
        last.append(hidden[-1:])
        lane.lengths[i] = len(prompt)
    return model.logits(torch.cat(last))


def _decode(model: DSAModel, lane: _Lane, tokens: torch.Tensor) -> torch.Tensor:
    """One decode step of every request (``tokens`` ``[requests]`` at their next positions): logits
    fp32 ``[requests, vocab]``."""
    positions, loc, attn = build_extend_inputs(lane.table.req_to_token, lane.rows, lane.lengths,
                                               [1] * len(lane.rows))
    hidden = model.forward(tokens, positions, loc, lane.kv, attn)
    lane.lengths = [n + 1 for n in lane.lengths]
    return model.logits(hidden)


@torch.no_grad()
def measure(model: RecordingModel, prompts: list[list[int]], new_tokens: int, *, chunk: int = 512,
            compare: str = "fp8_e4m3") -> dict:
    """The three lanes (module docstring) over ``prompts`` for ``new_tokens`` tokens, the forced
    and free lanes on ``compare`` caches. Returns ``tokens`` (lane -> per-request token lists),
    ``layers`` (the indexer layers, in selection order), ``overlap`` (layer -> summary),
    ``per_request`` (logit error and greedy agreement) and ``logit_error`` (over all requests)."""
    layers = [i for i in range(model.config.num_hidden_layers) if model.model.layers[i].self_attn.indexer is not None]
    cache = dict(LANE_CACHE, forced=compare, free=compare)
    lanes = {name: _lane(model, prompts, new_tokens, cache[name]) for name in LANES}
    logits = {}
    for name in LANES:
        logits[name] = [_prefill(model, lanes[name], prompts, chunk)]
    model.take_selections()
    tokens = {name: [logits[name][0].argmax(1)] for name in ("bf16", "free")}
    overlaps = {layer: [] for layer in layers}
    for _ in range(new_tokens - 1):
        step = {}
        for name, fed in (("bf16", tokens["bf16"][-1]), ("forced", tokens["bf16"][-1]), ("free", tokens["free"][-1])):
            logits[name].append(_decode(model, lanes[name], fed))
            step[name] = model.take_selections()
        if not len(step["bf16"]) == len(step["forced"]) == len(layers):
            raise RuntimeError(f"expected one selection per indexer layer ({len(layers)}), got "
                               f"{len(step['bf16'])} and {len(step['forced'])}")
        for layer, a, b in zip(layers, step["bf16"], step["forced"]):
            overlaps[layer].append(selection_overlap(a, b))
        for name in tokens:
            tokens[name].append(logits[name][-1].argmax(1))
    stacked = {name: torch.stack(values, dim=1).float() for name, values in logits.items()}   # [requests, steps, V]
    token_lists = {name: torch.stack(values, dim=1).tolist() for name, values in tokens.items()}
    top2 = stacked["bf16"].topk(2, dim=2).values
    margins = (top2[..., 0] - top2[..., 1]).tolist()
    per_request = [{"request": i, "prompt_len": len(prompts[i]),
                    **logit_error(stacked["bf16"][i], stacked["forced"][i]),
                    **greedy_agreement(token_lists["bf16"][i], token_lists["free"][i], margins[i])}
                   for i in range(len(prompts))]
    vocab = stacked["bf16"].shape[-1]
    return {"tokens": token_lists, "layers": layers,
            "overlap": {layer: overlap_summary(values) for layer, values in overlaps.items()},
            "per_request": per_request,
            "logit_error": logit_error(stacked["bf16"].reshape(-1, vocab), stacked["forced"].reshape(-1, vocab))}


def speculative_check(config, prompts, args, device, dtype, use_triton, row_invariant: bool) -> dict:
    """Plain and speculative greedy decoding on FP8 caches through the Engine (a predictable model,
    row-invariant if asked): ``tokens_identical``, the differing requests, the mean accept length."""
    from dsaspec.engine.engine import Engine
    from dsaspec.speculative.spec_worker import SpecConfig
    from dsaspec.testing.spec_models import generated_tokens, predictable

    model = predictable(DSAModel(config, device=device, dtype=dtype, use_triton=use_triton,
                                 row_invariant=row_invariant).init_weights(args.seed), args.branch_scale)
    buckets = sorted({1 << i for i in range(len(prompts).bit_length())} | {len(prompts)})
    out = {}
    for name, spec in (("plain", None), ("speculative", SpecConfig(num_steps=args.spec_steps))):
        engine = Engine(model, context_len=args.prompt_len + args.spec_new_tokens + args.spec_steps + 1,
                        max_batch=len(prompts), bucket_sizes=buckets, progress=False, speculative=spec,
                        kv_cache_dtype="fp8_e4m3")
        out[name] = generated_tokens(engine, prompts, args.spec_new_tokens)
        if spec is not None:
            accept, graphs = engine.stats.mean_accept_len, engine.use_cuda_graph
    differ = [i for i, (a, b) in enumerate(zip(out["plain"], out["speculative"])) if a != b]
    return {"tokens_identical": not differ, "differing_requests": differ, "mean_accept_len": accept,
            "cuda_graphs": graphs, "row_invariant": row_invariant, "num_steps": args.spec_steps,
            "new_tokens": args.spec_new_tokens, "branch_scale": args.branch_scale}


def _apply_cpu_sizes(args) -> None:
    ignored = use_cpu_sizes(args, add_arguments, {"preset": "tiny", "prompt_len": 80, "prompts": 2, "new_tokens": 12,
                                                  "spec_new_tokens": 8, "branch_scale": 0.5})
    print(f"No CUDA: tiny preset (fp32; its 'bf16' cache is fp32) with the torch ops, {args.prompts} prompts of "
          f"{args.prompt_len} tokens, {args.new_tokens} new tokens ({args.spec_new_tokens} in the speculative check).")
    if ignored:
        print(ignored)


def run(args) -> int:
    from dsaspec.bench.results import bench_params, write_results

    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        _apply_cpu_sizes(args)
    config = get_config(args.preset)
    try:
        check_implemented(config.to_hf_dict())
    except ValueError as refusal:
        raise UserError(f"--preset {args.preset}: {refusal}") from None
    if args.prompt_len <= config.index_topk:
        raise UserError(f"--prompt-len {args.prompt_len}: the indexer selects only past index_topk "
                        f"{config.index_topk} live tokens ({args.preset}); give a longer prompt")
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    prompts = random_prompts([args.prompt_len] * args.prompts, config.vocab_size, seed=args.seed + 1)
    model = RecordingModel(config, device=device, dtype=dtype, use_triton=on_gpu).init_weights(args.seed)
    result = measure(model, prompts, args.new_tokens, chunk=args.prefill_chunk)
    del model
    if on_gpu:
        torch.cuda.empty_cache()
    result["speculative"] = speculative_check(config, prompts, args, device, dtype, on_gpu, row_invariant=on_gpu)
    method = (f"{args.preset}, seeded random weights ({'bf16' if on_gpu else 'fp32'}, "
              f"{'Triton' if on_gpu else 'torch'} ops), {args.prompts} random prompts of {args.prompt_len} tokens "
              f"(index_topk {config.index_topk}), {args.new_tokens} greedy tokens each, eager batched decode in "
              "three lanes: bf16 caches (reference tokens), FP8 caches fed the reference tokens (top-k overlap, "
              "logit error), FP8 caches greedy (token agreement). Speculative == plain: Engine on FP8 caches, "
              f"row-invariant, predictable model (branch scale {args.branch_scale}), S = {args.spec_steps}.")
    payload = {"method": method, "params": bench_params(args), "preset": args.preset,
               "index_topk": config.index_topk, **result,
               "overlap": [{"layer": layer, **s} for layer, s in result["overlap"].items()]}
    write_results("kv_accuracy", payload, markdown(payload), args.out)
    if not result["speculative"]["tokens_identical"]:
        print(f"error: speculative and plain decoding on FP8 caches differ in requests "
              f"{format_value(result['speculative']['differing_requests'])}")
        return 1
    return 0


def markdown(payload: dict) -> str:
    """The tables of a results payload: overlap per layer, logit error and agreement per request,
    the speculative check."""
    from dsaspec.bench.results import markdown_table

    overall = payload["logit_error"]
    spec = payload["speculative"]
    parts = [f"## Indexer top-k overlap (A ∩ B) / A, A: bf16 caches, B: FP8 caches teacher-forced (top-k "
             f"{payload['index_topk']})\n\n"
             + markdown_table([("layer", "layer"), ("mean", "mean overlap"), ("min", "min overlap"),
                               ("rows", "rows x steps")],
                              [dict(r, mean=f"{r['mean']:.4f}", min=f"{r['min']:.4f}") for r in payload["overlap"]]),
             "## Logit error (FP8 teacher-forced on the bf16 tokens) and greedy agreement (FP8 free-running)\n\n"
             + markdown_table([("request", "request"), ("max_abs", "max abs error"),
                               ("max_abs_rel", "max abs / std"), ("rms_rel", "RMS / std"), ("std", "logit std"),
                               ("top1_agreement", "forced top-1 agreement"),
                               ("first_difference", "first greedy difference"),
                               ("margin_at_first_difference", "bf16 top-2 margin there"),
                               ("agreement", "greedy agreement")],
                              [dict(r, max_abs=f"{r['max_abs']:.4g}", max_abs_rel=f"{r['max_abs_rel']:.3g}",
                                    rms_rel=f"{r['rms_rel']:.3g}", std=f"{r['std']:.4g}",
                                    top1_agreement=f"{r['top1_agreement']:.3f}", agreement=f"{r['agreement']:.3f}",
                                    margin_at_first_difference=None if r["first_difference"] is None
                                    else f"{r['margin_at_first_difference']:.4g}")
                               for r in payload["per_request"]])
             + f"\n\nAll requests: max abs error {overall['max_abs']:.4g} ({overall['max_abs_rel']:.3g} std), "
               f"RMS {overall['rms_rel']:.3g} std, teacher-forced top-1 agreement {overall['top1_agreement']:.3f}.",
             "## Speculative == plain on FP8 caches\n\n"
             + markdown_table([("num_steps", "S"), ("new_tokens", "tokens per request"),
                               ("mean_accept_len", "mean accept length"), ("cuda_graphs", "CUDA graphs"),
                               ("row_invariant", "row-invariant"),
                               ("tokens_identical", "tokens identical")], [spec])]
    return "\n\n".join(parts)
