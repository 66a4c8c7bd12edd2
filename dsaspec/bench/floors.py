"""Floor model of a decode step, a speculative iteration and a prefill: per phase, the bytes its
kernels must read and write and the FLOPs they must do, and the floor time at the device's
measured rates.

A forward over ``requests`` requests of ``q`` query rows each (``T = requests * q`` rows), every
request with ``live`` KV positions, costs per decoder layer (``a`` = bytes of the model dtype; an
FP8 linear (``ModelConfig.quantization``) is 1 byte a weight plus one fp32 scale per 128 x 128
block and does its FLOPs at the FP8 rate; ``k = index_topk``; MLA entry = 576 x ``a`` bytes, or
656 in ``fp8_e4m3`` (latent codes, 4 fp32 scales, bf16 rope key); indexer key = 128 x ``a``, or
132). A prefill chunk's rows live over different lengths (:class:`QueryRows`: row ``i`` of a chunk
at prefix ``p`` over ``p + i + 1`` positions): the per-row terms below are summed over its rows.

- ``indexer``: the weights of ``k_norm`` (weight, bias) and ``weights_proj``; read x ``[T,
  hidden]`` and the query and key projections ``[T, heads x 128 + 128]`` (``wq_b`` and ``wk`` run in
  the layer's fused GEMMs, counted under ``attention_proj``, where bench decode's markers put
  them); write q ``[T, heads, 128]``, head weights fp32 ``[T, heads]`` and the T index keys.
  Layers without an indexer (IndexShare) and seeded draft steps: nothing.
- ``indexer_logits``: only where ``live > k`` (shorter rows take every position and skip it):
  per request the ``live`` keys and their int32 page-table entries, q and head weights, write
  fp32 logits ``[T, live]``; ``2 T live heads 128`` FLOPs (at the FP8 rate on an FP8 key cache:
  e4m3 dots).
- ``topk``: read ``[T, live]`` fp32 logits (or int32 page-table entries where ``live <= k``),
  write int32 slots ``[T, k]``.
- ``sparse_mla``: per request ``min(live, k)`` gathered MLA entries (rows of one request may
  share them: the floor counts each once), the int32 indices, q ``[T, H, 576]``, write the
  latent output ``[T, H, 512]``; ``2 T H min(live, k) (576 + 512)`` FLOPs.
- ``attention_proj``: the weights of ``q_a_proj``, ``q_b_proj``, ``kv_a_proj_with_mqa``,
  ``kv_b_proj`` (W_UK, W_UV), ``o_proj``, the two norms; read x and the latent output; write q
  latent, q ``[T, H, 576]``, the output ``[T, hidden]`` and the T MLA entries. Where the indexer
  runs, also the indexer's ``wq_b`` and ``wk`` (one GEMM with ``q_b_proj``, one with ``q_a_proj``
  and ``kv_a_proj_with_mqa``: :meth:`~dsaspec.layers.attention.mla.MLAAttention.fuse_projections`)
  and their outputs ``[T, heads x 128 + 128]`` written.
- ``ffn``: dense SwiGLU weights, or the router (fp32), the experts hit (as counted in the run
  where the caller passes them, else uniform routing's ``E (1 - (1 - top_k / E) ** T)``) and the
  shared experts; read x, write the output.
- ``other``: the embedding rows, per layer two fused residual-add + RMSNorm (read x and the
  residual, write both, the norm weight) and the final norm (MTP: also ``enorm`` + ``hnorm``
  (read the embedding and the hidden, write both, their weights) and ``eh_proj`` (its weights,
  read ``[T, 2 hidden]``, write ``[T, hidden]``); the final norm is ``shared_head.norm``).

Per forward: ``lm_head`` (vocab weights, never FP8; read the head rows' hidden, write their
logits), ``sampling`` (read the logits, write an int64 token a row). Per step: ``metadata`` (the
int32 table entries of the live positions, read once per metadata replay: a decode step 1, an
iteration 3, or 2 without draft steps), ``feedback`` (the tokens copied out). Weights of split layers are
``1 / tp`` of the full ones (heads, FFN features, vocab). FLOPs = 2 x multiply-adds of the GEMMs
and the attention; element-wise work, RoPE and the tiny router math are not counted.

Floor of a phase = ``max(bytes / copy bandwidth, bf16 FLOPs / bf16 rate + FP8 FLOPs / FP8 rate,
launches x empty kernel)`` with one launch per layer it runs in; all three measured on the device
in the same run (:class:`Rates`).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, fields

import torch

from dsaspec.configs.model_config import ModelConfig
from dsaspec.ops.kv_cache_layout import INDEX_FP8_BYTES, MLA_FP8_BYTES

FP8_BLOCK = 128
PHASES = ("metadata", "indexer", "indexer_logits", "topk", "sparse_mla", "attention_proj", "ffn", "lm_head",
          "sampling", "other", "feedback")
LAYER_PHASES = ("indexer", "indexer_logits", "topk", "sparse_mla", "attention_proj", "ffn")
STEP, PER_LAYER, ITERATION = "step", "per layer", "iteration"


@dataclass
class Cost:
    """Bytes read + written, FLOPs at the bf16 rate and at the FP8 rate, and kernel launches (at
    least one a layer the phase runs in)."""

    bytes: int = 0
    flops: int = 0
    fp8_flops: int = 0
    launches: int = 0

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def __mul__(self, n: int) -> "Cost":
        return Cost(*(getattr(self, f.name) * n for f in fields(self)))


def add_costs(*parts: dict[str, Cost]) -> dict[str, Cost]:
    """Phase-wise sum of phase -> Cost dicts (every phase of :data:`PHASES` present)."""
    out = {p: Cost() for p in PHASES}
    for part in parts:
        for phase, cost in part.items():
            out[phase] = out[phase] + cost
    return out


def uniform_experts_hit(config: ModelConfig, rows: int) -> float:
    """The routed experts ``rows`` tokens hit in expectation under uniform routing:
    ``E (1 - (1 - top_k / E) ** rows)``."""
    experts = config.n_routed_experts
    return experts * (1 - (1 - config.num_experts_per_tok / experts) ** rows)


@dataclass(frozen=True)
class QueryRows:
    """The query rows of one forward, as the per-layer costs need them: ``rows`` rows;
    ``positions`` = sum of the rows' live lengths; ``selected`` = sum of ``min(live, k)``
    (sparse MLA's slots); ``gathered`` = MLA entries each request must read at least once
    (``min(longest live, k)`` a request); the indexer logits run for the ``logit_rows`` rows longer
    than ``k``, over ``logit_positions`` positions (their live lengths summed), reading
    ``logit_keys`` index keys (each request's longest such row)."""

    rows: int
    positions: int
    selected: int
    gathered: int
    logit_rows: int
    logit_positions: int
    logit_keys: int

    @classmethod
    def uniform(cls, requests: int, q: int, live: int, k: int) -> "QueryRows":
        """``requests`` requests of ``q`` rows, every row at ``live`` positions (decode, verify)."""
        rows, logits = requests * q, live > k
        return cls(rows, rows * live, rows * min(live, k), requests * min(live, k), rows * logits,
                   rows * live * logits, requests * live * logits)

    @classmethod
    def causal(cls, prefix: int, rows: int, k: int) -> "QueryRows":
        """One request's prefill chunk: ``rows`` rows at positions ``prefix .. prefix + rows - 1``,
        row ``i`` live over ``prefix + i + 1`` positions."""
        def total(first: int, last: int) -> int:   # first + ... + last (0 when last < first)
            return max(0, last - first + 1) * (first + last) // 2

        first, last = prefix + 1, prefix + rows
        short_last = min(last, k)                  # rows at live <= k: every position selected
        long_first = max(first, k + 1)
        long_rows = max(0, last - long_first + 1)
        return cls(rows, total(first, last), total(first, short_last) + long_rows * k, min(last, k),
                   long_rows, total(long_first, last), last if long_rows else 0)


class FloorModel:
    """The floor costs of one model (``config``) run in a dtype of ``act_bytes`` bytes with
    caches in ``kv_cache_dtype`` (``"bf16"``: the model dtype, or ``"fp8_e4m3"``), sharded over
    ``tp`` ranks (the costs of one rank). ``experts_hit``: rows of a forward -> the routed experts
    a MoE layer's rows hit, as counted in a run (bench decode); other row counts take uniform
    routing's expectation. See the module docstring for what each phase counts."""

    def __init__(self, config: ModelConfig, *, act_bytes: int, kv_cache_dtype: str = "bf16", tp: int = 1,
                 experts_hit: dict[int, float] | None = None):
        if kv_cache_dtype not in ("bf16", "fp8_e4m3"):
            raise ValueError(f"kv_cache_dtype: expected 'bf16' or 'fp8_e4m3', got {kv_cache_dtype!r}")
        if act_bytes not in (2, 4) or tp < 1:
            raise ValueError(f"act_bytes must be 2 or 4 and tp >= 1, got {act_bytes}, {tp}")
        self.config, self.a, self.tp = config, act_bytes, tp
        self.experts_hit = dict(experts_hit or {})
        fp8 = self.fp8_cache = kv_cache_dtype == "fp8_e4m3"
        self.mla_entry = MLA_FP8_BYTES if fp8 else config.kv_cache_dim * act_bytes
        self.index_entry = INDEX_FP8_BYTES if fp8 else config.index_head_dim * act_bytes

    def linear(self, name: str, n_in: int, n_out: int, rows: int, *, element: int | None = None) -> Cost:
        """A linear layer ``name`` (HF module name) of ``[n_out, n_in]`` over ``rows`` rows: its
        weight bytes (FP8 codes + block scales where the quantization converts it, else the model
        dtype; ``element``: never quantized, that many bytes a weight) and FLOPs."""
        quant = self.config.quantization
        flops = 2 * rows * n_in * n_out
        if element is None and quant is not None and quant.converts(name):
            scales = math.ceil(n_out / FP8_BLOCK) * math.ceil(n_in / FP8_BLOCK) * 4
            return Cost(bytes=n_in * n_out + scales, fp8_flops=flops)
        return Cost(bytes=n_in * n_out * (element or self.a), flops=flops)

    def forward(self, requests: int, q: int, live: int, *, mtp: bool = False, seeded: bool = False,
                head_rows: int | None = None) -> dict[str, Cost]:
        """Phase -> Cost of one forward (the target's decoder layers, or with ``mtp`` the MTP layer,
        its indexer skipped when ``seeded``) over ``requests x q`` rows at ``live`` KV positions a
        request, then the LM head and the greedy token over ``head_rows`` rows (default all)."""
        return self.forward_rows(QueryRows.uniform(requests, q, live, self.config.index_topk), mtp=mtp,
                                 seeded=seeded, head_rows=head_rows)

    def forward_rows(self, query: QueryRows, *, mtp: bool = False, seeded: bool = False,
                     head_rows: int | None = None) -> dict[str, Cost]:
        """:meth:`forward` over the rows ``query`` describes."""
        cfg, a = self.config, self.a
        rows = query.rows
        head_rows = rows if head_rows is None else head_rows
        layers = [cfg.num_hidden_layers] if mtp else range(cfg.num_hidden_layers)
        act = rows * cfg.hidden_size * a
        out = {p: Cost() for p in PHASES}
        for layer in layers:
            for phase, cost in self._layer(f"model.layers.{layer}", layer, query, seeded=mtp and seeded).items():
                out[phase] = out[phase] + cost
        fused_norm = Cost(bytes=4 * act + cfg.hidden_size * a)
        other = Cost(bytes=2 * act, launches=1) + fused_norm * (2 * len(layers)) + Cost(bytes=2 * act + cfg.hidden_size * a)
        if mtp:
            h = cfg.hidden_size
            other = other + Cost(bytes=4 * act + 2 * h * a) + self.linear(
                f"model.layers.{cfg.num_hidden_layers}.eh_proj", 2 * h, h, rows) + Cost(bytes=3 * act)
        out["other"] = other
        vocab = -(-cfg.vocab_size // self.tp)
        if head_rows:
            out["lm_head"] = self.linear("lm_head", cfg.hidden_size, vocab, head_rows, element=a) + Cost(
                bytes=head_rows * (cfg.hidden_size + vocab) * a, launches=1)
            out["sampling"] = Cost(bytes=head_rows * (vocab * a + 8), launches=1)
        return out

    def _layer(self, prefix: str, layer: int, query: QueryRows, *, seeded: bool) -> dict[str, Cost]:
        cfg, a, tp = self.config, self.a, self.tp
        rows, h, k = query.rows, cfg.hidden_size, cfg.index_topk
        heads = cfg.num_attention_heads // tp
        nh, d = cfg.index_n_heads, cfg.index_head_dim
        attn = f"{prefix}.self_attn"
        out = {}
        index_proj = Cost()   # the indexer's wq_b and wk, in the layer's fused GEMMs (attention_proj)
        if cfg.has_indexer(layer) and not seeded:
            ix = f"{attn}.indexer"
            index_proj = (self.linear(f"{ix}.wq_b", cfg.q_lora_rank, nh * d, rows) + self.linear(f"{ix}.wk", h, d, rows)
                          + Cost(bytes=rows * (nh * d + d) * a))
            out["indexer"] = (self.linear(f"{ix}.weights_proj", h, nh, rows)
                              + Cost(bytes=2 * d * a + rows * ((h + nh * d + d + nh * d) * a + nh * 4)
                                     + rows * self.index_entry, launches=1))
            if query.logit_rows:
                out["indexer_logits"] = Cost(
                    bytes=query.logit_keys * (self.index_entry + 4) + query.logit_rows * (nh * d * a + nh * 4)
                    + query.logit_positions * 4,
                    launches=1, **{"fp8_flops" if self.fp8_cache else "flops": 2 * query.logit_positions * nh * d})
            out["topk"] = Cost(bytes=(query.positions + rows * k) * 4, launches=1)
        out["sparse_mla"] = Cost(
            bytes=query.gathered * self.mla_entry + query.selected * 4
            + rows * heads * (cfg.kv_cache_dim + cfg.kv_lora_rank) * a,
            flops=2 * heads * query.selected * (cfg.kv_cache_dim + cfg.kv_lora_rank), launches=1)
        out["attention_proj"] = (
            self.linear(f"{attn}.q_a_proj", h, cfg.q_lora_rank, rows)
            + self.linear(f"{attn}.q_b_proj", cfg.q_lora_rank, heads * cfg.qk_head_dim, rows)
            + self.linear(f"{attn}.kv_a_proj_with_mqa", h, cfg.kv_cache_dim, rows)
            + self.linear(f"{attn}.kv_b_proj", cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), rows)
            + self.linear(f"{attn}.o_proj", heads * cfg.v_head_dim, h, rows)
            + index_proj
            + Cost(bytes=(cfg.q_lora_rank + cfg.kv_lora_rank) * a
                   + rows * (h + heads * cfg.kv_lora_rank + cfg.q_lora_rank + heads * cfg.kv_cache_dim + h) * a
                   + rows * self.mla_entry, launches=1))
        out["ffn"] = self._ffn(f"{prefix}.mlp", layer, rows) + Cost(bytes=2 * rows * h * a, launches=1)
        return out

    def _ffn(self, mlp: str, layer: int, rows: int) -> Cost:
        cfg, h = self.config, self.config.hidden_size
        if not cfg.is_moe_layer(layer):
            return self._swiglu(mlp, cfg.intermediate_size // self.tp, rows)
        experts = cfg.n_routed_experts
        hit = self.experts_hit.get(rows, uniform_experts_hit(cfg, rows))
        width = cfg.moe_intermediate_size // self.tp
        # FLOPs: each row through its top_k experts; bytes: the experts hit
        one = self._swiglu(f"{mlp}.experts.0", width, 1)
        routed = Cost(bytes=round(one.bytes * hit), flops=one.flops * rows * cfg.num_experts_per_tok,
                      fp8_flops=one.fp8_flops * rows * cfg.num_experts_per_tok)
        cost = self.linear(f"{mlp}.gate", h, experts, rows, element=4) + routed
        if cfg.n_shared_experts:
            cost = cost + self._swiglu(f"{mlp}.shared_experts", cfg.n_shared_experts * width, rows)
        return cost

    def _swiglu(self, name: str, width: int, rows: int) -> Cost:
        h = self.config.hidden_size
        return (self.linear(f"{name}.gate_proj", h, width, rows) + self.linear(f"{name}.up_proj", h, width, rows)
                + self.linear(f"{name}.down_proj", width, h, rows))

    def decode_step(self, bs: int, live: int) -> dict[str, Cost]:
        """Phase -> Cost of one decode step of ``bs`` requests at ``live`` KV positions each
        (metadata, the target forward, LM head, greedy token, the tokens copied out)."""
        return add_costs(self.forward(bs, 1, live), {"metadata": Cost(bytes=bs * live * 4, launches=1),
                                                     "feedback": Cost(bytes=2 * bs * 8, launches=1)})

    def prefill(self, prompt_len: int, chunk: int) -> dict[str, dict[str, Cost]]:
        """Prefill part (``target``, ``mtp``) -> phase -> Cost of one request's eager prefill of
        ``prompt_len`` tokens in chunks of at most ``chunk`` rows (``DSAModel.prefill`` and
        ``prefill_mtp``): a forward a chunk over its causal rows (:meth:`QueryRows.causal`), no LM
        head, then the LM head and the greedy token on the prompt's last row."""
        if prompt_len < 1 or chunk < 1:
            raise ValueError(f"prompt_len and chunk must be >= 1, got {prompt_len}, {chunk}")
        k = self.config.index_topk
        last_row = QueryRows.causal(prompt_len - 1, 1, k)
        out = {}
        for part, mtp in (("target", False), ("mtp", True)):
            chunks = [self.forward_rows(QueryRows.causal(start, min(chunk, prompt_len - start), k), mtp=mtp,
                                        head_rows=0) for start in range(0, prompt_len, chunk)]
            head = self.forward_rows(last_row, mtp=mtp, head_rows=1)
            out[part] = add_costs(*chunks, {p: head[p] for p in ("lm_head", "sampling")})
        return out

    def spec_iteration(self, bs: int, live: int, num_steps: int) -> dict[str, dict[str, Cost]]:
        """Iteration phase (``metadata``, ``draft``, ``verify``, ``extend``) -> phase -> Cost of one
        speculative iteration (S = ``num_steps``, N = S + 1 rows a request): the S - 1 MTP draft
        steps (seeded with IndexShare for the MTP iteration), the target over N rows with the LM
        head on all of them, the MTP layer over N rows with the LM head on one a request."""
        cfg, n = self.config, num_steps + 1
        draft = self.forward(bs, 1, live, mtp=True, seeded=cfg.index_share_for_mtp_iteration)
        replays = 2 + (num_steps > 1)
        return {"metadata": add_costs({"metadata": Cost(bytes=replays * bs * live * 4, launches=replays)}),
                "draft": add_costs(*[draft] * (num_steps - 1)),
                "verify": add_costs(self.forward(bs, n, live + n)),
                "extend": add_costs(self.forward(bs, n, live + n, mtp=True, head_rows=bs))}


@dataclass
class Rates:
    """Device rates measured once per run: copy bandwidth (GB/s, read + write), an empty kernel
    node (µs; 0 without CUDA), bf16 and FP8 matmul throughput (TFLOP/s; ``fp8_tflops`` None where
    the device has no FP8 matmul: FP8 FLOPs then count at the bf16 rate)."""

    copy_gbps: float
    empty_us: float
    bf16_tflops: float
    fp8_tflops: float | None

    @classmethod
    def measure(cls, device: torch.device) -> "Rates":
        """On CUDA: a 2 GiB device-to-device copy (events, median of 10), the empty kernel node and
        8192^3 bf16 / e4m3 matmuls (CUPTI in a CUDA graph, median of 20). On CPU: a 32 MiB copy and
        a 512^3 fp32 matmul (median of 5 wall times); no empty kernel, no FP8."""
        if device.type != "cuda":
            src = torch.empty(32 << 20, dtype=torch.uint8)
            dst = torch.empty_like(src)
            a = torch.randn(512, 512)
            return cls(2 * src.numel() / _median_s(lambda: dst.copy_(src)) / 1e9, 0.0,
                       2 * 512 ** 3 / _median_s(lambda: a @ a) / 1e12, None)
        from dsaspec.bench.timing import Floors

        floors = Floors.measure()
        return cls(floors.copy_gbps, floors.empty_us, matmul_tflops(torch.bfloat16), _fp8_tflops())

    def floor(self, cost: Cost) -> dict:
        """``bytes_floor_us``, ``flops_floor_us``, ``launch_floor_us`` and their maximum ``floor_us``."""
        fp8_rate = self.fp8_tflops or self.bf16_tflops
        out = {"bytes_floor_us": cost.bytes / (self.copy_gbps * 1e3),
               "flops_floor_us": cost.flops / (self.bf16_tflops * 1e6) + cost.fp8_flops / (fp8_rate * 1e6),
               "launch_floor_us": cost.launches * self.empty_us}
        out["floor_us"] = max(out.values())
        return out


def _median_s(fn, reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def matmul_tflops(dtype: torch.dtype = torch.bfloat16, n: int = 8192, iters: int = 20) -> float:
    """Measured tensor-core throughput of an ``n^3`` matmul in ``dtype`` (bf16, or e4m3 through
    ``torch._scaled_mm`` with unit scales, bf16 out), TFLOP/s: CUPTI time in a CUDA graph, median."""
    from dsaspec.bench.timing import time_in_graph

    a = torch.randn(n, n, device="cuda").to(dtype)
    b = torch.randn(n, n, device="cuda").to(dtype)
    if dtype == torch.float8_e4m3fn:
        one = torch.ones((), device="cuda")
        bt = b.t()                                   # column-major second operand
        fn = lambda: torch._scaled_mm(a, bt, one, one, out_dtype=torch.bfloat16)  # noqa: E731
    else:
        c = torch.empty_like(a)
        fn = lambda: torch.matmul(a, b, out=c)  # noqa: E731
    seconds = time_in_graph(fn, iters=iters, cold_l2=False, graph_diff=False).median_us * 1e-6
    return 2 * n ** 3 / seconds / 1e12


def _fp8_tflops() -> float | None:
    if torch.cuda.get_device_capability() < (8, 9):
        return None
    return matmul_tflops(torch.float8_e4m3fn)


def floor_rows(costs: dict[str, Cost], rates: Rates, measured_us: dict[str, float] | None, *,
               layers: int, step_us: float | None) -> list[dict]:
    """The floor table of one step: a row per phase of ``costs`` (phase, bytes, flops, fp8_flops,
    the floors of :meth:`Rates.floor`, ``measured_us`` from ``measured_us[phase]``,
    ``measured_over_floor`` and ``measured_over_bytes_floor``), then ``per layer`` (the
    :data:`LAYER_PHASES` summed, divided by ``layers``) and ``step`` (every phase; measured =
    ``step_us``). Measured values and ratios are None where not given."""
    phase_rows = [dict(phase=phase, bytes=c.bytes, flops=c.flops, fp8_flops=c.fp8_flops, **rates.floor(c),
                       measured_us=None if measured_us is None else measured_us.get(phase))
                  for phase, c in costs.items()]
    layer_rows = [r for r in phase_rows if r["phase"] in LAYER_PHASES]
    layer_measured = (None if measured_us is None
                      else sum(measured_us.get(r["phase"], 0.0) for r in layer_rows) / layers)
    return [_with_ratios(r) for r in phase_rows + [_total(PER_LAYER, layer_rows, layers, layer_measured),
                                                   _total(STEP, phase_rows, 1, step_us)]]


def iteration_rows(model: FloorModel, bs: int, live: int, num_steps: int, rates: Rates,
                   measured_us: dict[str, float] | None, iteration_us: float | None) -> tuple[list[dict], dict]:
    """The floor table of one speculative iteration (:meth:`FloorModel.spec_iteration`): a row per
    iteration phase whose floor is its ``step`` row of :func:`floor_rows` (the sum of its kernel
    groups' floors), measured from ``measured_us[phase]``, then ``iteration`` (measured =
    ``iteration_us``). Returns the rows and iteration phase -> its per-kernel-group rows."""
    detail = {phase: floor_rows(costs, rates, None, layers=1, step_us=None)
              for phase, costs in model.spec_iteration(bs, live, num_steps).items()}
    rows = [dict(detail[phase][-1], phase=phase, measured_us=None if measured_us is None else measured_us[phase])
            for phase in detail]
    return [_with_ratios(r) for r in rows + [_total(ITERATION, rows, 1, iteration_us)]], detail


def _total(name: str, members: list[dict], divide: int, measured: float | None) -> dict:
    row = {"phase": name}
    for key in ("bytes", "flops", "fp8_flops", "bytes_floor_us", "flops_floor_us", "launch_floor_us", "floor_us"):
        row[key] = sum(r[key] for r in members) / divide
    row["measured_us"] = measured
    return row


def _with_ratios(row: dict) -> dict:
    m = row["measured_us"]
    return dict(row, measured_over_floor=None if m is None or not row["floor_us"] else m / row["floor_us"],
                measured_over_bytes_floor=None if m is None or not row["bytes_floor_us"] else m / row["bytes_floor_us"])


def floor_markdown(rows: list[dict], markdown_table, *, unit: str = "µs", keys: tuple = ()) -> str:
    """A Markdown table of :func:`floor_rows` rows (``keys``: leading (field, title) columns), MB
    and GFLOP, floors and measured in ``unit`` (``"µs"`` or ``"ms"``)."""
    scale = 1e-3 if unit == "ms" else 1.0
    flat = [dict(r, mb=r["bytes"] / 1e6, gflop=(r["flops"] + r["fp8_flops"]) / 1e9,
                 **{f"{k}_s": None if r[k] is None else r[k] * scale
                    for k in ("bytes_floor_us", "flops_floor_us", "floor_us", "measured_us")}) for r in rows]
    return markdown_table(list(keys) + [
        ("phase", "phase"), ("mb", "MB read + written"), ("gflop", "GFLOP"),
        ("bytes_floor_us_s", f"bytes floor {unit}"), ("flops_floor_us_s", f"FLOP floor {unit}"),
        ("floor_us_s", f"floor {unit}"), ("measured_us_s", f"measured {unit}"),
        ("measured_over_floor", "measured / floor"), ("measured_over_bytes_floor", "measured / bytes floor")], flat)
