"""The mixture-of-experts FFN of GLM-5 / DeepSeek-V3.2: a sigmoid router with group-limited top-k
(``topk_method: noaux_tc``), ``n_routed_experts`` routed SwiGLU experts and the shared expert(s).

Tensor parallel: every expert is split by its intermediate features, like the dense FFN (the
gate/up rows of ``w13`` column parallel, ``w2`` row parallel); the router and the correction bias
are replicated. Every rank holds every token's hidden state after the attention's all-reduce, so
each rank runs the same routing and its share of every selected expert, and the partial outputs of
the routed and shared experts are summed by the layer's one all-reduce, as in the dense FFN: no
all-to-all, no token dispatch, and the group's collectives stay those the fake-TP emulation
(tests/fake_tp.py) checks. Each rank reads exactly ``1 / tp`` of every expert hit, whatever the
routing; expert parallelism (whole experts per rank) would add the all-to-all and leave the rank
holding the most hit experts of a small decode batch reading more than its share.

Fused path (:attr:`RoutedExperts.use_fused`): with the Triton ops and not row-invariant, the routed
experts run as one :func:`~dsaspec.ops.fused_moe.fused_moe` call, and the shared expert in the same
call where it has a routed expert's shape and weight format (:meth:`MoE.fuse_shared_experts`): it
is held as expert ``E`` of the routed experts' storage (its parameters are views of it, so nothing
is duplicated) and the router's kernel gives every token one more slot, expert ``E`` at weight 1.0.
That saves the separate MLP's launches (FP8: 4 or 5) and the bf16 add per layer; the output is the
fp32 sum of the ``k`` weighted routed outputs and the shared one, cast once (the separate MLP adds
a bf16 shared output to the routed sum cast to bf16: other last bits, one rounding fewer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dsaspec.configs.model_config import ModelConfig
from dsaspec.distributed.tp_group import TPGroup
from dsaspec.layers.fp8_linear import ActQuant, Fp8Input, Fp8Linear
from dsaspec.layers.linear import Linear
from dsaspec.layers.mlp import MLP
from dsaspec.layers.row_invariant import RowInvariant, row_invariant_ops
from dsaspec.ops.fp8_gemm import BLOCK, dequantize_weight, quantize_blocks, quantize_weight
from dsaspec.ops.moe_router import DECODE_MAX_TOKENS, decode_tile, route_topk, router_logits


@dataclass(frozen=True, eq=False)
class CheckpointPart:
    """One checkpoint tensor (or a slice of it) and the part of a fused parameter it fills:
    ``target.copy_(checkpoint[name][index])``, where ``name`` is relative to the module's prefix and
    ``full_shape`` is the checkpoint tensor's shape."""

    name: str
    full_shape: tuple[int, ...]
    index: tuple[slice, ...]
    target: torch.Tensor


# The default mode's router GEMM from 3 rows (bf16 weight values): cuBLAS bf16 -> fp32 took 7.0 / 7.2 / 7.8 /
# 8.8 us at T 4 / 32 / 128 / 256 where the FMA tile took 7.7 at T 4 and cuBLAS on x.float() (fp32 weight)
# 21.0 / 27.8 / 39.5 at T 32 / 128 / 256; the one-row tile (T <= 2) 6.4 against 6.7 at T 1 (GLM-5 rank,
# H200, cold L2; benchmarks/results/h200/router_gemm.md).
BF16_GEMM_MIN_TOKENS = 3


class Router(Linear):
    """``mlp.gate``: fp32 ``weight`` ``[E, hidden]`` and ``e_score_correction_bias`` ``[E]``
    (replicated). ``forward(x)`` -> ``(topk_ids int32 [T, k], topk_weights fp32 [T, k])``:

        s = sigmoid(x @ weight.T)                            (fp32)
        c = s + e_score_correction_bias                      (selection only)
        group score = sum of the top 2 of c in each of n_group groups of E / n_group experts
        ids = top-k of c over the experts of the topk_group best groups
        w = s[ids] (/ sum(s[ids]) + 1e-20 if norm_topk_prob) * routed_scaling_factor

    Per token; no host sync, static shapes. The GEMM is :func:`~dsaspec.ops.moe_router.router_logits`
    (fp32 FMAs on ``x`` as stored) in one tile for every T when ``row_invariant`` (so
    row-invariant), or with ``use_triton`` in the tile for T up to
    :data:`~dsaspec.ops.moe_router.DECODE_MAX_TOKENS` rows (decode sizes;
    :func:`~dsaspec.ops.moe_router.decode_tile`); torch's on ``x.float()`` otherwise. In the
    default mode on CUDA, from :data:`BF16_GEMM_MIN_TOKENS` bf16 rows, where ``weight`` holds bf16
    values (the checkpoints' gate dtype, and the random init's), cuBLAS's bf16 GEMM with fp32
    output replaces both: the products are exact in fp32 either way, the sums fp32 in the tensor
    cores' order (:meth:`bf16_weight`). The FMA tiles read that bf16 copy too where it exists
    (half the bytes, the same fp32 values). With
    ``use_triton`` (set by the model) or ``row_invariant`` everything after the GEMM is one kernel
    (:func:`~dsaspec.ops.moe_router.route_topk`: the same ids, the sum in id order; one program per
    token, so row-invariant by construction, where torch's CPU ``sigmoid`` rounds an element by its
    vector path or its scalar tail, which the row count decides), else torch ops.
    ``forward(x, shared)`` appends ``shared`` slots to each token, ids ``E, E + 1, ...`` at weight
    1.0: the shared experts run by the fused MoE (:meth:`MoE.fuse_shared_experts`); the kernel
    writes them itself, the torch path concatenates."""

    use_triton: bool = False

    def __init__(self, config: ModelConfig, device=None):
        super().__init__(config.hidden_size, config.n_routed_experts, bias=False, device=device, dtype=torch.float32)
        self._bf16 = None   # (the weight's version and storage, bf16_weight()) once asked for
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(config.n_routed_experts, device=device, dtype=torch.float32))
        self.top_k, self.groups, self.topk_group = config.num_experts_per_tok, config.n_group, config.topk_group
        self.norm_topk_prob, self.scaling = config.norm_topk_prob, config.routed_scaling_factor

    def bf16_weight(self) -> torch.Tensor | None:
        """``weight`` as bf16 ``[E, hidden]`` where that is exact, else None. Decided (a host sync)
        and kept (a copy: 3 MB a GLM-5 layer) until ``weight`` is written or replaced, so the first
        call must be eager: the graph runner's warm-up runs before every capture."""
        key = (self.weight._version, self.weight.data_ptr(), self.weight.device)
        if self._bf16 is None or self._bf16[0] != key:
            bf16 = self.weight.detach().bfloat16()
            self._bf16 = (key, bf16 if torch.equal(bf16.float(), self.weight) else None)
        return self._bf16[1]

    def _fma_weight(self) -> torch.Tensor:
        """The weight the FMA tiles read: the bf16 copy where exact (half the bytes, the same fp32
        values, so the same logits), else the fp32 weight."""
        bf16 = self.bf16_weight()
        return self.weight if bf16 is None else bf16

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` (bf16 or fp32) -> fp32 ``x @ weight.T`` ``[T, E]`` (class docstring)."""
        if self.row_invariant:
            return router_logits(x, self._fma_weight())
        if self.use_triton and x.is_cuda and x.dtype == torch.bfloat16 and x.shape[0] >= BF16_GEMM_MIN_TOKENS:
            bf16 = self.bf16_weight()
            if bf16 is not None:
                return torch.mm(x, bf16.t(), out_dtype=torch.float32)
        if self.use_triton and x.shape[0] <= DECODE_MAX_TOKENS:
            return router_logits(x, self._fma_weight(), config=decode_tile(x.shape[0]))
        return F.linear(x.float(), self.weight)

    def forward(self, x: torch.Tensor, shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        if self.use_triton or self.row_invariant:
            return route_topk(self.logits(x), self.e_score_correction_bias, top_k=self.top_k,
                              n_group=self.groups, topk_group=self.topk_group, norm_topk_prob=self.norm_topk_prob,
                              scaling=self.scaling, n_shared=shared)
        scores = self.logits(x).sigmoid()
        tokens, experts = scores.shape
        choice = (scores + self.e_score_correction_bias).view(tokens, self.groups, experts // self.groups)
        best_groups = choice.topk(2, dim=-1).values.sum(-1).topk(self.topk_group, dim=-1).indices
        in_best = torch.zeros(tokens, self.groups, 1, dtype=torch.bool, device=x.device)
        in_best.scatter_(1, best_groups[..., None], True)
        ids = choice.masked_fill(~in_best, float("-inf")).view(tokens, experts).topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        ids, weights = ids.to(torch.int32), weights * self.scaling
        if shared:
            slots = torch.arange(experts, experts + shared, dtype=torch.int32, device=x.device)
            ids = torch.cat([ids, slots.expand(tokens, shared)], dim=1)
            weights = torch.cat([weights, weights.new_ones(tokens, shared)], dim=1)
        return ids, weights


class RoutedExperts(RowInvariant, nn.Module):
    """``mlp.experts``: ``w13`` ``[E, 2 I_r, hidden]`` (expert e's gate rows then up rows) and ``w2``
    ``[E, hidden, I_r]``, ``I_r = moe_intermediate_size / tp`` (this rank's intermediate features).
    With ``fp8`` (an FP8 ``quantization_config``) they are e4m3 as the checkpoint stores them, with
    fp32 ``w13_scale_inv`` ``[E, 2 I_r / 128, hidden / 128]`` (the gate blocks' ``weight_scale_inv``,
    then the up blocks') and ``w2_scale_inv`` ``[E, hidden / 128, I_r / 128]``; ``I_r`` and
    ``hidden`` must be multiples of 128.

    ``forward(x [T, hidden], topk_ids int32 [T, k], topk_weights fp32 [T, k])`` -> ``[T, hidden]``
    in ``x``'s dtype, this rank's partial of ``sum_j w_j * down_j(silu(gate_j x) * up_j x)``:
    ``dsaspec.ops.fused_moe.fused_moe`` when ``use_fused`` (set by the model: the Triton ops with
    ``RuntimeOptions.fused_moe``, not row-invariant; row blocks of ``moe_block_m(T)`` rows and
    ``moe_split_k`` gate/up splits), else plain torch: a loop over all experts in a fixed order,
    each on every token, its output times the token's weight for it (the sum over the
    slots that picked it, 0 when none did) added in fp32. The torch path has static shapes and no
    host sync (CUDA-graph safe) and computes each token from its own row only, so with the
    row-invariant GEMM its result does not depend on the other tokens; it costs every expert's
    weights and FLOPs on every token (a fallback, not fast).
    FP8 on the torch path: the fused op's math in plain torch, as :class:`Fp8Linear`'s torch path
    (``x`` and the activation, rounded to ``x``'s dtype, quantized per token per 128 columns with
    ``scale_fmt`` and dequantized; each expert's weights dequantized; fp32 GEMMs), so it runs on
    any device and its row invariance is the row-invariant GEMM's.

    ``stacked`` (set by :meth:`MoE.fuse_shared_experts`, else None): ``w13`` / ``w2`` (and the
    scales) by name as tensors of ``E + 1`` experts whose first ``E`` the parameters view, the last
    being the shared expert; the fused path then runs them all, so ``topk_ids`` may hold ``E``."""

    use_fused: bool = False
    stacked: dict[str, torch.Tensor] | None = None

    def __init__(self, config: ModelConfig, group: TPGroup, device=None, dtype=None, *, fp8: bool = False,
                 scale_fmt: str | None = None, name: str = "mlp.experts"):
        super().__init__()
        self.config, self.group = config, group
        self.num_experts, self.hidden = config.n_routed_experts, config.hidden_size
        self.full_intermediate = config.moe_intermediate_size
        self.intermediate = config.moe_intermediate_size // group.size
        self.fp8, self.scale_fmt = fp8, scale_fmt
        if fp8 and (self.intermediate % BLOCK or self.hidden % BLOCK):
            raise ValueError(f"{name}: FP8 experts need hidden_size and the rank's moe_intermediate_size "
                             f"(moe_intermediate_size {self.full_intermediate} / tp {group.size} = "
                             f"{self.intermediate}) to be multiples of {BLOCK} (weight_block_size [128, 128]); "
                             f"hidden_size is {self.hidden}")
        weights = torch.float8_e4m3fn if fp8 else dtype
        shape13 = (self.num_experts, 2 * self.intermediate, self.hidden)
        self.w13 = nn.Parameter(torch.empty(shape13, device=device, dtype=weights))
        self.w2 = nn.Parameter(torch.empty(self.num_experts, self.hidden, self.intermediate, device=device,
                                           dtype=weights))
        if fp8:
            blocks13 = (self.num_experts, 2 * self.intermediate // BLOCK, self.hidden // BLOCK)
            blocks2 = (self.num_experts, self.hidden // BLOCK, self.intermediate // BLOCK)
            self.w13_scale_inv = nn.Parameter(torch.empty(blocks13, device=device, dtype=torch.float32))
            self.w2_scale_inv = nn.Parameter(torch.empty(blocks2, device=device, dtype=torch.float32))

    def to_fp8(self, name: str, scale_fmt: str | None, device=None) -> "RoutedExperts":
        """FP8 experts of this module's shape and split (module ``name`` in errors), on ``device``."""
        return RoutedExperts(self.config, self.group, device, self.w13.dtype, fp8=True, scale_fmt=scale_fmt,
                             name=name)

    def checkpoint_parts(self, fused: bool = False) -> dict[str, list[CheckpointPart]]:
        """Where ``w13`` / ``w2`` (the keys) come from in a checkpoint: per expert
        ``{e}.gate_proj.weight`` / ``{e}.up_proj.weight`` ``[I, hidden]`` and
        ``{e}.down_proj.weight`` ``[hidden, I]`` (the official checkpoints, transformers'
        ``save_pretrained``), or with ``fused`` transformers' in-memory ``gate_up_proj`` ``[E, 2I,
        hidden]`` and ``down_proj`` ``[E, hidden, I]`` (bf16 only). A rank takes its intermediate slice
        ``[rank * I_r, (rank + 1) * I_r)`` of each. FP8 experts also list ``w13_scale_inv`` /
        ``w2_scale_inv`` from the per-expert ``{e}.{proj}.weight_scale_inv`` (their 128-blocks)."""
        return self._parts(fused, self.w13, self.w2)

    def _parts(self, fused: bool, w13: torch.Tensor, w2: torch.Tensor) -> dict[str, list[CheckpointPart]]:
        full, local, hidden, experts = self.full_intermediate, self.intermediate, self.hidden, self.num_experts
        mine = slice(self.group.rank * local, (self.group.rank + 1) * local)
        up = slice(full + mine.start, full + mine.stop)
        gate_t, up_t, every = w13[:, :local], w13[:, local:], slice(None)
        if fused:
            return {"w13": [CheckpointPart("gate_up_proj", (experts, 2 * full, hidden), (every, mine, every), gate_t),
                            CheckpointPart("gate_up_proj", (experts, 2 * full, hidden), (every, up, every), up_t)],
                    "w2": [CheckpointPart("down_proj", (experts, hidden, full), (every, every, mine), w2)]}
        parts = {"w13": [CheckpointPart(f"{e}.{proj}.weight", (full, hidden), (mine, every), target[e])
                         for e in range(experts) for proj, target in (("gate_proj", gate_t), ("up_proj", up_t))],
                 "w2": [CheckpointPart(f"{e}.down_proj.weight", (hidden, full), (every, mine), w2[e])
                        for e in range(experts)]}
        if self.fp8:
            blocks = slice(mine.start // BLOCK, mine.stop // BLOCK)
            s13, s2, half = self.w13_scale_inv, self.w2_scale_inv, local // BLOCK
            parts["w13_scale_inv"] = [
                CheckpointPart(f"{e}.{proj}.weight_scale_inv", (full // BLOCK, hidden // BLOCK), (blocks, every), t)
                for e in range(experts) for proj, t in (("gate_proj", s13[e, :half]), ("up_proj", s13[e, half:]))]
            parts["w2_scale_inv"] = [CheckpointPart(f"{e}.down_proj.weight_scale_inv", (hidden // BLOCK, full // BLOCK),
                                                    (every, blocks), s2[e]) for e in range(experts)]
        return parts

    @torch.no_grad()
    def set_from_fused(self, param: str, value: torch.Tensor) -> None:
        """Set ``w13`` or ``w2`` (``param``) from the whole float tensor in transformers' fused layout
        (``[E, 2 I, hidden]`` / ``[E, hidden, I]``): this rank's slice, for FP8 experts quantized per
        128 x 128 block of each expert's projection (the slice of the whole tensor's quantization:
        the split lies on block boundaries), with its ``_scale_inv``."""
        target = getattr(self, param)
        local = torch.empty(target.shape, dtype=torch.float32, device=target.device) if self.fp8 else target
        for part in self._parts(True, **{"w13": self.w13, "w2": self.w2, param: local})[param]:
            part.target.copy_(value[part.index])
        if self.fp8:
            scale = getattr(self, f"{param}_scale_inv")
            for e in range(self.num_experts):
                codes, scales = quantize_weight(local[e])
                target[e].copy_(codes)
                scale[e].copy_(scales)

    def _weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ``e``'s ``w13`` and ``w2`` as the torch path multiplies them (FP8: dequantized, fp32)."""
        if not self.fp8:
            return self.w13[e], self.w2[e]
        return (dequantize_weight(self.w13[e], self.w13_scale_inv[e], torch.float32),
                dequantize_weight(self.w2[e], self.w2_scale_inv[e], torch.float32))

    def _gemm_input(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as the torch path's GEMM reads it (FP8: quantized per token per 128 columns, dequantized)."""
        if not self.fp8:
            return x
        codes, scales = quantize_blocks(x, 1, self.scale_fmt)
        return codes.float() * scales.repeat_interleave(BLOCK, dim=1)

    def forward(self, x: torch.Tensor | Fp8Input, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """``x`` may be an :class:`~dsaspec.layers.fp8_linear.Fp8Input` of this module's ``scale_fmt``
        (:attr:`MoE.input_quant`): the fused FP8 path then reads its codes instead of quantizing
        ``x`` (the same codes); every other path reads its ``x``."""
        codes = None
        if isinstance(x, Fp8Input):
            if x.scale_fmt != self.scale_fmt:
                raise ValueError(f"RoutedExperts: the input was quantized with scale_fmt {x.scale_fmt!r}, "
                                 f"the experts' is {self.scale_fmt!r}")
            codes, x = (x.codes, x.scales), x.x
        if self.use_fused:
            from dsaspec.ops.fused_moe import fused_moe, moe_block_m, moe_split_k

            out = torch.empty_like(x)
            held = dict(self.named_parameters(recurse=False)) if self.stacked is None else self.stacked
            scales = dict(w13_scale=held["w13_scale_inv"], w2_scale=held["w2_scale_inv"]) if self.fp8 else {}
            block_m = moe_block_m(x.shape[0])   # no workspace: the op allocates one of this block_m
            split_k = moe_split_k(self.intermediate, self.fp8, block_m)
            # the router's ids are in range by construction: no host-synced range check (graph-safe)
            fused_moe(x.contiguous(), held["w13"], held["w2"], topk_ids, topk_weights, out,
                      scale_fmt=self.scale_fmt, split_k=split_k, block_m=block_m,
                      check_values=False, hidden_codes=codes if self.fp8 else None, **scales)
            return out
        linear = row_invariant_ops().linear if self.row_invariant else F.linear
        per_expert = torch.zeros(x.shape[0], self.num_experts, dtype=torch.float32, device=x.device)
        per_expert.scatter_add_(1, topk_ids.long(), topk_weights)  # a repeated id counts per slot
        out = torch.zeros(x.shape[0], self.hidden, dtype=torch.float32, device=x.device)
        x_in = self._gemm_input(x)
        for e in range(self.num_experts):
            w13, w2 = self._weights(e)
            gate, up = linear(x_in, w13).split(self.intermediate, dim=-1)
            act = (F.silu(gate) * up).to(x.dtype)  # rounded to x's dtype, as the fused op
            out += per_expert[:, e:e + 1] * linear(self._gemm_input(act), w2).float()
        return out.to(x.dtype)


class MoE(nn.Module):
    """``mlp`` of an MoE layer: ``gate`` (:class:`Router`), ``experts`` (:class:`RoutedExperts`) and,
    with ``n_shared_experts`` > 0, ``shared_experts`` (a SwiGLU of ``n_shared_experts *
    moe_intermediate_size`` features, split like the dense FFN). ``forward(x [T, hidden])`` =
    routed + shared, one all-reduce over the TP group: on the fused path with the shared expert
    stacked (:meth:`fuse_shared_experts`) one fused call, else the routed experts plus the shared
    MLP's partial output."""

    def __init__(self, config: ModelConfig, group: TPGroup, device=None, dtype=None):
        super().__init__()
        self.group = group
        self.gate = Router(config, device)
        self.experts = RoutedExperts(config, group, device, dtype)
        shared = config.n_shared_experts * config.moe_intermediate_size
        self.shared_experts = MLP(config, group, device, dtype, intermediate_size=shared) if shared else None
        self._views: list[int] = []

    def fuse_shared_experts(self) -> None:
        """Hold the shared expert as expert ``E`` of the routed experts (``experts.stacked``), for
        the fused path, where it fits: this rank's shared width equals a routed expert's
        (``n_shared_experts`` 1: a SwiGLU of ``W`` features is the sum of SwiGLUs over chunks of
        them, but ``n_shared * I_r`` rows of ``gate_proj`` cannot view the gate rows of ``n_shared``
        experts, which alternate with up rows) and the weights are the routed experts' format (the
        same dtype; FP8 with the same ``scale_fmt`` or both not). Else nothing changes.

        One storage per tensor, ``[E + 1, ...]``: ``w13`` / ``w2`` (and their ``_scale_inv``) view
        its first ``E`` experts; the shared MLP's fused ``gate_up`` weight (and scales) is its
        expert ``E`` of ``w13`` (the shared ``gate_proj`` / ``up_proj`` view its two halves, as
        :class:`~dsaspec.layers.fused_linear.FusedLinear` keeps them; fused here first if it is
        not yet) and ``down_proj`` its expert ``E`` of ``w2``. The current values are copied in, so
        the parameters keep their names, shapes and values, whatever writes them (a checkpoint
        load, ``init_weights``) writes what the fused call reads, and the torch path and the
        separate MLP read the same tensors. A move or conversion of this module (``.to``,
        ``.cuda``, ``.float`` ..., directly or through a parent) stacks them again."""
        mlp, experts = self.shared_experts, self.experts
        kind = Fp8Linear if experts.fp8 else Linear
        parts = () if mlp is None else (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        if not parts or mlp.gate_proj.out_features != experts.intermediate or not all(
                type(p) is kind and p.weight.dtype == experts.w13.dtype
                and getattr(p, "scale_fmt", None) == experts.scale_fmt for p in parts):
            return
        if mlp.gate_up is None:  # fuse_linears fuses these: one type, dtype and scale format
            mlp.fuse_projections()
        self._stack()

    @torch.no_grad()
    def _stack(self) -> None:
        """(Re)build ``experts.stacked`` from the parameters' current values and make them views."""
        experts, mlp = self.experts, self.shared_experts
        stacked = {}
        for name, routed in experts.named_parameters(recurse=False):
            stacked[name] = routed.new_empty((routed.shape[0] + 1, *routed.shape[1:]))
            stacked[name][:-1].copy_(routed.detach())
            routed.data = stacked[name][:-1]
        suffixes = ("", "_scale_inv") if experts.fp8 else ("",)
        mlp.gate_up.refuse({f"weight{s}": stacked[f"w13{s}"][-1] for s in suffixes})
        for s in suffixes:
            down = getattr(mlp.down_proj, f"weight{s}")
            stacked[f"w2{s}"][-1].copy_(down.detach())
            down.data = stacked[f"w2{s}"][-1]
        experts.stacked = stacked
        self._views = self._pointers()

    def _pointers(self) -> list[int]:
        tensors = (*self.experts.stacked.values(), *self.experts.parameters(), *self.shared_experts.parameters(),
                   *self.shared_experts.buffers())
        return [t.data_ptr() for t in tensors]

    def _apply(self, fn, recurse=True):
        module = super()._apply(fn, recurse)  # moves each view on its own
        if self.experts.stacked is not None:
            self._stack()
        return module

    @property
    def input_quant(self) -> ActQuant | None:
        """How the layer's FP8 GEMMs quantize its input where every one of them reads the same codes:
        the fused FP8 experts with the shared expert stacked (the router reads the bf16 rows), so
        the norm before it writes them (:class:`~dsaspec.layers.norm.RMSNorm` ``quant``; one
        act_quant launch fewer); else None."""
        experts = self.experts
        if experts.fp8 and experts.use_fused and (self.shared_experts is None or experts.stacked is not None):
            return ActQuant(experts.scale_fmt)
        return None

    def forward(self, x: torch.Tensor | Fp8Input) -> torch.Tensor:
        """``x [T, hidden]``, or an :class:`~dsaspec.layers.fp8_linear.Fp8Input` of it with
        :attr:`input_quant`'s codes -> ``[T, hidden]`` (summed over the TP group)."""
        experts_x, x = x, x.x if isinstance(x, Fp8Input) else x
        fused_shared = self.experts.use_fused and self.experts.stacked is not None
        if fused_shared and self._pointers() != self._views:
            raise RuntimeError("MoE: the experts' parameters no longer view their stacked storage (the routed or "
                               "shared experts were moved or replaced on their own); move the MoE layer, which "
                               "stacks them again")
        topk_ids, topk_weights = self.gate(x, int(fused_shared))
        out = self.experts(experts_x, topk_ids, topk_weights)
        if self.shared_experts is not None and not fused_shared:
            out = out + self.shared_experts.partial(x)
        return self.group.all_reduce(out)


def set_fused_moe(model: nn.Module, fused_moe: bool, row_invariant: bool) -> None:
    """Route every :class:`RoutedExperts` of ``model`` to the fused kernel when ``fused_moe`` (the
    model runs the Triton ops with ``RuntimeOptions.fused_moe``) and the model is not row-invariant
    (the torch path is the one whose per-token result has been checked not to depend on the other
    tokens); with them the shared experts stacked by :meth:`MoE.fuse_shared_experts`."""
    fused = fused_moe and not row_invariant
    for module in model.modules():
        if isinstance(module, RoutedExperts):
            module.use_fused = fused
