"""Fused MoE (``dsaspec.ops.fused_moe``) against the fp64 loop of ``dsaspec.reference.fused_moe``.

* Closeness: fp32 within rtol = atol = 1e-5 (fp32 accumulation of O(1) terms); bf16 within
  rtol = atol = 2**-5 (the activation and the output are rounded to bf16 by both, and the
  interpreter's casts truncate, so the activations may be one ulp apart before the down
  projection).
* Exact contracts: the routing layout in the workspace (stable sort by expert, segments padded
  with -1), the combine (the in-order fp32 sum of the weighted partials), a poisoned workspace
  changing nothing, row invariance (a token's bits alone equal its bits in a batch) and graph
  replay. The bitwise checks at production shapes are GPU tests.
"""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch

from compile_scripts import integer_rows, run_in_scripts
from dsaspec.ops import device as device_facts, fp8_gemm, fused_moe as moe
from dsaspec.reference import fp8_gemm as fp8_ref
from dsaspec.reference.fused_moe import fused_moe as reference
from dsaspec.reference.fused_moe import fused_moe_fp8 as fp8_reference

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2**-5, atol=2**-5)}
DTYPES = [torch.float32, torch.bfloat16]


def _case(tokens, topk, experts, hidden_size, inter, *, dtype, device, seed=0, ids=None):
    """Inputs of one call: distinct random experts per token unless ``ids`` is given."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, hidden_size, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden_size, generator=gen) * hidden_size ** -0.5
    w2 = torch.randn(experts, hidden_size, inter, generator=gen) * inter ** -0.5
    if ids is None:
        ids = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)]
                          or [torch.zeros(0, topk)]).reshape(tokens, topk)
    weights = torch.rand(tokens, topk, generator=gen) + 0.1
    return (hidden.to(dtype).to(device), w13.to(dtype).to(device), w2.to(dtype).to(device),
            ids.to(torch.int32).to(device), weights.to(device))


def _run(hidden, w13, w2, ids, weights, workspace=None, **kwargs):
    out = torch.empty_like(hidden)
    return moe.fused_moe(hidden, w13, w2, ids, weights, out, workspace=workspace, **kwargs)


def _assert_close(got, want, dtype):
    torch.testing.assert_close(got.double(), want.double(), **TOL[dtype])


# (T, k, E, H, I): every T of the contract, k 1..8, E 4..64, H and I not multiples of 16
CASES = [(1, 1, 4, 16, 16), (1, 8, 64, 48, 40), (63, 2, 8, 33, 17), (64, 8, 16, 64, 32),
         (65, 3, 64, 40, 24), (127, 1, 4, 32, 48), (128, 4, 32, 16, 16), (129, 6, 8, 24, 8),
         (512, 2, 16, 32, 16)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,topk,experts,hidden_size,inter", CASES)
def test_matches_reference(tokens, topk, experts, hidden_size, inter, dtype, device):
    args = _case(tokens, topk, experts, hidden_size, inter, dtype=dtype, device=device)
    _assert_close(_run(*args), reference(*args), dtype)


def _routing(name, tokens, topk, experts):
    if name == "one-expert-for-all":  # every token's slot 0 is expert 2, the rest random
        gen = torch.Generator().manual_seed(1)
        ids = torch.stack([torch.cat([torch.tensor([2]), 3 + torch.randperm(experts - 3, generator=gen)[:topk - 1]])
                           for _ in range(tokens)])
    elif name == "all-pairs-one-expert":  # repeated ids within a row
        ids = torch.full((tokens, topk), experts - 1)
    elif name == "repeats":  # repeats within rows, and experts 0 and 1 hit by no token
        gen = torch.Generator().manual_seed(2)
        ids = torch.randint(2, 2 + min(4, experts - 2), (tokens, topk), generator=gen)
    return ids


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("routing", ["one-expert-for-all", "all-pairs-one-expert", "repeats"])
def test_routing_extremes_match_reference(routing, dtype, device):
    tokens, topk, experts = 40, 4, 32
    ids = _routing(routing, tokens, topk, experts)
    args = _case(tokens, topk, experts, 48, 24, dtype=dtype, device=device, ids=ids)
    _assert_close(_run(*args), reference(*args), dtype)


def test_repeated_ids_count_each_slot(device):
    """Slots ``(e, w1), (e, w2)`` give what one slot ``(e, w1 + w2)`` gives (to rounding)."""
    hidden, w13, w2, _, _ = _case(5, 2, 8, 32, 16, dtype=torch.float32, device=device)
    ids = torch.full((5, 2), 3, dtype=torch.int32, device=device)
    weights = torch.tensor([[0.25, 0.5]] * 5, device=device)
    merged = _run(hidden, w13, w2, ids[:, :1].contiguous(), weights.sum(1, keepdim=True))
    torch.testing.assert_close(_run(hidden, w13, w2, ids, weights), merged, rtol=1e-6, atol=1e-6)


def test_zero_tokens_writes_nothing(device):
    hidden, w13, w2, ids, weights = _case(0, 3, 8, 32, 16, dtype=torch.float32, device=device)
    out = torch.empty(0, 32, device=device)
    assert moe.fused_moe(hidden, w13, w2, ids, weights, out) is out
    workspace = moe.fused_moe_workspace(4, 3, 8, 32, 16, device, torch.float32)
    assert moe.fused_moe(hidden, w13, w2, ids, weights, out, workspace=workspace) is out


def test_out_may_be_hidden(device):
    args = _case(9, 3, 8, 32, 16, dtype=torch.float32, device=device)
    want = _run(*args)
    hidden = args[0].clone()
    assert moe.fused_moe(hidden, *args[1:], hidden) is hidden
    assert torch.equal(hidden, want)


def _expected_layout(ids, experts, block_m=moe.BLOCK_M):
    """sorted_pairs / block_experts of the contract: pairs stably sorted by expert, each
    expert's segment padded with -1 to whole blocks of ``block_m`` rows, unused blocks -1."""
    flat = ids.flatten().tolist()
    rows, blocks = [], []
    for e in range(experts):
        segment = [p for p, got in enumerate(flat) if got == e]
        padded = -(-len(segment) // block_m) * block_m
        rows += segment + [-1] * (padded - len(segment))
        blocks += [e] * (padded // block_m)
    total = moe.max_blocks(len(flat), experts, block_m)
    return rows + [-1] * (total * block_m - len(rows)), blocks + [-1] * (total - len(blocks))


@pytest.mark.parametrize("chunks", [None, (16, 16), (64, 8)], ids=["default", "chunks16", "chunks64-8"])
@pytest.mark.parametrize("routing", ["random", "repeats", "all-pairs-one-expert", "unplaced", "17-experts"])
def test_workspace_layout_is_a_stable_padded_sort(routing, chunks, device, monkeypatch):
    """The align launch's sorted rows and block experts against a plain sort, with its pair and
    block chunks at the defaults (one chunk each here) and small enough that every loop crosses
    chunks (185 pairs, 26 blocks); ids outside [0, E) (graph replay of unchecked ids) are dropped;
    the counter of its last program is left at 0 (a graph replay finds it as the capture did)."""
    if chunks is not None:
        for name, value in zip(("_ALIGN_PAIR_CHUNK", "_ALIGN_BLOCK_CHUNK"), chunks):
            monkeypatch.setattr(moe, name, value)
    tokens, topk, experts = 37, 5, 17 if routing == "17-experts" else 16
    gen = torch.Generator().manual_seed(3)
    if routing in ("random", "17-experts"):
        ids = torch.randint(0, experts, (tokens, topk), generator=gen)
    elif routing == "unplaced":
        ids = torch.randint(-2, experts + 2, (tokens, topk), generator=gen)
    else:
        ids = _routing(routing, tokens, topk, experts)
    args = _case(tokens, topk, experts, 16, 16, dtype=torch.float32, device=device, ids=ids)
    workspace = moe.fused_moe_workspace(tokens, topk, experts, 16, 16, device, torch.float32)
    _run(*args, workspace=workspace, check_values=False)
    rows, blocks = _expected_layout(ids, experts)
    assert workspace.sorted_pairs.tolist() == rows
    assert workspace.block_experts.tolist() == blocks
    assert not device_facts._counters[workspace.sorted_pairs.device].any()


def test_combine_is_the_in_order_fp32_sum(device):
    """fp32: ``out[t]`` is bitwise ``((p[t,0] + p[t,1]) + p[t,2]) + ...`` of the partials."""
    tokens, topk = 21, 6
    args = _case(tokens, topk, 16, 40, 16, dtype=torch.float32, device=device)
    args[4][:, ::2] *= 1e-3  # magnitudes far apart make the sum order visible in the bits
    workspace = moe.fused_moe_workspace(tokens, topk, 16, 40, 16, device, torch.float32)
    out = _run(*args, workspace=workspace)
    partial = workspace.partial[: tokens * topk].view(tokens, topk, 40)
    want = partial[:, 0].clone()
    for j in range(1, topk):
        want += partial[:, j]
    assert torch.equal(out, want)
    _assert_close(out, reference(*args), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_down_projection_keeps_fp32_weighted_partials(dtype, device):
    """The partial row of pair p is ``w[p] * w2[e] @ act[row of p]`` in fp32 (to fp32
    accumulation), from the op's own activations: not rounded to the hidden dtype (sorted layout)."""
    tokens, topk, experts, hidden_size, inter = 19, 3, 8, 40, 48
    args = _case(tokens, topk, experts, hidden_size, inter, dtype=dtype, device=device)
    workspace = moe.fused_moe_workspace(tokens, topk, experts, hidden_size, inter, device, dtype)
    _run(*args, workspace=workspace, sort_pairs=True)
    rows = workspace.sorted_pairs.tolist()
    pairs = torch.tensor([p for p in rows if p >= 0], device=device)
    act = workspace.act[torch.tensor([r for r, p in enumerate(rows) if p >= 0], device=device)]
    experts_of = args[3].flatten()[pairs].long()
    want = torch.einsum("phi,pi->ph", args[2][experts_of].double(), act.double())
    want *= args[4].flatten()[pairs].double()[:, None]
    torch.testing.assert_close(workspace.partial[pairs].double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_poisoned_workspace_changes_nothing(dtype, device):
    """Every workspace entry a call reads is written by it: a workspace for 129 tokens, filled
    with valid-looking pair ids and experts and NaN activations / partials, then reused with new
    routing, gives the bits of a zero-filled workspace at T = 65 and 129."""
    experts, topk, hidden_size, inter = 16, 3, 32, 24
    workspace = moe.fused_moe_workspace(129, topk, experts, hidden_size, inter, device, dtype)
    zeroed = moe.fused_moe_workspace(129, topk, experts, hidden_size, inter, device, dtype)
    for buffer in (zeroed.sorted_pairs, zeroed.block_experts, zeroed.act, zeroed.partial):
        buffer.zero_()
    gen = torch.Generator().manual_seed(4)
    for tokens, seed in ((65, 5), (129, 6), (65, 7)):
        workspace.sorted_pairs.copy_(torch.randint(0, 65 * topk, workspace.sorted_pairs.shape, generator=gen))
        workspace.block_experts.copy_(torch.randint(0, experts, workspace.block_experts.shape, generator=gen))
        workspace.act.fill_(math.nan)
        workspace.partial.fill_(math.nan)
        args = _case(tokens, topk, experts, hidden_size, inter, dtype=dtype, device=device, seed=seed)
        assert torch.equal(_run(*args, workspace=workspace), _run(*args, workspace=zeroed))


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_invariant_small(dtype, device):
    """A token's output bits alone (T = 1) and in a shuffled subset equal its bits in the batch."""
    tokens, topk, experts = 24, 4, 8
    hidden, w13, w2, ids, weights = _case(tokens, topk, experts, 48, 32, dtype=dtype, device=device)
    _assert_row_invariant(hidden, w13, w2, ids, weights, alone=(0, 7, 23))


def _assert_row_invariant(hidden, w13, w2, ids, weights, alone, **kwargs):
    full = _run(hidden, w13, w2, ids, weights, **kwargs)
    for t in alone:
        got = _run(hidden[t:t + 1], w13, w2, ids[t:t + 1], weights[t:t + 1], **kwargs)
        assert torch.equal(got[0], full[t]), f"token {t} alone differs from token {t} of {len(ids)}"
    perm = torch.randperm(len(ids), generator=torch.Generator().manual_seed(8))[: len(ids) // 2 + 1]
    perm = perm.to(hidden.device)
    got = _run(hidden[perm], w13, w2, ids[perm].contiguous(), weights[perm].contiguous(), **kwargs)
    assert torch.equal(got, full[perm]), "a shuffled subset of the tokens differs"


# split-K of gate/up: H = 400 is 13 fp32 K blocks (32 columns) and 4 bf16 ones (128), so splits
# 2, 3, 4 change the summation order (split 3 of 4 blocks leaves the last split empty)
SPLIT_H = 400


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_k", [1, 2, 3, 4])
@pytest.mark.parametrize("routing", [None, "all-pairs-one-expert", "repeats"])
def test_split_k_matches_reference(routing, split_k, dtype, device):
    """Odd T, random / one-expert / repeated ids (experts hit by one token in the random case)."""
    tokens, topk, experts = 7, 3, 16
    ids = None if routing is None else _routing(routing, tokens, topk, experts)
    args = _case(tokens, topk, experts, SPLIT_H, 24, dtype=dtype, device=device, ids=ids)
    _assert_close(_run(*args, split_k=split_k), reference(*args), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_k_row_invariant(dtype, device):
    """The batch of 17 (68 pairs) sorted, the tokens alone and the subset (9) in the pair layout."""
    hidden, w13, w2, ids, weights = _case(17, 4, 8, SPLIT_H, 32, dtype=dtype, device=device)
    _assert_row_invariant(hidden, w13, w2, ids, weights, alone=(0, 8, 16), split_k=3)


def test_split_k_partials_are_the_k_ranges(device):
    """Split s of gate/up holds the fp32 sums over its K blocks [s * ceil(13 / 3), ...) of 32
    columns (5, 5, 3 blocks), gate in columns [0, I), up in [I, 2I); act is silu(gate) * up of
    their sums (sorted layout)."""
    tokens, topk, experts, inter = 6, 2, 8, 24
    hidden, w13, w2, ids, weights = args = _case(tokens, topk, experts, SPLIT_H, inter, dtype=torch.float32,
                                                 device=device)
    workspace = moe.fused_moe_workspace(tokens, topk, experts, SPLIT_H, inter, device, torch.float32, split_k=3)
    _run(*args, workspace=workspace, split_k=3, sort_pairs=True)
    rows = torch.tensor([r for r, p in enumerate(workspace.sorted_pairs.tolist()) if p >= 0], device=device)
    pairs = workspace.sorted_pairs[rows].long()
    w = w13[ids.flatten()[pairs].long()].double()  # [rows, 2I, H]
    x = hidden[pairs // topk].double()
    for s, (start, end) in enumerate([(0, 160), (160, 320), (320, SPLIT_H)]):
        want = torch.einsum("rnh,rh->rn", w[..., start:end], x[:, start:end])
        torch.testing.assert_close(workspace.gate_up[s, rows].double(), want, rtol=1e-5, atol=1e-6)
    gate, up = workspace.gate_up[:, rows].double().sum(0).split(inter, dim=1)
    torch.testing.assert_close(workspace.act[rows].double(), gate * torch.sigmoid(gate) * up, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("split_k", [2, 9])
def test_split_k_poisoned_workspace_changes_nothing(split_k, device):
    """NaN partials of every split (a workspace for 9 splits, reused at T = 23, 4, 23: sorted, pair
    layout, sorted) change nothing, and each call leaves the reduction counters at 0; split 9 of 13
    K blocks (span 2) leaves 2 splits without a block, which add zeros."""
    experts, topk, inter = 8, 3, 16
    workspace = moe.fused_moe_workspace(23, topk, experts, SPLIT_H, inter, device, torch.float32, split_k=9)
    for tokens, seed in ((23, 1), (4, 2), (23, 3)):
        workspace.gate_up.fill_(math.nan)
        workspace.act.fill_(math.nan)
        args = _case(tokens, topk, experts, SPLIT_H, inter, dtype=torch.float32, device=device, seed=seed)
        fresh = moe.fused_moe_workspace(tokens, topk, experts, SPLIT_H, inter, device, torch.float32,
                                        split_k=split_k)
        fresh.gate_up.zero_()
        got = _run(*args, workspace=workspace, split_k=split_k)
        assert not device_facts.tile_counters(torch.device(device), 1).any(), "a call left a reduction counter set"
        assert torch.equal(got, _run(*args, workspace=fresh, split_k=split_k))
        _assert_close(got, reference(*args), torch.float32)


def test_split_k_is_checked(device):
    args = _case(4, 2, 8, 32, 16, dtype=torch.float32, device=device)
    with pytest.raises(ValueError, match="^split_k: expected >= 1, got 0"):
        _run(*args, split_k=0)
    with pytest.raises(TypeError, match="^split_k: expected an int"):
        _run(*args, split_k=2.0)
    workspace = moe.fused_moe_workspace(4, 2, 8, 32, 16, device, torch.float32, split_k=2)
    with pytest.raises(ValueError, match="^workspace: allocated for split_k <= 2, this call has split_k 4"):
        _run(*args, workspace=workspace, split_k=4)
    plain = moe.fused_moe_workspace(4, 2, 8, 32, 16, device, torch.float32)
    assert plain.gate_up is None
    with pytest.raises(ValueError, match="^workspace: allocated for split_k <= 1"):
        _run(*args, workspace=plain, split_k=2)


def test_align_compiles_for_sm90_without_spills():
    """Without a GPU: the align kernel (the running counts, the last program's gather and scan) compiles
    for sm_90 at 9 and at a rank's 257 experts without register spills, within a block's shared
    memory (scripts/compile_fused_moe.py, in a subprocess)."""
    out = run_in_scripts("compile_fused_moe",
                         "for experts in c.ALIGN_EXPERTS:\n"
                         "    r = c.compile_align(experts)\n"
                         "    print(r['regs'], r['spill'], r['shared'], c.dsa.SM90_SHARED)")
    results = integer_rows(out)
    assert len(results) == 2, out
    for regs, spilled, shared, limit in results:
        assert 0 < regs <= 255 and spilled == 0 and shared <= limit, out


def test_split_k_kernels_compile_for_sm90_without_spills():
    """Without a GPU: gate/up at split 1, 2, 4 (with a split also the last program's reduction) and
    down, bf16 and FP8 experts, in the sorted and the pair layout, at the TP 8 rank's shapes (k 8 + the
    shared slot, H 7168, I 256, H200 tiles), compile for sm_90 with no register spills and within a block's shared memory, the
    down kernel without fp32 FMAs (scripts/compile_fused_moe.py, in a subprocess)."""
    out = run_in_scripts("compile_fused_moe",
                         "for fp8 in (False, True):\n"
                         "    for sort in (True, False):\n"
                         "        for kernel, split in [('gate_up', s) for s in c.SPLITS] + [('down', 1)]:\n"
                         "            r = c.compile_moe(kernel, fp8, split, sort)\n"
                         "            print(r['regs'], r['spill'], r['shared'], c.dsa.SM90_SHARED,"
                         " r['ptx'].count('fma.rn.f32') if kernel == 'down' else 0)")
    results = integer_rows(out)
    assert len(results) == 2 * 2 * (len((1, 2, 4)) + 1), out
    for regs, spilled, shared, limit, fmas in results:
        assert 0 < regs <= 255 and spilled == 0 and shared <= limit and fmas == 0, out


def test_unchecked_out_of_range_ids_contribute_nothing(device):
    args = list(_case(10, 3, 8, 32, 16, dtype=torch.float32, device=device))
    ids, weights = args[3], args[4]
    bad = ids.clone()
    bad[2, 1], bad[5, 0], bad[9, 2] = 8, -1, 1 << 30
    zeroed = weights.clone()
    zeroed[2, 1] = zeroed[5, 0] = zeroed[9, 2] = 0.0
    for name, value in (("max", 8), ("min", -1)):
        probe = ids.clone()
        probe[0, 0] = value
        with pytest.raises(ValueError, match=r"topk_ids: expected ids in \[0, 8\)"):
            _run(args[0], args[1], args[2], probe, weights)
    want = _run(args[0], args[1], args[2], ids, zeroed)
    torch.testing.assert_close(_run(args[0], args[1], args[2], bad, weights, check_values=False), want,
                               rtol=1e-6, atol=1e-6)


def _workspace(tokens, topk):
    return lambda g: moe.fused_moe_workspace(tokens, topk, 8, 32, 16, g["hidden"].device, torch.float32)


# (argument, its replacement from the good arguments, the error's start)
BAD = [
    ("hidden", lambda g: g["hidden"].half(), "hidden: expected dtype"),
    ("hidden", lambda g: g["hidden"].tolist(), "hidden: expected a torch.Tensor"),
    ("hidden", lambda g: g["hidden"][0], "hidden: expected 2 dimensions"),
    ("w13", lambda g: g["w13"].double(), "w13: expected dtype"),
    ("w13", lambda g: g["w13"][:, :31], r"w13: expected shape \(E >= 1, 2 \* I >= 2, 32\)"),
    ("w13", lambda g: g["w13"][..., :16], r"w13: expected shape"),
    ("w13", lambda g: g["w13"].transpose(1, 2).contiguous().transpose(1, 2), "w13: the last dimension"),
    ("w2", lambda g: g["w2"][:, :, :8], r"w2: expected shape \(8, 32, 16\)"),
    ("w2", lambda g: g["w2"][:4], r"w2: expected shape \(8, 32, 16\)"),
    ("topk_ids", lambda g: g["topk_ids"].long(), "topk_ids: expected dtype torch.int32"),
    ("topk_ids", lambda g: g["topk_ids"][:3], r"topk_ids: expected shape \(4, '\*'\)"),
    ("topk_ids", lambda g: g["topk_ids"].repeat(1, 2)[:, :2], "topk_ids: expected a contiguous"),
    ("topk_weights", lambda g: g["topk_weights"].bfloat16(), "topk_weights: expected dtype torch.float32"),
    ("topk_weights", lambda g: g["topk_weights"][:, :1], r"topk_weights: expected shape \(4, 2\)"),
    ("topk_weights", lambda g: g["topk_weights"].repeat(1, 2)[:, :2], "topk_weights: expected a contiguous"),
    ("out", lambda g: g["out"].bfloat16(), "out: expected dtype torch.float32"),
    ("out", lambda g: g["out"][:, :16], r"out: expected shape \(4, 32\)"),
    ("workspace", lambda g: torch.empty(4), "workspace: expected a FusedMoEWorkspace"),
    ("workspace", _workspace(3, 2), "workspace: sized for <= 3 tokens"),
    ("workspace", _workspace(4, 3), r"workspace: sized for <= 4 tokens, \(k, E, H, I, dtype\) = \(3,"),
]


@pytest.mark.parametrize("name,change,message", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_arguments_are_named(name, change, message, device):
    h, w13, w2, ids, weights = _case(4, 2, 8, 32, 16, dtype=torch.float32, device=device)
    good = dict(hidden=h, w13=w13, w2=w2, topk_ids=ids, topk_weights=weights, out=torch.empty_like(h),
                workspace=None)
    args = {**good, name: change(good)}
    with pytest.raises((ValueError, TypeError), match=f"^{message}"):
        moe.fused_moe(args.pop("hidden"), args.pop("w13"), args.pop("w2"), args.pop("topk_ids"),
                      args.pop("topk_weights"), args.pop("out"), **args)


def test_zero_experts_per_token_is_refused(device):
    h, w13, w2, ids, weights = _case(4, 2, 8, 32, 16, dtype=torch.float32, device=device)
    with pytest.raises(ValueError, match="^topk_ids: expected k >= 1"):
        moe.fused_moe(h, w13, w2, ids[:, :0], weights[:, :0], torch.empty_like(h))


@pytest.mark.parametrize("name,value,error", [
    ("max_tokens", 0, ValueError), ("topk", True, TypeError), ("num_experts", 2.0, TypeError),
    ("hidden_size", -1, ValueError), ("intermediate_size", None, TypeError), ("split_k", 0, ValueError)])
def test_workspace_counts_are_checked(name, value, error, device):
    kwargs = dict(max_tokens=4, topk=2, num_experts=8, hidden_size=32, intermediate_size=16, split_k=1)
    kwargs[name] = value
    with pytest.raises(error, match=f"^{name}: expected"):
        moe.fused_moe_workspace(**kwargs, device=device, dtype=torch.float32)


def test_workspace_dtype_is_checked(device):
    with pytest.raises(ValueError, match="dtype: expected torch.bfloat16 or torch.float32"):
        moe.fused_moe_workspace(4, 2, 8, 32, 16, device, torch.float16)


@pytest.mark.parametrize("block_m", moe.BLOCK_MS)
@pytest.mark.parametrize("pairs,experts", [(1, 4), (8, 256), (512, 256), (4096, 64), (4096, 256), (3, 2),
                                           (36864, 257)])
def test_max_blocks_bounds_every_routing(pairs, experts, block_m):
    """The static block count is reached by the worst routing (min(E, P) experts one pair over
    a whole number of blocks) and never exceeded, at every block height."""
    used = min(experts, pairs)
    counts = [1] * used
    counts[0] += pairs - used
    worst = sum(-(-c // block_m) for c in counts)
    assert worst <= moe.max_blocks(pairs, experts, block_m)
    spread = [pairs // used + (i < pairs % used) for i in range(used)]
    assert max(worst, sum(-(-c // block_m) for c in spread)) <= moe.max_blocks(pairs, experts, block_m)


# -------------------------------------------------------------------------------------------------
# GPU: production shapes, bitwise properties


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_gpu_bf16_production_shape_matches_reference(tokens):
    args = _case(tokens, 8, 256, 7168, 256, dtype=torch.bfloat16, device="cuda")
    _assert_close(_run(*args), reference(*args), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_row_invariant_at_one_and_sixty_four_tokens(dtype):
    hidden, w13, w2, ids, weights = _case(64, 8, 64, 2048, 512, dtype=dtype, device="cuda")
    _assert_row_invariant(hidden, w13, w2, ids, weights, alone=range(64))


@pytest.mark.gpu
def test_gpu_row_invariant_across_token_counts():
    """Token 0's bits are the same inside batches of 1..512 (k = 8, E = 256)."""
    hidden, w13, w2, ids, weights = _case(512, 8, 256, 1024, 256, dtype=torch.bfloat16, device="cuda")
    full = _run(hidden, w13, w2, ids, weights)
    for tokens in (1, 2, 3, 16, 63, 64, 65, 128, 129, 257, 511):
        got = _run(hidden[:tokens], w13, w2, ids[:tokens], weights[:tokens])
        assert torch.equal(got, full[:tokens]), f"T={tokens} differs from T=512"


@pytest.mark.gpu
def test_gpu_graph_replay_with_new_routing():
    tokens, topk, experts, hidden_size, inter = 64, 8, 64, 1024, 256
    hidden, w13, w2, ids, weights = _case(tokens, topk, experts, hidden_size, inter,
                                          dtype=torch.bfloat16, device="cuda")
    workspace = moe.fused_moe_workspace(tokens, topk, experts, hidden_size, inter, "cuda", torch.bfloat16)
    out = torch.empty_like(hidden)
    moe.fused_moe(hidden, w13, w2, ids, weights, out, workspace=workspace)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe.fused_moe(hidden, w13, w2, ids, weights, out, workspace=workspace, check_values=False)
    for seed in (11, 12, 13):
        new = _case(tokens, topk, experts, hidden_size, inter, dtype=torch.bfloat16, device="cuda", seed=seed)
        if seed == 13:  # every pair on one expert: a segment of 512 rows
            new = new[:3] + (torch.full_like(ids, 5), new[4])
        for static, value in zip((hidden, ids, weights), (new[0], new[3], new[4])):
            static.copy_(value)
        graph.replay()
        eager = _run(hidden, w13, w2, ids, weights)
        assert torch.equal(out, eager), f"seed {seed}: replay differs from eager"
        _assert_close(out, reference(hidden, w13, w2, ids, weights), torch.bfloat16)


@pytest.mark.gpu
def test_gpu_deterministic():
    args = _case(512, 8, 256, 2048, 256, dtype=torch.bfloat16, device="cuda")
    first = _run(*args)
    for _ in range(3):
        assert torch.equal(_run(*args), first)


# -------------------------------------------------------------------------------------------------
# FP8 block-scaled experts (e4m3 weights, fp32 scale per 128 x 128 block) against
# reference.fused_moe_fp8. Each stage is checked tightly: the quantized hidden rows and
# activations are act_quant's bitwise, gate/up and down are within fp32 accumulation (rtol 1e-5)
# of fp64 from the op's own codes. End to end, an activation the op computes one fp32 ulp away
# from the fp64 reference can land on the neighbouring e4m3 code (or its block's scale can move by
# an ulp): one code step of one of I activations, up to 2**-4 of its block's amax, so fp32 is
# checked within rtol = atol = 1e-3 there (a wrong scale or block index is off by O(1)). bf16:
# the activation is rounded to bf16 first (truncated under the interpreter), one bf16 ulp off the
# reference's for many elements, so a few percent of the codes move (2% normwise error seen at
# T = 1): bf16 is checked normwise, ||out - ref|| <= 2**-4 ||ref||; the fp32 cases pin the math.


def _assert_fp8_close(got, want, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-3, atol=1e-3)
    else:
        error = float((got.double() - want.double()).norm() / want.double().norm())
        assert error <= 2**-4, f"normwise relative error {error:.3g} > 2**-4"


def _fp8_case(tokens, topk=3, experts=8, hidden_size=256, inter=256, *, dtype, device, seed=0, ids=None):
    """``_case`` with each expert's projections quantized per 128 x 128 block (reference quantizer)."""
    hidden, w13, w2, ids, weights = _case(tokens, topk, experts, hidden_size, inter, dtype=torch.float32,
                                          device="cpu", seed=seed, ids=ids)

    def quantize(w):
        codes, scales = zip(*(fp8_ref.quantize_weight(w[e]) for e in range(len(w))))
        return torch.stack(codes).to(device), torch.stack(scales).to(device)

    (w13, s13), (w2, s2) = quantize(w13), quantize(w2)
    return (hidden.to(dtype).to(device), w13, s13, w2, s2, ids.to(device), weights.to(device))


def _run_fp8(hidden, w13, s13, w2, s2, ids, weights, workspace=None, **kwargs):
    out = torch.empty_like(hidden)
    return moe.fused_moe(hidden, w13, w2, ids, weights, out, w13_scale=s13, w2_scale=s2,
                         workspace=workspace, **kwargs)


fp8_warnings = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # NaN padding rows


@fp8_warnings
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 3, 17, 64, 65])
def test_fp8_matches_reference(tokens, dtype, device):
    args = _fp8_case(tokens, dtype=dtype, device=device, seed=tokens)
    _assert_fp8_close(_run_fp8(*args), fp8_reference(*args), dtype)


@fp8_warnings
@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_fp8_each_k_block_takes_its_own_scales(tokens, split_k, device):
    """Hidden rows, gate/up rows and down columns whose 128-wide blocks differ in magnitude by powers
    of two, so every K block of gate/up (H 512: 4) and of down (I 384: 3) has scales of its own and a
    scale taken from the wrong block is off by 2x or more (the kernels load a program's scales before
    the K loop and pick one a step). Pair layout at T 1 and 3, sorted at 40 (120 pairs)."""
    hidden, w13, w2, ids, weights = _case(tokens, 3, 8, 512, 384, dtype=torch.float32, device="cpu", seed=11)
    blocks = lambda base, n: (base ** torch.arange(n, dtype=torch.float32)).repeat_interleave(128)  # noqa: E731
    hidden = hidden * blocks(4.0, 4)
    w13 = w13 * blocks(2.0, 4) * blocks(2.0, 3).repeat(2)[:, None]   # K blocks; each I block's gate / up rows
    w2 = w2 * blocks(0.5, 3)

    def quantize(w):
        codes, scales = zip(*(fp8_ref.quantize_weight(w[e]) for e in range(len(w))))
        return torch.stack(codes).to(device), torch.stack(scales).to(device)

    (q13, s13), (q2, s2) = quantize(w13), quantize(w2)
    assert len(set(s13[0, 0].tolist())) == 4 and len(set(s2[0, 0].tolist())) == 3   # a scale per K block
    args = (hidden.to(device), q13, s13, q2, s2, ids.to(device), weights.to(device))
    _assert_fp8_close(_run_fp8(*args, split_k=split_k), fp8_reference(*args), torch.float32)


@fp8_warnings
@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
@pytest.mark.parametrize("routing", ["one-expert-for-all", "all-pairs-one-expert", "repeats"])
def test_fp8_routing_extremes_match_reference(routing, scale_fmt, device):
    """Experts hit by no token, repeated ids in a row, every pair on one expert; both scale formats."""
    tokens, topk, experts = 19, 4, 16
    args = _fp8_case(tokens, topk, experts, 128, 256, dtype=torch.float32, device=device,
                     ids=_routing(routing, tokens, topk, experts))
    _assert_fp8_close(_run_fp8(*args, scale_fmt=scale_fmt), fp8_reference(*args, scale_fmt=scale_fmt),
                      torch.float32)


@fp8_warnings
@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_fp8_quantized_activations_are_act_quant_bitwise(scale_fmt, split_k, device):
    """The workspace's e4m3 hidden rows and activations, codes and scales, are act_quant's
    (reference) of the hidden rows and of the op's own activation rows, bit for bit, whether
    act_quant runs (one split) or the split reduction quantizes (two); the activations are
    silu(gate) * up of those hidden codes and the dequantized w13, the down partials the
    activation codes times the dequantized w2 (fp32 accumulation; sorted layout)."""
    tokens, topk, experts = 13, 3, 8
    hidden, w13, s13, w2, s2, ids, weights = args = _fp8_case(tokens, topk, experts, dtype=torch.float32,
                                                              device=device)
    workspace = moe.fused_moe_workspace(tokens, topk, experts, 256, 256, device, torch.float32, fp8=True,
                                        split_k=split_k)
    _run_fp8(*args, workspace=workspace, scale_fmt=scale_fmt, split_k=split_k, sort_pairs=True)
    codes, scales = fp8_ref.act_quant(hidden, scale_fmt)
    assert torch.equal(workspace.hidden_q[:tokens].view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(workspace.hidden_scale[:tokens].view(torch.int32), scales.view(torch.int32))
    rows = torch.tensor([r for r, p in enumerate(workspace.sorted_pairs.tolist()) if p >= 0], device=device)
    codes, scales = fp8_ref.act_quant(workspace.act[rows], scale_fmt)
    assert torch.equal(workspace.act_q[rows].view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(workspace.act_scale[rows].view(torch.int32), scales.view(torch.int32))
    pairs = workspace.sorted_pairs[rows].long()
    experts_of = ids.flatten()[pairs].long()
    x = fp8_ref.dequantize(*fp8_ref.act_quant(hidden, scale_fmt), 1)[pairs // topk]
    gate_up = torch.stack([fp8_ref.dequantize(w13[e], s13[e], 128) @ x_p for e, x_p in zip(experts_of.tolist(), x)])
    gate, up = gate_up.split(256, dim=1)
    torch.testing.assert_close(workspace.act[rows].double(), gate * torch.sigmoid(gate) * up, rtol=1e-5, atol=1e-6)
    act = fp8_ref.dequantize(codes, scales, 1)
    down = torch.stack([fp8_ref.dequantize(w2[e], s2[e], 128) @ a for e, a in zip(experts_of.tolist(), act)])
    want = down * weights.flatten()[pairs].double()[:, None]
    torch.testing.assert_close(workspace.partial[pairs].double(), want, rtol=1e-5, atol=1e-6)


@fp8_warnings
@pytest.mark.parametrize("sort_pairs", [False, True])
def test_fp8_split_reduction_groups_of_several_tiles(sort_pairs, device):
    """Two splits of 16-wide gate/up tiles (the narrowest, as on a GPU of many SMs): each 128-column
    group's reduction waits for its 2 x 8 programs, then gives the activation codes, scales and
    output of the one-tile groups (the widest tiles) bit for bit, and leaves the counters at 0."""
    tokens, topk, experts = 5, 3, 8
    args = _fp8_case(tokens, topk, experts, dtype=torch.bfloat16, device=device, seed=6)
    results = []
    for sms in (1, 4096):
        workspace = moe.fused_moe_workspace(tokens, topk, experts, 256, 256, device, torch.bfloat16, fp8=True,
                                            split_k=2)
        with mock.patch.object(moe, "sm_count", lambda device, without_cuda=1, sms=sms: sms):
            assert moe._tile(256, 256, topk, torch.bfloat16, device, weight_tiles=2, fp8=True,
                             split_k=2).block_n == (128 if sms == 1 else 16)
            out = _run_fp8(*args, workspace=workspace, scale_fmt="ue8m0", split_k=2, sort_pairs=sort_pairs)
        assert not device_facts.tile_counters(torch.device(device), 1).any()
        rows = ([r for r, p in enumerate(workspace.sorted_pairs.tolist()) if p >= 0] if sort_pairs
                else list(range(tokens * topk)))
        results.append([out, workspace.act_q[rows].view(torch.uint8), workspace.act_scale[rows]])
    wide, narrow = results
    assert all(torch.equal(a, b) for a, b in zip(wide, narrow))


@fp8_warnings
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_row_invariant_small(dtype, device):
    """FP8: a token's output bits alone and in a shuffled subset equal its bits in the batch."""
    hidden, w13, s13, w2, s2, ids, weights = _fp8_case(24, 4, 8, dtype=dtype, device=device)
    full = _run_fp8(hidden, w13, s13, w2, s2, ids, weights)
    for t in (0, 7, 23):
        got = _run_fp8(hidden[t:t + 1], w13, s13, w2, s2, ids[t:t + 1], weights[t:t + 1])
        assert torch.equal(got[0], full[t]), f"token {t} alone differs from token {t} of 24"
    perm = torch.randperm(24, generator=torch.Generator().manual_seed(8))[:13].to(device)
    got = _run_fp8(hidden[perm], w13, s13, w2, s2, ids[perm].contiguous(), weights[perm].contiguous())
    assert torch.equal(got, full[perm]), "a shuffled subset of the tokens differs"


@fp8_warnings
@pytest.mark.parametrize("split_k", [1, 2])
def test_fp8_poisoned_workspace_changes_nothing(split_k, device):
    """NaN activations, codes and scales left in the workspace (with two splits the padding rows'
    codes are never written) change no output bit."""
    experts, topk = 8, 3
    sizes = (40, topk, experts, 256, 256, device, torch.float32)
    workspace = moe.fused_moe_workspace(*sizes, fp8=True, split_k=split_k)
    zeroed = moe.fused_moe_workspace(*sizes, fp8=True, split_k=split_k)
    for buffer in (zeroed.sorted_pairs, zeroed.block_experts, zeroed.act, zeroed.partial, zeroed.hidden_q,
                   zeroed.hidden_scale, zeroed.act_q, zeroed.act_scale):
        buffer.zero_()
    for tokens, seed in ((40, 5), (17, 6)):
        for buffer in (workspace.act, workspace.partial, workspace.hidden_scale, workspace.act_scale):
            buffer.fill_(math.nan)
        workspace.act_q.view(torch.uint8).fill_(0x7F)                                       # NaN codes
        args = _fp8_case(tokens, topk, experts, dtype=torch.float32, device=device, seed=seed)
        assert torch.equal(_run_fp8(*args, workspace=workspace, split_k=split_k),
                           _run_fp8(*args, workspace=zeroed, split_k=split_k))


@fp8_warnings
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_k", [2, 3])
def test_fp8_split_k_matches_reference_and_is_row_invariant(split_k, dtype, device):
    """H = 512: 4 FP8 K blocks; split 3 spans 2, 2 and none."""
    hidden, w13, s13, w2, s2, ids, weights = args = _fp8_case(9, 3, 8, 512, 128, dtype=dtype, device=device,
                                                              ids=_routing("repeats", 9, 3, 8))
    full = _run_fp8(*args, split_k=split_k)
    _assert_fp8_close(full, fp8_reference(*args), dtype)
    for t in (0, 8):
        got = _run_fp8(hidden[t:t + 1], w13, s13, w2, s2, ids[t:t + 1], weights[t:t + 1], split_k=split_k)
        assert torch.equal(got[0], full[t]), f"token {t} alone differs from token {t} of 9"


@fp8_warnings
@pytest.mark.parametrize("sort_pairs", [False, True])
@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_fp8_hidden_codes_are_read_instead_of_quantizing(scale_fmt, sort_pairs, device):
    """Codes written ahead (the post-attention norm's): act_quant's of the rows give the same bits as
    quantizing inside, at one and at several splits; another rows' codes give those rows' output
    (the codes are what gate/up reads, not a recomputation from ``hidden``)."""
    hidden, w13, s13, w2, s2, ids, weights = _fp8_case(5, 3, 8, dtype=torch.bfloat16, device=device, seed=4)
    other = _fp8_case(5, 3, 8, dtype=torch.bfloat16, device=device, seed=5)[0]
    for split_k in (1, 2):
        kwargs = dict(scale_fmt=scale_fmt, split_k=split_k, sort_pairs=sort_pairs)
        inside = _run_fp8(hidden, w13, s13, w2, s2, ids, weights, **kwargs)
        ahead = _run_fp8(hidden, w13, s13, w2, s2, ids, weights, hidden_codes=fp8_ref.act_quant(hidden, scale_fmt),
                         **kwargs)
        assert torch.equal(ahead, inside)
        swapped = _run_fp8(hidden, w13, s13, w2, s2, ids, weights, hidden_codes=fp8_ref.act_quant(other, scale_fmt),
                           **kwargs)
        assert torch.equal(swapped, _run_fp8(other, w13, s13, w2, s2, ids, weights, **kwargs))
        assert not torch.equal(swapped, inside)


FP8_BAD = [
    ("w13_scale", lambda g: None, "w13_scale: FP8 \\(e4m3\\) experts need their fp32 block scales, got None"),
    ("w2_scale", lambda g: None, "w2_scale: FP8 \\(e4m3\\) experts need"),
    ("w13_scale", lambda g: g["w13_scale"][:, :1], r"w13_scale: expected shape \(8, 4, 2\)"),
    ("w2_scale", lambda g: g["w2_scale"].double(), "w2_scale: expected dtype torch.float32"),
    ("w13_scale", lambda g: g["w13_scale"].transpose(0, 1).contiguous().transpose(0, 1),
     "w13_scale: expected a contiguous tensor"),
    ("w2", lambda g: g["w2"].float(), "w2: expected dtype torch.float8_e4m3fn"),
    ("scale_fmt", lambda g: "e8m0", "scale_fmt: expected one of"),
    ("workspace", lambda g: moe.fused_moe_workspace(4, 2, 8, 256, 256, "cpu", torch.float32),
     "workspace: allocated with fp8=False, but the experts are torch.float8_e4m3fn"),
    ("hidden_codes", lambda g: (torch.zeros(4, 128, dtype=moe.FP8), torch.ones(4, 2)),
     r"hidden_codes\[0\]: expected shape \(4, 256\)"),
    ("hidden_codes", lambda g: (torch.zeros(4, 256, dtype=moe.FP8), torch.ones(4, 2, dtype=torch.float64)),
     r"hidden_codes\[1\]: expected dtype torch.float32"),
    ("hidden_codes", lambda g: (torch.zeros(4, 256, dtype=moe.FP8), torch.ones(4, 4)),
     r"hidden_codes\[1\]: expected shape \(4, 2\)"),
]


@pytest.mark.parametrize("name,change,message", FP8_BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(FP8_BAD)])
def test_fp8_bad_arguments_are_named(name, change, message):
    h, w13, s13, w2, s2, ids, weights = _fp8_case(4, 2, 8, dtype=torch.float32, device="cpu")
    good = dict(w13=w13, w2=w2, w13_scale=s13, w2_scale=s2, scale_fmt=None, workspace=None)
    args = {**good, name: change(good)}
    with pytest.raises(ValueError, match=f"^{message}"):
        moe.fused_moe(h, args.pop("w13"), args.pop("w2"), ids, weights, torch.empty_like(h), **args)


def test_fp8_shapes_off_the_blocks_and_scales_of_bf16_experts_are_refused():
    h, w13, w2, ids, weights = _case(4, 2, 8, 128, 64, dtype=torch.float32, device="cpu")
    codes = w13.to(moe.FP8), w2.to(moe.FP8)
    scales = torch.ones(8, 1, 1), torch.ones(8, 1, 1)
    with pytest.raises(ValueError, match="^intermediate_size: FP8 experts need a multiple of 128"):
        moe.fused_moe(h, *codes, ids, weights, torch.empty_like(h), w13_scale=scales[0], w2_scale=scales[1])
    with pytest.raises(ValueError, match="^w13_scale: block scales go with e4m3 experts; w13 is torch.float32"):
        moe.fused_moe(h, w13, w2, ids, weights, torch.empty_like(h), w13_scale=scales[0])
    with pytest.raises(ValueError, match="^hidden_codes: quantized rows go with e4m3 experts; w13 is torch.float32"):
        moe.fused_moe(h, w13, w2, ids, weights, torch.empty_like(h), hidden_codes=fp8_ref.act_quant(h))
    fp8_args = _fp8_case(4, 2, 8, dtype=torch.float32, device="cpu")
    with pytest.raises(TypeError, match="^hidden_codes: expected a \\(codes, scales\\) tuple, got list"):
        _run_fp8(*fp8_args, hidden_codes=list(fp8_ref.act_quant(fp8_args[0])))
    with pytest.raises(ValueError, match="^hidden_size: FP8 experts need a multiple of 128"):
        moe.fused_moe_workspace(4, 2, 8, 96, 128, "cpu", torch.float32, fp8=True)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_gpu_fp8_production_shape_matches_reference(tokens):
    """GLM-5 / DeepSeek-V3.2 at TP 8 per rank: E = 256, k = 8, H = 7168, I = 256."""
    args = _fp8_case(tokens, 8, 256, 7168, 256, dtype=torch.bfloat16, device="cuda")
    _assert_fp8_close(_run_fp8(*args), fp8_reference(*args), torch.bfloat16)


@pytest.mark.gpu
def test_gpu_fp8_row_invariant_across_token_counts():
    hidden, w13, s13, w2, s2, ids, weights = _fp8_case(512, 8, 64, 1024, 256, dtype=torch.bfloat16, device="cuda")
    full = _run_fp8(hidden, w13, s13, w2, s2, ids, weights)
    for tokens in (1, 3, 17, 64, 65, 129, 511):
        got = _run_fp8(hidden[:tokens], w13, s13, w2, s2, ids[:tokens], weights[:tokens])
        assert torch.equal(got, full[:tokens]), f"T={tokens} differs from T=512"


@pytest.mark.gpu
def test_gpu_fp8_graph_replay_with_new_routing():
    tokens, topk, experts = 64, 8, 64
    hidden, w13, s13, w2, s2, ids, weights = _fp8_case(tokens, topk, experts, 1024, 256, dtype=torch.bfloat16,
                                                       device="cuda")
    workspace = moe.fused_moe_workspace(tokens, topk, experts, 1024, 256, "cuda", torch.bfloat16, fp8=True)
    out = torch.empty_like(hidden)
    kwargs = dict(w13_scale=s13, w2_scale=s2, workspace=workspace)
    moe.fused_moe(hidden, w13, w2, ids, weights, out, **kwargs)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe.fused_moe(hidden, w13, w2, ids, weights, out, check_values=False, **kwargs)
    for seed in (11, 12):
        new = _fp8_case(tokens, topk, experts, 1024, 256, dtype=torch.bfloat16, device="cuda", seed=seed)
        for static, value in zip((hidden, ids, weights), (new[0], new[5], new[6])):
            static.copy_(value)
        graph.replay()
        assert torch.equal(out, _run_fp8(hidden, w13, s13, w2, s2, ids, weights)), f"seed {seed}: replay differs"


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("split_k", [2, 4, 7])
def test_gpu_split_k_production_shape(split_k, fp8):
    """E = 256, k = 8, H = 7168, I = 256 (a TP 8 rank's experts): split-K gate/up matches the
    reference at T = 1, 8 and token 0's bits are the same at T = 1..64; graph replay equals eager."""
    dtype = torch.bfloat16
    if fp8:
        hidden, w13, s13, w2, s2, ids, weights = _fp8_case(64, 8, 256, 7168, 256, dtype=dtype, device="cuda")
        scales = dict(w13_scale=s13, w2_scale=s2)
    else:
        hidden, w13, w2, ids, weights = _case(64, 8, 256, 7168, 256, dtype=dtype, device="cuda")
        s13 = s2 = None
        scales = {}

    def run(tokens, **kwargs):
        out = torch.empty_like(hidden[:tokens])
        return moe.fused_moe(hidden[:tokens], w13, w2, ids[:tokens], weights[:tokens], out, split_k=split_k,
                             **scales, **kwargs)

    full = run(64)
    for tokens in (1, 8):
        if fp8:
            want = fp8_reference(hidden[:tokens], w13, s13, w2, s2, ids[:tokens], weights[:tokens])
            _assert_fp8_close(full[:tokens], want, dtype)
        else:
            _assert_close(full[:tokens], reference(hidden[:tokens], w13, w2, ids[:tokens], weights[:tokens]), dtype)
    for tokens in (1, 2, 3, 17, 63):
        assert torch.equal(run(tokens), full[:tokens]), f"T={tokens} differs from T=64"
    workspace = moe.fused_moe_workspace(8, 8, 256, 7168, 256, "cuda", dtype, fp8=fp8, split_k=split_k)
    out = torch.empty_like(hidden[:8])
    moe.fused_moe(hidden[:8], w13, w2, ids[:8], weights[:8], out, workspace=workspace, split_k=split_k, **scales)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe.fused_moe(hidden[:8], w13, w2, ids[:8], weights[:8], out, workspace=workspace, split_k=split_k,
                      check_values=False, **scales)
    out.zero_()
    graph.replay()
    assert torch.equal(out, full[:8]), "graph replay differs from eager"


# -------------------------------------------------------------------------------------------------
# Shared experts as extra experts (the MoE layer's fused path): a shared SwiGLU of S * I features is
# the sum of S SwiGLUs over consecutive chunks of I features, run as experts E .. E + S - 1 with
# weight 1.0 in every token's last S slots, against the reference's one wide SwiGLU.


def _shared(hidden_size, inter, n_shared, seed=9):
    """The shared experts of the model's definition: gate, up ``[S * I, H]``, down ``[H, S * I]``."""
    gen = torch.Generator().manual_seed(seed)
    width = n_shared * inter
    return (torch.randn(width, hidden_size, generator=gen) * hidden_size ** -0.5,
            torch.randn(width, hidden_size, generator=gen) * hidden_size ** -0.5,
            torch.randn(hidden_size, width, generator=gen) * width ** -0.5)


def _as_experts(gate, up, down, inter, rows_per_row=1, cols_per_col=1):
    """The shared gate / up / down (or their block scales: ``rows_per_row`` / ``cols_per_col`` 128)
    as ``[S, 2I, H]`` / ``[S, H, I]`` experts of I features each."""
    rows, cols = inter // rows_per_row, inter // cols_per_col
    chunks = gate.shape[0] // rows
    w13 = torch.stack([torch.cat([gate[s * rows:(s + 1) * rows], up[s * rows:(s + 1) * rows]]) for s in range(chunks)])
    return w13, torch.stack([down[:, s * cols:(s + 1) * cols] for s in range(chunks)])


def _with_shared_slots(ids, weights, experts, n_shared):
    """Every token's slots k .. k + S - 1: experts E .. E + S - 1 at weight 1.0."""
    tokens = ids.shape[0]
    slots = torch.arange(experts, experts + n_shared, dtype=torch.int32, device=ids.device).expand(tokens, n_shared)
    return (torch.cat([ids, slots], dim=1).contiguous(),
            torch.cat([weights, torch.ones(tokens, n_shared, device=weights.device)], dim=1).contiguous())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_shared", [1, 2])
@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_shared_experts_match_reference(tokens, n_shared, dtype, device):
    """Also the workspace of k + S slots over E + S experts (sorted layout): each shared expert's
    segment holds every token's pair."""
    topk, experts, hidden_size, inter = 3, 8, 48, 24
    hidden, w13, w2, ids, weights = _case(tokens, topk, experts, hidden_size, inter, dtype=dtype, device=device,
                                          seed=tokens)
    gate, up, down = (w.to(dtype).to(device) for w in _shared(hidden_size, inter, n_shared))
    extra13, extra2 = _as_experts(gate, up, down, inter)
    all_ids, all_weights = _with_shared_slots(ids, weights, experts, n_shared)
    workspace = moe.fused_moe_workspace(tokens, topk + n_shared, experts + n_shared, hidden_size, inter, device,
                                        dtype)
    got = _run(hidden, torch.cat([w13, extra13]), torch.cat([w2, extra2]), all_ids, all_weights, workspace,
               sort_pairs=True)
    _assert_close(got, reference(hidden, w13, w2, ids, weights, shared=(gate, up, down)), dtype)
    rows, blocks = _expected_layout(all_ids, experts + n_shared)
    assert workspace.sorted_pairs.tolist() == rows and workspace.block_experts.tolist() == blocks


def _fp8_shared(hidden_size, inter, n_shared, device):
    """:func:`_shared` quantized per 128 x 128 block (reference quantizer), as ((codes, scales), ...)."""
    return tuple(tuple(t.to(device) for t in fp8_ref.quantize_weight(w)) for w in _shared(hidden_size, inter, n_shared))


@fp8_warnings
@pytest.mark.parametrize("n_shared", [1, 2])
@pytest.mark.parametrize("tokens,dtype", [(1, torch.float32), (3, torch.float32), (17, torch.float32),
                                          (17, torch.bfloat16)])
def test_fp8_shared_experts_match_reference(tokens, dtype, n_shared, device):
    """FP8 (H 256, I 128): the chunks of I features are whole 128-blocks of the shared weights, so
    the experts' block scales are the shared ones' chunks; split gate/up, as the layer runs them."""
    topk, experts, inter = 3, 8, 128
    hidden, w13, s13, w2, s2, ids, weights = _fp8_case(tokens, topk, experts, 256, inter, dtype=dtype,
                                                       device=device, seed=tokens)
    shared = _fp8_shared(256, inter, n_shared, device)
    (gate, gate_s), (up, up_s), (down, down_s) = shared
    extra13, extra2 = _as_experts(gate, up, down, inter)
    extra_s13, extra_s2 = _as_experts(gate_s, up_s, down_s, inter, 128, 128)
    all_ids, all_weights = _with_shared_slots(ids, weights, experts, n_shared)
    got = _run_fp8(hidden, torch.cat([w13, extra13]), torch.cat([s13, extra_s13]), torch.cat([w2, extra2]),
                   torch.cat([s2, extra_s2]), all_ids, all_weights, split_k=2)
    _assert_fp8_close(got, fp8_reference(hidden, w13, s13, w2, s2, ids, weights, shared=shared), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_shared_slots_from_the_router_kernel_are_row_invariant(dtype, device):
    """Ids and weights from the router kernel with one shared slot (route_topk's n_shared): a
    token's output bits alone and in a shuffled subset equal its bits in the batch; the shared
    expert is expert E, hit by every token."""
    from dsaspec.ops.moe_router import route_topk

    tokens, topk, experts, hidden_size, inter = 17, 3, 8, 48, 24
    hidden, w13, w2, _, _ = _case(tokens, topk, experts, hidden_size, inter, dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(tokens, experts, generator=gen).to(device)
    ids, weights = route_topk(logits, torch.zeros(experts, device=device), top_k=topk, n_group=4, topk_group=2,
                              norm_topk_prob=True, scaling=2.5, n_shared=1)
    assert ids[:, -1].tolist() == [experts] * tokens
    extra13, extra2 = _as_experts(*(w.to(dtype).to(device) for w in _shared(hidden_size, inter, 1)), inter)
    _assert_row_invariant(hidden, torch.cat([w13, extra13]), torch.cat([w2, extra2]), ids, weights, alone=(0, 8, 16))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_gpu_fp8_shared_expert_production_shape(tokens):
    """A TP 8 rank of GLM-5: E = 256 + 1 shared, k = 8 + 1 slot, H = 6144, I = 256, split_k 4:
    matches the reference; token 0's bits are the same at T = 1..64; graph replay equals eager."""
    dtype, inter, hidden_size = torch.bfloat16, 256, 6144
    hidden, w13, s13, w2, s2, ids, weights = _fp8_case(64, 8, 256, hidden_size, inter, dtype=dtype, device="cuda")
    shared = _fp8_shared(hidden_size, inter, 1, "cuda")
    extra13, extra2 = _as_experts(shared[0][0], shared[1][0], shared[2][0], inter)
    extra_s13, extra_s2 = _as_experts(shared[0][1], shared[1][1], shared[2][1], inter, 128, 128)
    weights13, scales13 = torch.cat([w13, extra13]), torch.cat([s13, extra_s13])
    weights2, scales2 = torch.cat([w2, extra2]), torch.cat([s2, extra_s2])
    all_ids, all_weights = _with_shared_slots(ids, weights, 256, 1)

    def run(count, **kwargs):
        return _run_fp8(hidden[:count], weights13, scales13, weights2, scales2, all_ids[:count],
                        all_weights[:count], split_k=4, **kwargs)

    full = run(64)
    want = fp8_reference(hidden[:tokens], w13, s13, w2, s2, ids[:tokens], weights[:tokens], shared=shared)
    _assert_fp8_close(full[:tokens], want, dtype)
    assert torch.equal(run(tokens), full[:tokens]), f"T={tokens} differs from T=64"
    workspace = moe.fused_moe_workspace(tokens, 9, 257, hidden_size, inter, "cuda", dtype, fp8=True, split_k=4)
    out = torch.empty_like(hidden[:tokens])
    kwargs = dict(w13_scale=scales13, w2_scale=scales2, workspace=workspace, split_k=4)
    moe.fused_moe(hidden[:tokens], weights13, weights2, all_ids[:tokens], all_weights[:tokens], out, **kwargs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe.fused_moe(hidden[:tokens], weights13, weights2, all_ids[:tokens], all_weights[:tokens], out,
                      check_values=False, **kwargs)
    out.zero_()
    graph.replay()
    assert torch.equal(out, full[:tokens]), "graph replay differs from eager"


# -------------------------------------------------------------------------------------------------
# The pair layout (P <= PAIR_LAYOUT_MAX_PAIRS: no align, the combine in the down launch) against the
# sorted layout, bitwise: the same blocks, the same tiles, the same fp32 sums in the same order.


def _pair_routing(tokens, routed=6):
    """3 routed slots with repeats across tokens (expert 0 for tokens 0 and 2, expert 5 for every
    token), then the shared slot: id ``routed`` at weight 1.0; the other weights far apart in
    magnitude, so the order of the fp32 sum shows in the bits."""
    ids = torch.tensor([[t % 2, 2 + t % 3, routed - 1, routed] for t in range(tokens)], dtype=torch.int32)
    weights = torch.rand(tokens, 4, generator=torch.Generator().manual_seed(tokens)) + 0.1
    weights[:, 0] *= 1e-3
    weights[:, 2] *= 1e-3
    weights[:, 3] = 1.0
    return ids, weights


def _rows_of_pairs(workspace, pairs, sort):
    """The workspace row of each pair: its sorted row, or the pair itself in the pair layout."""
    if not sort:
        return torch.arange(pairs)
    rows = workspace.sorted_pairs.tolist()
    return torch.tensor([rows.index(p) for p in range(pairs)])


# (experts, activations, split_k, H): 2 K blocks each (fp32: of 32 columns, bf16 and FP8: of 128);
# at H 128 the pair layout's down runs 64-column tiles where the sorted one runs 128 (a tile per token)
PAIR_CASES = [("fp32", torch.float32, 1, 64), ("bf16", torch.bfloat16, 4, 256),
              ("fp8", torch.float32, 1, 256), ("fp8", torch.bfloat16, 4, 256), ("fp8", torch.bfloat16, 1, 128)]


@fp8_warnings
@pytest.mark.parametrize("experts_dtype,dtype,split_k,hidden_size", PAIR_CASES)
def test_pair_layout_is_bitwise_the_sorted_layout(experts_dtype, dtype, split_k, hidden_size, device):
    """T = 1, 2, 3 with the shared slot and experts repeated across tokens: the pair layout's output
    and every pair's activation (FP8: its e4m3 codes and scales) equal the sorted layout's bitwise."""
    fp8 = experts_dtype == "fp8"
    inter = 128 if fp8 else 16
    for tokens in (1, 2, 3):
        ids, weights = _pair_routing(tokens)
        if fp8:
            hidden, w13, s13, w2, s2, _, _ = _fp8_case(tokens, 4, 7, hidden_size, inter, dtype=dtype, device=device,
                                                       ids=ids)
            scales = dict(w13_scale=s13, w2_scale=s2)
        else:
            hidden, w13, w2, _, _ = _case(tokens, 4, 7, hidden_size, inter, dtype=dtype, device=device, ids=ids)
            scales = {}
        ids, weights = ids.to(device), weights.to(device)
        got = {}
        for sort in (True, False):
            workspace = moe.fused_moe_workspace(tokens, 4, 7, hidden_size, inter, device, dtype, fp8=fp8,
                                                split_k=split_k)
            out = moe.fused_moe(hidden, w13, w2, ids, weights, torch.empty_like(hidden), workspace=workspace,
                                split_k=split_k, sort_pairs=sort, **scales)
            rows = _rows_of_pairs(workspace, 4 * tokens, sort).to(device)
            stages = [workspace.act[rows]]
            if fp8:
                stages += [workspace.act_q[rows].view(torch.uint8), workspace.act_scale[rows]]
            got[sort] = [out] + stages
        for name, sorted_value, pair_value in zip(("out", "act", "act codes", "act scales"), got[True], got[False]):
            assert torch.equal(sorted_value, pair_value), f"T={tokens}: the pair layout's {name} differs"


def test_pair_layout_splits_an_expert_of_more_than_a_block(device):
    """18 pairs of one expert (repeats within rows too): the pair layout's blocks lead at pairs 0 and
    16 (ranks 0 and 16), as the sorted layout's two blocks of that expert; the same bits."""
    args = _case(9, 2, 4, 48, 16, dtype=torch.float32, device=device, ids=torch.full((9, 2), 3))
    assert torch.equal(_run(*args, sort_pairs=False), _run(*args, sort_pairs=True))


@fp8_warnings
@pytest.mark.parametrize("fp8", [False, True])
def test_layout_choice_across_the_threshold_changes_no_bit(fp8, device):
    """4 slots (3 routed + the shared one), split 4: T = 16 is P = 64, the default pair layout's
    last, T = 17 the sorted layout's first; a token's bits alone (T = 1), at T = 16 and at T = 17 are
    the same."""
    assert not moe.sorts_pairs(16 * 4) and moe.sorts_pairs(17 * 4)
    ids = torch.cat([torch.randint(0, 6, (17, 3), generator=torch.Generator().manual_seed(5)),
                     torch.full((17, 1), 6)], dim=1)
    if fp8:
        hidden, w13, s13, w2, s2, ids, weights = _fp8_case(17, 4, 7, 256, 128, dtype=torch.bfloat16, device=device,
                                                           ids=ids)
        scales = dict(w13_scale=s13, w2_scale=s2)
    else:
        hidden, w13, w2, ids, weights = _case(17, 4, 7, 256, 16, dtype=torch.bfloat16, device=device, ids=ids)
        scales = {}
    weights[:, 3] = 1.0

    def run(tokens):
        out = torch.empty_like(hidden[:tokens])
        return moe.fused_moe(hidden[:tokens], w13, w2, ids[:tokens], weights[:tokens], out, split_k=4, **scales)

    full = run(17)
    assert torch.equal(run(16), full[:16]), "T = 16 (pair layout) differs from T = 17 (sorted)"
    assert torch.equal(run(1), full[:1]), "T = 1 (pair layout) differs from T = 17 (sorted)"


def _launches(tokens, topk, fp8, split_k, sort_pairs=None):
    """The kernels one ``fused_moe`` call launches, in order, with their grids (none run)."""
    kernels = {"align": moe._align_kernel, "act_quant": fp8_gemm._act_quant_kernel,
               "gate_up": moe._gate_up_kernel, "down": moe._down_kernel,
               "combine": moe._combine_kernel}
    launched = []
    if fp8:
        hidden, w13, s13, w2, s2, ids, weights = _fp8_case(tokens, topk, 16, 128, 128, dtype=torch.float32,
                                                           device="cpu")
        scales = dict(w13_scale=s13, w2_scale=s2)
    else:
        hidden, w13, w2, ids, weights = _case(tokens, topk, 16, 128, 16, dtype=torch.float32, device="cpu")
        scales = {}
    for name, kernel in kernels.items():
        kernel.run = lambda *args, name=name, grid, **kwargs: launched.append((name, grid))
    try:
        moe.fused_moe(hidden, w13, w2, ids, weights, torch.empty_like(hidden), split_k=split_k,
                      sort_pairs=sort_pairs, **scales)
    finally:
        for kernel in kernels.values():
            del kernel.run
    return launched


@pytest.mark.parametrize("fp8,split_k,sorted_names,pair_names", [
    (False, 1, "align gate_up down combine", "gate_up down"),
    (False, 4, "align gate_up down combine", "gate_up down"),
    (True, 1, "align act_quant gate_up act_quant down combine", "act_quant gate_up act_quant down"),
    (True, 4, "align act_quant gate_up down combine", "act_quant gate_up down")])
def test_pair_layout_drops_align_and_combine(fp8, split_k, sorted_names, pair_names):
    """T = 1, 2, 4 (k = 9: P = 9 .. 36) launch the pair layout's kernels by default, two fewer, on
    grids from T alone (gate/up P blocks x splits x column tiles, down T tokens x column tiles, the
    tiles the same at every T); at T = 8 (P = 72) the sorted layout's. A split adds no launch: the
    gate/up programs reduce it."""
    tiles = set()
    for tokens in (1, 2, 4):
        launched = _launches(tokens, 9, fp8, split_k)
        assert " ".join(name for name, _ in launched) == pair_names, f"T={tokens}"
        grids = dict(launched)
        pairs = 9 * tokens
        tiles.add((grids["gate_up"][0] / (pairs * split_k), grids["down"][0] / tokens))
        assert " ".join(name for name, _ in _launches(tokens, 9, fp8, split_k, True)) == sorted_names
    assert len(tiles) == 1 and all(n == int(n) >= 1 for n in tiles.pop())
    assert " ".join(name for name, _ in _launches(8, 9, fp8, split_k)) == sorted_names



def _rank_case(hidden_size, fp8, tokens):
    """A TP 8 rank's experts (E 256, k 8, I 256; FP8 or bf16, bf16 activations) and ``tokens`` random
    tokens' inputs, on the GPU, with the shared expert built apart: hidden, w13, w2, ids, weights, the
    shared expert's weights (the references' ``shared``), the FP8 scales (None for bf16), and the
    experts with the shared one appended as expert 256 (w13, w2 and the scales keyword arguments)."""
    dtype, inter = torch.bfloat16, 256
    if fp8:
        hidden, w13, s13, w2, s2, ids, weights = _fp8_case(tokens, 8, 256, hidden_size, inter, dtype=dtype,
                                                           device="cuda")
        shared = _fp8_shared(hidden_size, inter, 1, "cuda")
        extra13, extra2 = _as_experts(shared[0][0], shared[1][0], shared[2][0], inter)
        extra_s13, extra_s2 = _as_experts(shared[0][1], shared[1][1], shared[2][1], inter, 128, 128)
        scales, all_scales = (s13, s2), dict(w13_scale=torch.cat([s13, extra_s13]), w2_scale=torch.cat([s2, extra_s2]))
    else:
        hidden, w13, w2, ids, weights = _case(tokens, 8, 256, hidden_size, inter, dtype=dtype, device="cuda")
        shared = tuple(w.to(dtype).cuda() for w in _shared(hidden_size, inter, 1))
        extra13, extra2 = _as_experts(*shared, inter)
        scales, all_scales = None, {}
    return (hidden, w13, w2, ids, weights, shared, scales,
            (torch.cat([w13, extra13]), torch.cat([w2, extra2]), all_scales))


def _rank_experts(hidden_size, fp8, tokens=8):
    """:func:`_rank_case`'s experts with the shared one as expert 256 (k 8 + 1) and ``tokens`` tokens'
    inputs, routed experts repeated across tokens (tokens 0 and 1 share slot 0's, token 3 picks token
    2's last): hidden, w13, w2, ids, weights and the keyword arguments of the layer's call (scales,
    split_k)."""
    hidden, _, _, ids, weights, _, _, (w13, w2, kwargs) = _rank_case(hidden_size, fp8, tokens)
    ids[1, 0] = ids[0, 0]
    if ids[2, 7] not in ids[3]:
        ids[3, 7] = ids[2, 7]
    ids, weights = _with_shared_slots(ids, weights, 256, 1)
    kwargs["split_k"] = moe.moe_split_k(256, fp8)
    return hidden, w13, w2, ids, weights, kwargs


@pytest.mark.gpu
@pytest.mark.parametrize("fp8,hidden_size", [(True, 6144), (True, 7168), (False, 7168)])
def test_gpu_pair_layout_production_shapes(fp8, hidden_size):
    """GLM-5 (H 6144) / DeepSeek-V3.2 (H 7168) TP 8 ranks, FP8 (and bf16 experts): the pair layout
    equals the sorted layout bitwise at T = 1, 2, 4, 8, and so does the default (pairs up to T = 7)."""
    hidden, w13, w2, ids, weights, kwargs = _rank_experts(hidden_size, fp8)

    def run(tokens, **more):
        out = torch.empty_like(hidden[:tokens])
        return moe.fused_moe(hidden[:tokens], w13, w2, ids[:tokens], weights[:tokens], out, **kwargs, **more)

    full = run(8, sort_pairs=True)
    for tokens in (1, 2, 4, 8):
        assert torch.equal(run(tokens, sort_pairs=False), full[:tokens]), f"T={tokens}: pairs differ from sorted"
        assert torch.equal(run(tokens), full[:tokens]), f"T={tokens}: the default layout differs from sorted"


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 4])
def test_gpu_pair_layout_graph_replay_with_new_routing(tokens):
    """A CUDA graph of the default (pair) layout at the GLM-5 rank's shapes, replayed with new hidden
    rows, ids and weights (random; then every token on the same 8 routed experts), equals the eager
    sorted layout bitwise."""
    hidden, w13, w2, ids, weights, kwargs = _rank_experts(6144, True)
    hidden, ids, weights = hidden[:tokens].clone(), ids[:tokens].clone(), weights[:tokens].clone()
    workspace = moe.fused_moe_workspace(tokens, 9, 257, 6144, 256, "cuda", torch.bfloat16, fp8=True,
                                        split_k=kwargs["split_k"])
    out = torch.empty_like(hidden)
    moe.fused_moe(hidden, w13, w2, ids, weights, out, workspace=workspace, **kwargs)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe.fused_moe(hidden, w13, w2, ids, weights, out, workspace=workspace, check_values=False, **kwargs)
    gen = torch.Generator(device="cuda").manual_seed(3)
    for same_experts in (False, True):
        routed = torch.rand(tokens, 256, generator=gen, device="cuda").argsort(dim=1)[:, :8]
        if same_experts:
            routed = routed[:1].expand(tokens, 8)
        ids[:, :8] = routed.to(torch.int32)
        weights[:, :8] = torch.rand(tokens, 8, generator=gen, device="cuda")
        hidden.copy_(torch.randn(hidden.shape, generator=gen, device="cuda"))
        graph.replay()
        want = moe.fused_moe(hidden, w13, w2, ids, weights, torch.empty_like(hidden), sort_pairs=True, **kwargs)
        assert torch.equal(out, want), f"same experts {same_experts}: replay differs from eager sorted"


# -------------------------------------------------------------------------------------------------
# Tall row blocks (block_m 64 / 128: prefill chunks). Each expert's segment is padded to block_m rows
# and the GEMM tiles have block_m rows; against the references as the 16-row blocks are (same tolerances).

TALL = [64, 128]


def _tall_routing(name, tokens=48):
    """3 routed slots over experts 0..3 and the shared slot (expert 4, weight 1.0 set by the caller):
    "counts": expert 0 no pair, expert 1 exactly 64, expert 2 65 (one block of 64 and one row over),
    expert 3 15, shuffled so rows repeat ids; "one-expert": every routed pair on expert 2 (144 pairs:
    64 + 64 + 16 rows, or 128 + 16)."""
    if name == "counts":
        flat = torch.tensor([1] * 64 + [2] * 65 + [3] * (3 * tokens - 129))
        routed = flat[torch.randperm(len(flat), generator=torch.Generator().manual_seed(7))].view(tokens, 3)
        assert any(len(set(row)) < 3 for row in routed.tolist()), "no row repeats an id"
    else:
        routed = torch.full((tokens, 3), 2)
    return routed


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("block_m", TALL)
@pytest.mark.parametrize("routing", ["counts", "one-expert"])
def test_tall_blocks_match_reference(routing, block_m, split_k, dtype, device):
    """T 48, 3 routed slots and the shared expert as expert 4 (every token's last slot): the output
    against the reference with its shared SwiGLU, and the align launch's layout padded to block_m
    (H 256: 8 fp32 / 2 bf16 K blocks, so split 2 changes the order; I 40: masked columns)."""
    tokens, experts, hidden_size, inter = 48, 4, 256, 40
    routed = _tall_routing(routing, tokens)
    hidden, w13, w2, ids, weights = _case(tokens, 3, experts, hidden_size, inter, dtype=dtype, device=device,
                                          ids=routed)
    shared = tuple(w.to(dtype).to(device) for w in _shared(hidden_size, inter, 1))
    extra13, extra2 = _as_experts(*shared, inter)
    all_ids, all_weights = _with_shared_slots(ids, weights, experts, 1)
    workspace = moe.fused_moe_workspace(tokens, 4, experts + 1, hidden_size, inter, device, dtype, split_k=split_k,
                                        block_m=block_m)
    assert workspace.block_m == block_m
    got = _run(hidden, torch.cat([w13, extra13]), torch.cat([w2, extra2]), all_ids, all_weights, workspace,
               split_k=split_k, block_m=block_m)
    _assert_close(got, reference(hidden, w13, w2, ids, weights, shared=shared), dtype)
    rows, blocks = _expected_layout(all_ids, experts + 1, block_m)
    assert workspace.sorted_pairs.tolist() == rows and workspace.block_experts.tolist() == blocks
    assert not device_facts.tile_counters(torch.device(device), 1).any()


@fp8_warnings
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("block_m", TALL)
@pytest.mark.parametrize("routing", ["counts", "one-expert"])
def test_fp8_tall_blocks_match_reference(routing, block_m, split_k, dtype, device):
    """FP8 experts (H 256: 2 K blocks, I 128), the routings above with the shared expert; split 2 has the
    reducing program quantize the activations of its block_m rows."""
    tokens, experts, hidden_size, inter = 48, 4, 256, 128
    hidden, w13, s13, w2, s2, ids, weights = _fp8_case(tokens, 3, experts, hidden_size, inter, dtype=dtype,
                                                       device=device, ids=_tall_routing(routing, tokens))
    shared = _fp8_shared(hidden_size, inter, 1, device)
    (gate, gate_s), (up, up_s), (down, down_s) = shared
    extra13, extra2 = _as_experts(gate, up, down, inter)
    extra_s13, extra_s2 = _as_experts(gate_s, up_s, down_s, inter, 128, 128)
    all_ids, all_weights = _with_shared_slots(ids, weights, experts, 1)
    got = _run_fp8(hidden, torch.cat([w13, extra13]), torch.cat([s13, extra_s13]), torch.cat([w2, extra2]),
                   torch.cat([s2, extra_s2]), all_ids, all_weights, split_k=split_k, block_m=block_m)
    _assert_fp8_close(got, fp8_reference(hidden, w13, s13, w2, s2, ids, weights, shared=shared), dtype)


@pytest.mark.parametrize("block_m", TALL)
def test_tall_blocks_sort_few_pairs_by_default(block_m, device):
    """At P <= 64 (the pair layout's range at 16 rows) a tall call sorts: the align launch writes the
    layout of block_m-row segments over a poisoned workspace, and the output matches the reference."""
    args = _case(2, 3, 8, 32, 16, dtype=torch.float32, device=device, ids=torch.tensor([[1, 1, 5], [5, 0, 1]]))
    workspace = moe.fused_moe_workspace(2, 3, 8, 32, 16, device, torch.float32, block_m=block_m)
    workspace.sorted_pairs.fill_(3)
    workspace.block_experts.fill_(2)
    _assert_close(_run(*args, workspace=workspace, block_m=block_m), reference(*args), torch.float32)
    rows, blocks = _expected_layout(args[3], 8, block_m)
    assert workspace.sorted_pairs.tolist() == rows and workspace.block_experts.tolist() == blocks


def test_block_m_arguments_are_checked(device):
    args = _case(4, 2, 8, 32, 16, dtype=torch.float32, device=device)
    for bad in (32, 0, True, 64.0):
        with pytest.raises(ValueError, match=r"^block_m: expected one of \(16, 64, 128\), got "):
            _run(*args, block_m=bad)
        with pytest.raises(ValueError, match=r"^block_m: expected one of \(16, 64, 128\)"):
            moe.fused_moe_workspace(4, 2, 8, 32, 16, device, torch.float32, block_m=bad)
    with pytest.raises(ValueError, match="^sort_pairs: the pair layout .* 16-row blocks only, got block_m 64"):
        _run(*args, sort_pairs=False, block_m=64)
    for allocated, called in ((16, 64), (64, 16), (128, 64)):
        workspace = moe.fused_moe_workspace(4, 2, 8, 32, 16, device, torch.float32, block_m=allocated)
        with pytest.raises(ValueError, match=f"^workspace: allocated for block_m {allocated}, this call has "
                                             f"block_m {called}"):
            _run(*args, workspace=workspace, block_m=called)
    assert moe.fused_moe_workspace(4, 2, 8, 32, 16, device, torch.float32).block_m == moe.BLOCK_M == 16


def test_block_m_rule():
    """16-row blocks below PREFILL_MIN_ROWS (512) tokens, TALL_BLOCK_M (64) from there; FP8 gate/up
    splits on 16-row blocks only."""
    assert (moe.PREFILL_MIN_ROWS, moe.TALL_BLOCK_M) == (512, 64)
    assert [moe.moe_block_m(t) for t in (1, 64, 511, 512, 513, 4096)] == [16, 16, 16, 64, 64, 64]
    assert [moe.moe_split_k(256, True, block_m) for block_m in (16, 64, 128)] == [4, 1, 1]


@pytest.mark.parametrize("table", ["default", "wide"])
def test_tall_tiles_keep_two_stages_within_shared_memory(table, monkeypatch):
    """Every tall tile (gate/up and down, FP8 / bf16 / fp32) pipelines >= 2 stages of its block_m-row
    activation tile and weight tiles within _STAGE_BYTES; FP8 keeps 128-column K blocks and BLOCK_N
    dividing 128 (one weight scale per tile and K block). Also with 256-wide tiles in the table (a
    retune), where bf16 must narrow BLOCK_K and FP8 BLOCK_N to keep two stages."""
    if table == "wide":
        for key in list(moe._TALL_TILES):
            monkeypatch.setitem(moe._TALL_TILES, key, (256, 8))
    for block_m in TALL:
        for dtype, fp8 in ((torch.bfloat16, True), (torch.bfloat16, False), (torch.float32, False)):
            for n, k_dim, weight_tiles in ((256, 6144, 2), (6144, 256, 1), (2048, 7168, 2), (7168, 2048, 1)):
                t = moe._tile(n, k_dim, 9, dtype, "cpu", weight_tiles=weight_tiles, fp8=fp8, block_m=block_m)
                size = 1 if fp8 else dtype.itemsize
                assert t.num_stages >= 2, (block_m, dtype, fp8, n, t)
                assert t.num_stages * (block_m + weight_tiles * t.block_n) * t.block_k * size <= moe._STAGE_BYTES
                if fp8:
                    assert t.block_k == 128 and 128 % t.block_n == 0


@fp8_warnings
def test_layer_runs_tall_unsplit_blocks_from_512_tokens(device):
    """RoutedExperts' fused path (FP8, I 128, H 1024: 8 K blocks, so the layer's split 4 at 16 rows sums
    them in another order than one split): at T 512 its output is bitwise the op's on 64-row blocks unsplit and
    not the op's on 16-row blocks in 4 splits; at T 511 the other way round; both match the layer's torch
    path within the FP8 tolerance; the layer's call names the block height."""
    from dsaspec.configs.model_config import get_config
    from dsaspec.distributed.tp_group import TPGroup
    from dsaspec.layers.moe import RoutedExperts

    config = get_config("tiny-moe", hidden_size=1024)
    layer = RoutedExperts(config, TPGroup.single(device), device, torch.float32, fp8=True)
    gen = torch.Generator().manual_seed(3)
    experts, hidden_size, inter, topk = layer.num_experts, layer.hidden, layer.intermediate, 2
    assert (hidden_size, inter, moe.moe_split_k(inter, True)) == (1024, 128, 4)
    layer.set_from_fused("w13", torch.randn(experts, 2 * inter, hidden_size, generator=gen) * hidden_size ** -0.5)
    layer.set_from_fused("w2", torch.randn(experts, hidden_size, inter, generator=gen) * inter ** -0.5)
    x = torch.randn(512, hidden_size, generator=gen).to(device)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(512)]).to(torch.int32).to(device)
    weights = (torch.rand(512, topk, generator=gen) + 0.1).to(device)
    scales = dict(w13_scale=layer.w13_scale_inv, w2_scale=layer.w2_scale_inv)
    for tokens, (block_m, split_k), other in ((512, (64, 1), (16, 4)), (511, (16, 4), (64, 1))):
        args = (x[:tokens], layer.w13, layer.w2, ids[:tokens], weights[:tokens])
        layer.use_fused = True
        # the block height changes no bit under the interpreter (numpy's row-invariant matmul): seen in the call
        with mock.patch.object(moe, "fused_moe", wraps=moe.fused_moe) as spy:
            got = layer(*args[:1], *args[3:])
        assert (spy.call_args.kwargs["block_m"], spy.call_args.kwargs["split_k"]) == (block_m, split_k)
        assert torch.equal(got, _run(*args, **scales, block_m=block_m, split_k=split_k)), f"T={tokens}"
        assert not torch.equal(got, _run(*args, **scales, block_m=other[0], split_k=other[1])), f"T={tokens}"
        layer.use_fused = False
        _assert_fp8_close(got, layer(*args[:1], *args[3:]), torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("block_m", TALL)
def test_gpu_tall_blocks_production_shape(block_m, fp8):
    """A TP 8 rank of GLM-5 (E 256 + the shared expert, k 8 + its slot, H 6144, I 256) at T 4096 on tall
    blocks, unsplit and in 4 splits: the first 16 tokens match the reference; the whole output is
    normwise within 2**-6 of the 16-row blocks' (FP8: the e4m3 warpgroup MMA sums with fewer bits); two
    calls give the same bits; an expert of every pair (token 0's first id on every token) too."""
    tokens, dtype = 4096, torch.bfloat16
    hidden, w13, w2, ids, weights, shared, fp8_scales, (all13, all2, scales) = _rank_case(6144, fp8, tokens)
    for routing in ("random", "one-expert"):
        if routing == "one-expert":
            ids = ids[:1, :1].expand(tokens, 8).contiguous()
        all_ids, all_weights = _with_shared_slots(ids, weights, 256, 1)

        def run(**kwargs):
            out = torch.empty_like(hidden)
            return moe.fused_moe(hidden, all13, all2, all_ids, all_weights, out, **scales, **kwargs)

        short = run(block_m=16)
        for split_k in (1, 4):
            tall = run(block_m=block_m, split_k=split_k)
            again = run(block_m=block_m, split_k=split_k)
            assert torch.equal(again, tall), f"{routing} split {split_k}: not deterministic"
            error = float((tall.double() - short.double()).norm() / short.double().norm())
            assert error <= 2**-6, f"{routing} split {split_k}: {error:.3g} from the 16-row blocks"
            if fp8:
                s13, s2 = fp8_scales
                want = fp8_reference(hidden[:16], w13, s13, w2, s2, ids[:16], weights[:16], shared=shared)
                _assert_fp8_close(tall[:16], want, dtype)
            else:
                _assert_close(tall[:16], reference(hidden[:16], w13, w2, ids[:16], weights[:16], shared=shared), dtype)
