"""Whether Triton 3.6 can express the warp-specialized gather that sparse MLA at many rows needs
(docs/dsa-kernels.md, "Gathers and the dots"): a compile probe for sm_90, no GPU needed.

Triton's ``tl`` front end pipelines the sparse MLA block loop only as far as its own software
pipeliner goes (every iteration waits for all outstanding copies; ``warp_specialize=True`` leaves
the loop unchanged). Its Gluon dialect (``triton.experimental.gluon``) lets a kernel place work on
warps itself. This probe builds the skeleton of a FlashMLA-style pipeline in it and compiles it
for sm_90 with the wheel's ptxas:

- a worker partition (4 warps) gathers ``BLOCK_N`` selected 512-wide cache rows per block with
  ``cp.async`` into a ring of ``STAGES`` shared-memory slots, each slot's arrival signalled on an
  mbarrier by ``cp.async.mbarrier.arrive``;
- the default partition (one warpgroup) waits on a slot, runs the QK dot of 64 heads against it
  as an asynchronous wgmma, frees the slot and sums the scores.

It passes when the SASS holds the instructions that make the pipeline real: ``LDGSTS`` (the
gathers), ``HGMMA`` (wgmma), ``ARRIVES.LDGSTSBAR`` (the copy-completion arrive) and
``USETMAXREG`` (the register split between partitions). The probe is never run: its
synchronization (barrier counts, phases) is a sketch for the GPU kernel, not a tested one, and
Gluon kernels do not run under Triton's interpreter.

    python3 scripts/probe_gluon_sparse_mla.py
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compile_metadata import compile_instead_of_launch  # noqa: E402  (sets the compile-only env)

import torch  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import async_copy  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait)

QK_WIDTH = 576  # a cache row: 512 latent + 64 rope columns (the probe gathers the latent part)
REQUIRED = ("LDGSTS", "HGMMA", "ARRIVES.LDGSTSBAR", "USETMAXREG")


@gluon.jit
def _gather_partition(kv_ptr, slots_ptr, kv_smem, full, empty, num_blocks, ROW: gl.constexpr,
                      BLOCK_N: gl.constexpr, LATENT: gl.constexpr, STAGES: gl.constexpr):
    """Worker: block ``b``'s rows into slot ``b % STAGES`` once the scores have freed it."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    for b in range(num_blocks):
        stage = b % STAGES
        mbarrier.wait(empty.index(stage), ((b // STAGES) & 1) ^ 1)
        index = b * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        slot = gl.load(slots_ptr + index)
        columns = gl.arange(0, LATENT, layout=gl.SliceLayout(0, layout))
        rows = kv_ptr + slot.to(gl.int64)[:, None] * ROW + columns[None, :]
        async_copy.async_copy_global_to_shared(kv_smem.index(stage), rows)
        async_copy.mbarrier_arrive(full.index(stage), increment_count=False)


@gluon.jit
def _score_partition(q_smem, kv_smem, full, empty, out_ptr, num_blocks, BLOCK_H: gl.constexpr,
                     BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Default: the QK wgmma of every block as its slot fills, summed into ``out``."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    total = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=mma)
    for b in range(num_blocks):
        stage = b % STAGES
        mbarrier.wait(full.index(stage), (b // STAGES) & 1)
        scores = warpgroup_mma(q_smem, kv_smem.index(stage).permute((1, 0)),
                               gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=mma), is_async=True)
        scores = warpgroup_mma_wait(0, deps=[scores])
        mbarrier.arrive(empty.index(stage), count=1)
        total += scores
    heads = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, mma))
    columns = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
    gl.store(out_ptr + heads[:, None] * BLOCK_N + columns[None, :], total)


@gluon.jit
def _probe_kernel(q_ptr, kv_ptr, slots_ptr, out_ptr, num_blocks, ROW: gl.constexpr,
                  BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, LATENT: gl.constexpr,
                  STAGES: gl.constexpr):
    """One row's 64 heads: queries to shared memory, then the two partitions."""
    swizzled: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                                  rank=2)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, LATENT], swizzled)
    kv_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, LATENT], swizzled)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(full.index(i), count=128)  # one copy-completion arrive per worker thread
        mbarrier.init(empty.index(i), count=1)
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    heads = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, layout))
    columns = gl.arange(0, LATENT, layout=gl.SliceLayout(0, layout))
    q_smem.store(gl.load(q_ptr + heads[:, None] * ROW + columns[None, :]))
    fence_async_shared()
    gl.warp_specialize(
        [(_score_partition, (q_smem, kv_smem, full, empty, out_ptr, num_blocks, BLOCK_H, BLOCK_N,
                             STAGES)),
         (_gather_partition, (kv_ptr, slots_ptr, kv_smem, full, empty, num_blocks, ROW, BLOCK_N,
                              LATENT, STAGES))],
        [4], [96])


def main() -> int:
    argparse.ArgumentParser(description="Compile a warp-specialized gather -> wgmma pipeline in "
                                        "Gluon for sm_90 (no GPU needed).").parse_args()
    knobs.nvidia.dump_ptxas_log = True
    heads, block_n = 64, 64
    record: dict = {}
    with compile_instead_of_launch(_probe_kernel, record, keep_compiled=True):
        _probe_kernel[(1,)](torch.zeros(heads, QK_WIDTH, dtype=torch.bfloat16),
                            torch.zeros(4096, QK_WIDTH, dtype=torch.bfloat16),
                            torch.zeros(2048, dtype=torch.int32),
                            torch.zeros(heads, block_n), 32, ROW=QK_WIDTH, BLOCK_H=heads,
                            BLOCK_N=block_n, LATENT=512, STAGES=2, num_warps=4)
    compiled = record["compiled"]
    cubin = Path(os.environ["TRITON_CACHE_DIR"]) / "probe.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    sass = subprocess.run([str(nvdisasm), "-c", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    found = collections.Counter(re.findall(r"\b(?:LDGSTS|HGMMA|ARRIVES\.LDGSTSBAR|USETMAXREG)\b",
                                           sass))
    print(f"sm_90: {record['regs']} registers, {compiled.metadata.shared} B shared memory, "
          f"{compiled.metadata.num_warps} warps; {dict(found)}")
    missing = [name for name in REQUIRED if not found[name]]
    if missing:
        print(f"probe_gluon_sparse_mla: missing from the SASS: {', '.join(missing)}")
        return 1
    print("probe_gluon_sparse_mla: the warp-specialized gather -> wgmma pipeline compiles for sm_90")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
