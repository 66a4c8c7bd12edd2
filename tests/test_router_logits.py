"""The router's GEMM (dsaspec.ops.moe_router.router_logits) against its float64 definition
(dsaspec.reference.moe_router.router_logits): within the worst-case bound of an fp32 sum of K
products, at the presets' widths and odd ones (K not a multiple of the block, one expert, experts
not a multiple of the tile), token counts around the tile edges, bf16 and fp32 rows, strided rows;
a bf16 weight against the fp32 weight of its values, bit for bit;
each token's bits independent of the other tokens and of T; poisoned rows kept to themselves;
bad arguments named."""

import pytest
import torch

from compile_scripts import compiled_counts
from dsaspec.ops import moe_router
from dsaspec.ops.moe_router import RouterGemmConfig, router_logits
from dsaspec.reference import moe_router as ref

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

WIDE = RouterGemmConfig(rows=16, experts=16, block_k=256, num_warps=4)   # fewer programs for the interpreter


def _rows(tokens: int, k: int, dtype, device, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, k, generator=gen).to(dtype).to(device)


def _weight(experts: int, k: int, device, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(experts, k, generator=gen) / k ** 0.5).to(device)


def _assert_within_fp32_sum_bound(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """|got - exact| <= K u / (1 - K u) * (|x| @ |w|^T): the bound of any order of an fp32 sum of K
    exact products (bf16 x fp32 and fp32 x fp32 products are rounded once: K + 1 terms)."""
    k = x.shape[1]
    u = 2.0 ** -24
    gamma = (k + 1) * u / (1 - (k + 1) * u)
    exact = ref.router_logits(x, w)
    bound = gamma * (x.cpu().double().abs() @ w.cpu().double().abs().T)
    err = (got.cpu().double() - exact).abs()
    assert got.dtype == torch.float32
    assert bool((err <= bound).all()), f"max error {err.max().item():.3g} over bound {bound.max().item():.3g}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens, experts, k, config", [
    (1, 256, 6144, None),            # a GLM-5 decode row, the default tile
    (3, 256, 1000, None),            # K not a multiple of block_k
    (5, 7, 300, None),               # experts not a multiple of the tile
    (1, 1, 64, None),
    (63, 24, 512, WIDE), (64, 24, 512, WIDE), (65, 24, 512, WIDE), (129, 40, 1024, WIDE),
])
def test_matches_the_float64_definition(tokens, experts, k, config, dtype, device):
    x = _rows(tokens, k, dtype, device)
    w = _weight(experts, k, device)
    out = torch.full((tokens, experts), float("nan"), device=device)
    got = router_logits(x, w, out, config=config)
    assert got is out
    _assert_within_fp32_sum_bound(got, x, w)


@pytest.mark.parametrize("config", [None, WIDE, RouterGemmConfig(rows=2, experts=4, block_k=128, num_warps=2)],
                         ids=["default", "wide", "narrow"])
def test_each_token_alone_is_the_same_bits(config, device):
    """A token's logits are the same bits alone, at other positions, in other batches; NaN / inf
    rows poison only themselves."""
    tokens, experts, k = 37, 24, 700
    x = _rows(tokens, k, torch.bfloat16, device, seed=3)
    x[5, 17] = float("nan")
    x[20, 3] = float("inf")
    w = _weight(experts, k, device, seed=4)
    full = router_logits(x, w, config=config).cpu()
    assert full[5].isnan().all() and not full[[r for r in range(tokens) if r not in (5, 20)]].isnan().any()
    for rows in ([0], [36], [16, 17], list(range(31, 37)), [36, 0, 18]):
        part = router_logits(x[rows], w, config=config).cpu()
        assert torch.equal(part.view(torch.int32), full[rows].view(torch.int32)), rows


@pytest.mark.parametrize("config", [None, WIDE, RouterGemmConfig(rows=1, experts=1, block_k=256, num_warps=4)],
                         ids=["default", "wide", "one_row"])
def test_a_bf16_weight_gives_its_fp32_values_bits(config, device):
    """The weight stored as bf16 and as the fp32 tensor of the same values (the checkpoints' gate
    weights): the same logits, bit for bit (bf16 converts to fp32 exactly), on bf16 and fp32 rows."""
    w = _weight(24, 700, device, seed=8).bfloat16()
    for dtype in (torch.bfloat16, torch.float32):
        x = _rows(5, 700, dtype, device, seed=9)
        got, want = router_logits(x, w, config=config), router_logits(x, w.float(), config=config)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_reads_strided_rows_and_writes_only_its_region(device):
    x = _rows(6, 2 * 320, torch.bfloat16, device, seed=5)[:, :320]      # row stride 640
    w = _weight(9, 320, device, seed=6)
    out = torch.full((6, 12), -3.0, device=device)
    router_logits(x, w, out[:, :9])
    assert torch.equal(out[:, :9].cpu(), router_logits(x.contiguous(), w).cpu())
    assert bool((out[:, 9:] == -3.0).all())


def test_no_tokens_launches_nothing(device):
    out = router_logits(torch.empty(0, 64, dtype=torch.bfloat16, device=device), _weight(8, 64, device))
    assert out.shape == (0, 8)


def test_tiles_compile_for_sm90_without_spills():
    """Without a GPU: the row-invariant tile and each decode tile compile for sm_90 without spilled
    registers (scripts/compile_decode_epilogues.py, in a subprocess)."""
    tiles = [(1, RouterGemmConfig()), *moe_router._DECODE_TILES]
    rows = compiled_counts("compile_decode_epilogues", "(c.compile_router_logits(t, n) for n, t in "
                           "[(1, c.moe_router.RouterGemmConfig()), *c.moe_router._DECODE_TILES])", ("regs", "spill"))
    assert len(rows) == len(tiles)
    for r in rows:
        assert 0 < r["regs"] <= 255 and r["spill"] == 0, r


@pytest.mark.gpu
@pytest.mark.parametrize("k", [6144, 7168])
def test_gpu_production_sizes(k):
    """The GLM-5 / DeepSeek-V3.2 router (E 256, K 6144 / 7168) at decode, verify and prefill token
    counts in the default tile: within the bound, and every token the bits of its single-row call."""
    device = torch.device("cuda")
    w = _weight(256, k, device, seed=7)
    x = _rows(256, k, torch.bfloat16, device, seed=8)
    alone = torch.cat([router_logits(x[t:t + 1], w) for t in range(256)])
    for tokens in (1, 4, 32, 128, 256):
        got = router_logits(x[:tokens], w)
        _assert_within_fp32_sum_bound(got, x[:tokens], w)
        assert torch.equal(got.view(torch.int32), alone[:tokens].view(torch.int32)), tokens


def _t(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype)


@pytest.mark.parametrize("call, message", [
    (lambda: router_logits(_t(2, 8, dtype=torch.float16), _t(4, 8)), "x: expected dtype"),
    (lambda: router_logits(_t(2, 8, dtype=torch.bfloat16), _t(4, 8, dtype=torch.float16)), "weight: expected dtype"),
    (lambda: router_logits(_t(2, 8), _t(4, 9)), "weight: expected shape"),
    (lambda: router_logits(_t(2, 3, 8), _t(4, 8)), "x: expected 2 dimensions"),
    (lambda: router_logits(_t(2, 8), _t(4, 8), _t(2, 4, dtype=torch.bfloat16)), "out: expected dtype"),
    (lambda: router_logits(_t(2, 8), _t(4, 8), _t(3, 4)), "out: expected shape"),
    (lambda: RouterGemmConfig(rows=3), "config.rows: expected a power of two, got 3"),
    (lambda: RouterGemmConfig(block_k=0), "config.block_k: expected a power of two, got 0"),
])
def test_bad_arguments_are_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()
