"""Models, prompts and engines that the speculative-decoding tests and the token-comparison
scripts share: a DSA model made predictable enough that MTP drafts get accepted, prompts of given
lengths, an Engine sized for them, and a report of where two runs' greedy tokens part.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dsaspec.configs.model_config import get_config
from dsaspec.configs.runtime_options import RuntimeOptions
from dsaspec.engine.engine import Engine
from dsaspec.memory import PAGE_SIZE, KVPool, PageAllocator, ReqToTokenPool, RequestSlots
from dsaspec.models.dsa_model import DSAModel

GPU_CONTEXT = 1 << 20          # the configured context of the GPU runs: 1M, as served


def random_prompts(lengths, vocab: int, seed: int = 0) -> list[list[int]]:
    """Seeded random prompts (lists of token ids in ``[0, vocab)``) of the given lengths."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


def generated_tokens(engine: Engine, requests, max_new, **kwargs) -> list[list[int]]:
    """The generated token ids of each request (``Engine.generate``)."""
    return [r.token_ids for r in engine.generate(requests, max_new, **kwargs)]


@torch.no_grad()
def predictable(model: DSAModel, branch_scale: float) -> DSAModel:
    """Scale every residual branch (o_proj, the FFN's down projections; FP8 ones through their
    block scales) by ``branch_scale`` and make
    the MTP layer read only the embedding of its token (``eh_proj = [I | 0]``, ``enorm = 1``,
    ``shared_head.norm = the final norm``): the target's next token then mostly depends on the
    current token alone, and the MTP layer mostly predicts it. Returns ``model`` (changed in place)."""
    hidden = model.config.hidden_size

    def scale(module, weight: str) -> None:   # FP8 weights: their block scales
        getattr(module, f"{weight}_scale_inv" if hasattr(module, f"{weight}_scale_inv") else weight).mul_(branch_scale)

    for layer in model.model.layers:
        scale(layer.self_attn.o_proj, "weight")
        mlp = layer.mlp
        if hasattr(mlp, "experts"):      # MoE: the routed and the shared experts' down projections
            scale(mlp.experts, "w2")
            scale(mlp.shared_experts.down_proj, "weight")
        else:
            scale(mlp.down_proj, "weight")
    mtp = model.mtp_layer
    mtp.eh_proj.weight.zero_()
    mtp.eh_proj.weight[:, :hidden] = torch.eye(hidden)
    mtp.enorm.weight.fill_(1.0)
    mtp.shared_head.norm.weight.copy_(model.model.norm.weight)
    return model


def gpu_model(preset: str, *, row_invariant: bool, branch_scale: float = 0.5, seed: int = 0,
              options: RuntimeOptions | None = None) -> DSAModel:
    """A :func:`predictable` bf16 model of ``preset`` on CUDA with the Triton ops."""
    model = DSAModel(get_config(preset), device="cuda", use_triton=True, row_invariant=row_invariant,
                     options=options)
    return predictable(model.init_weights(seed), branch_scale)


def gpu_prompts(count: int, preset: str, seed: int = 11) -> list[list[int]]:
    """``count`` prompts mixing rows longer than the preset's top-k (sparse) and shorter (dense)."""
    k = get_config(preset).index_topk
    lengths = [(k + 37, 7, 3 * k // 2, 64, 130)[i % 5] for i in range(count)]
    return random_prompts(lengths, get_config(preset).vocab_size, seed)


def gpu_engine(model: DSAModel, spec=None, *, max_batch: int, requests, max_new: int, **kwargs) -> Engine:
    """An Engine with KV pages for ``requests`` plus ``max_new`` tokens each, buckets 1..32, the
    1M context configured unless ``context_len`` is given."""
    slots = PAGE_SIZE * (2 + max_batch * -(-(max(map(len, requests)) + max_new + 8) // PAGE_SIZE))
    kwargs.setdefault("context_len", GPU_CONTEXT)
    return Engine(model, speculative=spec, max_batch=max_batch, num_slots=slots, progress=False,
                  bucket_sizes=(1, 2, 4, 8, 16, 32), **kwargs)


def logit_margin(model: DSAModel, prompt: list[int], generated: list[int], position: int) -> float:
    """Top-2 logit margin of ``model`` where a plain run produced ``generated[position]`` after
    ``prompt`` (one eager prefill of ``prompt + generated[:position]`` on CUDA)."""
    sequence = prompt + generated[:position]
    pool = ReqToTokenPool(1, len(sequence) + 8, device="cuda")
    slots = RequestSlots(pool, PageAllocator(PAGE_SIZE * (2 + len(sequence) // PAGE_SIZE)))
    kv = KVPool.for_model(model.config, slots.allocator.num_slots, dtype=torch.bfloat16, device="cuda")
    row = slots.admit(len(sequence))
    hidden = model.prefill(torch.tensor(sequence, device="cuda"), pool.req_to_token, row, kv)
    top = model.logits(hidden[-1:])[0].topk(2).values
    return float(top[0] - top[1])


def first_differences(model: DSAModel, requests, want, got, names: tuple[str, str]) -> list[str]:
    """One Markdown line per request whose tokens differ: the first differing generated token, the
    two runs' tokens there (``names``: the runs of ``want`` and ``got``) and the top-2 logit margin
    of ``want``'s run there (``model`` must be the model that produced ``want``)."""
    lines = []
    for i, (a, b) in enumerate(zip(want, got)):
        if a == b:
            continue
        position = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
        margin = logit_margin(model, requests[i], a, position)
        lines.append(f"- request {i} (prompt {len(requests[i])}): first difference at generated token "
                     f"{position} ({names[0]} {a[position]}, {names[1]} {b[position]}); {names[0]} "
                     f"top-2 logit margin there {margin:.4f}")
    return lines


def write_report(lines: list[str], out: str | None) -> None:
    """Print the report and, with ``out``, write it there too."""
    report = "\n".join(lines)
    print(report)
    if out:
        Path(out).write_text(report + "\n")
