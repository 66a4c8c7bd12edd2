"""The router's GEMM and selection in one launch (dsaspec.ops.moe_router.route_rows) against the
two launches it replaces (router_logits, then route_topk; each tested against its plain-torch
definition in test_router_logits.py / test_moe_router.py), bit for bit: the presets' routing and
an odd one, token counts 1 / 2 / 3 / 16 (partial row tiles), K not a multiple of the block, bf16 and
fp32 rows, shared slots; the tile counters left zero so a second call (a graph replay) selects
again; the Router taking it with ``one_launch``; bad arguments named. On the GPU: the GLM-5 rank's
sizes, every decode tile, and CUDA-graph replays with new rows."""

import pytest
import torch

from dsaspec.configs.model_config import get_config
from dsaspec.ops.moe_router import DECODE_MAX_TOKENS, RouterGemmConfig, decode_tile, route_rows, route_topk, router_logits
from dsaspec.ops.row_invariant import _tile_counters

# (experts, n_group, topk_group, top_k, n_shared): GLM-5 (one group, a shared slot), DeepSeek-V3.2
# (4 of 8 groups), groups of 12 experts
ROUTINGS = ((256, 1, 1, 8, 1), (256, 8, 4, 8, 0), (96, 8, 3, 6, 2))
ODD_TILE = RouterGemmConfig(rows=2, experts=4, block_k=64, num_warps=2)


def _inputs(tokens: int, experts: int, k: int, dtype, device, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=gen).to(dtype)
    weight = torch.randn(experts, k, generator=gen) / k ** 0.5
    bias = torch.randn(experts, generator=gen) * 0.1
    return x.to(device), weight.to(device), bias.to(device)


def _assert_two_launches(x, weight, bias, config, **routing):
    ids, weights = route_rows(x, weight, bias, config=config, **routing)
    want_ids, want_weights = route_topk(router_logits(x, weight, config=config), bias, **routing)
    assert torch.equal(ids, want_ids)
    assert torch.equal(weights.view(torch.int32), want_weights.view(torch.int32))


@pytest.mark.interpreter
@pytest.mark.parametrize("experts, n_group, topk_group, top_k, n_shared", ROUTINGS)
def test_the_same_bits_as_the_two_launches(experts, n_group, topk_group, top_k, n_shared, device):
    routing = dict(top_k=top_k, n_group=n_group, topk_group=topk_group, norm_topk_prob=True, scaling=2.5,
                   n_shared=n_shared)
    for tokens, config, dtype in ((1, decode_tile(1), torch.bfloat16), (3, ODD_TILE, torch.float32),
                                  (16, RouterGemmConfig(), torch.bfloat16)):
        x, weight, bias = _inputs(tokens, experts, 130, dtype, device, seed=tokens + experts)
        _assert_two_launches(x, weight, bias, config, **routing)


@pytest.mark.interpreter
def test_counters_are_left_zero_and_a_second_call_selects_again(device):
    """The last program of a row tile resets its counter: a second call with other rows (what a
    graph replay does) selects again, from its own logits."""
    routing = dict(top_k=3, n_group=4, topk_group=2, norm_topk_prob=False, scaling=1.0)
    for seed in (1, 2):
        x, weight, bias = _inputs(5, 16, 70, torch.float32, device, seed)
        _assert_two_launches(x, weight, bias, ODD_TILE, **routing)
        assert not _tile_counters(x.device, 3).any()


@pytest.mark.interpreter
def test_no_tokens_launches_nothing(device):
    _, weight, bias = _inputs(1, 16, 70, torch.float32, device, 0)
    ids, weights = route_rows(torch.empty(0, 70, device=device), weight, bias, top_k=3, n_group=4, topk_group=2,
                              norm_topk_prob=True, scaling=1.0, n_shared=1)
    assert ids.shape == weights.shape == (0, 4)


@pytest.mark.parametrize("change, message", [
    (dict(x=torch.zeros(DECODE_MAX_TOKENS + 1, 8)), f"x: expected at most {DECODE_MAX_TOKENS} rows, got"),
    (dict(x=torch.zeros(2, 8, dtype=torch.float16)), "x: expected dtype in"),
    (dict(weight=torch.zeros(16, 8, dtype=torch.bfloat16)), "weight: expected dtype torch.float32"),
    (dict(weight=torch.zeros(16, 9)), r"weight: expected shape \('\*', 8\), got \(16, 9\)"),
    (dict(bias=torch.zeros(15)), r"bias: expected shape \(16,\)"),
    (dict(n_group=3), "n_group: expected a divisor of the 16 experts"),
    (dict(top_k=9), "top_k: expected at most topk_group x experts a group = 8, got 9"),
])
def test_bad_arguments_are_named(change, message):
    args = dict(x=torch.zeros(2, 8), weight=torch.zeros(16, 8), bias=torch.zeros(16), top_k=4, n_group=4,
                topk_group=2, norm_topk_prob=True, scaling=1.0) | change
    with pytest.raises(ValueError, match=message):
        route_rows(args.pop("x"), args.pop("weight"), args.pop("bias"), **args)


@pytest.mark.interpreter
def test_router_takes_one_launch_where_its_gemm_is_the_triton_tile(monkeypatch):
    """With the Triton ops a Router of at most DECODE_MAX_TOKENS rows runs route_rows when
    ``one_launch`` and the two launches when not, the same bits; above, the two launches."""
    import dsaspec.layers.moe as moe_module
    from dsaspec.models.dsa_model import DSAModel

    config = get_config("tiny-moe")
    model = DSAModel(config, dtype=torch.float32, use_triton=True).init_weights(2)
    router = next(m for m in model.modules() if isinstance(m, moe_module.Router))
    with torch.no_grad():
        router.e_score_correction_bias.copy_(
            torch.randn(config.n_routed_experts, generator=torch.Generator().manual_seed(4)) * 0.1)
    calls = []
    for name in ("route_rows", "route_topk"):
        real = getattr(moe_module, name)
        monkeypatch.setattr(moe_module, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    x = torch.randn(DECODE_MAX_TOKENS + 1, config.hidden_size, generator=torch.Generator().manual_seed(3))
    one = router(x[:5], shared=1)
    router.one_launch = False
    two = router(x[:5], shared=1)
    router.one_launch = True
    router(x)
    assert calls == ["route_rows", "route_topk", "route_topk"]
    assert torch.equal(one[0], two[0]) and torch.equal(one[1].view(torch.int32), two[1].view(torch.int32))


def test_tiles_compile_for_sm90_without_spills():
    """Without a GPU: each decode tile and the row-invariant tile, with GLM-5's and DeepSeek-V3.2's
    routing, compile for sm_90 without spilled registers (scripts/compile_decode_epilogues.py, in a
    subprocess)."""
    from compile_scripts import compiled_counts

    rows = compiled_counts("compile_decode_epilogues", "(c.compile_route_rows(t, n, r) for n, t in "
                           "[(1, c.moe_router.RouterGemmConfig()), *c.moe_router._DECODE_TILES] for r in c.ROUTINGS)",
                           ("regs", "spill"))
    assert len(rows) == 2 * 4
    for r in rows:
        assert 0 < r["regs"] <= 255 and r["spill"] == 0, r


@pytest.mark.gpu
def test_gpu_glm5_rank_every_decode_tile_and_graph_replays():
    """On CUDA at the GLM-5 rank's router (K 6144, E 256, a shared slot): the two launches' bits at
    every T up to DECODE_MAX_TOKENS in its decode tile and the row-invariant mode's, and a graph
    of route_rows replayed over new rows matches the two launches each time."""
    device = torch.device("cuda")
    config = get_config("glm5-fp8-tp8-rank")
    routing = dict(top_k=config.num_experts_per_tok, n_group=config.n_group, topk_group=config.topk_group,
                   norm_topk_prob=config.norm_topk_prob, scaling=config.routed_scaling_factor, n_shared=1)
    experts, k = config.n_routed_experts, config.hidden_size
    for tokens in range(1, DECODE_MAX_TOKENS + 1):
        x, weight, bias = _inputs(tokens, experts, k, torch.bfloat16, device, seed=tokens)
        for tile in (decode_tile(tokens), RouterGemmConfig()):
            _assert_two_launches(x, weight, bias, tile, **routing)
    x, weight, bias = _inputs(2, experts, k, torch.bfloat16, device, seed=99)
    route_rows(x, weight, bias, config=decode_tile(2), **routing)   # warm-up: compiles, allocates the counters
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, weights = route_rows(x, weight, bias, config=decode_tile(2), **routing)
    for seed in range(5):
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to(device, torch.bfloat16))
        graph.replay()
        want_ids, want_weights = route_topk(router_logits(x, weight, config=decode_tile(2)), bias, **routing)
        assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)
