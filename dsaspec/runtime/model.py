"""The DSA decoder (DeepSeek-V3.2 / GLM-5 family) and its MTP layer, with HF parameter names.

Every forward is a *step* over ``R`` query rows (prefill chunk, decode, target verify, draft
extend, draft decode are all the same code): each row has a token, a RoPE position, a KV slot to
write (``out_cache_loc``) and, in :class:`AttentionInputs`, the row's page table and causal length.
Per layer, the row's MLA cache entry ``[latent 512 | roped key 64]`` and indexer key are written at
its slot *before* attention, then the attention reads ``page_table_1[r, :seqlens[r]]``:

    indexer_logits -> topk_slots -> sparse_mla_decode   (absorbed / MQA form over the 576-wide cache)

The three ops come from :func:`dsa_ops` (Triton kernels, or plain torch behind ``use_triton``).
With ``AttentionInputs.schedule`` given, a step does no host sync and allocates nothing that
depends on data, so it can be captured in a CUDA graph.

Tensor parallel over a :class:`~dsaspec.distributed.tp_group.TPGroup` (docs/runtime.md): vocab-parallel
embedding and LM head, MLA split by attention heads (``q_b_proj`` / ``kv_b_proj`` column parallel,
``o_proj`` row parallel), dense FFN split by its intermediate features; one all-reduce after the
embedding, ``o_proj`` and ``down_proj``. The latent projections, the lightning indexer, the norms
and the MTP layer's ``eh_proj`` are replicated, and so are the KV caches (latent MLA: one KV head).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from dsaspec import flags
from dsaspec.distributed.tp_group import TPGroup
from dsaspec.ops.indexer_schedule import indexer_programs
from dsaspec.runtime.config import ModelConfig, yarn_mscale
from dsaspec.runtime.memory import KVPool
from dsaspec.speculative.lm_head import VOCAB_PAD_MULTIPLE, VocabParallelLMHead, padded_vocab_size

# ---------------------------------------------------------------------------------------------
# ops


@functools.lru_cache(maxsize=3)
def dsa_ops(use_triton: bool, sparse_mla_gluon: bool) -> SimpleNamespace:
    """The four DSA ops (``indexer_schedule``, ``indexer_logits``, ``topk_slots``,
    ``sparse_mla_decode``) with the signatures of ``dsaspec.ops`` (``out=`` and ``check_values``):
    the Triton kernels when ``use_triton`` (sparse MLA's Gluon kernel where its default
    configuration takes it, unless ``sparse_mla_gluon`` is off), else the runtime's plain-torch
    versions (:mod:`dsaspec.runtime.torch_ops`; eager only: they read lengths on the host)."""
    if use_triton:
        from dsaspec.ops.indexer import indexer_logits
        from dsaspec.ops.indexer_schedule import indexer_schedule
        from dsaspec.ops.sparse_mla import sparse_mla_decode
        from dsaspec.ops.topk import topk_slots
        if not sparse_mla_gluon:
            sparse_mla_decode = _sparse_mla_decode_triton_only
    else:
        from dsaspec.runtime.torch_ops import indexer_logits, indexer_schedule, sparse_mla_decode, topk_slots
    return SimpleNamespace(indexer_schedule=indexer_schedule, indexer_logits=indexer_logits,
                           topk_slots=topk_slots, sparse_mla_decode=sparse_mla_decode)


def _sparse_mla_decode_triton_only(q, kv_cache, slots, sm_scale, out, *, workspace=None, **kwargs):
    """``sparse_mla_decode`` with the Triton kernel's default configuration for these rows."""
    from dsaspec.ops.sparse_mla import sparse_mla_config, sparse_mla_decode

    config = sparse_mla_config(q.shape[0], q.shape[1], split=workspace is not None)
    return sparse_mla_decode(q, kv_cache, slots, sm_scale, out, workspace=workspace, config=config,
                             **kwargs)


@dataclass
class AttentionInputs:
    """What the sparse attention of one step reads (all layers share it).

    Attributes
    ----------
    page_table_1 : Tensor
        int32 ``[R, W]``: row ``r``'s logical position -> KV slot.
    seqlens : Tensor
        int32 ``[R]``: row ``r`` attends to positions ``[0, seqlens[r])`` (``seqlens_expanded``).
    schedule : Tensor or None
        int32 ``[indexer_programs(device) + 1, 2]`` indexer schedule of ``seqlens``; None: computed in the step
        (eager only).
    index_logits : Tensor or None
        fp32 ``[R, W_out]`` scratch for the indexer logits (``W_out >= max seqlens``); None:
        allocated ``[R, W]`` in the step.
    topk_slots : Tensor or None
        int32 ``[R, index_topk]``; after the step it holds the *last* layer's selected slots
        (-1 fills). None: allocated in the step.
    rows_per_group : int
        The indexer's row groups (the schedule's): N for grouped target-verify rows, else 1.
    workspace : AttentionWorkspace or None
        The Triton ops' workspaces for these rows (``DSAModel.attention_workspace``), or None:
        none (one top-k program and one sparse-MLA pass per row).
    """

    page_table_1: torch.Tensor
    seqlens: torch.Tensor
    schedule: torch.Tensor | None = None
    index_logits: torch.Tensor | None = None
    topk_slots: torch.Tensor | None = None
    rows_per_group: int = 1
    workspace: "AttentionWorkspace | None" = None

    @property
    def rows(self) -> int:
        return self.seqlens.shape[0]

    @classmethod
    def from_metadata(cls, metadata, schedule: torch.Tensor, index_topk: int,
                      logits_width: int | None = None, scratch: "AttentionScratch | None" = None, *,
                      rows_per_group: int = 1,
                      workspace: "AttentionWorkspace | None" = None) -> "AttentionInputs":
        """Inputs over a DSA backend's static buffers of one (batch, mode): ``metadata`` (a
        ``MetadataBuffers``: its ``page_table_1`` and ``seqlens_expanded``), its indexer
        ``schedule`` and that schedule's ``rows_per_group``. The scratch (``index_logits`` fp32
        ``[R, logits_width or W]``, ``topk_slots`` int32 ``[R, index_topk]``) is allocated here
        (call at capture), or taken as the leading rows of ``scratch``, which forwards that never
        run at the same time can share."""
        page_table = metadata.page_table_1
        rows, width = page_table.shape
        if scratch is None:
            scratch = AttentionScratch.allocate(rows, logits_width or width, index_topk, page_table.device)
        return cls(page_table_1=page_table, seqlens=metadata.seqlens_expanded, schedule=schedule,
                   rows_per_group=rows_per_group, workspace=workspace, **scratch.view(rows))


@dataclass(frozen=True)
class AttentionWorkspace:
    """Workspaces of the Triton DSA ops for forwards of one row count (allocate once, before graph
    capture; forwards that run one after another, every layer and phase, share them).

    Attributes
    ----------
    sparse_mla : Tensor or None
        ``sparse_mla_workspace``: split the selected slots of a row (None: one pass per row,
        row-invariant).
    topk : Tensor or None
        ``topk_workspace``: split each row's top-k over several programs (None: one per row). The
        selection is exact either way.
    topk_single_launch : None or False
        ``topk_slots``'s ``single_launch``: with ``topk``, None (one launch where it fits) or False
        (five launches), from ``DSASPEC_TOPK_SINGLE_LAUNCH``, read when the workspace is made;
        None without it.
    topk_candidates : Tensor or None
        ``topk_candidates`` for ``topk``'s chunks (one program per row without it): long rows
        select from candidate lists bounded by a sample (None: the passes over the whole row).
        The selection is exact either way.
    """

    sparse_mla: torch.Tensor | None = None
    topk: torch.Tensor | None = None
    topk_single_launch: bool | None = None
    topk_candidates: torch.Tensor | None = None


NO_WORKSPACE = AttentionWorkspace()


@dataclass
class AttentionScratch:
    """Indexer scratch of up to ``rows`` query rows: logits fp32 ``[rows, width]`` and selected slots
    int32 ``[rows, index_topk]``."""

    index_logits: torch.Tensor
    topk_slots: torch.Tensor

    @classmethod
    def allocate(cls, rows: int, width: int, index_topk: int, device) -> "AttentionScratch":
        return cls(torch.empty(rows, width, device=device),
                   torch.empty(rows, index_topk, dtype=torch.int32, device=device))

    def view(self, rows: int) -> dict:
        """The leading ``rows`` rows, as ``AttentionInputs`` keyword arguments."""
        if rows > self.topk_slots.shape[0]:
            raise ValueError(f"the attention scratch holds {self.topk_slots.shape[0]} rows, {rows} asked for")
        return dict(index_logits=self.index_logits[:rows], topk_slots=self.topk_slots[:rows])


@dataclass
class _ForwardState:
    """What every layer of one forward reads: RoPE cos/sin fp32 ``[R, rope/2]``, the rows' KV
    slots, the attention inputs, the ops, whether the ops run their value checks (host syncs),
    and ``selected``: the KV slots int32 ``[R, k]`` the last indexer chose (a shared-indexer
    layer attends to them). ``seeded``: ``selected`` was given up front (IndexShare draft steps)
    and no indexer runs."""

    cos: torch.Tensor
    sin: torch.Tensor
    out_cache_loc: torch.Tensor
    attn: AttentionInputs
    ops: SimpleNamespace
    check_values: bool
    selected: torch.Tensor | None = None
    seeded: bool = False


def build_extend_inputs(req_to_token: torch.Tensor, rows, prefix_lens, extend_lens):
    """Eager inputs for extending requests by contiguous new tokens (prefill chunks): request
    ``b`` (table row ``rows[b]``) gets rows for positions ``prefix_lens[b] + [0, extend_lens[b])``,
    each attending causally to ``[0, position]``.

    Returns ``(positions int64 [R], out_cache_loc int64 [R], AttentionInputs)`` with
    ``R = sum(extend_lens)``, request-major; ``page_table_1`` holds each request's table row cut
    to the longest live length, and ``index_logits`` is allocated at that width.
    """
    device = req_to_token.device
    live_width = max(int(p) + int(e) for p, e in zip(prefix_lens, extend_lens))
    positions, table_rows = [], []
    for row, prefix, extend in zip(rows, prefix_lens, extend_lens):
        positions.append(torch.arange(prefix, prefix + extend, device=device))
        table_rows.append(torch.full((extend,), int(row), device=device, dtype=torch.long))
    positions = torch.cat(positions)
    table_rows = torch.cat(table_rows)
    out_cache_loc = req_to_token[table_rows, positions].long()
    inputs = AttentionInputs(page_table_1=req_to_token[table_rows, :live_width],
                             seqlens=(positions + 1).to(torch.int32),
                             index_logits=torch.empty(positions.numel(), live_width, device=device))
    return positions, out_cache_loc, inputs


# ---------------------------------------------------------------------------------------------
# building blocks


class RowInvariant:
    """Mixin of the modules whose arithmetic cuBLAS / torch would shape by the number of rows:
    with ``row_invariant`` set (by :class:`DSAModel`) they run the kernels of
    :mod:`dsaspec.ops.row_invariant`, whose results per row do not depend on the other rows."""

    row_invariant: bool = False


def _row_invariant_ops():
    from dsaspec.ops import row_invariant

    return row_invariant


class RMSNorm(RowInvariant, nn.Module):
    """``y = x / sqrt(mean(x^2) + eps) * weight`` in fp32, returned in ``x``'s dtype."""

    def __init__(self, dim: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_invariant:
            return _row_invariant_ops().rms_norm(x, self.weight, self.eps)
        xf = x.float()
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


class LayerNorm(RowInvariant, nn.Module):
    """LayerNorm with weight and bias (the indexer's ``k_norm``), fp32 math."""

    def __init__(self, dim: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_invariant:
            return _row_invariant_ops().layer_norm(x, self.weight, self.bias, self.eps)
        y = F.layer_norm(x.float(), (x.shape[-1],), self.weight.float(), self.bias.float(), self.eps)
        return y.to(x.dtype)


@dataclass(frozen=True)
class Shard:
    """Where a tensor-parallel parameter comes from in its checkpoint tensor: along dim ``dim``
    (checkpoint size ``full``), checkpoint indices ``[start, start + valid)`` are the local indices
    ``[0, valid)``; local indices past ``valid`` (vocab padding) hold zeros."""

    dim: int
    start: int
    valid: int
    full: int

    def full_shape(self, local_shape) -> tuple[int, ...]:
        """The checkpoint shape of a parameter of ``local_shape``."""
        shape = list(local_shape)
        shape[self.dim] = self.full
        return tuple(shape)

    def index(self, ndim: int) -> tuple[slice, ...]:
        """The slices of the checkpoint tensor (``ndim`` dims) this rank holds."""
        index = [slice(None)] * ndim
        index[self.dim] = slice(self.start, self.start + self.valid)
        return tuple(index)

    def fill(self, param: torch.Tensor, part: torch.Tensor) -> None:
        """Write ``part`` (the checkpoint tensor at :meth:`index`, any dtype) into ``param``; zero
        the padding."""
        local = param.shape[self.dim]
        if self.valid < local:
            param.narrow(self.dim, self.valid, local - self.valid).zero_()
        param.narrow(self.dim, 0, self.valid).copy_(part)


def _vocab_pad_multiple(group: TPGroup) -> int:
    """The vocab is padded to a multiple of ``64 * TP`` at TP > 1 and not at all at TP 1 (the
    checkpoint's shape, and TP 1 GEMMs of the vocab's own width)."""
    return VOCAB_PAD_MULTIPLE if group.size > 1 else 1


class Linear(RowInvariant, nn.Linear):
    """Bias-free ``y = x @ weight.T`` (cuBLAS, or the row-invariant GEMM). ``shard``: this rank's
    part of the checkpoint weight (None: replicated)."""

    shard: Shard | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_invariant:
            return _row_invariant_ops().linear(x, self.weight)
        return F.linear(x, self.weight)


COLUMN, ROW = "column", "row"


def _linear(in_features: int, out_features: int, device, dtype, *, group: TPGroup | None = None,
            split: str | None = None) -> Linear:
    """A bias-free :class:`Linear`, replicated, or split over ``group``: ``COLUMN`` parallel (this
    rank's contiguous block of the output features) or ``ROW`` parallel (its block of the input
    features; the partial outputs need a sum over the group)."""
    if split is None or group.size == 1:
        return Linear(in_features, out_features, bias=False, device=device, dtype=dtype)
    dim, full = (0, out_features) if split == COLUMN else (1, in_features)
    local = full // group.size
    shape = (out_features, local) if split == ROW else (local, in_features)
    module = Linear(shape[1], shape[0], bias=False, device=device, dtype=dtype)
    module.shard = Shard(dim, group.rank * local, local, full)
    return module


class VocabParallelEmbedding(nn.Module):
    """The token embedding (``embed_tokens.weight``), its rows split over ``group`` as the LM head
    splits the vocab: rank ``r`` holds rows ``[r * Sh, (r + 1) * Sh)`` of the padded table. Each
    rank looks up the ids it holds (zeros for the others) and one all-reduce sums the ranks: every
    output row has one non-zero contributor, so the sum is exact. At TP 1: a plain lookup."""

    def __init__(self, vocab_size: int, hidden_size: int, group: TPGroup, device=None, dtype=None):
        super().__init__()
        self.group = group
        self.rows = padded_vocab_size(vocab_size, group.size, _vocab_pad_multiple(group)) // group.size
        self.start = group.rank * self.rows
        self.shard = Shard(0, self.start, max(0, min(vocab_size - self.start, self.rows)), vocab_size)
        self.weight = nn.Parameter(torch.zeros(self.rows, hidden_size, device=device, dtype=dtype))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids`` int ``[R]`` -> ``[R, hidden]`` (one all-reduce at TP > 1)."""
        if self.group.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        held = (local >= 0) & (local < self.rows)
        out = F.embedding(torch.where(held, local, 0), self.weight)
        out.masked_fill_(~held[:, None], 0)
        return self.group.all_reduce(out)


class LMHead(RowInvariant, VocabParallelLMHead):
    """The LM head (``lm_head.weight``): a :class:`VocabParallelLMHead` over the model's TP group
    (the speculative runtime's LogitsProcessor runs over it), with the row-invariant GEMM when the
    model runs row-invariant. The vocab is padded only at TP > 1 (``_vocab_pad_multiple``)."""

    def __init__(self, vocab_size: int, hidden_size: int, group: TPGroup, dtype):
        super().__init__(vocab_size, hidden_size, group, dtype=dtype, pad_multiple=_vocab_pad_multiple(group))
        self.shard = Shard(0, self.shard_start, self.valid_columns, vocab_size)

    def forward(self, hidden_states: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Local logits ``[rows, Sh]`` (``hidden_states @ weight^T``, into ``out`` if given)."""
        if self.row_invariant:
            return _row_invariant_ops().linear(hidden_states, self.weight, out=out)
        return super().forward(hidden_states, out)


def _bmm(a: torch.Tensor, b: torch.Tensor, row_invariant: bool) -> torch.Tensor:
    """``a[i] @ b[i]`` (cuBLAS, or the row-invariant GEMM)."""
    return _row_invariant_ops().bmm(a, b) if row_invariant else torch.bmm(a, b)


def rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies fp64 ``[qk_rope_head_dim // 2]`` and the cos/sin factor
    (YaRN's ``mscale(mscale) / mscale(mscale_all_dim)``, 1 without scaling)."""
    dim = config.qk_rope_head_dim
    base = config.rope_theta
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq, 1.0
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast", 32.0))
    beta_slow = float(scaling.get("beta_slow", 1.0))

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    ramp = (torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)
    extrapolate = 1.0 - ramp.clamp(0.0, 1.0)  # 1: keep the original (high) frequency
    inv_freq = inv_freq / factor * (1.0 - extrapolate) + inv_freq * extrapolate
    cos_sin_factor = (yarn_mscale(factor, float(scaling.get("mscale", 1.0) or 0.0))
                      / yarn_mscale(factor, float(scaling.get("mscale_all_dim", 0.0) or 0.0)))
    return inv_freq, cos_sin_factor


class Rotary(nn.Module):
    """cos/sin of the RoPE angles ``position * inv_freq`` (angles in fp64, so large positions keep
    their precision)."""

    def __init__(self, config: ModelConfig, device=None):
        super().__init__()
        inv_freq, self.cos_sin_factor = rope_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` int ``[R]`` -> ``(cos, sin)`` fp32 ``[R, rope_dim // 2]``."""
        angles = positions.to(torch.float64)[:, None] * self.inv_freq[None, :]
        return ((angles.cos() * self.cos_sin_factor).float(),
                (angles.sin() * self.cos_sin_factor).float())


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate the last dim of ``x`` ``[R, ..., d]`` by the angles of its row (``cos``/``sin``
    fp32 ``[R, d/2]``): pairs ``(2i, 2i+1)`` when ``interleaved``, else ``(i, i + d/2)``.
    fp32 math, result in ``x``'s dtype."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    cos, sin = cos.view(shape), sin.view(shape)
    xf = x.float()
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    else:
        half = xf.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
        rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.to(x.dtype)


def _rope_first(x: torch.Tensor, rope_dim: int, cos, sin, interleaved: bool) -> torch.Tensor:
    """RoPE on the first ``rope_dim`` dims of the last axis (the indexer's layout)."""
    return torch.cat((apply_rope(x[..., :rope_dim], cos, sin, interleaved), x[..., rope_dim:]), dim=-1)


# ---------------------------------------------------------------------------------------------
# layers


class Indexer(RowInvariant, nn.Module):
    """The lightning indexer's projections: ``wq_b`` (q latent -> heads x 128), ``wk`` + LayerNorm
    ``k_norm`` (hidden -> 128, one key per token), ``weights_proj`` (hidden -> one weight per head)."""

    def __init__(self, config: ModelConfig, device=None, dtype=None):
        super().__init__()
        self.config = config
        self.wq_b = _linear(config.q_lora_rank, config.index_n_heads * config.index_head_dim, device, dtype)
        self.wk = _linear(config.hidden_size, config.index_head_dim, device, dtype)
        self.k_norm = LayerNorm(config.index_head_dim, config.attn_norm_eps, device, dtype)
        self.weights_proj = _linear(config.hidden_size, config.index_n_heads, device, dtype)

    def forward(self, x, q_latent, step: _ForwardState, index_k_cache):
        """Write each row's key into ``index_k_cache[out_cache_loc]``; return the query
        ``[R, index_n_heads, 128]`` (model dtype) and head weights fp32 ``[R, index_n_heads]``
        (``weights_proj(x) * index_head_dim**-0.5 * index_n_heads**-0.5``)."""
        cfg = self.config
        rows = x.shape[0]
        rope, interleaved = cfg.qk_rope_head_dim, cfg.indexer_rope_interleave
        q = self.wq_b(q_latent).view(rows, cfg.index_n_heads, cfg.index_head_dim)
        q = _rope_first(q, rope, step.cos, step.sin, interleaved)
        k = _rope_first(self.k_norm(self.wk(x)), rope, step.cos, step.sin, interleaved)
        index_k_cache.index_copy_(0, step.out_cache_loc, k)
        if self.row_invariant:
            weights = _row_invariant_ops().linear(x.float(), self.weights_proj.weight.float())
        else:
            weights = F.linear(x.float(), self.weights_proj.weight.float())
        weights = weights * cfg.index_weight_scale
        return q, weights


class MLAAttention(RowInvariant, nn.Module):
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
        self.q_a_proj = _linear(config.hidden_size, config.q_lora_rank, device, dtype)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.attn_norm_eps, device, dtype)
        self.q_b_proj = _linear(config.q_lora_rank, heads * config.qk_head_dim, device, dtype, split=COLUMN, **tp)
        self.kv_a_proj_with_mqa = _linear(config.hidden_size, config.kv_cache_dim, device, dtype)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, config.attn_norm_eps, device, dtype)
        self.kv_b_proj = _linear(config.kv_lora_rank, heads * (config.qk_nope_head_dim + config.v_head_dim),
                                 device, dtype, split=COLUMN, **tp)
        self.o_proj = _linear(heads * config.v_head_dim, config.hidden_size, device, dtype, split=ROW, **tp)
        self.indexer = Indexer(config, device, dtype) if config.has_indexer(layer) else None

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of ``kv_b_proj.weight``: ``W_UK [H, qk_nope, 512]`` and ``W_UV [H, v, 512]`` (this
        rank's ``H / TP`` heads)."""
        cfg = self.config
        per_head = self.kv_b_proj.weight.view(self.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim,
                                              cfg.kv_lora_rank)
        return per_head[:, : cfg.qk_nope_head_dim], per_head[:, cfg.qk_nope_head_dim:]

    def forward(self, x, step: _ForwardState, mla_cache, index_k_cache) -> torch.Tensor:
        """``x`` ``[R, hidden]`` (normed) -> ``[R, hidden]`` (summed over the TP group); writes the
        rows' entries of ``mla_cache`` ``[slots, 576]`` and ``index_k_cache`` ``[slots, 128]`` at
        ``out_cache_loc`` and ``attn.topk_slots`` (if given)."""
        cfg = self.config
        rows, heads = x.shape[0], self.num_heads
        q_latent = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_latent).view(rows, heads, cfg.qk_head_dim)
        q_nope, q_rope = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        q_rope = apply_rope(q_rope, step.cos, step.sin, cfg.rope_interleave)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        k_rope = apply_rope(k_rope, step.cos, step.sin, cfg.rope_interleave)
        mla_cache.index_copy_(0, step.out_cache_loc, torch.cat((self.kv_a_layernorm(latent), k_rope), dim=-1))
        if self.indexer is not None and not step.seeded:
            q_index, index_weights = self.indexer(x, q_latent, step, index_k_cache)
            step.selected = _select_slots(q_index, index_weights, index_k_cache, step, cfg.index_topk)

        w_uk, w_uv = self.absorbed_weights()
        q_absorbed = _bmm(q_nope.transpose(0, 1), w_uk, self.row_invariant).transpose(0, 1)  # [R, H, 512]
        q_mqa = torch.cat((q_absorbed, q_rope), dim=-1).contiguous()              # [R, H, 576]
        o_latent = torch.empty(rows, heads, cfg.kv_lora_rank, device=x.device, dtype=x.dtype)
        workspace = step.attn.workspace or NO_WORKSPACE
        step.ops.sparse_mla_decode(q_mqa, mla_cache, step.selected, cfg.softmax_scale, out=o_latent,
                                   check_values=step.check_values, workspace=workspace.sparse_mla)
        o = _bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2), self.row_invariant).transpose(0, 1)  # [R, H, v]
        return self.group.all_reduce(self.o_proj(o.reshape(rows, heads * cfg.v_head_dim)))


def _select_slots(q_index, index_weights, index_k_cache, step: _ForwardState, index_topk):
    """Indexer logits over each row's live positions, then the top-k as slots: int32 ``[R, k]``.
    Rows of at most ``index_topk`` live positions take them all: the indexer skips them."""
    rows, device = q_index.shape[0], q_index.device
    attn, ops = step.attn, step.ops
    schedule = attn.schedule
    if schedule is None:
        sms = indexer_programs(device)
        schedule = ops.indexer_schedule(attn.seqlens, sms,
                                        out=torch.empty(sms + 1, 2, dtype=torch.int32, device=device),
                                        skip_len=index_topk, rows_per_group=attn.rows_per_group)
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


class MLP(nn.Module):
    """Dense SwiGLU: ``down(silu(gate(x)) * up(x))``; over a TP group the intermediate features are
    split (``gate_proj`` / ``up_proj`` column parallel, ``down_proj`` row parallel) and one
    all-reduce sums the partial outputs."""

    def __init__(self, config: ModelConfig, group: TPGroup, device=None, dtype=None):
        super().__init__()
        self.group = group
        tp = dict(group=group)
        self.gate_proj = _linear(config.hidden_size, config.intermediate_size, device, dtype, split=COLUMN, **tp)
        self.up_proj = _linear(config.hidden_size, config.intermediate_size, device, dtype, split=COLUMN, **tp)
        self.down_proj = _linear(config.intermediate_size, config.hidden_size, device, dtype, split=ROW, **tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


class DecoderLayer(nn.Module):
    """RMSNorm -> MLA with DSA -> residual -> RMSNorm -> SwiGLU -> residual (layer index ``layer``)."""

    def __init__(self, config: ModelConfig, layer: int, group: TPGroup, device=None, dtype=None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        self.self_attn = MLAAttention(config, layer, group, device, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        self.mlp = MLP(config, group, device, dtype)

    def forward(self, x, step: _ForwardState, mla_cache, index_k_cache):
        x = x + self.self_attn(self.input_layernorm(x), step, mla_cache, index_k_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class SharedHead(nn.Module):
    """The MTP layer's ``shared_head``: its own norm; the LM head itself is the target's."""

    def __init__(self, config: ModelConfig, device=None, dtype=None):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)


class MTPLayer(DecoderLayer):
    """The MTP (NextN) layer: ``enorm``, ``hnorm``, ``eh_proj`` (2 hidden -> hidden, embedding
    first, replicated), one full decoder layer (the inherited parameters) and ``shared_head.norm``;
    it shares the target's embedding and LM head."""

    def __init__(self, config: ModelConfig, group: TPGroup, device=None, dtype=None):
        super().__init__(config, config.num_hidden_layers, group, device, dtype)
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        self.eh_proj = _linear(2 * config.hidden_size, config.hidden_size, device, dtype)
        self.shared_head = SharedHead(config, device, dtype)


class DSABackbone(nn.Module):
    """``model.*`` of the HF layout: embedding, decoder layers (+ the MTP layer last), final norm."""

    def __init__(self, config: ModelConfig, group: TPGroup, device=None, dtype=None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, group, device, dtype)
        layers = [DecoderLayer(config, i, group, device, dtype) for i in range(config.num_hidden_layers)]
        layers += [MTPLayer(config, group, device, dtype) for _ in range(config.num_nextn_predict_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)


# ---------------------------------------------------------------------------------------------
# the model


class DSAModel(nn.Module):
    """The DSA decoder with its MTP layer; parameter names are the HF checkpoint's.

    Parameters
    ----------
    config : ModelConfig
    device, dtype :
        Where and in which dtype the parameters live (bf16 is the target; caches must match).
    use_triton : bool
        Run the DSA ops as Triton kernels (else plain torch, eager only).
    row_invariant : bool
        Run the GEMMs and norms through :mod:`dsaspec.ops.row_invariant`, so every row's result
        is bitwise independent of how many rows a step holds: a target-verify step then computes
        each position exactly as a decode step does, and speculative greedy output equals plain
        greedy output token for token. Default off (cuBLAS and torch's norms, which pick their
        kernels by the row count).
    tp_group : TPGroup or None
        Tensor-parallel group this rank's shard belongs to (every rank builds its own DSAModel over
        the same group, collectively); None: TP 1 on ``device``. With a group, ``device`` must be
        None or the group's device. ``num_attention_heads`` and ``intermediate_size`` must divide
        by its size. TP 1 computes exactly what the unsharded model does.
    """

    def __init__(self, config: ModelConfig, *, device=None, dtype=torch.bfloat16, use_triton: bool = False,
                 row_invariant: bool = False, tp_group: TPGroup | None = None):
        super().__init__()
        self.config = config.validate()
        if tp_group is None:
            tp_group = TPGroup.single(torch.device(device) if device is not None else torch.get_default_device())
        elif device is not None and torch.device(device) != tp_group.device:
            raise ValueError(f"device {device} differs from the TP group's device {tp_group.device}; pass device=None")
        for name in ("num_attention_heads", "intermediate_size"):
            if getattr(config, name) % tp_group.size:
                raise ValueError(f"tensor parallel size {tp_group.size} must divide ModelConfig.{name} "
                                 f"({getattr(config, name)})")
        device = tp_group.device
        self.group = tp_group
        self.use_triton = use_triton
        self.row_invariant = row_invariant
        self.sparse_mla_gluon = flags.sparse_mla_gluon()
        self.model = DSABackbone(config, tp_group, device, dtype)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, tp_group, dtype)
        self.rotary = Rotary(config, device)
        self.requires_grad_(False)
        for module in self.modules():
            if isinstance(module, RowInvariant):
                module.row_invariant = row_invariant

    @property
    def tp_size(self) -> int:
        """Ranks of the tensor-parallel group (1: unsharded)."""
        return self.group.size

    @property
    def num_local_heads(self) -> int:
        """Attention heads of this rank (``num_attention_heads / tp_size``)."""
        return self.config.num_attention_heads // self.group.size

    def shards(self) -> dict[str, Shard]:
        """The tensor-parallel parameters by HF name: where each comes from in its checkpoint
        tensor. Parameters not listed are replicated (the checkpoint tensor as is)."""
        return {f"{name}.weight": module.shard for name, module in self.named_modules()
                if getattr(module, "shard", None) is not None}

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's shape in the (unsharded) checkpoint, by HF name."""
        shards = self.shards()
        return {name: shards[name].full_shape(p.shape) if name in shards else tuple(p.shape)
                for name, p in self.state_dict().items()}

    @property
    def mtp_layer(self) -> MTPLayer:
        """The MTP layer (``model.layers[num_hidden_layers]``)."""
        if self.config.num_nextn_predict_layers == 0:
            raise ValueError("this model has no MTP layer (num_nextn_predict_layers=0)")
        return self.model.layers[self.config.num_hidden_layers]

    @torch.no_grad()
    def init_weights(self, seed: int) -> "DSAModel":
        """Seeded random init (same seed, device type and dtype -> same weights): projections
        ``N(0, 1/fan_in)``, embedding ``N(0, 1)``, norm weights ``1 + N(0, 0.1^2)``, norm biases
        ``N(0, 0.1^2)``. Every tensor is drawn at its checkpoint shape and a TP rank keeps its
        shard, so the ranks of any TP size hold the shards of the TP 1 model of the same seed."""
        device = next(self.parameters()).device
        generator = torch.Generator(device=device).manual_seed(seed)
        shards = self.shards()
        for name, param in self.named_parameters():
            shard = shards.get(name)
            shape = param.shape if shard is None else shard.full_shape(param.shape)
            noise = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
            if name.endswith("embed_tokens.weight"):
                value = noise
            elif len(shape) == 2:
                value = noise / math.sqrt(shape[1])
            elif name.endswith(".bias"):
                value = noise * 0.1
            else:
                value = 1.0 + noise * 0.1
            if shard is None:
                param.copy_(value)
            else:
                shard.fill(param, value[shard.index(value.dim())])
        return self

    def _state(self, positions, out_cache_loc, attn: AttentionInputs, check_values: bool,
               seed_slots: torch.Tensor | None = None) -> _ForwardState:
        cos, sin = self.rotary(positions)
        ops = dsa_ops(self.use_triton, self.sparse_mla_gluon)
        return _ForwardState(cos, sin, out_cache_loc, attn, ops, check_values,
                             selected=seed_slots, seeded=seed_slots is not None)

    def _check(self, input_ids, positions, out_cache_loc, attn: AttentionInputs, kv: KVPool, layers: int):
        rows = input_ids.shape[0]
        for name, tensor in (("positions", positions), ("out_cache_loc", out_cache_loc),
                             ("attn.seqlens", attn.seqlens)):
            if tensor.shape != (rows,):
                raise ValueError(f"{name} must have shape [{rows}] (one per input row), got {tuple(tensor.shape)}")
        if attn.page_table_1.dim() != 2 or attn.page_table_1.shape[0] != rows:
            raise ValueError(f"attn.page_table_1 must be [{rows}, W], got {tuple(attn.page_table_1.shape)}")
        for name, tensor in (("attn.seqlens", attn.seqlens), ("attn.page_table_1", attn.page_table_1)):
            if tensor.dtype != torch.int32:
                raise ValueError(f"{name} must be int32, got {tensor.dtype}")
        if out_cache_loc.dtype != torch.int64:
            raise ValueError(f"out_cache_loc must be int64 (index_copy_ indices), got {out_cache_loc.dtype}")
        if kv.num_layers != layers:
            raise ValueError(f"the KV pool has {kv.num_layers} layer(s), this forward needs {layers}")
        if kv.mla_cache[0].dtype != self.lm_head.weight.dtype:
            raise ValueError(f"KV pool dtype {kv.mla_cache[0].dtype} != model dtype {self.lm_head.weight.dtype}")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, out_cache_loc: torch.Tensor,
                kv: KVPool, attn: AttentionInputs, *, check_values: bool = True) -> torch.Tensor:
        """One target step over ``R`` rows.

        Parameters
        ----------
        input_ids : int ``[R]``; positions : int64 ``[R]`` (RoPE positions);
        out_cache_loc : int64 ``[R]`` (slot each row's KV is written to);
        kv : the target KVPool (``num_hidden_layers`` layers); attn : AttentionInputs of the rows.
        check_values : let the ops check lengths and slots against their buffers (host syncs);
        pass False inside CUDA graphs. Shapes and dtypes are always checked (host only).

        Returns
        -------
        Tensor ``[R, hidden]`` (model dtype): the hidden state after the final norm (the LM-head
        input, and the hidden the MTP layer consumes). Writes every layer's cache entries at
        ``out_cache_loc`` and ``attn.topk_slots`` if given.
        """
        self._check(input_ids, positions, out_cache_loc, attn, kv, self.config.num_hidden_layers)
        step = self._state(positions, out_cache_loc, attn, check_values)
        x = self.model.embed_tokens(input_ids)
        for i in range(self.config.num_hidden_layers):
            x = self.model.layers[i](x, step, kv.mla_cache[i], kv.index_k_cache[i])
        return self.model.norm(x)

    def forward_mtp(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                    out_cache_loc: torch.Tensor, kv: KVPool, attn: AttentionInputs, *,
                    seed_slots: torch.Tensor | None = None, check_values: bool = True) -> torch.Tensor:
        """One MTP step over ``R`` rows: ``shared_head.norm(layer(eh_proj([enorm(embed(ids)),
        hnorm(hidden)])))``.

        Parameters
        ----------
        input_ids : int ``[R]`` (row at position p holds token p+1); hidden : ``[R, hidden]``
        (target post-norm hidden of position p, or the previous MTP output); positions,
        out_cache_loc, attn, check_values : as in ``forward``; kv : the MTP layer's own KVPool (1 layer).
        seed_slots : optional int32 ``[R, index_topk]`` KV slots (``-1`` = none) the attention reads
        instead of running the indexer (IndexShare draft steps; the indexer key is not written).

        Returns
        -------
        Tensor ``[R, hidden]``: the MTP output after ``shared_head.norm`` (LM-head input and the
        hidden carried to the next draft step). Writes the MTP caches at ``out_cache_loc``.
        """
        layer = self.mtp_layer
        rows = input_ids.shape[0]
        self._check(input_ids, positions, out_cache_loc, attn, kv, 1)
        if hidden.shape != (rows, self.config.hidden_size):
            raise ValueError(f"hidden must be [{rows}, {self.config.hidden_size}], got {tuple(hidden.shape)}")
        if seed_slots is not None and (seed_slots.shape != (rows, self.config.index_topk)
                                       or seed_slots.dtype != torch.int32):
            raise ValueError(f"seed_slots must be int32 [{rows}, {self.config.index_topk}], got "
                             f"{seed_slots.dtype} {tuple(seed_slots.shape)}")
        step = self._state(positions, out_cache_loc, attn, check_values, seed_slots)
        embedded = layer.enorm(self.model.embed_tokens(input_ids))
        x = layer.eh_proj(torch.cat((embedded, layer.hnorm(hidden.to(embedded.dtype))), dim=-1))
        x = layer(x, step, kv.mla_cache[0], kv.index_k_cache[0])
        return layer.shared_head.norm(x)

    def attention_workspace(self, rows: int) -> AttentionWorkspace | None:
        """The Triton ops' workspaces for steps of ``rows`` rows (allocate once, before graph
        capture), or None with the torch ops. The sparse-MLA split is left out in the row-invariant
        mode (its summation order depends on the rows); either part is None where rows enough to
        fill the GPU need no split."""
        if not self.use_triton:
            return None
        from dsaspec.ops.device import sm_count
        from dsaspec.ops.sparse_mla import sparse_mla_config, sparse_mla_workspace
        from dsaspec.ops.topk import topk_candidates, topk_workspace

        device = self.lm_head.weight.device
        # off-GPU (the interpreter) a small chunk count keeps the CPU runs quick
        num_sms = sm_count(device, without_cuda=8)
        topk = topk_workspace(rows, device, num_sms=num_sms)
        candidates = topk_candidates(rows, self.config.index_topk, device,
                                     num_chunks=1 if topk is None else topk.shape[1])
        heads = self.num_local_heads
        # sized for the configuration sparse_mla_decode takes (DSASPEC_SPARSE_MLA_GLUON)
        mla_config = sparse_mla_config(rows, heads, split=True,
                                       device=device if self.sparse_mla_gluon else None)
        return AttentionWorkspace(
            sparse_mla=None if self.row_invariant else sparse_mla_workspace(rows, heads, device,
                                                                            config=mla_config),
            topk=topk, topk_single_launch=None if topk is None or flags.topk_single_launch() else False,
            topk_candidates=candidates)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head (shared by the MTP layer): ``[R, hidden]`` -> fp32 ``[R, vocab]``; at TP > 1 the
        vocab shards are all-gathered (collective)."""
        local = self.lm_head(hidden)
        if self.group.size == 1:
            return local.float()
        gathered = self.group.all_gather(local, torch.empty(self.group.size, *local.shape, dtype=local.dtype,
                                                             device=local.device))
        return gathered.permute(1, 0, 2).reshape(local.shape[0], -1)[:, :self.config.vocab_size].float()

    # ---- eager prefill helpers --------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, req_to_token: torch.Tensor, row: int, kv: KVPool, *,
                prefix_len: int = 0, chunk_size: int = 512) -> torch.Tensor:
        """Eager prefill of one request: positions ``prefix_len + [0, T)`` of table row ``row``
        (slots already allocated), in chunks of ``chunk_size`` rows. Returns the post-norm hidden
        ``[T, hidden]``; writes the target caches."""
        return self._chunked(lambda ids, _, pos, loc, attn: self.forward(ids, pos, loc, kv, attn),
                             input_ids, None, req_to_token, row, prefix_len, chunk_size)

    @torch.no_grad()
    def prefill_mtp(self, next_ids: torch.Tensor, hidden: torch.Tensor, req_to_token: torch.Tensor,
                    row: int, kv: KVPool, *, prefix_len: int = 0, chunk_size: int = 512,
                    selection_out: torch.Tensor | None = None) -> torch.Tensor:
        """Eager MTP prefill (draft extend) of one request: row at position ``prefix_len + i``
        takes ``next_ids[i]`` (the token at position + 1) and ``hidden[i]``. Returns the MTP
        outputs ``[T, hidden]``; writes the MTP caches and, when given, ``selection_out`` (int32
        ``[index_topk]``) with the KV slots the MTP indexer selected for the last row (the
        IndexShare seed of the first draft steps)."""
        def step(ids, h, pos, loc, attn):
            out = self.forward_mtp(ids, h, pos, loc, kv, attn)
            if selection_out is not None:
                selection_out.copy_(attn.topk_slots[-1])
            return out

        return self._chunked(step, next_ids, hidden, req_to_token, row, prefix_len, chunk_size)

    def _chunked(self, step, input_ids, hidden, req_to_token, row, prefix_len, chunk_size):
        outputs = []
        for start in range(0, input_ids.shape[0], chunk_size):
            ids = input_ids[start:start + chunk_size]
            positions, loc, attn = build_extend_inputs(req_to_token, [row], [prefix_len + start], [ids.shape[0]])
            attn.topk_slots = torch.empty(ids.shape[0], self.config.index_topk, dtype=torch.int32,
                                          device=ids.device)
            chunk_hidden = None if hidden is None else hidden[start:start + chunk_size]
            outputs.append(step(ids, chunk_hidden, positions, loc, attn))
        return torch.cat(outputs)
