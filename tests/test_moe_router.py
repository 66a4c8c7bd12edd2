"""The MoE router kernel (dsaspec.ops.moe_router) against its plain-torch definition
(dsaspec.reference.moe_router), exactly: the presets' routing (GLM-5: one group; DeepSeek-V3.2:
4 of 8 groups; tiny-moe), groups of a size that is not a power of two, token counts around the
edges, without normalization, ties to the lower index, outputs poisoned first, bad arguments named;
the Router choosing it with the Triton ops; on the GPU its scores against torch's sigmoid and its
ids against the torch router's.

Off the GPU the kernel's ``exp`` is numpy's (the interpreter cannot call libdevice), so here the
reference runs over numpy's ``exp``; on the GPU over torch's."""

import numpy as np
import pytest
import torch

from compile_scripts import compiled_counts
from dsaspec.configs.model_config import get_config
from dsaspec.ops.moe_router import decode_tile, route_topk
from dsaspec.reference import moe_router as ref

pytestmark = pytest.mark.interpreter

TOKENS = (1, 2, 63, 64, 65, 129)
# (experts, n_group, topk_group, top_k): GLM-5, DeepSeek-V3.2, tiny-moe, groups of 12 and 3 experts
ROUTINGS = ((256, 1, 1, 8), (256, 8, 4, 8), (8, 4, 2, 3), (96, 8, 3, 6), (24, 8, 8, 24))


def numpy_exp(x: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.exp(x.cpu().numpy())).to(x.device)


def _case(tokens: int, experts: int, seed: int, device, spread: float = 4.0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=gen) * spread
    bias = torch.randn(experts, generator=gen) * 0.1
    return logits.to(device), bias.to(device)


def _check(logits, bias, exp=numpy_exp, **routing):
    tokens, slots = logits.shape[0], routing["top_k"] + routing.get("n_shared", 0)
    ids = torch.full((tokens, slots), -7, dtype=torch.int32, device=logits.device)
    weights = torch.full((tokens, slots), float("nan"), device=logits.device)
    got = route_topk(logits, bias, ids=ids, weights=weights, **routing)
    assert got[0] is ids and got[1] is weights
    want_ids, want_weights = ref.route_topk(logits, bias, exp=exp, **routing)
    assert torch.equal(ids.cpu(), want_ids.cpu())
    assert torch.equal(weights.cpu().view(torch.int32), want_weights.cpu().view(torch.int32))
    return ids, weights


@pytest.mark.parametrize("experts, n_group, topk_group, top_k", ROUTINGS)
def test_bit_for_bit_with_the_reference(experts, n_group, topk_group, top_k, device):
    """ids and weights (their bits) at every token count, with normalization and scaling."""
    for tokens in TOKENS:
        logits, bias = _case(tokens, experts, seed=tokens * 131 + experts, device=device)
        ids, _ = _check(logits, bias, top_k=top_k, n_group=n_group, topk_group=topk_group,
                        norm_topk_prob=True, scaling=2.5)
        groups = ids.long() // (experts // n_group)
        assert all(len(set(row)) <= topk_group for row in groups.tolist())
        assert all(len(set(row)) == top_k for row in ids.tolist())


def test_without_normalization_the_weights_are_the_scores_scaled(device):
    logits, bias = _case(17, 256, seed=5, device=device)
    _, weights = _check(logits, bias, top_k=8, n_group=8, topk_group=4, norm_topk_prob=False, scaling=1.5)
    assert float(weights.max()) <= 1.5


def test_group_limit_excludes_a_better_expert_of_a_worse_group(device):
    """Group 0's best expert is the best of all, but group 0's two best sum to less than groups 1's
    and 2's: with topk_group 2 no expert of group 0 is chosen."""
    logits = torch.full((1, 12), -4.0)
    logits[0, 0] = 6.0                       # group 0: one very good expert, the rest poor
    logits[0, 4:6] = 3.0                     # group 1: two good experts
    logits[0, 8:10] = 2.5                    # group 2
    logits, bias = logits.to(device), torch.zeros(12, device=device)
    ids, _ = _check(logits, bias, top_k=3, n_group=3, topk_group=2, norm_topk_prob=True, scaling=1.0)
    assert sorted(ids[0].tolist()) == [4, 5, 8] and ids[0, 0] in (4, 5)


def test_ties_go_to_the_lower_index(device):
    """Equal choices (all logits equal, no bias): the lowest ids, in id order; equal group
    scores: the lower groups."""
    logits, bias = torch.zeros(3, 16, device=device), torch.zeros(16, device=device)
    ids, weights = _check(logits, bias, top_k=4, n_group=4, topk_group=2, norm_topk_prob=True, scaling=1.0)
    assert ids.tolist() == [[0, 1, 2, 3]] * 3
    assert torch.equal(weights, torch.full_like(weights, 0.25))


def test_the_bias_selects_but_does_not_weigh(device):
    """A large bias on expert 7 puts it first, with its own (small) score as its weight."""
    logits = torch.zeros(1, 8, device=device)
    logits[0, 7] = -3.0
    bias = torch.zeros(8, device=device)
    bias[7] = 10.0
    ids, weights = _check(logits, bias, top_k=2, n_group=1, topk_group=1, norm_topk_prob=False, scaling=1.0)
    assert ids[0, 0] == 7 and float(weights[0, 0]) == pytest.approx(1 / (1 + np.exp(3.0)), rel=1e-6)


@pytest.mark.parametrize("n_shared", [1, 2])
def test_shared_slots_follow_the_routed_ones(n_shared, device):
    """With ``n_shared`` every token's slots k .. k + n_shared - 1 hold experts E .. E + n_shared - 1
    at weight exactly 1.0 (not scaled, not in the normalization); the routed slots keep the bits
    they have without them."""
    experts, top_k = 8, 3
    routing = dict(top_k=top_k, n_group=4, topk_group=2, norm_topk_prob=True, scaling=2.5)
    for tokens in (1, 3, 17):
        logits, bias = _case(tokens, experts, seed=tokens, device=device)
        ids, weights = _check(logits, bias, n_shared=n_shared, **routing)
        plain_ids, plain_weights = route_topk(logits, bias, **routing)
        assert torch.equal(ids[:, :top_k], plain_ids)
        assert torch.equal(weights[:, :top_k].view(torch.int32), plain_weights.view(torch.int32))
        assert ids[:, top_k:].tolist() == [list(range(experts, experts + n_shared))] * tokens
        assert weights[:, top_k:].tolist() == [[1.0] * n_shared] * tokens


def test_router_appends_the_shared_slots_on_both_paths():
    """``Router.forward(x, shared)``: the kernel's slots and the torch path's concatenated ones."""
    from dsaspec.layers.moe import Router

    config = get_config("tiny-moe")
    top_k, experts = config.num_experts_per_tok, config.n_routed_experts
    router = Router(config)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(5, config.hidden_size, generator=gen)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen) / config.hidden_size ** 0.5)
        router.e_score_correction_bias.copy_(torch.randn(experts, generator=gen) * 0.1)
        want_ids, want_weights = router(x, 2)
        router.use_triton = True
        ids, weights = router(x, 2)
    for got_ids, got_weights in ((ids, weights), (want_ids, want_weights)):
        assert got_ids.shape == (5, top_k + 2) and got_ids[:, top_k:].tolist() == [[experts, experts + 1]] * 5
        assert got_weights[:, top_k:].tolist() == [[1.0, 1.0]] * 5
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=0)


def test_no_tokens_writes_nothing(device):
    ids = torch.full((0, 8), -1, dtype=torch.int32, device=device)
    got = route_topk(torch.empty(0, 256, device=device), torch.zeros(256, device=device), top_k=8, n_group=1,
                     topk_group=1, norm_topk_prob=True, scaling=2.5, ids=ids)
    assert got[0] is ids and got[1].shape == (0, 8)


@pytest.mark.parametrize("change, message", [
    (dict(logits=torch.zeros(2, 16, dtype=torch.bfloat16)), "logits: expected dtype torch.float32"),
    (dict(bias=torch.zeros(15)), r"bias: expected shape \(16,\)"),
    (dict(n_group=3), "n_group: expected a divisor of the 16 experts leaving at least two a group, got 3"),
    (dict(n_group=16, topk_group=1, top_k=1), "n_group: expected a divisor of the 16 experts leaving at least two"),
    (dict(topk_group=5), "topk_group: expected at most n_group = 4, got 5"),
    (dict(top_k=9), r"top_k: expected at most topk_group x experts a group = 8, got 9"),
    (dict(top_k=0), "top_k"),
    (dict(ids=torch.zeros(2, 4, dtype=torch.int64)), "ids: expected dtype torch.int32"),
    (dict(weights=torch.zeros(2, 3)), r"weights: expected shape \(2, 4\)"),
    (dict(n_shared=-1), "n_shared: expected >= 0, got -1"),
    (dict(n_shared=1, ids=torch.zeros(2, 4, dtype=torch.int32)), r"ids: expected shape \(2, 5\)"),
])
def test_bad_arguments_are_named(change, message):
    args = dict(logits=torch.zeros(2, 16), bias=torch.zeros(16), top_k=4, n_group=4, topk_group=2,
                norm_topk_prob=True, scaling=1.0) | change
    with pytest.raises((ValueError, TypeError), match=message):
        route_topk(args.pop("logits"), args.pop("bias"), **args)


def test_router_takes_the_kernel_with_the_triton_ops(monkeypatch):
    """The Router of a model with the Triton ops runs the kernel (same ids as its torch path, weights
    within a few ulps: the sums' order, and torch's CPU sigmoid against numpy's exp); without them
    the torch path."""
    import dsaspec.layers.moe as moe_module
    from dsaspec.models.dsa_model import DSAModel

    config = get_config("tiny-moe")
    model = DSAModel(config, dtype=torch.float32, use_triton=True).init_weights(2)
    routers = [m for m in model.modules() if isinstance(m, moe_module.Router)]
    assert routers and all(r.use_triton for r in routers)
    router = routers[0]
    with torch.no_grad():
        router.e_score_correction_bias.copy_(
            torch.randn(config.n_routed_experts, generator=torch.Generator().manual_seed(4)) * 0.1)
    x = torch.randn(9, config.hidden_size, generator=torch.Generator().manual_seed(3))
    calls = []
    monkeypatch.setattr(moe_module, "route_topk", lambda *a, **k: calls.append(1) or route_topk(*a, **k))
    ids, weights = router(x)
    assert calls == [1]
    router.use_triton = False
    want_ids, want_weights = router(x)
    assert calls == [1] and torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=0)
    model.use_triton = False
    assert not any(r.use_triton for r in routers)


def test_router_logits_read_the_rows_as_stored(monkeypatch):
    """The router's GEMM is router_logits on the bf16 rows themselves (no fp32 copy), fp32 out: in
    the row-invariant mode in its default tile at every T, with the Triton ops in the decode tile
    of T up to DECODE_MAX_TOKENS rows; torch's ``F.linear(x.float(), W)`` otherwise (and above),
    within fp32 rounding of it."""
    import dsaspec.layers.moe as moe_module
    from dsaspec.layers.moe import Router
    from dsaspec.ops.moe_router import DECODE_MAX_TOKENS, decode_tile, router_logits

    config = get_config("tiny-moe")
    router = Router(config)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(DECODE_MAX_TOKENS + 1, config.hidden_size, generator=gen).to(torch.bfloat16)
    seen = []
    monkeypatch.setattr(moe_module, "router_logits", lambda rows, weight, *a, config=None, **k:
                        seen.append((rows, config)) or router_logits(rows, weight, *a, config=config, **k))
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen) / config.hidden_size ** 0.5)
        plain = router.logits(x)
        assert seen == []
        for tokens in (1, 4, DECODE_MAX_TOKENS):
            for flag, tile in (("use_triton", decode_tile(tokens)), ("row_invariant", None)):
                setattr(router, flag, True)
                got = router.logits(x[:tokens])
                setattr(router, flag, False)
                assert seen[-1][0] is not None and seen[-1][0].data_ptr() == x.data_ptr()
                assert seen[-1][1] == tile and got.dtype == torch.float32
                torch.testing.assert_close(got, plain[:tokens], rtol=1e-5, atol=1e-6)
        assert decode_tile(1) != decode_tile(DECODE_MAX_TOKENS)
        router.use_triton, calls = True, len(seen)   # a prefill's rows: to cuBLAS ...
        assert torch.equal(router.logits(x), plain) and len(seen) == calls
        router.row_invariant = True                  # ... but never in the row-invariant mode
        assert torch.equal(router.logits(x), router_logits(x, router.weight)) and seen[-1][1] is None


def test_the_fma_tiles_read_the_bf16_copy_where_exact(monkeypatch):
    """The Router's FMA tiles (the Triton ops' decode tile, the row-invariant mode's) read the bf16
    copy of a weight holding bf16 values and the fp32 weight otherwise; the same logits either way."""
    import dsaspec.layers.moe as moe_module
    from dsaspec.layers.moe import Router
    from dsaspec.ops.moe_router import router_logits

    config = get_config("tiny-moe")
    router = Router(config)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, config.hidden_size, generator=gen).bfloat16()
    seen = []
    monkeypatch.setattr(moe_module, "router_logits", lambda rows, weight, *a, **k: seen.append(weight.dtype)
                        or router_logits(rows, weight, *a, **k))
    with torch.no_grad():
        for weight, dtype in ((torch.randn(router.weight.shape, generator=gen).bfloat16().float(), torch.bfloat16),
                              (torch.randn(router.weight.shape, generator=gen) / 3, torch.float32)):
            router.weight.copy_(weight)
            for flag in ("use_triton", "row_invariant"):
                setattr(router, flag, True)
                got = router.logits(x)
                setattr(router, flag, False)
                assert seen[-1] == dtype
                want = router_logits(x, router.weight, config=None if flag == "row_invariant" else decode_tile(3))
                assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_compiles_for_sm90():
    """Without a GPU: GLM-5's and DeepSeek-V3.2's routing compile for sm_90 without spilled
    registers, with libdevice's ``expf`` (not ``tl.exp``'s bare ``ex2``) and IEEE divisions only
    (scripts/compile_decode_epilogues.py, in a subprocess)."""
    rows = compiled_counts("compile_decode_epilogues", "(c.compile_router(*routing) for routing in c.ROUTINGS)",
                           ("regs", "spill", "expf_calls", "div_rn", "div_approx"))
    assert len(rows) == 2
    for r in rows:
        assert 0 < r["regs"] <= 255 and r["spill"] == 0 and r["div_approx"] == 0, r
        assert 0 < r["expf_calls"] < r["div_rn"], r      # a division per score, then the weights


@pytest.mark.gpu
def test_gpu_scores_are_torch_sigmoid_and_ids_the_torch_routers():
    """On CUDA the reference over torch's exp, bitwise; and the ids of the torch router's own ops
    (torch.sigmoid, topk) at the presets' routing, the weights within their sums' last bits."""
    from dsaspec.layers.moe import Router

    device = torch.device("cuda")
    for experts, n_group, topk_group, top_k in ROUTINGS:
        for tokens in TOKENS + (512,):
            logits, bias = _case(tokens, experts, seed=tokens + experts, device=device)
            ids, weights = _check(logits, bias, exp=torch.exp, top_k=top_k, n_group=n_group, topk_group=topk_group,
                                  norm_topk_prob=True, scaling=2.5)
    config = get_config("glm5-fp8-tp8-rank")
    router = Router(config, device).eval()
    hidden = torch.randn(64, config.hidden_size, device=device)
    with torch.no_grad():
        router.weight.copy_(torch.randn_like(router.weight) / config.hidden_size ** 0.5)
        router.e_score_correction_bias.copy_(torch.randn(config.n_routed_experts, device=device) * 0.1)
        want_ids, want_weights = router(hidden)
        router.use_triton = True
        ids, weights = router(hidden)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=0)


def test_bf16_weight_only_where_exact_and_kept_until_written():
    """``Router.bf16_weight``: the bf16 copy where the fp32 weight holds bf16 values (the random
    init's, as the checkpoints'), None where a value would round; decided again after a write."""
    from dsaspec.layers.moe import Router
    from dsaspec.models.dsa_model import DSAModel

    model = DSAModel(get_config("tiny-moe"), dtype=torch.float32).init_weights(2)
    routers = [m for m in model.modules() if isinstance(m, Router)]
    assert routers and all(torch.equal(r.bf16_weight(), r.weight.bfloat16()) for r in routers)
    router = routers[0]
    kept = router.bf16_weight()
    assert router.bf16_weight() is kept
    with torch.no_grad():
        router.weight[0, 0] += 2.0 ** -20                  # no longer a bf16 value
    assert router.bf16_weight() is None
    with torch.no_grad():
        router.weight.copy_(router.weight.bfloat16().float() * 2)
    assert torch.equal(router.bf16_weight(), router.weight.bfloat16())


@pytest.mark.gpu
def test_gpu_bf16_weights_take_cublas_bf16_from_its_token_count():
    """On CUDA with the Triton ops and bf16 weight values: from BF16_GEMM_MIN_TOKENS rows the logits
    are cuBLAS's bf16 GEMM with fp32 output (bitwise), below it the FMA tile's; all within fp32
    rounding of the float64 product; a weight that is not bf16 keeps torch's fp32 GEMM."""
    from dsaspec.layers.moe import BF16_GEMM_MIN_TOKENS, Router
    from dsaspec.ops.moe_router import decode_tile, router_logits

    device = torch.device("cuda")
    config = get_config("glm5-fp8-tp8-rank")
    router = Router(config, device).eval()
    router.use_triton = True
    gen = torch.Generator(device=device).manual_seed(8)
    x = torch.randn(256, config.hidden_size, device=device, generator=gen).bfloat16()
    with torch.no_grad():
        weight = torch.randn(router.weight.shape, device=device, generator=gen) / config.hidden_size ** 0.5
        router.weight.copy_(weight.bfloat16().float())
        for tokens in (1, BF16_GEMM_MIN_TOKENS - 1, BF16_GEMM_MIN_TOKENS, 32, 256):
            got = router.logits(x[:tokens])
            exact = (x[:tokens].double() @ router.weight.double().t()).float()
            torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-5)
            if tokens >= BF16_GEMM_MIN_TOKENS:
                want = torch.mm(x[:tokens], router.weight.bfloat16().t(), out_dtype=torch.float32)
            else:
                want = router_logits(x[:tokens], router.weight, config=decode_tile(tokens))
            assert torch.equal(got, want), tokens
        router.weight.copy_(weight)
        assert torch.equal(router.logits(x[:32]), torch.nn.functional.linear(x[:32].float(), weight))
