"""Greedy tokens with sparse MLA's Gluon kernel against the Triton kernel (the summation orders
differ): where they part, and by what logit margin.

On a GPU: the ``bench`` preset in bf16 (GLM-5 attention shapes, 2 layers, predictable weights as in
the engine tests), one batch of sparse (longer than the top-k) and dense prompts decoded plainly by
the engine (CUDA graphs, split sparse MLA) twice: with the model's ``sparse_mla_gluon`` option off (the
Triton kernel everywhere) and on (the default: the Gluon kernel where it runs). For every request whose
tokens differ it reports the first differing generated token and the Triton run's top-2 logit
margin there (recomputed by an eager prefill, as in ``diagnose_spec_identity.py``).

    PYTHONPATH=. python3 scripts/compare_sparse_mla_tokens.py --batch 32 --out tokens.md
"""

from __future__ import annotations

import sys

import torch

from dsaspec.cli_parsing import Parser, positive_int
from dsaspec.configs.runtime_options import RuntimeOptions
from dsaspec.errors import UserError
from dsaspec.testing.spec_models import (first_differences, generated_tokens, gpu_engine, gpu_model, gpu_prompts,
                                         write_report)

MAX_BATCH = 32  # the engine's largest graph bucket in the engine tests' setup


def _generate(options: RuntimeOptions, requests, batch: int, max_new: int):
    """(model, tokens) of a plain greedy run of a model built with ``options``."""
    model = gpu_model("bench", row_invariant=False, branch_scale=0.2, options=options)
    engine = gpu_engine(model, max_batch=batch, requests=requests, max_new=max_new)
    return model, generated_tokens(engine, requests, max_new)


@torch.no_grad()
def main() -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=positive_int, default=MAX_BATCH,
                        help=f"requests (at most {MAX_BATCH}, the largest graph bucket)")
    parser.add_argument("--max-new", type=positive_int, default=64, help="generated tokens per request")
    parser.add_argument("--out", default=None, help="write the report (Markdown) here too")
    try:
        args = parser.parse_args()
        if args.batch > MAX_BATCH:
            raise UserError(f"--batch: expected at most {MAX_BATCH}, got {args.batch}")
        if not torch.cuda.is_available():
            raise UserError("needs a CUDA device")
        options = RuntimeOptions.from_environment()
    except UserError as err:
        print(f"compare_sparse_mla_tokens: error: {err}", file=sys.stderr)
        return 2
    requests = gpu_prompts(args.batch, "bench")
    triton_model, want = _generate(options.replace(sparse_mla_gluon=False), requests, args.batch, args.max_new)
    _, got = _generate(options.replace(sparse_mla_gluon=True), requests, args.batch, args.max_new)
    differing = first_differences(triton_model, requests, want, got, ("Triton", "Gluon"))
    write_report(["# Greedy tokens: sparse MLA Gluon kernel vs Triton kernel", "",
                  f"bench preset, bf16, plain greedy decode through the engine (CUDA graphs), "
                  f"{args.batch} requests (prompt lengths {sorted(set(map(len, requests)))}), "
                  f"{args.max_new} new tokens each.", "",
                  f"{len(differing)} of {args.batch} requests differ.", ""] + differing, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
