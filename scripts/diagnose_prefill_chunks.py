"""Where two prefill chunk sizes part ways: per watched layer, how many prompt rows differ and the
largest difference in each 512-row bucket.

Prefills one random prompt twice through ``DSAModel.prefill`` (chunks of ``--chunks A,B``, bf16
caches) and compares the outputs of the watched decoder layers row by row. On a GPU: the preset in
bf16 with the Triton ops; without CUDA the ``tiny`` preset in fp32 with the torch ops (a smoke run).
Prints one line per layer.

    PYTHONPATH=. python3 scripts/diagnose_prefill_chunks.py --preset glm5-fp8-tp8-rank --prompt-len 8192
"""

from __future__ import annotations

import argparse
import sys

import torch

from dsaspec.flags import select_triton_interpreter

select_triton_interpreter(torch.cuda.is_available())   # before anything imports triton

from dsaspec.bench.prefill import _Request  # noqa: E402
from dsaspec.cli_parsing import positive_int, positive_int_list  # noqa: E402
from dsaspec.configs.model_config import PRESETS, get_config  # noqa: E402
from dsaspec.configs.runtime_options import RuntimeOptions  # noqa: E402
from dsaspec.models.dsa_model import DSAModel  # noqa: E402

BUCKET = 512


def layer_outputs(model: DSAModel, request: _Request, prompt: list[int], chunk: int, layers: list[int]) -> dict:
    """fp32 ``[T, hidden]`` output of each of ``layers`` over one prefill of ``prompt`` in ``chunk``-row chunks."""
    outputs: dict[int, list[torch.Tensor]] = {i: [] for i in layers}
    hooks = [model.model.layers[i].register_forward_hook(
        lambda module, args, out, i=i: outputs[i].append((out[0] if isinstance(out, tuple) else out).float()))
        for i in layers]
    try:
        request.prefill(prompt, chunk)
    finally:
        for hook in hooks:
            hook.remove()
    return {i: torch.cat(parts) for i, parts in outputs.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="glm5-fp8-tp8-rank", choices=sorted(PRESETS))
    parser.add_argument("--prompt-len", type=positive_int, default=8192)
    parser.add_argument("--chunks", type=positive_int_list, default=[512, 4096], help="two chunk sizes, A,B")
    parser.add_argument("--layers", type=positive_int_list, default=None,
                        help="decoder layers to watch, comma-separated (default: 1 2 3 4 10 40 and the last; 0 is "
                             "always watched)")
    args = parser.parse_args()
    if len(args.chunks) != 2:
        parser.error(f"--chunks: expected two sizes, got {len(args.chunks)}")
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    preset, prompt_len = (args.preset, args.prompt_len) if on_gpu else ("tiny", min(args.prompt_len, 150))
    model = DSAModel(get_config(preset), device=device, dtype=torch.bfloat16 if on_gpu else torch.float32,
                     use_triton=on_gpu, options=RuntimeOptions.from_environment()).init_weights(0)
    last = model.config.num_hidden_layers - 1
    wanted = args.layers if args.layers is not None else [1, 2, 3, 4, 10, 40, last]
    layers = sorted({0, *(i for i in wanted if i <= last)})
    prompt = torch.randint(0, model.config.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    request = _Request(model, prompt_len, "bf16", device)
    first, second = (layer_outputs(model, request, prompt, chunk, layers) for chunk in args.chunks)
    print(f"{preset}, prompt {prompt_len}, chunks {args.chunks[0]} against {args.chunks[1]}")
    for i in layers:
        diff = (first[i] - second[i]).abs().amax(dim=1)
        differing = diff.nonzero()
        buckets = " ".join(f"{float(diff[s:s + BUCKET].max()):.3g}" for s in range(0, prompt_len, BUCKET))
        print(f"layer {i}: |output| max {float(second[i].abs().max()):.3g}, rows differing {differing.numel()} "
              f"(first {int(differing[0]) if differing.numel() else '-'}), max difference per {BUCKET} rows: {buckets}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
