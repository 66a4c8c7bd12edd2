"""The MoE router's selection in one kernel (Triton): from the router GEMM's fp32 logits ``l [T, E]``
to each token's ``k`` expert ids and weights, the ``noaux_tc`` rule of GLM-5 / DeepSeek-V3.2
(:class:`dsaspec.layers.moe.Router`), instead of some fifteen torch launches. Per token, in fp32:

    s = 1 / (1 + exp(-l))                           the scores
    c = s + bias                                    (selection only)
    group score = the largest plus the second largest c of each of G groups of E / G experts
    ids = the k largest c over the experts of the topk_group best groups, largest first
    w_j = s[ids_j];  with norm: w_j = w_j / ((((w_0 + w_1) + w_2) + ... + w_(k-1)) + 1e-20)
    w_j = w_j * scaling

``exp`` is the CUDA math library's ``expf`` on the GPU (libdevice, what torch's ``sigmoid`` calls)
and the divisions IEEE (``div.rn``), so the scores are torch's ``sigmoid`` bits; under the Triton
interpreter ``exp`` is numpy's. Equal values (a group score or a ``c``) go to the lower index,
where ``torch.topk`` leaves the order of ties open; the sum of the weights runs in id order, where
the torch router's ``sum`` runs in its own order, so a weight can differ from the torch router's
in its last bit. One program per token: a token's ids and weights depend on its own logits only.
The program is one warp: its reductions over the E values (eight a lane at E = 256) run as warp
shuffles, without the shared-memory round trips and barriers of four warps; the warp count changes
no bit (maxima are exact). Each value is ranked by one int64 key, its fp32 bits as an order-keeping
signed int over ``2**31 - 1 - index``, so one maximum finds the largest value and its lowest
index, and a top-k step is that one reduction; a selected expert's weight is its score computed
again from its logit (a load). Routing over all groups (``topk_group == n_group``) skips the group
scores.

With ``n_shared`` the kernel also writes the shared experts' slots of the fused MoE
(:mod:`dsaspec.ops.fused_moe`): slots ``k .. k + n_shared - 1`` of each token hold ids ``E ..
E + n_shared - 1`` and weight 1.0 (the shared experts as extra experts after the routed ones, on
every token, unscaled), in the same launch.

The router's GEMM (:func:`router_logits`) has a kernel of its own: fp32 logits ``x @ W^T`` from
the bf16 hidden rows as stored and the gate weight ``W [E, hidden]`` (fp32, or bf16 where its
values are bf16's: half the bytes, the same logits), by FMAs in fp32 (no ``x.float()`` copy; bf16
converts to fp32 exactly). A program holds a tile of ``rows`` tokens x
``experts`` experts and walks K in blocks of ``block_k``: per block, each (token, expert) sum of
its ``block_k`` products is one reduction over the block, added to the running sum in K order. The
tile, block and warps are a :class:`RouterGemmConfig` the caller passes; for a fixed one a token's
logits are the same bits whatever the other tokens are (a reduction's order is the layout's, the
same for every row of the tile), so the row-invariant mode passes one for every T and the default
mode the fastest for its T (:func:`decode_tile`). At decode sizes the weight (6-7 MB at E = 256)
is the traffic (3-3.5 MB as bf16): small expert tiles put a program on every SM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsaspec.ops.checks import check_count, check_tensor
from dsaspec.ops.device import enter_chain, interpreted, supports_pdl
from dsaspec.ops.silu_and_mul import torch_exp


@triton.jit
def _ranked(value, index):
    """int64 keys whose order is ``value``'s (fp32, never -0.0 or NaN), then the lower ``index``
    (int32, in ``[0, 2**31)``): one maximum finds both the largest value and its lowest index."""
    bits = value.to(tl.int32, bitcast=True)
    order = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)   # signed ints in the floats' order
    return (order.to(tl.int64) << 32) | (0x7FFFFFFF - index).to(tl.int64)


@triton.jit
def _ranked_value(key):
    """The fp32 value of a :func:`_ranked` key."""
    order = (key >> 32).to(tl.int32)
    return tl.where(order < 0, order ^ 0x7FFFFFFF, order).to(tl.float32, bitcast=True)


@triton.jit
def _ranked_index(key):
    """The index of a :func:`_ranked` key."""
    return 0x7FFFFFFF - (key & 0x7FFFFFFF).to(tl.int32)


@triton.jit
def _router_kernel(logits_ptr, bias_ptr, ids_ptr, weights_ptr, stride_logits, stride_ids, stride_weights,
                   scaling, GROUP: tl.constexpr, GROUPS: tl.constexpr, TOPK_GROUP: tl.constexpr,
                   TOPK: tl.constexpr, SHARED: tl.constexpr, NORM: tl.constexpr, LIBDEVICE_EXP: tl.constexpr,
                   GROUPS_PAD: tl.constexpr, GROUP_PAD: tl.constexpr, TOPK_PAD: tl.constexpr,
                   CHAINED: tl.constexpr):
    # the token's E = GROUPS * GROUP logits as a [GROUPS_PAD, GROUP_PAD] tile, expert g * GROUP + j
    enter_chain(CHAINED)
    row = tl.program_id(0).to(tl.int64)
    row_logits = logits_ptr + row * stride_logits
    g = tl.arange(0, GROUPS_PAD)[:, None]
    j = tl.arange(0, GROUP_PAD)[None, :]
    live = (g < GROUPS) & (j < GROUP)
    expert = g * GROUP + j
    logit = tl.load(row_logits + expert, mask=live, other=0.0)
    score = tl.math.div_rn(tl.full(logit.shape, 1.0, tl.float32), 1.0 + torch_exp(-logit, LIBDEVICE_EXP))
    choice = score + tl.load(bias_ptr + expert, mask=live, other=0.0)   # never -0.0: score >= +0.0
    lowest = tl.full(choice.shape, -(2 ** 63), tl.int64)               # below every key: padding, taken
    key = tl.where(live, _ranked(choice, expert), lowest)
    if TOPK_GROUP < GROUPS:
        # each group's two largest choices (equal ones both count), summed: the group's score
        first = tl.max(key, axis=1)
        second = tl.max(tl.where(key == first[:, None], lowest, key), axis=1)
        gid = tl.arange(0, GROUPS_PAD)
        no_group = tl.full((GROUPS_PAD,), -(2 ** 63), tl.int64)
        group_key = tl.where(gid < GROUPS, _ranked(_ranked_value(first) + _ranked_value(second), gid), no_group)
        # the TOPK_GROUP best groups: largest first, equal scores to the lower group
        chosen = gid < 0
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.max(group_key, axis=0)
            chosen = chosen | (group_key == best)
            group_key = tl.where(group_key == best, no_group, group_key)
        key = tl.where(chosen[:, None], key, lowest)
    # the TOPK largest choices, largest first, equal values to the lower expert id; each one's
    # score again from its logit (the same operations, so the same bits as in the tile)
    slot = tl.arange(0, TOPK_PAD)
    ids = tl.zeros((TOPK_PAD,), dtype=tl.int32)
    weights = tl.zeros((TOPK_PAD,), dtype=tl.float32)
    total = 0.0
    for t in tl.static_range(TOPK):
        best = tl.max(tl.max(key, axis=1), axis=0)
        at = _ranked_index(best)
        key = tl.where(key == best, lowest, key)
        one_plus_e = 1.0 + torch_exp(-tl.load(row_logits + at), LIBDEVICE_EXP)
        w = tl.math.div_rn(tl.full([], 1.0, tl.float32), one_plus_e)
        total = total + w
        ids = tl.where(slot == t, at, ids)
        weights = tl.where(slot == t, w, weights)
    if NORM:
        weights = tl.math.div_rn(weights, tl.broadcast_to(total + 1e-20, weights.shape))
    weights = weights * scaling
    # the shared experts' slots: experts E, E + 1, ... at weight 1.0
    ids = tl.where(slot >= TOPK, GROUPS * GROUP + slot - TOPK, ids)
    weights = tl.where(slot >= TOPK, 1.0, weights)
    keep = slot < TOPK + SHARED
    tl.store(ids_ptr + row * stride_ids + slot, ids, mask=keep)
    tl.store(weights_ptr + row * stride_weights + slot, weights, mask=keep)


def route_topk(logits: torch.Tensor, bias: torch.Tensor, *, top_k: int, n_group: int, topk_group: int,
               norm_topk_prob: bool, scaling: float, n_shared: int = 0, ids: torch.Tensor | None = None,
               weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts and routing weights from the router logits (module docstring), one launch.

    ``logits``: fp32 ``[T, E]``, last dimension contiguous; ``bias``: fp32 ``[E]`` (the
    ``e_score_correction_bias``), contiguous, same device. ``n_group`` must divide E with at least
    two experts a group, ``topk_group`` in ``[1, n_group]``, ``top_k`` in ``[1, topk_group * E /
    n_group]``, ``n_shared >= 0``. Writes and returns ``ids`` int32 ``[T, top_k + n_shared]`` and
    ``weights`` fp32 ``[T, top_k + n_shared]`` (allocated when None; last dimension contiguous):
    the routed slots, then ids ``E + s`` with weight 1.0 for ``s < n_shared``. No host sync."""
    check_tensor("logits", logits, dtype=torch.float32, ndim=2)
    tokens, experts = logits.shape
    check_tensor("bias", bias, dtype=torch.float32, shape=(experts,), device=logits.device)
    for name, value in (("top_k", top_k), ("n_group", n_group), ("topk_group", topk_group)):
        check_count(name, value)
    check_count("n_shared", n_shared, minimum=0)
    if experts % n_group or experts // n_group < 2:
        raise ValueError(f"n_group: expected a divisor of the {experts} experts leaving at least two a group, "
                         f"got {n_group}")
    group = experts // n_group
    if topk_group > n_group:
        raise ValueError(f"topk_group: expected at most n_group = {n_group}, got {topk_group}")
    if top_k > topk_group * group:
        raise ValueError(f"top_k: expected at most topk_group x experts a group = {topk_group * group}, got {top_k}")
    slots = top_k + n_shared
    if ids is None:
        ids = torch.empty(tokens, slots, dtype=torch.int32, device=logits.device)
    if weights is None:
        weights = torch.empty(tokens, slots, dtype=torch.float32, device=logits.device)
    check_tensor("ids", ids, dtype=torch.int32, shape=(tokens, slots), device=logits.device)
    check_tensor("weights", weights, dtype=torch.float32, shape=(tokens, slots), device=logits.device)
    if tokens:
        chained = supports_pdl(logits.device)
        _router_kernel[(tokens,)](
            logits, bias, ids, weights, logits.stride(0), ids.stride(0), weights.stride(0), float(scaling),
            GROUP=group, GROUPS=n_group, TOPK_GROUP=topk_group, TOPK=top_k, SHARED=n_shared,
            NORM=bool(norm_topk_prob), LIBDEVICE_EXP=not interpreted(_router_kernel),
            GROUPS_PAD=max(2, triton.next_power_of_2(n_group)), GROUP_PAD=triton.next_power_of_2(group),
            TOPK_PAD=max(2, triton.next_power_of_2(slots)), CHAINED=chained, launch_pdl=chained, num_warps=1)
    return ids, weights


@dataclass(frozen=True)
class RouterGemmConfig:
    """Tile of :func:`router_logits`: ``rows`` tokens x ``experts`` experts a program, K in blocks
    of ``block_k`` columns, ``num_warps`` warps (powers of two). Logits that must agree bitwise
    across calls need the same configuration."""

    rows: int = 4
    experts: int = 2
    block_k: int = 1024
    num_warps: int = 4

    def __post_init__(self):
        for name in ("rows", "experts", "block_k", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"config.{name}: expected a power of two, got {value}")


# The tiles of the default (not row-invariant) mode by token count, (most tokens, tile), from
# benchmarks/results/h200/router_gemm.md (GLM-5 / DeepSeek-V3.2 rank, E 256, cold L2): one token a
# program at T 1 (6.4 / 7.4 us, cuBLAS on x.float() 10.0 / 11.5), 2 x 2 at T 4 (7.7 / 9.1 against 19.1 /
# 20.5), the default 4 x 2 at T 16 (13.1 / 14.9 against 25.1 / 26.1); from T 32 cuBLAS is as fast or
# faster (21.1 against 21.7 at 32, 27.8 against 77.2 at 128), the FMA tiles being bound by their
# issue rate there. The row-invariant mode keeps the default tile at every T (10.1 us at T 1,
# 77 at 128, against 21.9 and 121 for the row-invariant GEMM on x.float()).
_DECODE_TILES = ((2, RouterGemmConfig(1, 1, 2048, 4)), (8, RouterGemmConfig(2, 2, 2048, 8)), (16, RouterGemmConfig()))
DECODE_MAX_TOKENS = _DECODE_TILES[-1][0]


def decode_tile(tokens: int) -> RouterGemmConfig:
    """The default mode's :func:`router_logits` tile for ``tokens`` rows, up to
    :data:`DECODE_MAX_TOKENS` (above, cuBLAS is the faster: the caller's choice)."""
    for most, tile in _DECODE_TILES:
        if tokens <= most:
            return tile
    raise ValueError(f"tokens: expected at most {DECODE_MAX_TOKENS} for a decode tile, got {tokens}")


EARLY_BLOCKS = tl.constexpr(2)   # the weight blocks _router_logits_kernel loads before its wait (w0, w1)


@triton.jit
def _router_weights(w_ptrs, k0, K, expert_live, BLOCK_K: tl.constexpr):
    # the weight block w[e, k0 + k] as stored, zero past K and for experts past E
    ks = tl.arange(0, BLOCK_K)
    return tl.load(w_ptrs + k0, mask=expert_live[:, None] & ((k0 + ks) < K)[None, :], other=0.0)


@triton.jit
def _router_inputs(x_ptrs, k0, K, row_live, BLOCK_K: tl.constexpr):
    # the input block x[t, k0 + k] in fp32, zero past K and for rows past the live tokens
    ks = tl.arange(0, BLOCK_K)
    return tl.load(x_ptrs + k0, mask=row_live[:, None] & ((k0 + ks) < K)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _router_block(acc, x, w):
    # acc plus one K block's reduction of x[t, k] * w[e, k]; a block past K (x and w zero) adds +0 to a
    # sum that is never -0 (it starts at +0): acc unchanged
    return acc + tl.sum(x[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)


@triton.jit(do_not_specialize=["tokens"])
def _router_logits_kernel(x_ptr, w_ptr, out_ptr, tokens, E, K, stride_x, stride_w, stride_out,
                          ROWS: tl.constexpr, EXPERTS: tl.constexpr, BLOCK_K: tl.constexpr, CHAINED: tl.constexpr):
    # out[t, e] = sum over K blocks in order of (one reduction of the block's x[t, k] * w[e, k]), fp32;
    # the first EARLY_BLOCKS weight blocks are loaded before the chain's wait (the kernel before never
    # writes the router's weight), so their latency overlaps that kernel's end
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    experts = tl.program_id(0) * EXPERTS + tl.arange(0, EXPERTS)
    ks = tl.arange(0, BLOCK_K)
    row_live = rows < tokens
    expert_live = experts < E
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_x + ks[None, :]
    w_ptrs = w_ptr + experts[:, None].to(tl.int64) * stride_w + ks[None, :]
    w0 = _router_weights(w_ptrs, 0, K, expert_live, BLOCK_K)
    w1 = _router_weights(w_ptrs, BLOCK_K, K, expert_live, BLOCK_K)
    enter_chain(CHAINED)
    acc = tl.zeros((ROWS, EXPERTS), dtype=tl.float32)
    acc = _router_block(acc, _router_inputs(x_ptrs, 0, K, row_live, BLOCK_K), w0)
    acc = _router_block(acc, _router_inputs(x_ptrs, BLOCK_K, K, row_live, BLOCK_K), w1)
    for k0 in range(EARLY_BLOCKS * BLOCK_K, K, BLOCK_K):
        x = _router_inputs(x_ptrs, k0, K, row_live, BLOCK_K)
        acc = _router_block(acc, x, _router_weights(w_ptrs, k0, K, expert_live, BLOCK_K))
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_out + experts[None, :]
    tl.store(out_ptrs, acc, mask=row_live[:, None] & expert_live[None, :])


def router_logits(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None, *,
                  config: RouterGemmConfig | None = None) -> torch.Tensor:
    """The router's fp32 logits ``out[t, e] = sum_k x[t, k] * weight[e, k]`` (module docstring),
    one launch, no host sync.

    ``x``: bf16 or fp32 ``[T, K]``, ``weight``: bf16 or fp32 ``[E, K]`` on ``x``'s device (a bf16
    weight gives the logits of its fp32 values, bit for bit), both with a contiguous last dimension
    (any row stride). Writes and returns ``out`` fp32 ``[T, E]``
    (allocated when None; contiguous last dimension). ``config`` None: :class:`RouterGemmConfig`'s
    defaults (the row-invariant mode's tile); each token's logits are bitwise independent of T and
    of the other tokens for a fixed configuration."""
    check_tensor("x", x, dtype=(torch.bfloat16, torch.float32), ndim=2)
    tokens, k = x.shape
    check_tensor("weight", weight, dtype=(torch.bfloat16, torch.float32), shape=(None, k), device=x.device)
    experts = weight.shape[0]
    if out is None:
        out = torch.empty(tokens, experts, dtype=torch.float32, device=x.device)
    check_tensor("out", out, dtype=torch.float32, shape=(tokens, experts), device=x.device)
    config = config or RouterGemmConfig()
    if tokens and experts:
        grid = (triton.cdiv(experts, config.experts), triton.cdiv(tokens, config.rows))
        chained = supports_pdl(x.device)
        _router_logits_kernel[grid](x, weight, out, tokens, experts, k, x.stride(0), weight.stride(0),
                                    out.stride(0), ROWS=config.rows, EXPERTS=config.experts,
                                    BLOCK_K=config.block_k, CHAINED=chained, launch_pdl=chained,
                                    num_warps=config.num_warps)
    return out
