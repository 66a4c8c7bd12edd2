"""sparse_mla_decode with the Gluon kernel (SPARSE_MLA_GLUON_CONFIG, Hopper only) against the
fp32 reference: edge valid counts around its 64-slot blocks, holes and repeats, a poisoned cache,
padded rows, production sizes with and without splits, row invariance (bitwise); 8, 16 and 32
heads (one program of 64 head slots, the rest padding: nothing written outside the real heads);
the default
workspace and configuration on Hopper; the phase stamps (ordered, outputs unchanged); off Hopper,
a clear error; on any machine, the sm_90 compile at 8-128 heads (no spills, shared memory within
the limit, the pipeline's instructions in the SASS, every global store predicated) and the stamps'
argument check.
(CUDA-graph replay with new slots: test_sparse_mla.py, for both kernels.)"""

import math
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsa_inputs import (assert_nothing_written_outside, poison_unselected, production_sparse_mla_inputs,
                        random_sparse_mla_inputs, sentinel_out_and_workspace, to_cpu)
from dsaspec.ops import sparse_mla_gluon
from dsaspec.ops.sparse_mla import (RECORD_WIDTH, SPARSE_MLA_GLUON_CONFIG, sparse_mla_config,
                                    sparse_mla_decode, sparse_mla_num_splits,
                                    sparse_mla_workspace)
from dsaspec.reference.sparse_mla import reference_sparse_mla_decode

# fp32 accumulation over up to 2048 slots, bf16 probabilities in the value product and a bf16
# output: the Triton kernel measured up to 2.1e-3 absolute error on an H200 at k = 2048.
GPU_ATOL = 3e-3
EDGE_COUNTS = [0, 1, 63, 64, 65, 127, 128, 129, 200, 256]


def _run(inputs, workspace=None):
    q = inputs["q"]
    out = torch.full((q.shape[0], q.shape[1], 512), 7.0, dtype=torch.bfloat16, device=q.device)
    return sparse_mla_decode(**inputs, out=out, workspace=workspace,
                             config=SPARSE_MLA_GLUON_CONFIG)


def _compare(inputs, workspace=None, atol=GPU_ATOL):
    out = _run(inputs, workspace)
    expected = reference_sparse_mla_decode(**to_cpu(inputs))
    torch.testing.assert_close(out.float().cpu(), expected, atol=atol, rtol=1e-2)
    return out


def test_refuses_what_it_cannot_run(device):
    """Off Hopper, or with a head count other than 8, 16, 32 or a multiple of 64, a clear error
    names the config."""
    inputs = random_sparse_mla_inputs(2, 48, num_slots=10, k=8, valid_counts=[8, 8],
                                      device=device)
    with pytest.raises(ValueError, match="config: the Gluon kernel needs a CUDA device of "
                                         "compute capability 9.x and 8, 16, 32 or a multiple of "
                                         "64 heads, got .* and 48 heads"):
        _run(inputs)


def test_compiles_for_sm90_as_designed():
    """Without a GPU: every form (single pass and split at 8, 16, 32, 64 and 128 heads on the
    bf16 cache and with each FP8 tile set, the defaults and the tune candidates, on the
    fp8_ds_mla cache, split with stamps; the slot-major attend partition at 8, 16 and 32 heads on
    the bf16 cache and the FP8 default's gathers) compiles for sm_90 with no spills, within the
    shared-memory limit, with cp.async gathers, wgmma, copy-completion arrives (FP8: the e4m3
    conversion) and the register split in the SASS and only predicated global stores (masked to
    the real heads) (scripts/compile_sparse_mla_gluon.py, in a subprocess: it compiles instead of
    interpreting); each FP8 line prints its gather loop."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(root / "scripts" / "compile_sparse_mla_gluon.py")],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "every form compiles for sm_90 as designed" in proc.stdout
    # the slot-major attend partition: 8, 16, 32 heads x single pass, split x bf16, FP8 in the ring slot
    assert sum(", slot-major " in line for line in proc.stdout.splitlines()) == 12
    for tiles in sparse_mla_gluon.FP8_TILES + sparse_mla_gluon.FP8_TUNE_TILES:
        lines = [line for line in proc.stdout.splitlines() if f"fp8 cache ({tiles}):" in line]
        assert len(lines) >= 10 and all(" 0 B spilled" in line and "gather loop per block" in line
                                        for line in lines), (tiles, lines)
    # the gathers through registers and in the ring slot (staging=0) have the bf16 kernel's shared
    # memory (two ring slots, no staging stage; head-major) and print their loop from the ring-slot
    # wait to the arrive
    bf16 = next(line for line in proc.stdout.splitlines() if line.startswith("64 heads, single pass:"))
    bf16_shared = re.search(r"(\d+) B shared memory", bf16).group(1)
    registers = [t for t in sparse_mla_gluon.FP8_TILES + sparse_mla_gluon.FP8_TUNE_TILES if t.staging == 0]
    assert registers
    for tiles in registers:
        lines = [line for line in proc.stdout.splitlines()
                 if f"fp8 cache ({tiles}):" in line and ", slot-major " not in line]
        where = "(in the ring slot" if tiles.in_slot else "(through registers"
        assert all(f" {bf16_shared} B shared memory" in line and where in line for line in lines), (tiles, lines)
    assert any(t.in_slot for t in registers)


def test_trace_argument_is_checked():
    """A stamp buffer of the wrong shape or dtype is refused by name before any launch."""
    q = torch.zeros(2, 64, 576, dtype=torch.bfloat16)
    args = (q, torch.zeros(16, 576, dtype=torch.bfloat16), torch.zeros(2, 64, dtype=torch.int32),
            torch.zeros(2, 64, 512, dtype=torch.bfloat16), None, 0.1)
    stamps = 2 * len(sparse_mla_gluon.TRACE_STAMPS)
    with pytest.raises(ValueError, match=r"trace: expected shape \(2, 16\), got \(3, 16\)"):
        sparse_mla_gluon.launch_sparse_mla_gluon(*args, scan=64, record_width=RECORD_WIDTH,
                                                 trace=torch.zeros(3, stamps, dtype=torch.int64))
    with pytest.raises(ValueError, match="trace: expected dtype torch.int64"):
        sparse_mla_gluon.launch_sparse_mla_gluon(*args, scan=64, record_width=RECORD_WIDTH,
                                                 trace=torch.zeros(2, stamps, dtype=torch.int32))


needs_hopper = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
    reason="the Gluon kernel needs a compute-capability-9 GPU")


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("num_splits", [None, 2, 3])
@pytest.mark.parametrize("num_heads", [64, 128])
def test_gpu_edge_counts_and_poisoned_cache(num_heads, num_splits):
    """Valid counts around the 64-slot blocks (0, 1, 63-65, 127-129, ...), unselected cache rows
    NaN; split runs (some empty) combine from a NaN-filled workspace."""
    inputs = random_sparse_mla_inputs(len(EDGE_COUNTS), num_heads, num_slots=3000, k=256,
                                      valid_counts=EDGE_COUNTS, device="cuda", seed=num_heads)
    workspace = None
    if num_splits is not None:
        workspace = sparse_mla_workspace(len(EDGE_COUNTS), num_heads, "cuda",
                                         num_splits=num_splits).fill_(float("nan"))
    _compare(poison_unselected(inputs), workspace)


@pytest.mark.gpu
@needs_hopper
def test_gpu_holes_repeats_and_padded_rows():
    """-1 entries anywhere (a whole 64-slot block of them, only the last entry valid), repeated
    slots, and graph padding rows (one slot, the dummy slot 0) whose output is its value exactly."""
    gen = torch.Generator().manual_seed(1)
    inputs = random_sparse_mla_inputs(6, 64, num_slots=50, k=300, valid_counts=[300] * 6,
                                      device="cuda", seed=1)
    slots = inputs["slots"].cpu()
    slots[torch.rand(slots.shape, generator=gen) < 0.4] = -1
    slots[0, 64:128] = -1
    slots[1] = -1
    slots[2, :-1] = -1
    slots[3] = -1
    slots[3, 0] = 0
    inputs = poison_unselected(dict(inputs, slots=slots.to("cuda")))
    out = _compare(inputs)
    torch.testing.assert_close(out[3].float(), inputs["kv_cache"][0, :512].float().expand(64, 512),
                               atol=0, rtol=0)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("num_splits", [None, 2, 3])
@pytest.mark.parametrize("num_heads", [8, 16, 32])
def test_gpu_few_heads_padded_program(num_heads, num_splits):
    """8 / 16 / 32 heads, one program of 64 head slots: odd valid counts around the 64-slot
    blocks, -1 holes (a whole block of them), a graph padding row (the dummy slot 0: its value
    exactly), a NaN-poisoned cache. ``q`` and ``out`` are views of 64-head buffers whose other
    heads hold NaN / a sentinel, and the workspace the first rows of a larger NaN buffer: the
    padding heads' outputs and records are written nowhere (the sentinel and NaN tail stay)."""
    counts = [0, 1, 63, 65, 127, 129, 200, 255, 256]
    rows = len(counts) + 1
    inputs = random_sparse_mla_inputs(rows, num_heads, num_slots=3000, k=256,
                                      valid_counts=counts + [1], device="cuda", seed=num_heads)
    slots = inputs["slots"].cpu()
    slots[7, 64:128] = -1
    slots[8, 1::3] = -1
    slots[-1, 0] = 0
    inputs = poison_unselected(dict(inputs, slots=slots.to("cuda")))
    wide_q = torch.full((rows, 64, 576), float("nan"), dtype=torch.bfloat16, device="cuda")
    wide_q[:, :num_heads] = inputs["q"]
    inputs["q"] = wide_q[:, :num_heads]
    wide_out, out, workspace, tail = sentinel_out_and_workspace(rows, num_heads, num_splits, RECORD_WIDTH)
    out = sparse_mla_decode(**inputs, out=out, workspace=workspace, config=SPARSE_MLA_GLUON_CONFIG)
    expected = reference_sparse_mla_decode(**to_cpu(inputs))
    torch.testing.assert_close(out.float().cpu(), expected, atol=GPU_ATOL, rtol=1e-2)
    torch.testing.assert_close(out[-1].float(),
                               inputs["kv_cache"][0, :512].float().expand(num_heads, 512),
                               atol=0, rtol=0)
    assert_nothing_written_outside(wide_out, num_heads, tail)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("num_heads", [8, 16, 32, 64, 128])
@pytest.mark.parametrize("num_rows", [1, 16, 96])
def test_gpu_production_sizes(num_rows, num_heads, split):
    inputs = production_sparse_mla_inputs(num_rows, num_heads, seed=num_rows)
    workspace = (sparse_mla_workspace(num_rows, num_heads, "cuda", num_splits=max(
        2, sparse_mla_num_splits(num_rows, num_heads, 132, SPARSE_MLA_GLUON_CONFIG)))
        if split else None)
    _compare(inputs, workspace)


@pytest.mark.gpu
@needs_hopper
def test_gpu_default_is_gluon_with_its_workspace():
    """On Hopper the default single pass and the default split path of 16 rows take the Gluon
    kernel (64 heads, and 32 heads as one padded program), with the default workspace sized for
    its programs (one per SM)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for heads in (64, 32):
        assert sparse_mla_config(1, heads, split=False, device="cuda") == SPARSE_MLA_GLUON_CONFIG
        assert sparse_mla_config(16, heads, split=True, device="cuda") == SPARSE_MLA_GLUON_CONFIG
        workspace = sparse_mla_workspace(16, heads, "cuda")
        assert workspace.shape[2] == min(SPARSE_MLA_GLUON_CONFIG.max_splits, sms // 16)
    inputs = production_sparse_mla_inputs(16, 32, seed=9)
    out = torch.empty(16, 32, 512, dtype=torch.bfloat16, device="cuda")
    sparse_mla_decode(**inputs, out=out, workspace=workspace)
    torch.testing.assert_close(out.float().cpu(), reference_sparse_mla_decode(**to_cpu(inputs)),
                               atol=GPU_ATOL, rtol=1e-2)


@pytest.mark.gpu
@needs_hopper
def test_gpu_row_invariant_without_workspace():
    """Bitwise: a row computed alone equals the row computed among others, and a row's output
    does not change when the other rows' slots change."""
    inputs = production_sparse_mla_inputs(5, 64, seed=4)
    together = _run(inputs)
    for row in range(5):
        alone = _run(dict(inputs, q=inputs["q"][row:row + 1].clone(),
                          slots=inputs["slots"][row:row + 1].clone()))
        assert torch.equal(alone[0], together[row]), row
    others = inputs["slots"].clone()
    others[1:] = torch.flip(others[1:], dims=(0,))
    assert torch.equal(_run(dict(inputs, slots=others))[0], together[0])


@pytest.mark.gpu
@needs_hopper
def test_gpu_stamps_are_ordered_and_change_nothing():
    """With ``trace`` each program's stamps follow its phases (SM clock: start, then the attend
    partition's scan, first block, blocks done, stored; the gather partition's scan before its
    first copies, and those before the first block is in shared memory), a program without blocks
    leaves the block stamps 0, and the split records are the untraced kernel's, bitwise."""
    counts, splits = [2048, 700, 0, 64], 3
    inputs = random_sparse_mla_inputs(4, 64, num_slots=5000, k=2048, valid_counts=counts,
                                      device="cuda", seed=3)
    workspace = sparse_mla_workspace(4, 64, "cuda", num_splits=splits)
    out = torch.empty(4, 64, 512, dtype=torch.bfloat16, device="cuda")
    sparse_mla_decode(**inputs, out=out, workspace=workspace, config=SPARSE_MLA_GLUON_CONFIG)
    untraced = workspace.clone()
    trace = torch.zeros(4 * splits, 2 * len(sparse_mla_gluon.TRACE_STAMPS), dtype=torch.int64,
                        device="cuda")
    sparse_mla_gluon.launch_sparse_mla_gluon(
        inputs["q"], inputs["kv_cache"], inputs["slots"], out, workspace,
        inputs["sm_scale"] * math.log2(math.e), scan=2048, record_width=RECORD_WIDTH, trace=trace)
    assert torch.equal(workspace, untraced)
    clock = trace.view(4, splits, -1, 2)[..., 0].cpu()
    for row, count in enumerate(counts):
        blocks = -(-count // 64)
        per_split = -(-blocks // splits)
        for split in range(splits):
            start, attend, scanned, first, done, stored, gather_scanned, issued = clock[row, split]
            assert start <= attend <= scanned <= done <= stored and start <= gather_scanned
            if split * per_split < blocks:
                assert scanned <= first <= done and gather_scanned <= issued <= first, (row, split)
            else:
                assert first == 0 and issued == 0, (row, split)
