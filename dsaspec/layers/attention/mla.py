"""Multi-head latent attention with DeepSeek Sparse Attention: the lightning indexer's projections,
the indexer -> top-k slot selection, and the absorbed (MQA) sparse attention over the 576-wide cache.

Per layer, a row's MLA cache entry ``[latent 512 | roped key 64]`` and indexer key are written at
its slot *before* attention, then the attention reads ``page_table_1[r, :seqlens[r]]``:

    indexer_logits -> topk_slots -> sparse_mla_decode
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from dsaspec.configs.model_config import ModelConfig
from dsaspec.distributed.tp_group import TPGroup
from dsaspec.forward_mode import PREFILL_MIN_ROWS
from dsaspec.layers.attention.inputs import NO_WORKSPACE, AttentionInputs
from dsaspec.layers.fp8_linear import Fp8Input, act_quant_of
from dsaspec.layers.fused_linear import HoldsFusedLinear, fuse_linears
from dsaspec.layers.linear import COLUMN, ROW, bmm, make_linear
from dsaspec.layers.norm import LayerNorm, RMSNorm
from dsaspec.layers.rotary import apply_rope, apply_rope_first
from dsaspec.layers.row_invariant import RowInvariant, row_invariant_ops
from dsaspec.ops.indexer import default_indexer_programs
from dsaspec.ops.kv_cache_layout import is_fp8_cache
from dsaspec.ops.mla_latent import decode_tiles


@dataclass
class ForwardState:
    """What every layer of one forward reads: RoPE cos/sin fp32 ``[R, rope/2]``, the rows' KV
    slots, the attention inputs, the ops, whether the ops run their value checks (host syncs),
    and ``selected``: the KV slots int32 ``[R, k]`` the last indexer chose (a shared-indexer
    layer attends to them). ``seeded``: ``selected`` was given up front (IndexShare draft steps)
    and no indexer runs. ``schedule``: where ``attn`` brings no indexer schedule (eager steps), the
    one the forward's first indexer wrote, which its other layers reuse (their rows, lengths, index
    heads and key cache dtype are the same)."""

    cos: torch.Tensor
    sin: torch.Tensor
    out_cache_loc: torch.Tensor
    attn: AttentionInputs
    ops: SimpleNamespace
    check_values: bool
    selected: torch.Tensor | None = None
    seeded: bool = False
    schedule: torch.Tensor | None = None


@functools.lru_cache(maxsize=8)
def hadamard_matrix(n: int, device: torch.device) -> torch.Tensor:
    """The ``n x n`` Sylvester Hadamard matrix scaled by ``n**-0.5`` (fp32, orthonormal and
    symmetric): ``x @ H`` is the fast Walsh-Hadamard transform of ``x``'s rows in natural order,
    as DeepSeek-V3.2's ``rotate_activation``. ``n`` a power of two. One shared tensor per
    ``(n, device)`` (read only; first built in the eager warm-up, before any graph capture)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"n: expected a power of two, got {n}")
    h = torch.ones(1, 1, device=device)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h * n ** -0.5


class Indexer(RowInvariant, nn.Module):
    """The lightning indexer's projections: ``wq_b`` (q latent -> heads x 128), ``wk`` + LayerNorm
    ``k_norm`` (hidden -> 128, one key per token), ``weights_proj`` (hidden -> one weight per head).

    With an FP8 key cache the query and key are rotated by the 128-wide Hadamard matrix
    (:func:`hadamard_matrix`) after RoPE, before the key is quantized into the cache and the query
    in the indexer op, as DeepSeek-V3.2's reference and the serving engines do (for both DSA model
    types, docs/fp8-kv-cache.md). The rotation is orthonormal, so it changes no logit but the
    quantization error (it spreads outlier channels over the 128-value group); a bf16 cache is
    read unrotated."""

    def __init__(self, config: ModelConfig, device=None, dtype=None):
        super().__init__()
        self.config = config
        self.wq_b = make_linear(config.q_lora_rank, config.index_n_heads * config.index_head_dim, device, dtype)
        self.wk = make_linear(config.hidden_size, config.index_head_dim, device, dtype)
        self.k_norm = LayerNorm(config.index_head_dim, config.attn_norm_eps, device, dtype)
        self.weights_proj = make_linear(config.hidden_size, config.index_n_heads, device, dtype)

    def forward(self, x, q_latent, step: ForwardState, index_k_cache, wk_out=None, wq_b_out=None):
        """Write each row's key into ``index_k_cache[out_cache_loc]``; return the query
        ``[R, index_n_heads, 128]`` (model dtype; both Hadamard-rotated with an FP8 cache) and
        head weights fp32 ``[R, index_n_heads]``
        (``weights_proj(x) * index_head_dim**-0.5 * index_n_heads**-0.5``). ``wk_out``: ``wk(x)``
        when the caller computed it (fused with the layer's other projections of ``x``);
        ``wq_b_out``: ``wq_b(q_latent)`` ``[R, index_n_heads * 128]`` when the caller computed it
        (fused with ``q_b_proj``; a column view, unit last stride); else ``q_latent``, the tensor or
        its :class:`~dsaspec.layers.fp8_linear.Fp8Input`, is read by ``wq_b`` alone."""
        cfg = self.config
        rows = x.shape[0]
        rope, interleaved = cfg.qk_rope_head_dim, cfg.indexer_rope_interleave
        wq_b_out = self.wq_b(q_latent) if wq_b_out is None else wq_b_out
        q = wq_b_out.view(rows, cfg.index_n_heads, cfg.index_head_dim)
        wk_out = self.wk(x) if wk_out is None else wk_out
        if step.ops.indexer_epilogues is not None:   # the Triton ops: q's, k's and the weights' in one launch
            # prefill chunks: the launch's head-weight programs read the hidden rows once per head
            # (0.45 ms a 4,096-row chunk of the GLM-5 rank, benchmarks/results/h200/logs/
            # prefill_glm5_rank_session22.md); one GEMM instead, another summation order
            gemm_weights = not self.row_invariant and rows >= PREFILL_MIN_ROWS
            q, weights = step.ops.indexer_epilogues(q, index_k_cache, step.out_cache_loc, wk_out, self.k_norm.weight,
                                                    self.k_norm.bias, self.k_norm.eps, step.cos, step.sin, rope,
                                                    interleaved, None if gemm_weights else x,
                                                    self.weights_proj.weight, cfg.index_weight_scale,
                                                    check_values=step.check_values)
            return q, self._prefill_head_weights(x) if gemm_weights else weights
        q = apply_rope_first(q, rope, step.cos, step.sin, interleaved)
        k = apply_rope_first(self.k_norm(wk_out), rope, step.cos, step.sin, interleaved)
        if is_fp8_cache(index_k_cache):
            q, k = self._rotate(q), self._rotate(k)
        step.ops.store_index_k(index_k_cache, step.out_cache_loc, k, check_values=step.check_values)
        return q, self._head_weights(x)

    def _head_weights(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 ``[R, index_n_heads]``: ``weights_proj`` in fp32 (the row-invariant GEMM when
        ``row_invariant``, else torch's) times ``index_weight_scale``."""
        linear = row_invariant_ops().linear if self.row_invariant else F.linear
        return linear(x.float(), self.weights_proj.weight.float()) * self.config.index_weight_scale

    def _prefill_head_weights(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`_head_weights` of a default-mode prefill chunk: on CUDA with bf16 rows and
        weight, cuBLAS's bf16 GEMM with fp32 output (the products exact in fp32 either way, the
        sums fp32 in its order), without the fp32 copies of the rows and the weight."""
        weight = self.weights_proj.weight
        if x.is_cuda and x.dtype == weight.dtype == torch.bfloat16:
            return torch.mm(x, weight.t(), out_dtype=torch.float32) * self.config.index_weight_scale
        return self._head_weights(x)

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ H`` over the last dim (fp32 math, ``x``'s dtype back), ``H`` symmetric."""
        dim = x.shape[-1]
        h = hadamard_matrix(dim, x.device)
        flat = x.reshape(-1, dim).float()
        if self.row_invariant:
            rotated = row_invariant_ops().linear(flat, h)
        else:
            rotated = flat @ h
        return rotated.to(x.dtype).view(x.shape)


class MLAAttention(HoldsFusedLinear, RowInvariant, nn.Module):
    """Multi-head latent attention with DSA, run in the absorbed (MQA) form over the 576-wide cache.
    Layer ``layer`` owns an indexer unless the config makes it a shared-indexer layer.

    Over a TP group of size ``T`` the rank holds ``H / T`` consecutive attention heads:
    ``q_b_proj`` and ``kv_b_proj`` are split by heads (column parallel; the HF layouts keep a head's
    rows together), ``o_proj`` by its input features (row parallel) and its partial outputs are
    summed by one all-reduce. ``q_a_proj``, ``kv_a_proj_with_mqa``, their norms and the indexer
    are replicated: every rank writes the same cache entries and selects the same top-k."""

    def __init__(self, config: ModelConfig, layer: int, group: TPGroup, device=None, dtype=None):
        super().__init__()
        self.config = config
        self.group = group
        heads = config.num_attention_heads
        self.num_heads = heads // group.size
        tp = dict(group=group)
        self.q_a_proj = make_linear(config.hidden_size, config.q_lora_rank, device, dtype)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.attn_norm_eps, device, dtype)
        self.q_b_proj = make_linear(config.q_lora_rank, heads * config.qk_head_dim, device, dtype, split=COLUMN, **tp)
        self.kv_a_proj_with_mqa = make_linear(config.hidden_size, config.kv_cache_dim, device, dtype)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, config.attn_norm_eps, device, dtype)
        self.kv_b_proj = make_linear(config.kv_lora_rank, heads * (config.qk_nope_head_dim + config.v_head_dim),
                                 device, dtype, split=COLUMN, **tp)
        self.o_proj = make_linear(heads * config.v_head_dim, config.hidden_size, device, dtype, split=ROW, **tp)
        self.indexer = Indexer(config, device, dtype) if config.has_indexer(layer) else None
        self.fused_input = self.fused_latent = None
        self.input_quant = self.latent_quant = None

    def fuse_projections(self) -> None:
        """One GEMM for the projections of the layer input: ``q_a_proj``, the indexer's ``wk``
        (where the layer has an indexer) and ``kv_a_proj_with_mqa``, in that order (the FP8 scale
        blocks stay whole: 576 is not a multiple of 128); and, where the layer has an indexer, one
        (``fused_latent``) for the projections of the normed q latent: ``q_b_proj`` (this rank's
        heads) then the indexer's ``wq_b`` (FP8: ``q_b_proj``'s rows must be a multiple of 128).
        Nothing changes where :func:`~dsaspec.layers.fused_linear.fuse_linears` refuses a group.
        The indexer's ``weights_proj`` reads the input too but runs in fp32.

        Where all the GEMMs of one input are FP8 of one ``scale_fmt``, its norm writes their codes
        too (:class:`~dsaspec.layers.norm.RMSNorm` ``quant``; one act_quant launch fewer each):
        ``input_quant`` for the layer input (the decoder layer's ``input_layernorm``),
        ``latent_quant`` for ``q_a_layernorm``'s (:func:`~dsaspec.layers.fp8_linear.act_quant_of`;
        None: the GEMMs quantize)."""
        parts = [self.q_a_proj] + ([self.indexer.wk] if self.indexer is not None else []) + [self.kv_a_proj_with_mqa]
        self.fused_input = fuse_linears(parts)
        self.input_quant = act_quant_of(parts)
        latent = [self.q_b_proj] + ([self.indexer.wq_b] if self.indexer is not None else [])
        if self.indexer is not None:
            self.fused_latent = fuse_linears(latent)
        self.latent_quant = act_quant_of(latent)

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of ``kv_b_proj``'s weight (dequantized when FP8): ``W_UK [H, qk_nope, 512]`` and
        ``W_UV [H, v, 512]`` (this rank's ``H / TP`` heads)."""
        cfg = self.config
        per_head = self.kv_b_proj.dense_weight().view(self.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim,
                                              cfg.kv_lora_rank)
        return per_head[:, : cfg.qk_nope_head_dim], per_head[:, cfg.qk_nope_head_dim:]

    def forward(self, x, step: ForwardState, mla_cache, index_k_cache) -> torch.Tensor:
        """``x`` ``[R, hidden]`` (normed; or an :class:`~dsaspec.layers.fp8_linear.Fp8Input` of it
        with ``input_quant``'s codes, which the input GEMMs read, the indexer's head weights reading
        its ``x``) -> ``[R, hidden]`` (summed over the TP group); writes the rows' entries of
        ``mla_cache`` ``[slots, 576]`` and ``index_k_cache`` ``[slots, 128]`` (or their FP8
        layouts, quantized on write) at ``out_cache_loc`` and ``attn.topk_slots`` (if given)."""
        cfg = self.config
        gemm_x, x = x, x.x if isinstance(x, Fp8Input) else x
        rows, heads = x.shape[0], self.num_heads
        if self.fused_input is None:
            q_a, wk_out, kv_a = self.q_a_proj(gemm_x), None, self.kv_a_proj_with_mqa(gemm_x)
        elif self.indexer is None:
            (q_a, kv_a), wk_out = self.fused_input(gemm_x), None
        else:
            q_a, wk_out, kv_a = self.fused_input(gemm_x)
        q_latent = self.q_a_layernorm(q_a, quant=self.latent_quant)
        run_indexer = self.indexer is not None and not step.seeded
        if run_indexer and self.fused_latent is not None:
            q, wq_b_out = self.fused_latent(q_latent)
        else:   # not fused, or the indexer skipped (a seeded step): q_b_proj alone, wq_b unread
            q, wq_b_out = self.q_b_proj(q_latent), None
        q = q.view(rows, heads, cfg.qk_head_dim)
        if step.ops.store_mla_normed is not None:   # the Triton ops: norm + RoPE + store in one kernel
            step.ops.store_mla_normed(mla_cache, step.out_cache_loc, kv_a, self.kv_a_layernorm.weight,
                                      self.kv_a_layernorm.eps, step.cos, step.sin, cfg.rope_interleave,
                                      check_values=step.check_values)
        else:
            latent, k_rope = kv_a.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
            k_rope = apply_rope(k_rope, step.cos, step.sin, cfg.rope_interleave)
            step.ops.store_mla(mla_cache, step.out_cache_loc,
                               torch.cat((self.kv_a_layernorm(latent), k_rope), dim=-1),
                               check_values=step.check_values)
        if run_indexer:
            q_index, index_weights = self.indexer(x, q_latent, step, index_k_cache, wk_out, wq_b_out)
            step.selected = _select_slots(q_index, index_weights, index_k_cache, step, cfg.index_topk)

        w_uk, w_uv = self.absorbed_weights()
        if step.ops.mla_query is not None:   # the Triton ops: W_UK's product and q's RoPE in one kernel
            q_mqa = step.ops.mla_query(q, w_uk, step.cos, step.sin, cfg.rope_interleave, self.row_invariant)
        else:
            q_nope, q_rope = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
            q_absorbed = bmm(q_nope.transpose(0, 1), w_uk, self.row_invariant).transpose(0, 1)  # [R, H, 512]
            q_rope = apply_rope(q_rope, step.cos, step.sin, cfg.rope_interleave)
            q_mqa = torch.cat((q_absorbed, q_rope), dim=-1)                       # [R, H, 576]
        o_latent = torch.empty(rows, heads, cfg.kv_lora_rank, device=x.device, dtype=x.dtype)
        workspace = step.attn.workspace or NO_WORKSPACE
        step.ops.sparse_mla_decode(q_mqa, mla_cache, step.selected, cfg.softmax_scale, out=o_latent,
                                   check_values=step.check_values, workspace=workspace.sparse_mla)
        # [R, H, v], written through its [H, R, v] view: o_proj reads it as [R, H * v] without a copy.
        # Below a prefill chunk's rows the Triton ops take the row-invariant GEMM: a chained launch, where
        # cuBLAS's bmm waits for sparse MLA's end.
        triton_gemm = self.row_invariant or (step.ops.mla_query is not None and decode_tiles(rows, False))
        o = torch.empty(rows, heads, cfg.v_head_dim, device=x.device, dtype=x.dtype)
        bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2), triton_gemm, out=o.transpose(0, 1))
        return self.group.all_reduce(self.o_proj(o.view(rows, heads * cfg.v_head_dim)))


def _select_slots(q_index, index_weights, index_k_cache, step: ForwardState, index_topk):
    """Indexer logits over each row's live positions, then the top-k as slots: int32 ``[R, k]``.
    Rows of at most ``index_topk`` live positions take them all: the indexer skips them."""
    rows, device = q_index.shape[0], q_index.device
    attn, ops = step.attn, step.ops
    schedule = attn.schedule if attn.schedule is not None else step.schedule
    if schedule is None:
        sms = default_indexer_programs(device, is_fp8_cache(index_k_cache), attn.rows_per_group,
                                       q_index.shape[1])
        schedule = ops.indexer_schedule(attn.seqlens, sms,
                                        out=torch.empty(sms + 1, 2, dtype=torch.int32, device=device),
                                        skip_len=index_topk, rows_per_group=attn.rows_per_group)
        step.schedule = schedule
    logits = attn.index_logits
    if logits is None:
        logits = torch.empty(rows, attn.page_table_1.shape[1], dtype=torch.float32, device=device)
    slots = attn.topk_slots
    if slots is None:
        slots = torch.empty(rows, index_topk, dtype=torch.int32, device=device)
    ops.indexer_logits(q_index, index_weights, index_k_cache, attn.page_table_1, attn.seqlens,
                       schedule, out=logits, skip_len=index_topk, rows_per_group=attn.rows_per_group,
                       check_values=step.check_values)
    workspace = attn.workspace or NO_WORKSPACE
    ops.topk_slots(logits, attn.seqlens, attn.page_table_1, index_topk, out=slots,
                   check_values=step.check_values, workspace=workspace.topk,
                   single_launch=workspace.topk_single_launch,
                   candidates=workspace.topk_candidates)
    return slots
