"""Compile the DSA kernels that read FP8 KV caches (the indexer logits and the Triton sparse MLA) and
the indexer epilogue that writes one (its rotated query and key variants beside the plain ones) for
sm_90 without a GPU and print, per kernel and configuration, what decides their speed: registers,
spilled bytes, shared memory, the tensor-core instructions in the SASS (``QGMMA ... E4M3``: an e4m3
wgmma; ``HGMMA ... BF16``: a bf16 one) and the global load forms (``LDGSTS.E.BYPASS.128``: 16-byte
``cp.async``; ``LDL`` / ``STL``: spill traffic). The bf16-cache forms are printed beside them.

Each case goes through the real host wrapper (``indexer_logits``, ``sparse_mla_decode``,
``index_q_rope``, ``store_index_k_normed``) on small CPU tensors of the production widths (64 heads,
2048 selected slots; 32 index heads); the launch is intercepted and compiled as Triton's JIT would
specialize it on a CUDA device (``UPCAST`` off, the interpreter's fp32 upcast), for
``GPUTarget("cuda", 90, 32)`` with the wheel's ptxas and nvdisasm.

    python3 scripts/compile_fp8_dsa.py [--sweep]

``--sweep`` also compiles the FP8 candidates (the indexer's ``TUNE_INDEXER_FP8`` of ``bench dsa-ops
--tune``, at 64 and at 32 index heads: DeepSeek-V3.2, GLM-5; sparse MLA tiles) and the slot-major
sparse MLA tiles at 8, 16 and 32 heads on both caches, printing their spills and marking those over
the sm_90 shared-memory limit. Needs no GPU and no driver.
"""

from __future__ import annotations

import collections
import itertools
import re
import subprocess
from pathlib import Path

from dsaspec.testing.offline_compile import compile_instead_of_launch, compile_only_environment, fresh_cache_dir

CACHE_DIR = compile_only_environment()  # before triton is imported

import torch  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402

from dsaspec.bench.dsa_ops import TUNE_INDEXER_FP8  # noqa: E402
from dsaspec.cli_parsing import Parser, parse_or_exit  # noqa: E402
from dsaspec.ops import index_rope, indexer, sparse_mla  # noqa: E402
from dsaspec.ops.indexer import IndexerConfig  # noqa: E402
from dsaspec.ops.kv_cache_layout import INDEX_FP8_PAGE_BYTES, INDEX_HEAD_DIM, MLA_FP8_BYTES  # noqa: E402
from dsaspec.ops.sparse_mla import LATENT_DIM, QK_DIM, SparseMLAConfig, sparse_mla_config  # noqa: E402

HEADS, TOPK, ROWS, PROGRAMS = 64, 2048, 64, 264
SASS_LINE = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/", re.MULTILINE)
SASS_OPS = re.compile(r"\b((?:QGMMA|HGMMA|HMMA|LDGSTS|LDG|LDL|STL|F2FP)(?:\.[A-Z0-9_x]+)*)")
SPARSE_MLA_SWEEP = [SparseMLAConfig(block_h=h, block_n=n, num_warps=w, num_stages=s, block_dv=dv)
                    for h, n, w, s, dv in ((64, 64, 8, 2, 512), (64, 32, 8, 2, 512), (64, 32, 8, 1, 512),
                                           (64, 16, 8, 2, 512), (64, 64, 8, 2, 256), (64, 32, 8, 2, 256),
                                           (64, 32, 8, 3, 256), (64, 16, 8, 2, 256), (64, 16, 8, 3, 256),
                                           (64, 32, 4, 2, 256), (64, 32, 4, 1, 256), (64, 16, 4, 2, 256),
                                           (64, 32, 4, 2, 128), (64, 64, 4, 1, 128), (16, 32, 4, 2, 512),
                                           (32, 64, 8, 3, 512), (32, 32, 8, 2, 512), (32, 64, 8, 2, 512),
                                           (32, 32, 4, 2, 512))]
# Slot-major tiles (SparseMLAConfig.slot_major) at a rank's 8 - 32 heads, on both caches: 16 heads a
# program on 4 warps (one m64n16 wgmma per k step), 32 on 8 warps, 32-slot blocks (the QK dots' M
# then falls below wgmma's 64, the PV dots keep it).
SLOT_MAJOR_HEADS = (8, 16, 32)
SLOT_MAJOR_SWEEP = [SparseMLAConfig(block_h=h, block_n=n, num_warps=w, num_stages=2, slot_major=True)
                    for h, n, w in ((16, 64, 4), (32, 64, 8), (16, 32, 4), (16, 64, 8))]
INDEX_ROPE_KINDS = ("q", "q_rotated", "k_dense", "k_fp8", "qk_dense", "qk_fp8")   # compile_index_rope's variants
SM90_SHARED = 232448  # bytes of shared memory one block may hold on sm_90 (227 KiB)


def compile_kernel(kernel, launch, overrides=(("UPCAST", False),)) -> dict:
    """Compile ``kernel`` as ``launch()`` would launch it on a CUDA device (with the constexpr
    ``overrides`` a CUDA host would pick, and ``CHAINED`` on where the kernel takes it, as on an
    H200); registers, spills, shared memory, the SASS instruction counts of :data:`SASS_OPS`, the
    SASS length (``instructions``) and the PTX (``ptx``)."""
    overrides = dict(overrides)
    if "CHAINED" in getattr(kernel, "arg_names", ()):
        overrides.setdefault("CHAINED", True)
    record: dict = {}
    fresh_cache_dir()  # cold: a cached kernel would come without its ptxas log
    with compile_instead_of_launch(kernel, record, keep_compiled=True):
        offline = kernel.run
        kernel.run = lambda *args, **kwargs: offline(*args, **(kwargs | overrides))
        launch()
    compiled = record["compiled"]
    cubin = CACHE_DIR / "kernel.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    sass = subprocess.run([str(nvdisasm), "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    return dict(regs=record["regs"], spill=record["spill_stores"] or 0, shared=compiled.metadata.shared,
                sass=collections.Counter(SASS_OPS.findall(sass)), instructions=len(SASS_LINE.findall(sass)),
                ptx=compiled.asm["ptx"])


def compile_indexer(fp8: bool, config: IndexerConfig | None = None, rows_per_group: int = 1,
                    heads: int = HEADS) -> dict:
    """One decode-shaped (``rows_per_group`` 1) or verify-shaped launch of the indexer logits with
    ``heads`` index heads (``config`` default: the cache's default)."""
    q = torch.zeros(ROWS, heads, INDEX_HEAD_DIM, dtype=torch.bfloat16)
    keys = (torch.zeros(16, INDEX_FP8_PAGE_BYTES, dtype=torch.uint8) if fp8
            else torch.zeros(1024, INDEX_HEAD_DIM, dtype=torch.bfloat16))
    width = 1024 + 16
    launch = lambda: indexer.indexer_logits(  # noqa: E731
        q, torch.zeros(ROWS, heads), keys, torch.zeros(ROWS, width, dtype=torch.int32),
        torch.ones(ROWS, dtype=torch.int32), torch.zeros(PROGRAMS + 1, 2, dtype=torch.int32),
        torch.zeros(ROWS, width), rows_per_group=rows_per_group, check_values=False, config=config)
    return compile_kernel(indexer._indexer_logits_kernel, launch)


def compile_sparse_mla(fp8: bool, config: SparseMLAConfig | None = None, heads: int = HEADS) -> dict:
    """One launch of the Triton sparse MLA kernel without a workspace over ``heads`` heads
    (``config`` default: the Triton configuration ``sparse_mla_decode`` takes there)."""
    q = torch.zeros(ROWS, heads, QK_DIM, dtype=torch.bfloat16)
    cache = (torch.zeros(4096, MLA_FP8_BYTES, dtype=torch.uint8) if fp8
             else torch.zeros(4096, QK_DIM, dtype=torch.bfloat16))
    config = config or sparse_mla_config(ROWS, heads, split=False, fp8_cache=fp8)
    launch = lambda: sparse_mla.sparse_mla_decode(  # noqa: E731
        q, cache, torch.zeros(ROWS, TOPK, dtype=torch.int32), 0.1,
        torch.zeros(ROWS, heads, LATENT_DIM, dtype=torch.bfloat16), check_values=False, config=config)
    return compile_kernel(sparse_mla._sparse_mla_decode_kernel, launch)


def compile_index_rope(kind: str) -> dict:
    """One launch of the indexer epilogue kernel, bf16 model, GLM-5's 32 index heads: ``kind``
    ``q`` (RoPE), ``q_rotated`` (RoPE, Hadamard), ``k_dense`` (LayerNorm, RoPE, copy into a bf16
    cache), ``k_fp8`` (LayerNorm, RoPE, Hadamard, quantize into the FP8 paged cache), or a layer's
    query, key and head weights in one launch (``indexer_epilogues``, the weights over GLM-5's
    hidden 6144): ``qk_dense`` (``q`` + ``k_dense``), ``qk_fp8`` (``q_rotated`` + ``k_fp8``)."""
    cos = sin = torch.zeros(ROWS, 32)
    q = torch.zeros(ROWS, 32, INDEX_HEAD_DIM, dtype=torch.bfloat16)
    cache = (torch.zeros(16, INDEX_FP8_PAGE_BYTES, dtype=torch.uint8) if kind.endswith("fp8")
             else torch.zeros(1024, INDEX_HEAD_DIM, dtype=torch.bfloat16))
    k = torch.zeros(ROWS, INDEX_HEAD_DIM, dtype=torch.bfloat16)
    w = torch.ones(INDEX_HEAD_DIM, dtype=torch.bfloat16)
    loc = torch.zeros(ROWS, dtype=torch.int64)
    if kind.startswith("qk"):
        x, head_weight = torch.zeros(ROWS, 6144, dtype=torch.bfloat16), torch.zeros(32, 6144)
        launch = lambda: index_rope.indexer_epilogues(  # noqa: E731
            q, cache, loc, k, w, w, 1e-6, cos, sin, 64, True, x, head_weight, 0.01, check_values=False)
    elif kind.startswith("q"):
        launch = lambda: index_rope.index_q_rope(q, cos, sin, 64, True, rotate=kind == "q_rotated")  # noqa: E731
    else:
        launch = lambda: index_rope.store_index_k_normed(  # noqa: E731
            cache, loc, k, w, w, 1e-6, cos, sin, 64, True, check_values=False)
    return compile_kernel(index_rope._index_rope_kernel, launch, overrides=())


def summary_line(name: str, result: dict) -> str:
    """One printed line of a :func:`compile_kernel` result: registers, spills, shared memory, the
    tensor-core and global / local memory instructions of its SASS."""
    mma = {op: n for op, n in result["sass"].items() if "GMMA" in op or "HMMA" in op}
    loads = {op: n for op, n in result["sass"].items() if op.startswith(("LDG", "LDL", "STL"))}
    e4m3 = any("E4M3" in op for op in mma)
    too_big = " (over the sm_90 limit: cannot launch)" if result["shared"] > SM90_SHARED else ""
    return (f"{name}: {result['regs']} regs, {result['spill']} B spilled, "
            f"{result['shared']} B shared{too_big}, "
            f"{result['instructions']} SASS instructions, e4m3 wgmma {'yes' if e4m3 else 'no'}; "
            f"MMA {mma}; loads {loads}")


def main() -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also compile the FP8 candidate configurations")
    args = parse_or_exit(parser)
    knobs.nvidia.dump_ptxas_log = True
    for fp8 in (False, True):
        cache = "fp8" if fp8 else "bf16"
        for group in (1, 8):
            print(summary_line(f"indexer {cache} default G={group}", compile_indexer(fp8, None, group)), flush=True)
        print(summary_line(f"sparse_mla {cache} default", compile_sparse_mla(fp8)), flush=True)
    for kind in INDEX_ROPE_KINDS:
        print(summary_line(f"index_rope {kind}", compile_index_rope(kind)), flush=True)
    if args.sweep:
        for heads in (HEADS, 32):
            for config in TUNE_INDEXER_FP8:
                print(summary_line(f"indexer fp8 {heads} heads {config}", compile_indexer(True, config, heads=heads)),
                      flush=True)
        for config in SPARSE_MLA_SWEEP:
            print(summary_line(f"sparse_mla fp8 {config}", compile_sparse_mla(True, config)), flush=True)
        for fp8, heads, config in itertools.product((False, True), SLOT_MAJOR_HEADS, SLOT_MAJOR_SWEEP):
            print(summary_line(f"sparse_mla {'fp8' if fp8 else 'bf16'} {heads} heads {config}",
                               compile_sparse_mla(fp8, config, heads)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
