"""Compile the Gluon sparse MLA kernel for sm_90 without a GPU and check what makes it the kernel
it is meant to be: no register spills, shared memory within the H100/H200 limit, and in the SASS
the gathers (``LDGSTS``: ``cp.async``), the tensor-core dots (``HGMMA``: wgmma), the
copy-completion mbarrier arrive (``ARRIVES.LDGSTSBAR``) and the register split between the
partitions (``USETMAXREG``); in the PTX, every global store predicated (the output and record
stores are masked to the program's real heads: with 8-32 heads the other head slots are
padding). On the ``fp8_ds_mla`` cache (each of ``sparse_mla_gluon.FP8_TILES`` and of the tune
candidates ``FP8_TUNE_TILES``) the SASS holds the e4m3 conversion (``F2FP.F16.E4M3.UNPACK_B``) in
place of the copy-completion arrive (the ring slot is signalled after the dequantizing stores), and
the line adds the gather partition's loop: its instructions and barriers per block, from the wait
for a free ring slot to the ``full`` arrive (the dequantizing) and from there to the next block's
commit (its copies; with ``refill="step"`` the earlier steps' copies come before the arrive), and
the two together; with ``staging=0`` (the gathers through registers, or with ``in_slot`` in the
ring slot) the loop from the wait to the
arrive, its global loads and shared stores.

Both forms (single pass and split records) over each cache at each of ``--heads`` (default 8,
16, 32: one padded program of 64 head slots; 64 and 128: one and two full ones), the split
form of 64 heads with the phase stamps (``trace``, bf16 and the first FP8 tiles), and at 8, 16 and
32 heads both forms of the slot-major attend partition (``slot_major``: the bf16 gathers and the FP8
default's in the ring slot) go through the real host launch
(``launch_sparse_mla_gluon``) on small CPU tensors; the launch is intercepted and compiled for
``GPUTarget("cuda", 90, 32)`` with the wheel's ptxas, as Triton's JIT would specialize it. Runs on
a CPU-only machine (the CPU tests run it in a subprocess); exits 1 when a check fails.

    python3 scripts/compile_sparse_mla_gluon.py [--heads 8,16,32,64,128]
"""

from __future__ import annotations

import collections
import re
import subprocess
from pathlib import Path

from dsaspec.testing.offline_compile import (compile_instead_of_launch, compile_only_environment,
                                             fresh_cache_dir)

CACHE_DIR = compile_only_environment()  # before triton is imported

import torch  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402

from dsaspec.ops import sparse_mla_gluon  # noqa: E402
from dsaspec.ops.kv_cache_layout import MLA_FP8_BYTES  # noqa: E402
from dsaspec.ops.sparse_mla import LATENT_DIM, QK_DIM, RECORD_WIDTH  # noqa: E402
from dsaspec.cli_parsing import Parser, parse_or_exit, positive_int_list  # noqa: E402

REQUIRED = ("LDGSTS", "HGMMA", "ARRIVES.LDGSTSBAR", "USETMAXREG")
REQUIRED_FP8 = ("LDGSTS", "HGMMA", "F2FP.F16.E4M3.UNPACK_B", "USETMAXREG")
SASS_OP = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]\s+)?([A-Z0-9_.]+)", re.MULTILINE)
SASS_NAMES = re.compile(r"\b(?:%s)\b" % "|".join(
    re.escape(name) for name in dict.fromkeys(REQUIRED + REQUIRED_FP8)))
MAX_SHARED_BYTES = 232448  # dynamic shared memory per block on compute capability 9.0 (227 KiB)
HEADS = (8, 16, 32, 64, 128)


def gather_loop(sass: str, registers: bool = False) -> dict:
    """The FP8 gather partition's loop in ``sass``: instructions and ``BAR`` barriers per thread
    and block from its wait for a free ring slot (the partition's first ``SYNCS.PHASECHK``) to the
    ``full`` arrive (``dequant``, ``dequant_bars``), from there to the next commit (``LDGDEPBAR``:
    ``copy``, ``copy_bars``), and both together (``block``, ``block_bars``). With
    ``refill="step"`` the earlier steps' copies fall before the arrive: compare ``block``. With
    ``registers`` (``staging=0``: the block's loads, conversion, stores and rope copies all lie
    between the wait and the arrive) only ``block`` and ``block_bars`` (wait to arrive), and the
    global loads (``LDG``: ``loads``) and shared-memory stores (``STS``: ``stores``) among them."""
    lines = [m.group(1) for m in SASS_OP.finditer(sass)]
    start = next(i for i, op in enumerate(lines) if op.startswith("USETMAXREG.TRY_ALLOC"))
    wait = next(i for i in range(start, len(lines)) if lines[i].startswith("SYNCS.PHASECHK"))
    arrive = next(i for i in range(wait, len(lines)) if lines[i].startswith("SYNCS.ARRIVE"))

    def bars(ops):
        return sum(op.startswith("BAR.SYNC") for op in ops)

    if registers:
        loop = lines[wait:arrive + 1]
        return dict(block=len(loop), block_bars=bars(loop),
                    loads=sum(op.startswith("LDG.") or op == "LDG" for op in loop),
                    stores=sum(op.startswith("STS") for op in loop))
    commit = next(i for i in range(arrive, len(lines)) if lines[i] == "LDGDEPBAR")
    return dict(dequant=arrive + 1 - wait, dequant_bars=bars(lines[wait:arrive]),
                copy=commit - arrive, copy_bars=bars(lines[arrive + 1:commit + 1]),
                block=commit + 1 - wait, block_bars=bars(lines[wait:commit + 1]))


def compile_form(heads: int, split: bool, traced: bool = False,
                 fp8_tiles: sparse_mla_gluon.FP8Tiles | None = None, slot_major: bool = False) -> dict:
    """Registers, spills, shared memory, warps, the counts of :data:`REQUIRED` (bf16 cache) or
    :data:`REQUIRED_FP8` in the SASS and of unpredicated global stores in the PTX of one form
    (``heads`` per row; ``split``: with a 3-split workspace; ``traced``: with the phase stamps;
    ``fp8_tiles``: on an ``fp8_ds_mla`` cache, then also :func:`gather_loop` under ``loop``;
    ``slot_major``: the slot-major attend partition) of the kernel."""
    rows, splits = 4, 3
    q = torch.zeros(rows, heads, QK_DIM, dtype=torch.bfloat16)
    out = torch.zeros(rows, heads, LATENT_DIM, dtype=torch.bfloat16)
    workspace = torch.zeros(rows, heads, splits, RECORD_WIDTH) if split else None
    cache = (torch.zeros(4096, MLA_FP8_BYTES, dtype=torch.uint8) if fp8_tiles
             else torch.zeros(4096, QK_DIM, dtype=torch.bfloat16))
    tiles = fp8_tiles or sparse_mla_gluon.BF16_TILES
    record: dict = {}
    fresh_cache_dir()  # cold: a cached kernel (same specialization) comes without its ptxas log
    with compile_instead_of_launch(sparse_mla_gluon._sparse_mla_gluon_kernel, record,
                                   keep_compiled=True):
        sparse_mla_gluon.launch_sparse_mla_gluon(
            q, cache, torch.zeros(rows, 2048, dtype=torch.int32), out, workspace, 0.1, scan=2048,
            record_width=RECORD_WIDTH, tiles=tiles, slot_major=slot_major,
            trace=torch.zeros(rows * -(-heads // 64) * splits,
                              2 * len(sparse_mla_gluon.TRACE_STAMPS),
                              dtype=torch.int64) if traced else None)
    compiled = record["compiled"]
    cubin = CACHE_DIR / "sparse_mla_gluon.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    sass = subprocess.run([str(nvdisasm), "-c", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    found = collections.Counter(SASS_NAMES.findall(sass))
    unmasked = len(re.findall(r"^\s*st\.global", compiled.asm["ptx"], flags=re.MULTILINE))
    return dict(regs=record["regs"], spill_stores=record["spill_stores"] or 0, unmasked=unmasked,
                shared=compiled.metadata.shared, warps=compiled.metadata.num_warps,
                sass={name: found[name] for name in (REQUIRED_FP8 if fp8_tiles else REQUIRED)},
                loop=gather_loop(sass, fp8_tiles.staging == 0) if fp8_tiles else None)


def main() -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=positive_int_list, default=list(HEADS),
                        help="head counts per row, comma-separated (default: 8,16,32,64,128)")
    args = parse_or_exit(parser)
    knobs.nvidia.dump_ptxas_log = True
    failures = []
    caches = [None, *sparse_mla_gluon.FP8_TILES, *sparse_mla_gluon.FP8_TUNE_TILES]
    forms = [(heads, split, False, tiles) for tiles in caches for heads in args.heads
             for split in (False, True)]
    stamped = [(64, True, True, None), (64, True, True, caches[1])]
    # the slot-major attend partition beside the bf16 gathers and the FP8 default's
    in_slot = sparse_mla_gluon.FP8_TILES[3]
    slot_major = [(heads, split, False, tiles) for tiles in (None, in_slot) for heads in args.heads
                  if heads in sparse_mla_gluon.FEW_HEADS for split in (False, True)]
    for index, (heads, split, traced, tiles) in enumerate(forms + stamped + slot_major):
        major = index >= len(forms + stamped)
        form = f"{heads} heads, " + ("slot-major " if major else "") + ("split" if split else "single pass") + (
            " with stamps" if traced else "") + (f", fp8 cache ({tiles})" if tiles else "")
        result = compile_form(heads, split, traced, tiles, major)
        loop = result["loop"]
        if loop is None:
            loop_line = ""
        elif "loads" in loop:
            where = "in the ring slot" if tiles.in_slot else "through registers"
            loop_line = (f"; gather loop per block ({where}, wait to arrive): "
                         f"{loop['block']} instructions, {loop['block_bars']} barriers, "
                         f"{loop['loads']} LDG, {loop['stores']} STS")
        else:
            loop_line = (f"; gather loop per block: dequantizing {loop['dequant']} instructions, "
                         f"{loop['dequant_bars']} barriers; copies {loop['copy']} instructions, "
                         f"{loop['copy_bars']} barriers; together {loop['block']} instructions, "
                         f"{loop['block_bars']} barriers")
        print(f"{form}: {result['regs']} registers, {result['spill_stores']} B spilled, "
              f"{result['shared']} B shared memory, {result['warps']} warps; SASS {result['sass']}; "
              f"{result['unmasked']} unpredicated global stores{loop_line}", flush=True)
        if result["spill_stores"]:
            failures.append(f"{form}: spills {result['spill_stores']} B")
        if result["shared"] > MAX_SHARED_BYTES:
            failures.append(f"{form}: {result['shared']} B of shared memory > {MAX_SHARED_BYTES}")
        if result["unmasked"]:
            failures.append(f"{form}: {result['unmasked']} global stores without a predicate")
        failures += [f"{form}: no {name} in the SASS" for name, count in result["sass"].items()
                     if not count]
    for failure in failures:
        print(f"compile_sparse_mla_gluon: {failure}")
    if not failures:
        print("compile_sparse_mla_gluon: every form compiles for sm_90 as designed")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
