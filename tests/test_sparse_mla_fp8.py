"""sparse_mla_decode on the ``fp8_ds_mla`` cache (uint8 ``[slots, 656]``) against the plain-torch
reference that dequantizes the bytes (fp64 attention), and against the bf16 kernel on the
dequantized cache (bitwise: the dequantization to bf16 is exact); splits, poisoned unselected
entries, config routing (GLUON_FP8_DEFAULT_CONFIG where the Gluon kernel runs: 64-slot blocks
dequantized in their ring slot), and the Triton ops' wiring. On Hopper the Gluon kernel's FP8
tiles and its gather-partition tune candidates (gpu-marked): against the reference at 8-128
heads, split or not, the 64-slot defaults bitwise against the bf16 Gluon kernel on the
dequantized cache, and each candidate bitwise against the staged FP8 default of its block size.

Tolerance under the interpreter (atol 1e-3, rtol 1e-2): the kernel runs the math in fp32 on
exactly the values the cache holds, so the error is fp32 summation (about 1e-6) plus the bf16
rounding of the output, which the interpreter truncates (up to one bf16 ulp, 2**-7 relative).
On the GPU: bf16 probabilities enter the value product, as on the bf16 cache: each probability is
off by at most 2**-8 of itself, so an output is off by at most 2**-8 sum_j p_j |v_j| (the values
in the cache reach 14, so no fixed atol fits), plus its own bf16 rounding (2**-8 relative).
"""

import re

import pytest
import torch

from dsa_inputs import assert_nothing_written_outside, sentinel_out_and_workspace
from compile_scripts import run_in_scripts
from dsaspec.layers.attention import torch_ops
from dsaspec.layers.attention.dsa_ops import dsa_ops
from dsaspec.ops.fp8_kv import gather_mla
from dsaspec.ops import sparse_mla, sparse_mla_gluon
from dsaspec.ops.sparse_mla import (SPARSE_MLA_BASELINE_CONFIG, SPARSE_MLA_CONFIG,
                                    SPARSE_MLA_FEW_ROWS_CONFIG, SPARSE_MLA_GLUON_CONFIG,
                                    SPARSE_MLA_GLUON_FP8_CONFIG,
                                    SPARSE_MLA_GLUON_FP8_NARROW_CONFIG,
                                    SPARSE_MLA_GLUON_FP8_ONE_SPLIT_CONFIG, SPARSE_MLA_GLUON_FP8_IN_SLOT_CONFIG,
                                    SPARSE_MLA_GLUON_FP8_TUNE_CONFIGS, SPARSE_MLA_SLOT_MAJOR_CONFIG,
                                    SPARSE_MLA_GLUON_FP8_SLOT_MAJOR_CONFIG, SPARSE_MLA_GLUON_SLOT_MAJOR_CONFIG,
                                    SparseMLAConfig,
                                    sparse_mla_config, sparse_mla_decode, sparse_mla_num_splits,
                                    sparse_mla_workspace)
from dsaspec.reference.sparse_mla import reference_sparse_mla_decode_fp8

# The unmarked tests hold the interpreter's tolerances; the gpu-marked ones the GPU's.
pytestmark = pytest.mark.interpreter

CONFIGS = {
    "new": SPARSE_MLA_CONFIG,
    "few_rows": SPARSE_MLA_FEW_ROWS_CONFIG,
    "baseline": SPARSE_MLA_BASELINE_CONFIG,
    # value columns over two and four programs: the value gathers dequantize groups 2-3 / 1..3
    "value_256": SparseMLAConfig(block_h=64, block_n=16, num_warps=8, num_stages=1, block_dv=256),
    "value_128": SparseMLAConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, block_dv=128),
    "slot_major": SPARSE_MLA_SLOT_MAJOR_CONFIG,
}
ATOL, RTOL = 1e-3, 1e-2
NAN_CODES = (0x7F, 0xFF)  # e4m3fn's NaNs


def random_fp8_cache(num_slots: int, gen: torch.Generator) -> torch.Tensor:
    """uint8 ``[num_slots, 656]`` ``fp8_ds_mla`` bytes built directly: every finite e4m3 code
    (subnormals and -0 included), power-of-two scales 2**-9 .. 2**-5 per 128 latent values,
    random bf16 rope values."""
    codes = torch.randint(0, 256, (num_slots, 512), generator=gen, dtype=torch.uint8)
    for nan in NAN_CODES:
        codes[codes == nan] = 0x7E  # 448 / -448 in their place
    scales = 2.0 ** torch.randint(-9, -4, (num_slots, 4), generator=gen).float()
    rope = torch.randn(num_slots, 64, generator=gen).to(torch.bfloat16)
    return torch.cat((codes, scales.view(torch.uint8), rope.view(torch.uint8)), dim=1)


def fp8_inputs(num_rows: int, num_heads: int, num_slots: int, k: int, valid_counts, device,
               seed: int = 0) -> dict:
    """Queries, an FP8 cache and per row ``valid_counts[r]`` random (repeating) slots, then -1."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.full((num_rows, k), -1, dtype=torch.int32)
    for row, count in enumerate(valid_counts):
        slots[row, :count] = torch.randint(0, num_slots, (count,), generator=gen, dtype=torch.int32)
    return dict(q=torch.randn(num_rows, num_heads, 576, generator=gen).to(torch.bfloat16).to(device),
                kv_cache=random_fp8_cache(num_slots, gen).to(device), slots=slots.to(device),
                sm_scale=576 ** -0.5)


def poison_unselected(inputs: dict) -> dict:
    """Every entry no slot selects set to 0xFF bytes: NaN codes, NaN scales, NaN rope values."""
    cache = inputs["kv_cache"].clone()
    selected = torch.zeros(cache.shape[0], dtype=torch.bool, device=cache.device)
    selected[inputs["slots"][inputs["slots"] >= 0].long()] = True
    cache[~selected] = 0xFF
    return dict(inputs, kv_cache=cache)


def _run(inputs, workspace=None, config=None, check_values=True):
    q = inputs["q"]
    out = torch.full((q.shape[0], q.shape[1], 512), 7.0, dtype=torch.bfloat16, device=q.device)
    return sparse_mla_decode(**inputs, out=out, workspace=workspace, config=config,
                             check_values=check_values)


def _reference(inputs):
    return reference_sparse_mla_decode_fp8(inputs["q"].cpu(), inputs["kv_cache"].cpu(),
                                           inputs["slots"].cpu(), inputs["sm_scale"])


def _assert_within_gpu_rounding(out, inputs):
    """``out`` (bf16, on the GPU) against the reference within the bf16-probability bound of the
    module docstring (and 1e-5 for fp32 sums)."""
    args = (inputs["q"].cpu(), inputs["kv_cache"].cpu(), inputs["slots"].cpu(), inputs["sm_scale"])
    want = reference_sparse_mla_decode_fp8(*args)
    magnitude = reference_sparse_mla_decode_fp8(*args, absolute_values=True)
    error = (out.float().cpu() - want).abs()
    bound = 2.0 ** -8 * (magnitude + want.abs()) + 1e-5
    assert torch.all(error <= bound), f"worst error over bound: {float((error / bound).max()):.3f}"


def _dequantized(inputs):
    """The same inputs over a bf16 cache holding the FP8 cache's values (exact in bf16; a NaN
    entry stays NaN)."""
    cache = inputs["kv_cache"]
    slots = torch.arange(cache.shape[0], device=cache.device)
    return dict(inputs, kv_cache=gather_mla(cache, slots, out_dtype=torch.bfloat16))


EDGE_COUNTS = [0, 1, 31, 32, 33, 63, 64]
# The Gluon kernel's FP8 defaults, then its gather-partition tune candidates (the bench's
# --tune rows), named by block size, ring slots, staging stages, gather warps, registers, steps,
# slot-id loads, refill and, for the dequantizing in the ring slot, "in_slot".
GLUON_FP8 = {"gluon_fp8": SPARSE_MLA_GLUON_FP8_CONFIG,
             "gluon_fp8_narrow": SPARSE_MLA_GLUON_FP8_NARROW_CONFIG,
             "gluon_fp8_one_split": SPARSE_MLA_GLUON_FP8_ONE_SPLIT_CONFIG,
             "gluon_fp8_in_slot": SPARSE_MLA_GLUON_FP8_IN_SLOT_CONFIG,
             **{f"gluon_fp8_tune_n{c.block_n}_r{c.num_stages}_"
                f"s{c.num_stages if c.staging is None else c.staging}_"
                f"w{c.gather_warps}_g{c.gather_registers}_d{c.dequant_steps}_{c.slot_loads}_"
                f"{c.refill}{'_in_slot' if c.in_slot else ''}": c
                for c in SPARSE_MLA_GLUON_FP8_TUNE_CONFIGS}}
GLUON_FP8_TUNE = [name for name in GLUON_FP8 if name.startswith("gluon_fp8_tune")]
needs_hopper = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
    reason="the Gluon kernel needs a compute-capability-9 GPU")


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("num_heads", [8, 16, 64])
def test_matches_reference(config, num_heads, device):
    """Ragged valid counts around the block sizes (k = 64), repeated slots, poisoned unselected
    entries."""
    inputs = fp8_inputs(len(EDGE_COUNTS), num_heads, num_slots=150, k=64,
                        valid_counts=EDGE_COUNTS, device=device, seed=num_heads)
    inputs = poison_unselected(inputs)
    out = _run(inputs, config=CONFIGS[config])
    torch.testing.assert_close(out.float().cpu(), _reference(inputs), atol=ATOL, rtol=RTOL)
    assert torch.all(out[0] == 0)  # no valid slot: zeros


@pytest.mark.parametrize("k", [1, 7, 37])
def test_odd_k_holes_and_repeats(k, device):
    """Odd k; -1 entries anywhere; a row whose only valid entry is its last; a row that selects
    one slot k times (its softmax is that slot's value exactly)."""
    gen = torch.Generator().manual_seed(k)
    inputs = fp8_inputs(4, 16, num_slots=12, k=k, valid_counts=[k] * 4, device=device, seed=k)
    slots = inputs["slots"].cpu()
    slots[0][torch.rand(k, generator=gen) < 0.4] = -1
    slots[1, :-1] = -1
    slots[2] = 5
    inputs = poison_unselected(dict(inputs, slots=slots.to(device)))
    out = _run(inputs)
    torch.testing.assert_close(out.float().cpu(), _reference(inputs), atol=ATOL, rtol=RTOL)
    value = _reference(dict(inputs, slots=torch.full((4, 1), 5, dtype=torch.int32)))[2]
    torch.testing.assert_close(out[2].float().cpu(), value, atol=0, rtol=2 ** -7)


@pytest.mark.parametrize("poison", ["codes", "scales", "rope"])
def test_poison_does_not_leak(poison, device):
    """NaN in one byte field of the unselected entries (slot 0, the stand-in address of every
    -1 entry, included) never reaches the output; the same NaN in a selected entry does (so
    the first check could fail)."""
    inputs = fp8_inputs(3, 8, num_slots=40, k=32, valid_counts=[32, 3, 0], device=device, seed=4)
    slots = inputs["slots"].clone()
    slots[slots == 0] = 1
    field = {"codes": slice(0, 512), "scales": slice(512, 528), "rope": slice(528, 656)}[poison]
    selected = torch.zeros(40, dtype=torch.bool, device=device)
    selected[slots[slots >= 0].long()] = True
    cache = inputs["kv_cache"].clone()
    cache[~selected, field] = 0xFF
    inputs = dict(inputs, slots=slots, kv_cache=cache)
    out = _run(inputs)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float().cpu(), _reference(inputs), atol=ATOL, rtol=RTOL)
    if poison == "codes" and not cache.is_cuda:
        return  # the interpreter widens e4m3fn's NaN codes to +-480 (the GPU's cvt gives NaN)
    cache[slots[1, 0].long(), field] = 0xFF
    assert _run(dict(inputs, kv_cache=cache))[1].isnan().all()


@pytest.mark.parametrize("config", ["new", "few_rows", "value_256", "value_128", "slot_major"])
@pytest.mark.parametrize("split", [False, True])
def test_bitwise_equal_to_bf16_kernel_on_dequantized_cache(config, split, device):
    """Same configuration, same workspace: the FP8 gathers hand the dots exactly the bf16 values
    the dequantized bf16 cache holds, so the two outputs are equal bit for bit."""
    inputs = fp8_inputs(4, 16, num_slots=300, k=96, valid_counts=[96, 50, 1, 0], device=device,
                        seed=7)
    workspace = sparse_mla_workspace(4, 16, device, num_splits=3) if split else None
    got = _run(inputs, workspace, CONFIGS[config])
    want = _run(_dequantized(inputs), workspace, CONFIGS[config])
    assert torch.equal(got, want)


@pytest.mark.parametrize("config", ["new", "few_rows", "slot_major"])
@pytest.mark.parametrize("num_splits,num_heads", [(1, 8), (2, 8), (3, 16), (5, 8), (3, 48)])
def test_split_workspace(num_splits, num_heads, config, device):
    """Split runs (some empty) combine to the reference and to the single pass; the NaN-filled
    workspace shows a missing record write."""
    config = CONFIGS[config]
    counts = [0, 1, 33, 100, 128, 65]
    inputs = fp8_inputs(len(counts), num_heads, num_slots=500, k=128, valid_counts=counts,
                        device=device, seed=num_splits)
    slots = inputs["slots"].cpu()
    slots[3, 5:40] = -1  # a hole spanning a whole split
    inputs = poison_unselected(dict(inputs, slots=slots.to(device)))
    workspace = sparse_mla_workspace(len(counts), num_heads, device, num_splits=num_splits,
                                     config=config)
    workspace.fill_(float("nan"))
    split = _run(inputs, workspace, config)
    torch.testing.assert_close(split.float().cpu(), _reference(inputs), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(split.float(), _run(inputs, config=config).float(), atol=ATOL,
                               rtol=RTOL)


def test_row_invariant_without_workspace(device):
    inputs = fp8_inputs(4, 16, num_slots=200, k=64, valid_counts=[64, 3, 0, 40], device=device,
                        seed=9)
    together = _run(inputs)
    for row in range(4):
        alone = _run(dict(inputs, q=inputs["q"][row:row + 1].clone(),
                          slots=inputs["slots"][row:row + 1].clone()))
        assert torch.equal(alone[0], together[row]), row


def test_compiles_for_sm90_without_spills():
    """Without a GPU: on the FP8 cache the default tiles compile for sm_90 without register
    spills and gather the rope values by 16-byte cp.async like the codes (no 2-byte loads, which
    stay outside the software pipeline); scripts/compile_fp8_dsa.py's compile, in a subprocess
    (it compiles instead of interpreting)."""
    out = run_in_scripts("compile_fp8_dsa", "r = c.compile_sparse_mla(True); "
                         "print(r['regs'], r['spill'], r['sass']['LDG.E.U16'], r['sass']['LDGSTS.E.BYPASS.128'])")
    regs, spilled, rope_scalar_loads, copies = map(int, out.split()[-4:])
    assert 0 < regs <= 255 and spilled == 0 and rope_scalar_loads == 0 and copies > 0, out


def test_bad_arguments(device):
    inputs = fp8_inputs(2, 4, num_slots=10, k=8, valid_counts=[8, 8], device=device)
    out = torch.zeros(2, 4, 512, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match=re.escape("kv_cache: expected shape ('*', 656), got "
                                                   "(10, 576)")):
        sparse_mla_decode(**dict(inputs, kv_cache=inputs["kv_cache"][:, :576]), out=out)
    with pytest.raises(ValueError, match=re.escape("kv_cache: expected shape ('*', 576), got "
                                                   "(10, 656)")):
        sparse_mla_decode(**dict(inputs, kv_cache=torch.zeros(10, 656, dtype=torch.bfloat16,
                                                              device=device)), out=out)
    with pytest.raises(ValueError, match="kv_cache: an fp8_ds_mla cache's row stride must be a "
                                         "multiple of 16 bytes, got 660"):
        padded = torch.zeros(10, 660, dtype=torch.uint8, device=device)
        padded[:, :656] = inputs["kv_cache"]
        sparse_mla_decode(**dict(inputs, kv_cache=padded[:, :656]), out=out)
    with pytest.raises(ValueError, match=re.escape("kv_cache: expected dtype in (torch.bfloat16, "
                                                   "torch.uint8), got torch.int8")):
        sparse_mla_decode(**dict(inputs, kv_cache=inputs["kv_cache"].view(torch.int8)), out=out)
    with pytest.raises(ValueError, match="slots: slot 10 is out of range for a kv_cache of 10 "
                                         "slots"):
        bad = inputs["slots"].clone()
        bad[0, 0] = 10
        sparse_mla_decode(**dict(inputs, slots=bad), out=out)
    fields = ("('block_h', 'block_n', 'num_warps', 'num_stages', 'block_dv', 'staging', "
              "'gather_warps', 'gather_registers', 'dequant_steps', 'slot_loads', 'refill', 'in_slot')")
    with pytest.raises(ValueError, match=re.escape(
            f"config: the Gluon kernel's tiles {fields} on an fp8_ds_mla kv_cache are one of "
            f"((64, 64, 8, 1, 512, None, 4, 88, 2, 'per_layout', 'block', False), "
            f"(64, 32, 8, 2, 512, None, 4, 96, 1, 'convert', 'block', False), "
            f"(64, 64, 8, 2, 512, 0, 4, 104, 4, 'per_layout', 'block', False), "
            f"(64, 64, 8, 2, 512, 0, 4, 88, 8, 'per_layout', 'block', True), "
            f"(64, 64, 8, 1, 512, None, 4, 88, 4, 'convert', 'block', False), ") + ".*" + re.escape(
            "got (64, 64, 8, 2, 512, None, 4, 88, 4, 'convert', 'block', False)")):
        sparse_mla_decode(**inputs, out=out, config=SPARSE_MLA_GLUON_CONFIG)
    for config in GLUON_FP8.values():
        with pytest.raises(ValueError, match=re.escape(
                f"config: the Gluon kernel's tiles {fields} on a bf16 kv_cache are one of "
                f"((64, 64, 8, 2, 512, None, 4, 88, 4, 'convert', 'block', False),), got "
                f"{config.tiles}")):
            sparse_mla_decode(**_dequantized(inputs), out=out, config=config)
    for config in GLUON_FP8.values():  # the right tiles, but 4 heads (and here no Hopper GPU)
        with pytest.raises(ValueError, match="config: the Gluon kernel needs a CUDA device of "
                                             "compute capability 9.x and 8, 16, 32 or a "
                                             "multiple of 64 heads, got .* and 4 heads"):
            sparse_mla_decode(**inputs, out=out, config=config)


@pytest.mark.parametrize("capability", [(9, 0), (8, 0)])
@pytest.mark.parametrize("num_sms", [132, 78, 8])
@pytest.mark.parametrize("configured", [True, False])
def test_fp8_cache_default_where_gluon_runs(capability, num_sms, configured, monkeypatch):
    """Where a bf16 cache takes the Gluon kernel (compute capability 9.x, 8-32 heads or a multiple
    of 64; a split of at least two 64-head programs) an FP8 cache takes the in-slot config, split
    or not, whatever the SM count; the launch over the workspace sized with it takes it again.
    Elsewhere, or with GLUON_FP8_DEFAULT_CONFIG None, the Triton configuration the CPU gets."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(sparse_mla, "sm_count", lambda device: num_sms)
    if not configured:
        monkeypatch.setattr(sparse_mla, "GLUON_FP8_DEFAULT_CONFIG", None)
    for heads in (8, 16, 32, 48, 64, 128):
        for rows in (1, 2, 3, 4, 5, 16, 33, 34, 39, 40, 66, 67, 256):
            programs = rows * -(-heads // 64)
            gluon = capability == (9, 0) and heads != 48
            for split in (False, True):
                fp8 = sparse_mla_config(rows, heads, split, device="cuda:0", fp8_cache=True, slot_major=False)
                bf16 = sparse_mla_config(rows, heads, split, device="cuda:0", slot_major=False)
                where = (heads, rows, split)
                assert (bf16 == SPARSE_MLA_GLUON_CONFIG) == (gluon and (not split or programs >= 2)), where
                if bf16.kernel == "gluon" and configured:
                    assert fp8 is SPARSE_MLA_GLUON_FP8_IN_SLOT_CONFIG, where
                else:
                    assert fp8 == sparse_mla_config(rows, heads, split) and fp8.kernel == "triton", where
            sized = sparse_mla_config(rows, heads, True, device="cuda:0", fp8_cache=True, slot_major=False)
            if sized.kernel == "gluon":  # as DSAModel.attention_workspace sizes it, and the launch
                workspace = sparse_mla_workspace(rows, heads, "cpu", num_sms=num_sms, config=sized)
                assert sparse_mla_config(rows, heads, workspace is not None, device="cuda:0",
                                         fp8_cache=True, slot_major=False) is sized, (heads, rows)
                assert (workspace is None) == (2 * programs > num_sms), (heads, rows)


@pytest.mark.parametrize("gluon", [True, False])
def test_triton_ops_read_the_fp8_pool(gluon, device):
    """The runtime's Triton ops (dsa_ops) run sparse MLA on an FP8 layer cache, with and without
    the Gluon switch, and agree with the torch ops on the same bytes."""
    # not poisoned: the torch ops read slot 0 for every -1 entry (weighted by 0)
    inputs = fp8_inputs(3, 16, num_slots=100, k=40, valid_counts=[40, 9, 0], device=device,
                        seed=11)
    want = torch.empty(3, 16, 512)
    torch_ops.sparse_mla_decode(inputs["q"].cpu(), inputs["kv_cache"].cpu(), inputs["slots"].cpu(),
                                inputs["sm_scale"], want)
    out = torch.empty(3, 16, 512, dtype=torch.bfloat16, device=device)
    workspace = sparse_mla_workspace(3, 16, device, num_splits=2)
    for ws in (None, workspace):
        dsa_ops(True, gluon, False).sparse_mla_decode(inputs["q"], inputs["kv_cache"], inputs["slots"],
                                               inputs["sm_scale"], out, check_values=False,
                                               workspace=ws)
        torch.testing.assert_close(out.float().cpu(), want, atol=ATOL, rtol=RTOL)


# ---- GPU: production shapes (64 heads, top-k 2048) ------------------------------------------


def _production(num_rows: int, num_heads: int, seed: int, k: int = 2048, num_slots: int = 1 << 17):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, k + 1, (num_rows,), generator=gen)
    counts[0] = k
    if num_rows > 1:
        counts[-1] = 1
    return fp8_inputs(num_rows, num_heads, num_slots, k, counts.tolist(), "cuda", seed=seed)


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["default", "new", "few_rows", "value_256", "slot_major", *GLUON_FP8])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("num_rows", [1, 16, 96])
def test_gpu_production_sizes(config, num_rows, split):
    if config in GLUON_FP8 and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel needs a compute-capability-9 GPU")
    inputs = _production(num_rows, 64, seed=num_rows)
    workspace = (sparse_mla_workspace(num_rows, 64, "cuda", num_splits=max(
        2, sparse_mla_num_splits(num_rows, 64, 132))) if split else None)
    config = {**CONFIGS, **GLUON_FP8}.get(config)
    _assert_within_gpu_rounding(_run(inputs, workspace, config), inputs)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["triton", "gluon"])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("num_heads", [8, 16, 32])
def test_gpu_slot_major_few_heads(num_heads, split, kernel):
    """The slot-major tiles of both kernels on the FP8 cache at a rank's 8 - 32 heads (2048 slots,
    96 rows of ragged counts) within the GPU rounding bound of the reference; the Gluon kernel's also
    bitwise its bf16 slot-major tiles' output on the dequantized cache (the same dots in the same
    order). The Triton slot-major tiles' are not: on an H100 (session 24) their FP8 output differed
    from their bf16 output in some bits at every head count, a difference in how the compiler lowers
    the two caches' dots that the CPU interpreter does not have."""
    if kernel == "gluon" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel needs a compute-capability-9 GPU")
    fp8 = SPARSE_MLA_GLUON_FP8_SLOT_MAJOR_CONFIG if kernel == "gluon" else SPARSE_MLA_SLOT_MAJOR_CONFIG
    inputs = _production(96, num_heads, seed=num_heads)
    workspace = sparse_mla_workspace(96, num_heads, "cuda", num_splits=3) if split else None
    got = _run(inputs, workspace, fp8)
    _assert_within_gpu_rounding(got, inputs)
    if kernel == "gluon":
        assert torch.equal(got, _run(_dequantized(inputs), workspace, SPARSE_MLA_GLUON_SLOT_MAJOR_CONFIG))


@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True])
def test_gpu_bitwise_equal_to_bf16_kernel(split):
    inputs = _production(16, 64, seed=2)
    workspace = sparse_mla_workspace(16, 64, "cuda", num_splits=4) if split else None
    got = _run(inputs, workspace, SPARSE_MLA_CONFIG)
    assert torch.equal(got, _run(_dequantized(inputs), workspace, SPARSE_MLA_CONFIG))


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["default", *GLUON_FP8])
@pytest.mark.parametrize("split", [False, True])
def test_gpu_cuda_graph_replay_with_new_slots(split, config):
    """Captured once over the FP8 cache with the default configuration (or a Gluon one),
    replayed with new slots (1, up to 100, up to 2048 valid per row): each replay matches the
    reference."""
    if config in GLUON_FP8 and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel needs a compute-capability-9 GPU")
    config = GLUON_FP8.get(config)
    num_rows, num_heads, k, num_slots = 24, 64, 2048, 1 << 17
    inputs = _production(num_rows, num_heads, seed=5, k=k, num_slots=num_slots)
    out = torch.zeros(num_rows, num_heads, 512, dtype=torch.bfloat16, device="cuda")
    workspace = sparse_mla_workspace(num_rows, num_heads, "cuda", num_splits=4) if split else None
    sparse_mla_decode(**inputs, out=out, workspace=workspace, config=config)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sparse_mla_decode(**inputs, out=out, check_values=False, workspace=workspace,
                          config=config)
    gen = torch.Generator().manual_seed(0)
    for high in (1, 100, k):
        counts = torch.randint(0, high + 1, (num_rows,), generator=gen).tolist()
        fresh = fp8_inputs(num_rows, num_heads, num_slots, k, counts, "cpu", seed=high)["slots"]
        inputs["slots"].copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        _assert_within_gpu_rounding(out, inputs)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("config", GLUON_FP8)
@pytest.mark.parametrize("num_splits", [None, 2, 3])
@pytest.mark.parametrize("num_heads", [8, 16, 32, 64, 128])
def test_gpu_gluon_edge_counts_holes_and_poison(config, num_heads, num_splits):
    """The Gluon kernel's FP8 tiles: odd valid counts around both block sizes (32 and 64), -1
    holes (a whole 64-slot block of them, every third entry), repeats, a graph padding row (the
    dummy slot 0: its dequantized value exactly), unselected entries poisoned with NaN bytes,
    split runs (some empty) from a NaN-filled workspace. ``out`` is a view of a 64-head buffer
    (8-32 heads: one padded program) and the workspace the first rows of a NaN buffer: nothing is
    written outside them."""
    counts = [0, 1, 31, 33, 63, 65, 127, 129, 200, 255, 256]
    rows = len(counts) + 1
    inputs = fp8_inputs(rows, num_heads, num_slots=3000, k=256, valid_counts=counts + [1],
                        device="cuda", seed=num_heads)
    slots = inputs["slots"].cpu()
    slots[8, 64:128] = -1
    slots[9, 1::3] = -1
    slots[-1, 0] = 0
    inputs = poison_unselected(dict(inputs, slots=slots.to("cuda")))
    wide_out, out, workspace, tail = sentinel_out_and_workspace(rows, num_heads, num_splits,
                                                                sparse_mla.RECORD_WIDTH)
    out = sparse_mla_decode(**inputs, out=out, workspace=workspace, config=GLUON_FP8[config])
    _assert_within_gpu_rounding(out, inputs)
    padding_row = _dequantized(inputs)["kv_cache"][0, :512]
    assert torch.equal(out[-1], padding_row.expand(num_heads, 512))
    assert_nothing_written_outside(wide_out, num_heads, tail)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("config", ["gluon_fp8", "gluon_fp8_one_split", "gluon_fp8_in_slot"])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("num_heads", [16, 64, 128])
def test_gpu_gluon_bitwise_equal_to_bf16_gluon_kernel(num_heads, split, config):
    """The 64-slot FP8 defaults (the bf16 kernel's dots in the same order; staged, and through
    registers for one split) on the FP8 cache equal SPARSE_MLA_GLUON_CONFIG on the dequantized
    bf16 cache, bitwise: the dequantization to bf16 is exact. (The 32-slot tiles sum in another
    order: the reference tests above cover them.)"""
    inputs = poison_unselected(_production(16, num_heads, seed=2))
    workspace = sparse_mla_workspace(16, num_heads, "cuda", num_splits=4) if split else None
    got = _run(inputs, workspace, GLUON_FP8[config])
    assert torch.equal(got, _run(_dequantized(inputs), workspace, SPARSE_MLA_GLUON_CONFIG))


def test_gluon_fp8_tune_candidates():
    """The tune candidates are Gluon FP8 configs distinct from each other and from the defaults,
    each with the block size of a default (so the default's output, bitwise, on the GPU)."""
    assert len(GLUON_FP8_TUNE) == len(SPARSE_MLA_GLUON_FP8_TUNE_CONFIGS) > 0
    assert len(set(GLUON_FP8.values())) == len(GLUON_FP8)
    defaults = (SPARSE_MLA_GLUON_FP8_CONFIG, SPARSE_MLA_GLUON_FP8_NARROW_CONFIG,
                SPARSE_MLA_GLUON_FP8_ONE_SPLIT_CONFIG, SPARSE_MLA_GLUON_FP8_IN_SLOT_CONFIG)
    for config in SPARSE_MLA_GLUON_FP8_TUNE_CONFIGS:
        assert config.kernel == "gluon" and config.block_n in (64, 32)
        assert config not in defaults
    # the slot-id loads and the per-step refill: the converted ids (the former 64-slot default),
    # the refill, both, and the loads per layout at 32
    options = {(c.block_n, c.dequant_steps, c.slot_loads, c.refill)
               for c in SPARSE_MLA_GLUON_FP8_TUNE_CONFIGS}
    assert {(64, 2, "convert", "block"), (64, 2, "convert", "step"),
            (64, 2, "per_layout", "step"), (32, 1, "per_layout", "block")} <= options
    # the gathers through registers (no staging stage) at 64 slots, the bf16 kernel's two ring
    # slots: eighth-block steps at 88 gather registers a candidate, quarter-block steps at 104 the
    # one-split default
    through_registers = {(c.block_n, c.num_stages, c.dequant_steps, c.gather_registers)
                         for c in SPARSE_MLA_GLUON_FP8_TUNE_CONFIGS if c.staging == 0 and not c.in_slot}
    assert through_registers == {(64, 2, 8, 88)}
    assert "gluon_fp8_tune_n64_r2_s0_w4_g88_d8_per_layout_block" in GLUON_FP8_TUNE
    # the dequantizing in the ring slot, a chunk a step: the default at 88 gather registers, a
    # candidate at 104; a scale group (two chunks) a step at 88 a candidate
    in_slot = {(c.block_n, c.num_stages, c.staging, c.dequant_steps, c.gather_registers)
               for c in SPARSE_MLA_GLUON_FP8_TUNE_CONFIGS if c.in_slot}
    assert in_slot == {(64, 2, 0, 8, 104), (64, 2, 0, 4, 88)}
    assert "gluon_fp8_tune_n64_r2_s0_w4_g104_d8_per_layout_block_in_slot" in GLUON_FP8_TUNE
    assert "gluon_fp8_tune_n64_r2_s0_w4_g88_d4_per_layout_block_in_slot" in GLUON_FP8_TUNE
    default = SPARSE_MLA_GLUON_FP8_IN_SLOT_CONFIG
    assert (default.block_n, default.num_stages, default.staging, default.dequant_steps,
            default.gather_registers, default.in_slot) == (64, 2, 0, 8, 88, True)
    one_split = SPARSE_MLA_GLUON_FP8_ONE_SPLIT_CONFIG
    assert (one_split.block_n, one_split.num_stages, one_split.staging, one_split.dequant_steps,
            one_split.gather_registers, one_split.slot_loads) == (64, 2, 0, 4, 104, "per_layout")


def test_fp8_tiles_reject_bad_gather_options():
    """FP8Tiles (like SparseMLAConfig) names a bad slot_loads or refill, and a per-step refill
    whose steps are too few or too short for a step's scale copies (8 rows a gather warp)."""
    with pytest.raises(ValueError, match=re.escape(
            "slot_loads: expected one of ('convert', 'per_layout'), got 'global'")):
        sparse_mla_gluon.FP8Tiles(64, 1, slot_loads="global")
    with pytest.raises(ValueError, match=re.escape(
            "refill: expected one of ('block', 'step'), got 'row'")):
        sparse_mla_gluon.FP8Tiles(64, 1, refill="row")
    for block_n, steps in ((64, 1), (64, 4), (32, 2)):
        with pytest.raises(ValueError, match=re.escape(
                f"refill: 'step' needs dequant_steps >= 2 and block_n // dequant_steps >= 8 * "
                f"gather_warps = 32 rows a step, got block_n {block_n}, dequant_steps {steps}")):
            sparse_mla_gluon.FP8Tiles(block_n, 1, dequant_steps=steps, refill="step")
    assert sparse_mla_gluon.FP8Tiles(64, 1, dequant_steps=2, refill="step").refill == "step"


def test_fp8_tiles_reject_what_the_register_gathers_do_not_implement():
    """FP8Tiles and SparseMLAConfig name the field: a negative staging; staging 0 (the gathers
    through registers) with the slot ids converted or a per-step refill (it has neither), or with
    steps that do not divide the block or are shorter than 8 rows (the sm_90 compile cannot slice
    the ring slot's swizzle pattern); the Triton kernel refuses staging 0 as any gather option."""
    with pytest.raises(ValueError, match=re.escape("staging: expected None or >= 0 staging stages, got -1")):
        sparse_mla_gluon.FP8Tiles(64, 2, staging=-1)
    for slot_loads, refill in (("convert", "block"), ("per_layout", "step"), ("convert", "step")):
        message = re.escape(f"staging: 0 (the gathers through registers) needs slot_loads='per_layout' "
                            f"and refill='block', got slot_loads {slot_loads!r}, refill {refill!r}")
        with pytest.raises(ValueError, match=message):
            sparse_mla_gluon.FP8Tiles(64, 2, staging=0, dequant_steps=2, slot_loads=slot_loads, refill=refill)
        with pytest.raises(ValueError, match=message):
            SparseMLAConfig(block_h=64, block_n=64, num_warps=8, num_stages=2, kernel="gluon", staging=0,
                            dequant_steps=2, slot_loads=slot_loads, refill=refill)
    for block_n, steps in ((64, 16), (64, 3), (32, 8)):
        message = re.escape(f"dequant_steps: staging 0 (the gathers through registers) needs a divisor of "
                            f"block_n {block_n} leaving at least 8 rows a step (a step's rows of the ring "
                            f"slot span whole 128-byte swizzle patterns), got {steps}")
        with pytest.raises(ValueError, match=message):
            sparse_mla_gluon.FP8Tiles(block_n, 2, staging=0, dequant_steps=steps, slot_loads="per_layout")
        with pytest.raises(ValueError, match=message):
            SparseMLAConfig(block_h=64, block_n=block_n, num_warps=8, num_stages=2, kernel="gluon",
                            staging=0, dequant_steps=steps, slot_loads="per_layout")
    # staged forms keep their old range of steps (the Triton configs' defaults at 16 slots)
    assert sparse_mla_gluon.FP8Tiles(16, 2).dequant_steps == 4
    assert sparse_mla_gluon.FP8Tiles(64, 2, staging=0, dequant_steps=8, slot_loads="per_layout").staging == 0
    with pytest.raises(ValueError, match=re.escape(
            "staging, gather_warps, gather_registers, dequant_steps, slot_loads, refill, in_slot: the Triton kernel "
            "has no gather partition")):
        SparseMLAConfig(block_h=64, block_n=64, num_warps=8, num_stages=2, staging=0,
                        dequant_steps=8, slot_loads="per_layout")
    with pytest.raises(ValueError, match=re.escape("kernel: the Gluon kernel's tiles")):
        SparseMLAConfig(block_h=64, block_n=64, num_warps=8, num_stages=2, kernel="gluon", staging=0,
                        dequant_steps=4, slot_loads="per_layout")


def test_fp8_tiles_reject_what_the_in_slot_gathers_do_not_implement():
    """The dequantizing in the ring slot is laid out for 64-slot blocks in the bf16 kernel's two
    ring slots, without staging stages, a 64-column chunk or a scale group a step: anything else
    is refused by name, in FP8Tiles and in SparseMLAConfig."""
    good = dict(block_n=64, stages=2, staging=0, dequant_steps=8, slot_loads="per_layout", in_slot=True)
    assert sparse_mla_gluon.FP8Tiles(**good).in_slot
    assert sparse_mla_gluon.FP8Tiles(**dict(good, dequant_steps=4)).dequant_steps == 4
    for field, value in (("staging", None), ("block_n", 32), ("stages", 1), ("dequant_steps", 2)):
        bad = dict(good, **{field: value})
        message = re.escape(f"in_slot: the dequantizing in the ring slot needs staging 0, block_n 64, stages 2 "
                            f"and dequant_steps 8 or 4 (a 64-column chunk or a scale group a step), got "
                            f"staging {bad['staging']}, block_n {bad['block_n']}, stages {bad['stages']}, "
                            f"dequant_steps {bad['dequant_steps']}")
        with pytest.raises(ValueError, match=message):
            sparse_mla_gluon.FP8Tiles(**bad)
        with pytest.raises(ValueError, match=message):
            SparseMLAConfig(block_h=64, block_n=bad["block_n"], num_warps=8, num_stages=bad["stages"],
                            kernel="gluon", staging=bad["staging"], dequant_steps=bad["dequant_steps"],
                            slot_loads="per_layout", in_slot=True)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("config", GLUON_FP8_TUNE)
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("num_heads", [16, 64, 128])
def test_gpu_gluon_tune_candidates_bitwise_equal_to_default(config, num_heads, split):
    """A gather-partition candidate changes how the blocks reach shared memory, not the dots or
    their order: its output equals the FP8 default of the same block size bit for bit (what the
    bench's tune checks per point), over poisoned unselected entries."""
    config = GLUON_FP8[config]
    default = (SPARSE_MLA_GLUON_FP8_CONFIG if config.block_n == SPARSE_MLA_GLUON_FP8_CONFIG.block_n
               else SPARSE_MLA_GLUON_FP8_NARROW_CONFIG)
    inputs = poison_unselected(_production(16, num_heads, seed=3))
    workspace = sparse_mla_workspace(16, num_heads, "cuda", num_splits=4) if split else None
    got = _run(inputs, workspace, config)
    assert torch.equal(got, _run(inputs, workspace, default))


@pytest.mark.parametrize("capability,refused", [((8, 0), True), ((8, 9), False), ((9, 0), False)])
def test_fp8_cache_needs_compute_capability_8_9(capability, refused, monkeypatch):
    """Before compute capability 8.9 there are no e4m3 conversions: a clear error, not a compile
    failure. Checked on the host from the device (a fake CUDA query tensor)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    inputs = fp8_inputs(1, 4, num_slots=8, k=4, valid_counts=[4], device="cpu")
    q = inputs["q"]
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: self is q))
    out = torch.zeros(1, 4, 512, dtype=torch.bfloat16)
    if refused:
        with pytest.raises(ValueError, match=r"kv_cache: an fp8_ds_mla cache needs a GPU of compute "
                                             r"capability 8.9 or newer"):
            sparse_mla_decode(**inputs, out=out)
    else:
        sparse_mla_decode(**inputs, out=out, config=SPARSE_MLA_CONFIG)
