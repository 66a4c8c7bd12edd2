"""Where speculative and plain greedy decoding part ways in the default (cuBLAS) mode, and why.

On a GPU: the ``bench`` preset in bf16 (predictable weights, so iterations commit several tokens),
one batch decoded plainly and speculatively with ``row_invariant=False``. For every request whose
tokens differ it reports the first differing position and the plain run's top-2 logit margin
there (recomputed by an eager prefill of the prompt and the plain tokens before it). Then it checks
which ops of a step give a row a different result at ``M = bs * N`` rows (verify) than at
``M = bs`` (decode): the GEMM shapes of the model through ``F.linear``, ``torch.bmm`` and the
RMSNorm expression. The same batch in the row-invariant mode must match exactly.

    PYTHONPATH=. python3 scripts/diagnose_spec_identity.py --out diagnose.md
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from dsaspec.speculative.spec_worker import SpecConfig
from dsaspec.testing.spec_models import (first_differences, generated_tokens, gpu_engine, gpu_model, gpu_prompts,
                                         write_report)


def _row_dependence(model, rows_decode: int, rows_verify: int) -> list[tuple[str, bool]]:
    """(op, row 0 identical at M = rows_decode and M = rows_verify) for the step's op shapes."""
    torch.manual_seed(0)
    cfg = model.config
    out = []
    layer = model.model.layers[0]
    for name, module in (("q_a_proj", layer.self_attn.q_a_proj), ("q_b_proj", layer.self_attn.q_b_proj),
                         ("kv_a_proj", layer.self_attn.kv_a_proj_with_mqa), ("o_proj", layer.self_attn.o_proj),
                         ("gate_proj", layer.mlp.gate_proj), ("down_proj", layer.mlp.down_proj),
                         ("lm_head", model.lm_head)):
        x = torch.randn(rows_verify, module.weight.shape[1], device="cuda", dtype=torch.bfloat16)
        small, large = F.linear(x[:rows_decode], module.weight), F.linear(x, module.weight)
        out.append((f"F.linear {name} [{module.weight.shape[1]} -> {module.weight.shape[0]}]",
                    torch.equal(small, large[:rows_decode])))
    w_uk, _ = layer.self_attn.absorbed_weights()
    q = torch.randn(cfg.num_attention_heads, rows_verify, cfg.qk_nope_head_dim, device="cuda", dtype=torch.bfloat16)
    out.append(("torch.bmm W_UK", torch.equal(torch.bmm(q[:, :rows_decode], w_uk), torch.bmm(q, w_uk)[:, :rows_decode])))
    x = torch.randn(rows_verify, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    norm = layer.input_layernorm
    out.append(("RMSNorm (torch)", torch.equal(norm(x[:rows_decode]), norm(x)[:rows_decode])))
    return out


@torch.no_grad()
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--out", default=None, help="write the report (Markdown) here too")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("error: needs a CUDA device", file=sys.stderr)
        return 2
    lines = ["# Speculative vs plain greedy tokens, bench preset, bf16, CUDA graphs", ""]
    requests = gpu_prompts(args.batch, "bench")
    for invariant in (False, True):
        model = gpu_model("bench", row_invariant=invariant, branch_scale=0.2)
        plain = gpu_engine(model, max_batch=args.batch, requests=requests, max_new=args.max_new)
        spec = gpu_engine(model, SpecConfig(num_steps=3), max_batch=args.batch, requests=requests,
                           max_new=args.max_new)
        want = generated_tokens(plain, requests, args.max_new)
        got = generated_tokens(spec, requests, args.max_new)
        mode = "row-invariant" if invariant else "default (cuBLAS, torch norms)"
        differing = first_differences(model, requests, want, got, ("plain", "speculative"))
        lines.append(f"## {mode}: {len(differing)} of {args.batch} requests differ "
                     f"(mean accept length {spec.stats.mean_accept_len:.2f})")
        lines += differing
        if not invariant:
            lines += ["", f"Row 0 of an op at M = {args.batch} (decode) vs M = {args.batch * 4} (verify):", ""]
            lines += [f"- {name}: {'identical' if same else 'DIFFERS'}" for name, same in
                      _row_dependence(model, args.batch, args.batch * 4)]
        lines.append("")
        del model, plain, spec
        torch.cuda.empty_cache()
    write_report(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
