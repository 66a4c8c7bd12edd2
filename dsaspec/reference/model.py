"""Reference forward of the DSA model: masked-dense attention, plain torch, fp32 math.

Takes whole token sequences (positions ``0..T-1``, no cache, no paging) and the parameters of a
:class:`dsaspec.models.dsa_model.DSAModel`. Attention is the MHA form (``k = [W_UK latent | roped
key]``, ``v = W_UV latent``, per head) over all preceding tokens, masked to the indexer's top-k:
score(t, s) = sum_h w_h(t) * relu(q_h(t) . k(s)), s <= t; row t keeps every s while t + 1 <= K,
else the K largest (ties: lowest position). A layer that ``config.indexer_types`` marks
``"shared"`` has no indexer and attends to the keys of the closest earlier ``"full"`` layer. An MoE layer
(its ``mlp`` has ``experts``) routes each token on its own, written out per token in Python: sigmoid
scores, the correction bias for the choice only, the ``topk_group`` groups of the largest top-2 sums,
the ``num_experts_per_tok`` best experts in them, weights from the unbiased scores (normalised if
``norm_topk_prob``, times ``routed_scaling_factor``), plus the shared expert. It shares no code with the runtime (it only reads the model's parameters and config), so it imports
nothing from the rest of the package.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class ReferenceOutput:
    """``logits`` fp32 ``[T, vocab]``; ``hidden`` fp32 ``[T, hidden]`` (post final norm, or post
    ``shared_head.norm`` for the MTP layer); ``selected``: per layer a bool ``[T, T]`` mask of the
    keys each row attends to."""

    logits: torch.Tensor
    hidden: torch.Tensor
    selected: list[torch.Tensor]


def _w(module) -> torch.Tensor:
    return module.weight.detach().float()


def _rms(x, norm) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * _w(norm)


def _rope(x, angles, interleaved: bool, factor: float) -> torch.Tensor:
    """Complex-rotation form: pair (2i, 2i+1) or (i, i + d/2) is one complex number times
    ``factor * exp(i * angle_i)``."""
    rotation = torch.polar(torch.full_like(angles, factor), angles)           # [T, d/2] complex128
    shape = (angles.shape[0],) + (1,) * (x.dim() - 2) + (angles.shape[1],)
    rotation = rotation.view(shape)
    xd = x.double()
    if interleaved:
        pairs = torch.view_as_complex(xd.reshape(*xd.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(pairs * rotation).flatten(-2).float()
    half = xd.shape[-1] // 2
    pairs = torch.complex(xd[..., :half], xd[..., half:]) * rotation
    return torch.cat((pairs.real, pairs.imag), dim=-1).float()


def _indexer_select(indexer, h, q_latent, angles, config, factor) -> torch.Tensor:
    """The lightning indexer of one layer on its normed input ``h`` and query latent: the mask of
    :func:`_select`."""
    length, rope = h.shape[0], config.qk_rope_head_dim
    index_q = (q_latent @ _w(indexer.wq_b).T).view(length, config.index_n_heads, config.index_head_dim)
    index_q = torch.cat((_rope(index_q[..., :rope], angles, config.indexer_rope_interleave, factor),
                         index_q[..., rope:]), -1)
    index_k = F.layer_norm(h @ _w(indexer.wk).T, (config.index_head_dim,), _w(indexer.k_norm),
                           indexer.k_norm.bias.detach().float(), indexer.k_norm.eps)
    index_k = torch.cat((_rope(index_k[:, :rope], angles, config.indexer_rope_interleave, factor),
                         index_k[:, rope:]), -1)
    index_w = h @ _w(indexer.weights_proj).T * (config.index_head_dim ** -0.5 * config.index_n_heads ** -0.5)
    return _select(index_q, index_w, index_k, config.index_topk)


def _select(index_q, index_w, index_k, topk: int) -> torch.Tensor:
    """bool ``[T, T]``: the keys row t keeps (causal, top-k of the indexer score)."""
    length = index_q.shape[0]
    scores = torch.einsum("th,ths->ts", index_w, torch.relu(torch.einsum("thd,sd->ths", index_q, index_k)))
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    selected = torch.zeros(length, length, dtype=torch.bool)
    for t in range(length):
        if t + 1 <= topk:
            selected[t, : t + 1] = True
        else:
            order = torch.sort(scores[t, : t + 1], descending=True, stable=True).indices
            selected[t, order[:topk]] = True
    return selected & causal


def _layer(layer, x, angles, config, factor, shared=None):
    """One decoder layer on fp32 ``x`` ``[T, hidden]``; returns (output, selected mask). ``shared``:
    the mask a shared-indexer layer attends to (None: the layer's own indexer selects)."""
    attn = layer.self_attn
    length, heads = x.shape[0], config.num_attention_heads
    nope, rope, v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
    h = _rms(x, layer.input_layernorm)

    q_latent = _rms(h @ _w(attn.q_a_proj).T, attn.q_a_layernorm)
    q = (q_latent @ _w(attn.q_b_proj).T).view(length, heads, nope + rope)
    q = torch.cat((q[..., :nope], _rope(q[..., nope:], angles, config.rope_interleave, factor)), -1)
    kv_a = h @ _w(attn.kv_a_proj_with_mqa).T
    latent = _rms(kv_a[:, : config.kv_lora_rank], attn.kv_a_layernorm)
    k_rope = _rope(kv_a[:, config.kv_lora_rank:], angles, config.rope_interleave, factor)
    kv = (latent @ _w(attn.kv_b_proj).T).view(length, heads, nope + v_dim)
    k = torch.cat((kv[..., :nope], k_rope[:, None, :].expand(length, heads, rope)), -1)
    v = kv[..., nope:]

    selected = shared if shared is not None else _indexer_select(attn.indexer, h, q_latent, angles, config,
                                                                 factor)

    scores = torch.einsum("thd,shd->hts", q, k) * config.softmax_scale
    scores = scores.masked_fill(~selected[None], float("-inf"))
    out = torch.einsum("hts,shd->thd", torch.softmax(scores, dim=-1), v).reshape(length, heads * v_dim)
    x = x + out @ _w(attn.o_proj).T

    h = _rms(x, layer.post_attention_layernorm)
    mlp = layer.mlp
    if hasattr(mlp, "experts"):
        return x + _moe(mlp, h, config), selected
    return x + _swiglu(h, _w(mlp.gate_proj), _w(mlp.up_proj), _w(mlp.down_proj)), selected


def _swiglu(h, gate, up, down) -> torch.Tensor:
    return (F.silu(h @ gate.T) * (h @ up.T)) @ down.T


def _moe(mlp, h, config) -> torch.Tensor:
    """The MoE FFN on fp32 ``h`` ``[T, hidden]``, one token at a time."""
    router, bias = _w(mlp.gate), mlp.gate.e_score_correction_bias.detach().float()
    w13, w2 = mlp.experts.w13.detach().float(), mlp.experts.w2.detach().float()
    inter, size = config.moe_intermediate_size, config.n_routed_experts // config.n_group
    out = torch.zeros_like(h)
    for t in range(h.shape[0]):
        scores = torch.sigmoid(router @ h[t])
        biased = (scores + bias).tolist()
        def top2(g):
            return sum(sorted(biased[g * size:(g + 1) * size], reverse=True)[:2])
        groups = sorted(range(config.n_group), key=lambda g: -top2(g))[:config.topk_group]
        candidates = [e for g in groups for e in range(g * size, (g + 1) * size)]
        chosen = sorted(candidates, key=lambda e: -biased[e])[:config.num_experts_per_tok]
        weights = scores[chosen]
        if config.norm_topk_prob:
            weights = weights / (weights.sum() + 1e-20)
        for e, weight in zip(chosen, weights * config.routed_scaling_factor):
            out[t] += weight * _swiglu(h[t], w13[e, :inter], w13[e, inter:], w2[e])
    if mlp.shared_experts is not None:
        shared = mlp.shared_experts
        out += _swiglu(h, _w(shared.gate_proj), _w(shared.up_proj), _w(shared.down_proj))
    return out


def _yarn_temperature(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1.0 else 1.0 + 0.1 * mscale * math.log(factor)


def _frequencies(config) -> tuple[list[float], float]:
    """RoPE frequency of each rotated pair and the cos/sin magnitude, YaRN per its definition:
    pair i keeps ``theta^(-2i/d)`` above the fast boundary, takes ``theta^(-2i/d) / factor``
    below the slow one, and blends linearly in between."""
    dim, base = config.qk_rope_head_dim, config.rope_theta
    plain = [base ** (-2.0 * i / dim) for i in range(dim // 2)]
    scaling = config.rope_scaling
    if scaling is None:
        return plain, 1.0
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])

    def boundary(rotations):  # the pair index whose wavelength fits `rotations` times in `original`
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(boundary(float(scaling.get("beta_fast", 32.0)))), 0)
    high = min(math.ceil(boundary(float(scaling.get("beta_slow", 1.0)))), dim - 1)
    frequencies = []
    for i, freq in enumerate(plain):
        interpolated = min(max((i - low) / max(high - low, 1e-3), 0.0), 1.0)
        frequencies.append(freq * (1.0 - interpolated) + freq / factor * interpolated)
    magnitude = (_yarn_temperature(factor, float(scaling.get("mscale", 1.0) or 0.0))
                 / _yarn_temperature(factor, float(scaling.get("mscale_all_dim", 0.0) or 0.0)))
    return frequencies, magnitude


def _angles(config, length: int) -> tuple[torch.Tensor, float]:
    frequencies, magnitude = _frequencies(config)
    positions = torch.arange(length, dtype=torch.float64)[:, None]
    return positions * torch.tensor(frequencies, dtype=torch.float64)[None, :], magnitude


@torch.no_grad()
def reference_forward(model, input_ids: torch.Tensor) -> ReferenceOutput:
    """Target forward of one sequence ``input_ids`` int ``[T]`` (positions ``0..T-1``) on CPU in
    fp32: logits ``[T, vocab]``, post-norm hidden ``[T, hidden]``, per-layer selections (a shared
    layer's is the full layer's it reuses)."""
    model, config = _on_cpu(model), model.config
    ids = input_ids.cpu().long()
    angles, factor = _angles(config, ids.shape[0])
    x = _w(model.model.embed_tokens)[ids]
    types = config.indexer_types or ("full",) * config.num_hidden_layers
    if types[0] != "full":
        raise ValueError(f"indexer_types[0] must be 'full' (a shared layer reuses an earlier full "
                         f"layer's selection), got {list(types)!r}")
    selected = []
    for i in range(config.num_hidden_layers):
        shared = selected[-1] if types[i] == "shared" else None
        x, mask = _layer(model.model.layers[i], x, angles, config, factor, shared)
        selected.append(mask)
    hidden = _rms(x, model.model.norm)
    return ReferenceOutput(hidden @ _w(model.lm_head).T, hidden, selected)


@torch.no_grad()
def reference_mtp_forward(model, next_ids: torch.Tensor, hidden: torch.Tensor) -> ReferenceOutput:
    """MTP forward of one sequence: row p (position p) takes token ``next_ids[p]`` (the token at
    p + 1) and ``hidden[p]`` ``[T, hidden]``: ``shared_head.norm(layer(eh_proj([enorm(e),
    hnorm(h)])))`` then the shared LM head; fp32 on CPU."""
    model, config = _on_cpu(model), model.config
    layer = model.mtp_layer
    ids = next_ids.cpu().long()
    angles, factor = _angles(config, ids.shape[0])
    embedded = _rms(_w(model.model.embed_tokens)[ids], layer.enorm)
    x = torch.cat((embedded, _rms(hidden.cpu().float(), layer.hnorm)), -1) @ _w(layer.eh_proj).T
    x, mask = _layer(layer, x, angles, config, factor)
    out = _rms(x, layer.shared_head.norm)
    return ReferenceOutput(out @ _w(model.lm_head).T, out, [mask])


def _on_cpu(model):
    """The model itself when on CPU, else a CPU copy."""
    if next(model.parameters()).device.type == "cpu":
        return model
    return copy.deepcopy(model).cpu()
