"""The indexer's head weights in one kernel (Triton): ``weights_proj`` in fp32 and its scale,

    out[r, h] = (sum_k float(x[r, k]) * float(W[h, k])) * scale      (fp32 products and sums)

as HF runs that module (``_keep_in_fp32_modules``: the input cast to fp32, an fp32 GEMM, then
``index_head_dim**-0.5 * index_n_heads**-0.5``). A skinny GEMM (N = the index heads, K = hidden,
R = 1..256 rows), split over K: program ``(row tile, head, split)`` owns 8 rows, one head and the
``split``-th of ``S`` chunks of K (whole 256-wide blocks, the last chunk shorter). ``S`` comes from
N, K and the device only (:func:`index_weights_splits`: about two programs per SM at one row tile,
every chunk at least two blocks; GLM-5's 32 heads x 6144: 8 chunks of 3 blocks, DeepSeek-V3.2's 64
x 7168: 4 of 7, on the H200's 132 SMs), so a decode row fills the GPU instead of 32 / 64 programs
each walking K alone, and a row's bits never depend on the row count or the other rows.

Summation order, per row and head: a split keeps an fp32 ``[8, 256]`` tile of products, each
column accumulating its chunk's blocks in order (``acc = fma(x, w, acc)``), then sums the tile's
256 columns once (``tl.sum``) into its partial ``p_s``;
the program that arrives last at the (row tile, head) (an atomic counter, which it resets to 0,
so the launch is CUDA-graph safe and leaves the counters as it found them) adds the partials in
split order, ``((p_0 + p_1) + p_2) + ... + p_(S-1)``, and multiplies by ``scale``. The order of
arrival decides who sums, never the order of the sum (one launch: a second, combining launch
would cost at one row about what the split saves). Where ``S`` is 1 (K of at most 3 blocks,
or more heads than SMs) the program writes ``p_0 * scale`` itself. The sums run in their own
order against torch's GEMM.

Split launches share the row-invariant GEMM's tile counters
(:mod:`dsaspec.ops.row_invariant`): the first one on a device allocates them, outside CUDA-graph
capture, and two split launches must not run at the same time on different streams of a device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsaspec.ops.checks import check_tensor
from dsaspec.ops.device import last_to_arrive, tile_counters
from dsaspec.ops.row_invariant import _k_split, split_k_for

_FLOAT_DTYPES = (torch.bfloat16, torch.float32)
_BLOCK_M, _BLOCK_K, _STAGES = 8, 256, 3


@triton.jit
def head_weights_program(pid, x_ptr, w_ptr, out_ptr, ws_ptr, counters_ptr, M, N, K, scale, stride_x, stride_w,
                         stride_out, k_blocks_per_split, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    """Program ``pid`` of the launch the module docstring describes (also run inside another
    launch's grid: :func:`~dsaspec.ops.index_rope.indexer_epilogues`)."""
    # splits vary fastest, then heads: the programs of one row tile run together (x from L2)
    split = pid % SPLITS
    tile = pid // SPLITS
    head = (tile % N).to(tl.int64)
    rows = (tile // N) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    k_lo = split * k_blocks_per_split * BLOCK_K
    k_hi = tl.minimum(K, k_lo + k_blocks_per_split * BLOCK_K)
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_x + ks[None, :]
    w_ptrs = w_ptr + head * stride_w + ks
    products = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
    for k in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        k_ok = k + ks < k_hi
        x = tl.load(x_ptrs + k, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptrs + k, mask=k_ok, other=0.0).to(tl.float32)
        # an explicit FMA: the same bits in a launch compiled without FMA contraction
        products = tl.fma(x, w[None, :], products)
    partial = tl.sum(products, 1)
    out_ptrs = out_ptr + rows.to(tl.int64) * stride_out + head
    if SPLITS == 1:
        tl.store(out_ptrs, partial * scale, mask=row_ok)
    else:
        ws_tile = ws_ptr + tile.to(tl.int64) * (SPLITS * BLOCK_M) + tl.arange(0, BLOCK_M)
        tl.store(ws_tile + split * BLOCK_M, partial)
        if last_to_arrive(counters_ptr + tile, SPLITS):
            total = tl.load(ws_tile, cache_modifier=".cg")
            for s in tl.static_range(1, SPLITS):
                total += tl.load(ws_tile + s * BLOCK_M, cache_modifier=".cg")
            tl.store(out_ptrs, total * scale, mask=row_ok)


@triton.jit(do_not_specialize=["M"])
def _index_weights_kernel(x_ptr, w_ptr, out_ptr, ws_ptr, counters_ptr, M, N, K, scale, stride_x, stride_w,
                          stride_out, k_blocks_per_split, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    head_weights_program(tl.program_id(0), x_ptr, w_ptr, out_ptr, ws_ptr, counters_ptr, M, N, K, scale, stride_x,
                         stride_w, stride_out, k_blocks_per_split, SPLITS, BLOCK_M, BLOCK_K, STAGES)


def index_weights_splits(heads: int, k: int, device: torch.device | str) -> tuple[int, int]:
    """``(K blocks per chunk, chunks S)`` of :func:`index_weights` for ``heads`` x ``k`` weights
    on ``device``: the row-invariant GEMM's split rule at one head a tile
    (:func:`~dsaspec.ops.row_invariant.split_k_for`: ``min(2 * SMs // heads, K-blocks // 2, 32)``
    chunks, at least 1, none empty; SMs: the device's, 132 off-GPU). Independent of the rows."""
    return _k_split(k, _BLOCK_K, split_k_for(heads, k, 1, _BLOCK_K, device))


@dataclass(frozen=True)
class HeadWeightsLaunch:
    """A checked :func:`index_weights` call, ready to run: ``out`` (fp32 ``[R, N]``, written by
    the launch), its ``programs`` and ``args`` / ``constexprs`` for :func:`head_weights_program`
    (after the program id)."""

    out: torch.Tensor
    programs: int
    args: tuple
    constexprs: dict

    @classmethod
    def absent(cls, placeholder: torch.Tensor) -> "HeadWeightsLaunch":
        """No head weights: no programs, arguments of the right kinds (``placeholder`` for the
        pointers, never read) for a launch that compiles the part out."""
        return cls(placeholder, 0, (placeholder,) * 5 + (0, 1, 0, 0.0, 0, 0, 0, 1),
                   dict(SPLITS=1, BLOCK_M=1, BLOCK_K=1, STAGES=1))


def prepare_index_weights(x: torch.Tensor, weight: torch.Tensor, scale: float, *, weight_name: str = "weight",
                          device: torch.device | None = None) -> HeadWeightsLaunch:
    """Check :func:`index_weights`'s arguments (``weight`` named ``weight_name`` in errors; ``x``
    on ``device`` when given) and allocate its output, workspace and counters."""
    check_tensor("x", x, dtype=_FLOAT_DTYPES, ndim=2, device=device)
    rows, k = x.shape
    check_tensor(weight_name, weight, dtype=_FLOAT_DTYPES, shape=(None, k), device=x.device)
    heads = weight.shape[0]
    out = torch.empty(rows, heads, dtype=torch.float32, device=x.device)
    if not rows or not heads:
        return HeadWeightsLaunch.absent(out)
    per_split, splits = index_weights_splits(heads, k, x.device)
    tiles = triton.cdiv(rows, _BLOCK_M) * heads
    if splits > 1:
        counters = tile_counters(x.device, tiles)
        workspace = torch.empty(tiles * splits * _BLOCK_M, dtype=torch.float32, device=x.device)
    else:
        counters = workspace = out  # not read by a one-split launch
    args = (x, weight, out, workspace, counters, rows, heads, k, float(scale), x.stride(0), weight.stride(0),
            out.stride(0), per_split)
    return HeadWeightsLaunch(out, tiles * splits, args,
                             dict(SPLITS=splits, BLOCK_M=_BLOCK_M, BLOCK_K=_BLOCK_K, STAGES=_STAGES))


def index_weights(x: torch.Tensor, weight: torch.Tensor, scale: float) -> torch.Tensor:
    """``(x.float() @ weight.float().T) * scale``: ``x`` ``[R, K]`` (bf16 or fp32, unit last
    stride, any row stride), ``weight`` ``[N, K]`` (bf16 or fp32, unit last stride) -> a new fp32
    tensor ``[R, N]``, summed in K chunks in the order of the module docstring. A split launch
    (``S > 1``, :func:`index_weights_splits`) also takes an fp32 workspace of ``8 S`` values per 8 rows
    and head and the device's tile counters (allocated on the first split launch: make it
    outside CUDA-graph capture)."""
    launch = prepare_index_weights(x, weight, scale)
    if launch.programs:
        _index_weights_kernel[(launch.programs,)](*launch.args, **launch.constexprs)
    return launch.out
