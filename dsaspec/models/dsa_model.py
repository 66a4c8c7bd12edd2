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
``o_proj`` row parallel), dense FFN and every expert (routed and shared) split by its intermediate
features; one all-reduce after the embedding, ``o_proj`` and the FFN. The latent projections, the
lightning indexer, the MoE router, the norms and the MTP layer's ``eh_proj`` are replicated, and
so are the KV caches (latent MLA: one KV head).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from tqdm import tqdm

from dsaspec.configs.model_config import ModelConfig, check_implemented
from dsaspec.configs.runtime_options import RuntimeOptions
from dsaspec.distributed.tp_group import TPGroup
from dsaspec.layers.attention.dsa_ops import dsa_ops
from dsaspec.layers.attention.inputs import AttentionInputs, AttentionWorkspace, build_extend_inputs
from dsaspec.layers.attention.mla import ForwardState, MLAAttention
from dsaspec.layers.fp8_convert import convert_to_fp8
from dsaspec.layers.fp8_linear import Fp8Linear
from dsaspec.layers.linear import Shard
from dsaspec.layers.mlp import MLP
from dsaspec.layers.moe import CheckpointPart, MoE, RoutedExperts, Router, set_fused_moe
from dsaspec.layers.norm import RMSNorm
from dsaspec.layers.rotary import Rotary
from dsaspec.layers.row_invariant import RowInvariant
from dsaspec.layers.vocab_parallel import LMHead, VocabParallelEmbedding
from dsaspec.memory import KVPool
from dsaspec.models.decoder_layer import DecoderLayer
from dsaspec.models.mtp import MTPLayer


# Rows a prefill forward takes by default (the engine's --chunked-prefill-size): a forward reads every
# weight it touches once, a MoE layer's experts included (at 512 rows a chunk hits every expert of a
# GLM-5 rank), so long prompts want few chunks; the logits budget below bounds their scratch.
DEFAULT_PREFILL_CHUNK = 4096
# Rows of a prefill chunk (consecutive positions of one request) the indexer groups so that they
# share each key block it reads: the kernel and configurations of grouped target-verify rows.
PREFILL_INDEX_GROUP = 4
# The fp32 indexer logits ([rows, live]) a prefill chunk may hold: at long prefixes a chunk gets fewer
# rows than asked for (1 GiB: 16k rows from position 0, about 2k from 128k, 250 from 1M).
PREFILL_LOGITS_BYTES = 1 << 30


class DSABackbone(nn.Module):
    """``model.*`` of the HF layout: embedding, decoder layers (+ the MTP layer last), final norm."""

    def __init__(self, config: ModelConfig, group: TPGroup, device=None, dtype=None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, group, device, dtype)
        layers = [DecoderLayer(config, i, group, device, dtype) for i in range(config.num_hidden_layers)]
        layers += [MTPLayer(config, group, device, dtype) for _ in range(config.num_nextn_predict_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)


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
        by its size, and so must ``moe_intermediate_size`` in an MoE model. TP 1 computes exactly
        what the unsharded model does.
    options : RuntimeOptions
        The runtime's switches (default: the shipped path); the model uses ``sparse_mla_gluon``,
        ``sparse_mla_slot_major``, ``topk_single_launch``, ``fused_moe`` and ``fp8_fast_accum`` (a
        ``ValueError`` with
        ``row_invariant``), and the engine and workers built over it take the rest from
        ``model.options`` unless given their own.

    The projections that read one input share one GEMM (:meth:`MLAAttention.fuse_projections`,
    :meth:`MLP.fuse_projections`), and an MoE layer's shared expert is held as one more routed
    expert (:meth:`MoE.fuse_shared_experts <dsaspec.layers.moe.MoE.fuse_shared_experts>`, run by
    the fused MoE); their parameters keep the checkpoint names and are views of the fused weights;
    moving or converting the model (``.to``, ``.cuda`` ...) fuses them again
    (:class:`~dsaspec.layers.fused_linear.HoldsFusedLinear`, ``MoE._apply``).

    With ``config.quantization`` (FP8 block-scaled weights) the projections it converts are
    :class:`~dsaspec.layers.fp8_linear.Fp8Linear` (e4m3 ``weight`` + fp32 ``weight_scale_inv``, the
    checkpoint's tensors; the Triton FP8 GEMM with ``use_triton``, else torch), and so are the
    routed experts (:class:`~dsaspec.layers.moe.RoutedExperts` with ``fp8``); their parameters
    are uninitialised until :meth:`init_weights` or a checkpoint load. Tensor-parallel splits of
    those layers must lie on 128-feature boundaries. A config
    :func:`~dsaspec.configs.model_config.check_implemented` refuses (FP8 routed experts) raises its
    ``ValueError``.
    """

    def __init__(self, config: ModelConfig, *, device=None, dtype=torch.bfloat16, use_triton: bool = False,
                 row_invariant: bool = False, tp_group: TPGroup | None = None,
                 options: RuntimeOptions | None = None):
        super().__init__()
        self.config = config.validate()
        check_implemented(config.to_hf_dict())
        if tp_group is None:
            tp_group = TPGroup.single(torch.device(device) if device is not None else torch.get_default_device())
        elif device is not None and torch.device(device) != tp_group.device:
            raise ValueError(f"device {device} differs from the TP group's device {tp_group.device}; pass device=None")
        for name in ("num_attention_heads", "intermediate_size") + (("moe_intermediate_size",) if config.is_moe else ()):
            if getattr(config, name) % tp_group.size:
                raise ValueError(f"tensor parallel size {tp_group.size} must divide ModelConfig.{name} "
                                 f"({getattr(config, name)})")
        device = tp_group.device
        self.group = tp_group
        self.row_invariant = row_invariant
        self.options = RuntimeOptions() if options is None else options
        if self.options.fp8_fast_accum and row_invariant:
            raise ValueError("options.fp8_fast_accum: the row-invariant mode needs the FP8 GEMMs' exact 16-row "
                             "tiles; turn one of the two off")
        self.sparse_mla_gluon = self.options.sparse_mla_gluon
        self.sparse_mla_slot_major = self.options.sparse_mla_slot_major
        if config.quantization is None:
            self.model = DSABackbone(config, tp_group, device, dtype)
        else:  # built without storage, the FP8 layers swapped in, then allocated once
            self.model = DSABackbone(config, tp_group, torch.device("meta"), dtype)
            convert_to_fp8(self, config.quantization, torch.device("meta"))
            self.model.to_empty(device=device)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, tp_group, dtype)
        self.rotary = Rotary(config, device)
        self.requires_grad_(False)
        for module in list(self.modules()):
            if isinstance(module, (MLAAttention, MLP)):
                module.fuse_projections()
        for module in self.modules():  # after the shared MLPs' gate_up fusion, which this keeps as views
            if isinstance(module, MoE):
                module.fuse_shared_experts()
        for module in self.modules():
            if isinstance(module, RowInvariant):
                module.row_invariant = row_invariant
            if isinstance(module, Fp8Linear):
                module.fast_accum = self.options.fp8_fast_accum
        self.use_triton = use_triton

    @property
    def use_triton(self) -> bool:
        """Whether the DSA ops, the FP8 GEMMs, the RMSNorms, the RoPE tables, the dense SwiGLU's
        ``silu(gate) * up``, the MoE routers' selection and (with ``options.fused_moe``, not row-invariant) the routed experts run
        as Triton kernels; assignable."""
        return self._use_triton

    @use_triton.setter
    def use_triton(self, value: bool) -> None:
        self._use_triton = value
        set_fused_moe(self, value and self.options.fused_moe, self.row_invariant)
        for module in self.modules():
            if isinstance(module, (Fp8Linear, RMSNorm, Rotary, MLP, Router)):
                module.use_triton = value

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
        shards = {}
        for name, module in self.named_modules():
            if getattr(module, "shard", None) is not None:
                shards[f"{name}.weight"] = module.shard
            if getattr(module, "scale_shard", None) is not None:
                shards[f"{name}.weight_scale_inv"] = module.scale_shard
        return shards

    def routed_experts(self) -> dict[str, RoutedExperts]:
        """The MoE layers' routed experts by module name (``model.layers.{i}.mlp.experts``): their
        fused ``w13`` / ``w2`` come from several checkpoint tensors each
        (:meth:`RoutedExperts.checkpoint_parts`)."""
        return {name: module for name, module in self.named_modules() if isinstance(module, RoutedExperts)}

    def checkpoint_parts(self, fused: bool = False) -> dict[str, list[CheckpointPart]]:
        """The fused expert parameters by name (``...mlp.experts.w13`` / ``w2``) -> their parts,
        with checkpoint names made absolute: per-expert tensors, or transformers' fused ones."""
        parts: dict[str, list[CheckpointPart]] = {}
        for prefix, experts in self.routed_experts().items():
            for param, group in experts.checkpoint_parts(fused).items():
                parts[f"{prefix}.{param}"] = [CheckpointPart(f"{prefix}.{p.name}", p.full_shape, p.index, p.target)
                                              for p in group]
        return parts

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every checkpoint tensor's (unsharded) shape, by HF name: the parameters', the fused
        experts as their per-expert tensors."""
        shards, parts = self.shards(), self.checkpoint_parts()
        shapes = {name: shards[name].full_shape(p.shape) if name in shards else tuple(p.shape)
                  for name, p in self.state_dict().items() if name not in parts}
        shapes.update((part.name, part.full_shape) for group in parts.values() for part in group)
        return shapes

    @property
    def mtp_layer(self) -> MTPLayer:
        """The MTP layer (``model.layers[num_hidden_layers]``)."""
        if self.config.num_nextn_predict_layers == 0:
            raise ValueError("this model has no MTP layer (num_nextn_predict_layers=0)")
        return self.model.layers[self.config.num_hidden_layers]

    @torch.no_grad()
    def init_weights(self, seed: int, *, progress: bool = False) -> "DSAModel":
        """Seeded random init (same seed, device type and dtype -> same weights): projections
        and experts ``N(0, 1/fan_in)`` (the MoE router's rounded to bf16), embedding ``N(0, 1)``,
        norm weights ``1 + N(0, 0.1^2)``, norm biases and the MoE correction bias ``N(0, 0.1^2)``. Every tensor is drawn at its
        checkpoint shape (the experts as transformers' fused ``[E, 2I, hidden]`` / ``[E, hidden,
        I]``) and a TP rank keeps its shard, so the ranks of any TP size hold the shards of the
        TP 1 model of the same seed. An FP8 projection (or expert) holds the block quantization of
        the value its bf16 twin (same config without ``quantization``, same seed) draws.
        ``progress``: a progress bar over the parameters (on stderr)."""
        device = next(self.parameters()).device
        generator = torch.Generator(device=device).manual_seed(seed)
        shards, parts = self.shards(), self.checkpoint_parts(fused=True)
        fp8 = {f"{name}.weight": module for name, module in self.named_modules() if isinstance(module, Fp8Linear)}
        experts = {f"{prefix}.{param}": module for prefix, module in self.routed_experts().items()
                   for param in ("w13", "w2")}
        params = list(self.named_parameters())
        for name, param in tqdm(params, desc="random weights", unit="tensor", disable=not progress):
            if name.endswith(".weight_scale_inv") and name[: -len("_scale_inv")] in fp8:
                continue
            if name.endswith("_scale_inv") and name[: -len("_scale_inv")] in experts:
                continue
            shard = shards.get(name)
            shape = param.shape if shard is None else shard.full_shape(param.shape)
            if name in parts:
                shape = parts[name][0].full_shape
            noise = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
            if name.endswith("embed_tokens.weight"):
                value = noise
            elif name.endswith("mlp.gate.weight"):   # the router: bf16 values, as the checkpoints store it
                value = (noise / math.sqrt(shape[-1])).bfloat16().float()
            elif len(shape) >= 2:
                value = noise / math.sqrt(shape[-1])
            elif name.endswith("bias"):
                value = noise * 0.1
            else:
                value = 1.0 + noise * 0.1
            part = value if shard is None else value[shard.index(value.dim())]
            if name in parts:
                experts[name].set_from_fused(name.rpartition(".")[2], value)
            elif name in fp8:
                fp8[name].set_dense(part)
            elif shard is None:
                param.copy_(value)
            else:
                shard.fill(param, part)
        return self

    def _state(self, positions, out_cache_loc, attn: AttentionInputs, check_values: bool,
               seed_slots: torch.Tensor | None = None) -> ForwardState:
        cos, sin = self.rotary(positions)
        ops = dsa_ops(self.use_triton, self.sparse_mla_gluon, self.sparse_mla_slot_major)
        return ForwardState(cos, sin, out_cache_loc, attn, ops, check_values,
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
        if kv.kv_cache_dtype != "fp8_e4m3" and kv.mla_cache[0].dtype != self.lm_head.weight.dtype:
            raise ValueError(f"KV pool dtype {kv.mla_cache[0].dtype} != model dtype {self.lm_head.weight.dtype}")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, out_cache_loc: torch.Tensor,
                kv: KVPool, attn: AttentionInputs, *, check_values: bool = True) -> torch.Tensor:
        """One target step over ``R`` rows.

        Parameters
        ----------
        input_ids : int ``[R]``; positions : int64 ``[R]`` (RoPE positions);
        out_cache_loc : int64 ``[R]`` (slot each row's KV is written to);
        kv : the target KVPool (``num_hidden_layers`` layers); attn : AttentionInputs of the rows.
        check_values : let the first layer's ops check lengths and slots against their buffers
        (host syncs; every layer reads the same rows, slots, tables and pool geometry, so the
        others do not repeat them); pass False inside CUDA graphs. Shapes and dtypes are always
        checked (host only).

        Returns
        -------
        Tensor ``[R, hidden]`` (model dtype): the hidden state after the final norm (the LM-head
        input, and the hidden the MTP layer consumes). Writes every layer's cache entries at
        ``out_cache_loc`` and ``attn.topk_slots`` if given.
        """
        self._check(input_ids, positions, out_cache_loc, attn, kv, self.config.num_hidden_layers)
        step = self._state(positions, out_cache_loc, attn, check_values)
        x, residual = self.model.embed_tokens(input_ids), None
        for i in range(self.config.num_hidden_layers):
            x, residual = self.model.layers[i](x, step, kv.mla_cache[i], kv.index_k_cache[i], residual)
            step.check_values = False
        return self.model.norm(x, residual)[0]

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
        x, residual = layer(x, step, kv.mla_cache[0], kv.index_k_cache[0])
        return layer.shared_head.norm(x, residual)[0]

    def attention_workspace(self, rows: int, fp8_cache: bool = False) -> AttentionWorkspace | None:
        """The Triton ops' workspaces for steps of ``rows`` rows over bf16 caches, or with
        ``fp8_cache`` over ``fp8_e4m3`` ones (allocate once, before graph capture), or None with
        the torch ops. The sparse-MLA split is left out in the row-invariant
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
        # sized for the configuration sparse_mla_decode takes (options.sparse_mla_gluon and
        # sparse_mla_slot_major, the cache dtype): the configurations split differently (the Gluon
        # FP8 one-split config comes exactly where this gives None, as sparse_mla_decode then takes)
        mla_config = sparse_mla_config(rows, heads, split=True,
                                       device=device if self.sparse_mla_gluon else None,
                                       fp8_cache=fp8_cache, slot_major=self.sparse_mla_slot_major)
        return AttentionWorkspace(
            sparse_mla=None if self.row_invariant else sparse_mla_workspace(rows, heads, device,
                                                                            config=mla_config),
            topk=topk, topk_single_launch=None if topk is None or self.options.topk_single_launch else False,
            topk_candidates=candidates)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head (shared by the MTP layer): ``[R, hidden]`` -> fp32 ``[R, vocab]``; at TP > 1 the
        vocab shards are all-gathered (collective; ``LMHead.gather_logits``)."""
        return self.lm_head.gather_logits(self.lm_head(hidden))

    # ---- eager prefill helpers --------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, req_to_token: torch.Tensor, row: int, kv: KVPool, *,
                prefix_len: int = 0, chunk_size: int = DEFAULT_PREFILL_CHUNK) -> torch.Tensor:
        """Eager prefill of one request: positions ``prefix_len + [0, T)`` of table row ``row``
        (slots already allocated), in chunks of at most ``chunk_size`` rows (fewer at long prefixes:
        :meth:`prefill_chunk_rows`; the indexer's rows grouped by :meth:`prefill_index_group`).
        Returns the post-norm hidden ``[T, hidden]``; writes the target caches."""
        return self._chunked(lambda ids, _, pos, loc, attn: self.forward(ids, pos, loc, kv, attn),
                             input_ids, None, req_to_token, row, prefix_len, chunk_size)

    @torch.no_grad()
    def prefill_mtp(self, next_ids: torch.Tensor, hidden: torch.Tensor, req_to_token: torch.Tensor,
                    row: int, kv: KVPool, *, prefix_len: int = 0,
                    chunk_size: int = DEFAULT_PREFILL_CHUNK,
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

    def prefill_index_group(self, rows: int) -> int:
        """The indexer's ``rows_per_group`` for a prefill chunk of ``rows`` rows of one request:
        :data:`PREFILL_INDEX_GROUP` consecutive positions share each key block read (the target
        verify groups' kernel), where it divides ``rows`` and the group fits (``group_fits``); 1
        otherwise and in the row-invariant mode (a group's head sum runs in another order than a
        single row's)."""
        from dsaspec.ops.indexer import group_fits

        grouped = (not self.row_invariant and rows % PREFILL_INDEX_GROUP == 0
                   and group_fits(PREFILL_INDEX_GROUP, self.config.index_n_heads))
        return PREFILL_INDEX_GROUP if grouped else 1

    @staticmethod
    def prefill_chunk_rows(prefix: int, remaining: int, chunk_size: int) -> int:
        """Rows of the prefill chunk that starts at position ``prefix`` with ``remaining`` rows to
        go: at most ``chunk_size``, and no more than fit their fp32 indexer logits ``[rows, prefix
        + rows]`` in :data:`PREFILL_LOGITS_BYTES` (a multiple of :data:`PREFILL_INDEX_GROUP` when
        that bound cuts the chunk; at least one row)."""
        cells = PREFILL_LOGITS_BYTES // 4
        fit = (math.isqrt(prefix * prefix + 4 * cells) - prefix) // 2     # rows * (prefix + rows) <= cells
        rows = min(chunk_size, remaining)
        if fit < rows:
            rows = max(1, fit - fit % PREFILL_INDEX_GROUP if fit >= PREFILL_INDEX_GROUP else fit)
        return rows

    def _chunked(self, step, input_ids, hidden, req_to_token, row, prefix_len, chunk_size):
        outputs, start, total = [], 0, input_ids.shape[0]
        while start < total:
            rows = self.prefill_chunk_rows(prefix_len + start, total - start, chunk_size)
            ids = input_ids[start:start + rows]
            positions, loc, attn = build_extend_inputs(req_to_token, [row], [prefix_len + start], [rows])
            attn.rows_per_group = self.prefill_index_group(rows)
            attn.topk_slots = torch.empty(rows, self.config.index_topk, dtype=torch.int32, device=ids.device)
            chunk_hidden = None if hidden is None else hidden[start:start + rows]
            outputs.append(step(ids, chunk_hidden, positions, loc, attn))
            start += rows
        return torch.cat(outputs)
