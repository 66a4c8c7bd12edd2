"""One MTP (EAGLE chain, ``topk = 1``) speculative-decoding iteration on a DSA model, from CUDA graphs:
the speculative :class:`~dsaspec.executor.worker.Worker`, whose :meth:`SpecWorker.step` is one iteration.

Per request the worker keeps, in device stores indexed by the request's ``req_to_token`` row, what
carries from one iteration to the next: the committed length ``L`` (positions ``0 .. L-1`` hold
target KV), the pending bonus token (the target's choice for position ``L``, not yet in any cache),
the first draft ``d_1`` and the MTP hidden that drafted it, and (IndexShare) the MTP top-k seed.
One iteration of a batch, with ``S`` draft steps and ``N = S + 1`` verified tokens per request:

    metadata   L = seq_lens[rows]; the decode metadata of every draft step backend (one launch),
               TARGET_VERIFY metadata from L, DRAFT_EXTEND metadata from L + N, the indexer
               schedules (graph M: the replay-metadata kernels of all phases in one graph)
    draft      S - 1 MTP forwards (graph D): step i embeds d_{i+1} at position L + i, writes the
               MTP cache at slot T[r, L + i], attends to [0, L) (DSA decode metadata of L; the
               IndexShare seed instead of the MTP indexer when the model shares it) and drafts
               d_{i+2} through the LogitsProcessor's greedy draft path
    verify     the target over N rows per request [bonus, d_1 .. d_S] at positions L .. L + S
               (graph V), the target's argmax per row, greedy acceptance (speculative/accept.py),
               L <- L + A and the new bonus written back to the stores
    extend     the MTP layer over the same N rows with the committed tokens and the verify
               hidden states (graph E); the row of position L + A - 1 gives the next d_1, its
               hidden and (IndexShare) the MTP indexer's top-k as the next seed

then one device-to-host copy of the accept lengths and committed tokens. Target tokens (verify rows,
the prefill's bonus) come from :func:`~dsaspec.executor.worker.greedy_target_tokens` with the
LogitsProcessor over the model's (vocab-parallel) LM head, draft tokens from its greedy draft path.
Rejected positions keep stale KV in both pools; the next verify and draft extend overwrite them
before anything reads them (rows attend causally and draft steps only to ``[0, L)``), and
``req_to_token`` is never rewritten. Padded rows of a bucket point at the dummy table row (all sink
slots) with ``L = 1``, reset after every verify. Batches above the largest bucket run the same phases
eagerly over metadata sized to their live lengths.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

import torch

from dsaspec.configs.runtime_options import RuntimeOptions
from dsaspec.executor.graph_runner import BucketGraphs
from dsaspec.executor.worker import (BucketWorker, RowCarry, StepResult, greedy_target_tokens,
                                     indexer_programs_for)
from dsaspec.layers.attention.backend import DSAAttnBackend
from dsaspec.layers.attention.multi_step import DSAMultiStepDraftBackend
from dsaspec.forward_mode import Mode
from dsaspec.speculative.accept import Acceptance, greedy_accept
from dsaspec.memory import PAGE_SIZE, KVPool, ReqToTokenPool
from dsaspec.layers.attention.inputs import AttentionInputs, AttentionScratch, AttentionWorkspace
from dsaspec.models.dsa_model import DEFAULT_PREFILL_CHUNK, DSAModel
from dsaspec.ops.indexer import group_fits
from dsaspec.speculative.draft_step import greedy_draft_step
from dsaspec.layers.logits_processor import LogitsProcessor

PHASES = ("metadata", "draft", "verify", "extend")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding settings (SGLang's option names).

    Attributes
    ----------
    num_steps : S, draft tokens per iteration (``--speculative-num-steps``), >= 1.
    num_draft_tokens : N, tokens verified per request (``--speculative-num-draft-tokens``); must be
        ``S + 1`` for a chain.
    eagle_topk : drafts per step (``--speculative-eagle-topk``); only 1 (a chain) is implemented.
    simulate_accept_len : None, or a mean accept length in ``[1, N]`` that every iteration is forced
        to (one draw per iteration: floor or ceil, the mean exact); the tokens then stop being the
        model's greedy output (``RuntimeOptions.simulate_accept_len``: commands pass it here).
    simulate_seed : seed of the simulated draws.
    """

    num_steps: int = 3
    num_draft_tokens: int | None = None
    eagle_topk: int = 1
    simulate_accept_len: float | None = None
    simulate_seed: int = 0

    def __post_init__(self):
        if self.num_draft_tokens is None:
            object.__setattr__(self, "num_draft_tokens", self.num_steps + 1)
        self.validate()

    def validate(self) -> "SpecConfig":
        """Raise ``ValueError`` naming the option that is out of range."""
        for name in ("num_steps", "num_draft_tokens", "eagle_topk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative {name} must be a positive int, got {value!r}")
        if self.eagle_topk != 1:
            raise ValueError(f"speculative eagle_topk={self.eagle_topk}: only 1 (a draft chain) is "
                             "implemented; tree drafts (topk > 1) are not")
        if self.num_draft_tokens != self.num_steps + 1:
            raise ValueError(f"speculative num_draft_tokens must be num_steps + 1 = {self.num_steps + 1} "
                             f"for a chain (topk 1), got {self.num_draft_tokens}")
        sim = self.simulate_accept_len
        if sim is not None and not 1.0 <= sim <= self.num_draft_tokens:
            raise ValueError(f"simulated accept length must lie in [1, {self.num_draft_tokens}] "
                             f"(num_draft_tokens), got {sim}")
        return self

    @property
    def simulated(self) -> bool:
        return self.simulate_accept_len is not None


class SpecState(RowCarry):
    """Per-request carry, one row per ``req_to_token`` row (the dummy row included, ``L = 1``):
    committed length ``seq_lens`` (int64), pending ``bonus`` token, first draft ``draft_first``, its
    MTP hidden ``draft_hidden`` (model dtype ``[rows, hidden]``) and the IndexShare ``seed`` (int32
    KV slots ``[rows, index_topk]``, -1 = none)."""

    FIELDS = RowCarry.FIELDS + ("draft_first", "draft_hidden", "seed")

    def __init__(self, table_rows: int, hidden: int, index_topk: int, dtype, device):
        super().__init__(table_rows, 1, device)
        self.draft_first = torch.zeros(table_rows, dtype=torch.int64, device=device)
        self.draft_hidden = torch.zeros(table_rows, hidden, dtype=dtype, device=device)
        self.seed = torch.full((table_rows, index_topk), -1, dtype=torch.int32, device=device)


class _Batch:
    """The tensors one iteration of ``n`` rows works on (static views of a bucket, or fresh ones for
    an eager batch). ``inputs`` = ``[rows | forced accept length]`` is the one host-to-device copy,
    ``outputs`` = ``[accept_len | committed]`` the one device-to-host copy."""

    def __init__(self, n: int, num_steps: int, hidden: int, dtype, device):
        rows_n = n * (num_steps + 1)
        long = dict(dtype=torch.int64, device=device)
        self.n = n
        self.inputs = torch.zeros(n + 1, **long)
        self.rows = self.inputs[:n]
        self.forced = self.inputs[n:]
        self.seq_lens = torch.ones(n, **long)
        self.extend_lens = torch.ones(n, **long)
        self.drafts = torch.zeros(n, num_steps, **long)
        self.verify_ids = torch.zeros(n, num_steps + 1, **long)
        self.positions = torch.zeros(n, num_steps + 1, **long)
        self.out_cache_loc = torch.zeros(n, num_steps + 1, **long)
        self.verify_hidden = torch.zeros(rows_n, hidden, dtype=dtype, device=device)
        self.outputs = torch.zeros(n, num_steps + 2, **long)
        self.acceptance = Acceptance(self.outputs[:, 0], self.outputs[:, 1:], torch.zeros(n, **long))


class SpecWorker(BucketWorker):
    """Prefill and speculative iterations of one model over one table, one phase graph per bucket.

    Parameters
    ----------
    model : DSAModel with an MTP layer.
    req_pool : the request table (``num_draft_tokens`` = N).
    target_kv, mtp_kv : the target's KV pool and the MTP layer's own (same slot ids).
    backend : DSAAttnBackend over ``req_pool.req_to_token`` with ``num_draft_tokens = N``: the
        TARGET_VERIFY and DRAFT_EXTEND buffers of every bucket.
    multi_step : DSAMultiStepDraftBackend with ``S - 1`` step backends (None when ``S == 1``).
    processor : LogitsProcessor over the model's LM head (``model.lm_head``): the draft tokens'
        greedy path and the target tokens; ``max_rows`` at least ``N`` times the larger of
        ``max_reqs`` and the largest bucket (the verify rows).
    spec : SpecConfig.
    use_cuda_graph : None: on CUDA with the Triton ops.
    """

    def __init__(self, model: DSAModel, req_pool: ReqToTokenPool, target_kv: KVPool, mtp_kv: KVPool,
                 backend: DSAAttnBackend, multi_step: DSAMultiStepDraftBackend | None,
                 processor: LogitsProcessor, spec: SpecConfig, *, use_cuda_graph: bool | None = None):
        config = model.config
        steps, n_verify = spec.num_steps, spec.num_draft_tokens
        if config.num_nextn_predict_layers != 1:
            raise ValueError("speculative decoding needs a model with its MTP layer (num_nextn_predict_layers=1)")
        if req_pool.num_draft_tokens != n_verify or backend.num_draft_tokens != n_verify:
            raise ValueError(f"req_pool and backend must be built for num_draft_tokens={n_verify}, got "
                             f"{req_pool.num_draft_tokens} and {backend.num_draft_tokens}")
        expected_steps = steps - 1
        have_steps = 0 if multi_step is None else multi_step.num_step_backends
        if have_steps != expected_steps:
            raise ValueError(f"num_steps={steps} needs {expected_steps} draft step backend(s), got {have_steps}")
        if processor.lm_head is not model.lm_head:
            raise ValueError("processor must run over the model's LM head (model.lm_head)")
        verify_rows = max(req_pool.max_reqs, backend.bucket_sizes[-1]) * n_verify
        if processor.max_rows < verify_rows:
            raise ValueError(f"processor.max_rows={processor.max_rows} is below the verify rows {verify_rows} "
                             f"(num_draft_tokens x max(max_reqs, largest bucket))")
        self.dtype = model.lm_head.weight.dtype
        state = SpecState(req_pool.req_to_token.shape[0], config.hidden_size, config.index_topk, self.dtype,
                          backend.device)
        super().__init__(model, target_kv, backend, state, use_cuda_graph=use_cuda_graph, processor=processor)
        self.spec, self.req_pool, self.mtp_kv, self.multi_step = spec, req_pool, mtp_kv, multi_step
        self.index_share = config.index_share_for_mtp_iteration
        largest = self.buckets[-1]
        self._static = _Batch(largest, steps, config.hidden_size, self.dtype, self.device)
        self._scratch = AttentionScratch.allocate(largest * n_verify, backend.width, config.index_topk,
                                                  self.device)
        self._attn: dict[int, dict] = {}          # bucket -> phase -> AttentionInputs (draft: one per step)
        pool = torch.cuda.graph_pool_handle() if self.use_cuda_graph else None
        self.graphs = {phase: BucketGraphs(self.use_cuda_graph, pool) for phase in PHASES}
        self._workspaces: dict[int, AttentionWorkspace | None] = {}
        self.simulate_accept_len = spec.simulate_accept_len   # may be changed between iterations
        self.rng = random.Random(spec.simulate_seed)          # the simulated draws

    # ---- capture ---------------------------------------------------------------------------
    def _capture_bucket(self, bucket: int) -> None:
        """Static buffers and metadata of every phase of ``bucket``; with graphs, warm up and
        capture its metadata, draft, verify and extend graphs."""
        rows_n = self.spec.num_draft_tokens
        attn = {}
        for phase, mode in (("verify", Mode.TARGET_VERIFY), ("extend", Mode.DRAFT_EXTEND)):
            self.backend.capture(bucket, mode)
            attn[phase] = self.backend.attention_inputs(bucket, mode, scratch=self._scratch,
                                                        workspace=self._workspace(bucket * rows_n))
        if self.multi_step is not None:
            self.multi_step.capture(bucket)
            attn["draft"] = [step.attention_inputs(bucket, Mode.DECODE, scratch=self._scratch,
                                                   workspace=self._workspace(bucket))
                             for step in self.multi_step.step_backends]
        self._attn[bucket] = attn
        batch = self._bucket_batch(bucket)
        self._load(batch, [], forced=0)                  # all padding: valid inputs to capture over
        bodies = {"metadata": lambda: self._prepare(batch, bucket),
                  **self._bodies(batch, attn, check_values=False)}
        for phase, body in bodies.items():
            self.graphs[phase].capture(bucket, body)

    def _workspace(self, rows: int) -> AttentionWorkspace | None:
        """The DSA ops' workspaces (sparse-MLA split, top-k chunks) of ``rows``-row forwards,
        shared by every phase (they run one after another)."""
        if rows not in self._workspaces:
            self._workspaces[rows] = self.model.attention_workspace(
                rows, fp8_cache=self.target_kv.kv_cache_dtype == "fp8_e4m3")
        return self._workspaces[rows]

    def _bucket_batch(self, bucket: int) -> _Batch:
        """Views of the largest bucket's static tensors for ``bucket`` rows."""
        static, view = self._static, _Batch.__new__(_Batch)
        view.n = bucket
        view.inputs = static.inputs[:bucket + 1]
        view.rows = view.inputs[:bucket]
        view.forced = view.inputs[bucket:]
        for name in ("seq_lens", "extend_lens", "drafts", "verify_ids", "positions", "out_cache_loc",
                     "outputs"):
            setattr(view, name, getattr(static, name)[:bucket])
        view.verify_hidden = static.verify_hidden[:bucket * self.spec.num_draft_tokens]
        view.acceptance = Acceptance(view.outputs[:, 0], view.outputs[:, 1:], static.acceptance.bonus[:bucket])
        return view

    def _bodies(self, batch: _Batch, attn: dict, *, check_values: bool) -> dict:
        """The phase bodies of ``batch`` (phase order) over its attention inputs ``attn[phase]``."""
        bodies = {"verify": lambda: self._verify(batch, attn["verify"], check_values),
                  "extend": lambda: self._extend(batch, attn["extend"], check_values)}
        if self.multi_step is not None:
            bodies = {"draft": lambda: self._draft(batch, attn["draft"], check_values), **bodies}
        return bodies

    # ---- prefill ---------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, row: int, prompt: Sequence[int], *, chunk_size: int = DEFAULT_PREFILL_CHUNK) -> int:
        """Eager prefill of one admitted request: the target over the prompt (its first token, the
        bonus), then the MTP layer over the prompt shifted by one with the bonus last (the first draft,
        its hidden and the IndexShare seed). Returns the first generated token."""
        ids, hidden, bonus = self._prefill_target(row, prompt, chunk_size)
        next_ids = torch.cat((ids[1:], bonus))
        selection = torch.empty(self.config.index_topk, dtype=torch.int32, device=self.device)
        drafted = self.model.prefill_mtp(next_ids, hidden, self.req_pool.req_to_token, row, self.mtp_kv,
                                         chunk_size=chunk_size, selection_out=selection)
        last = drafted[-1:]
        first_draft = greedy_draft_step(self.processor, last, torch.zeros(1, dtype=torch.int64,
                                                                          device=self.device)).tokens
        state = self.state
        state.draft_first[row] = first_draft[0]
        state.draft_hidden[row] = last[0]
        state.seed[row] = selection
        state.prefilled[row] = True
        return int(bonus)

    # ---- one iteration ---------------------------------------------------------------------
    def draw_accept_len(self) -> int:
        """This iteration's simulated accept length: floor or ceil of ``simulate_accept_len``, the
        ceil with probability frac(mean); 0 when simulation is off."""
        mean = self.simulate_accept_len
        if mean is None:
            return 0
        low = int(mean)
        return low + (self.rng.random() < mean - low)

    @torch.no_grad()
    def step(self, rows: Sequence[int], *, timed: bool = False) -> StepResult:
        """One speculative iteration of the requests in table rows ``rows`` (each prefilled, with
        slots up to ``L + N``; see :meth:`check_rows`): returns their accept lengths and committed
        tokens (one host sync). ``timed``: also the device time of each phase (CUDA events)."""
        rows = self.check_rows(rows)
        n = len(rows)
        bucket = self.bucket_for(n)
        forced = self.draw_accept_len()
        if bucket is None:
            batch = _Batch(n, self.spec.num_steps, self.config.hidden_size, self.dtype, self.device)
        else:
            batch = self._bucket_batch(bucket)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(len(PHASES) + 1)] \
            if timed and self.device.type == "cuda" else None
        record = (lambda i: events[i].record()) if events else (lambda i: None)
        record(0)
        self._load(batch, rows, forced)
        if bucket is None:
            attn = self._prepare_eager(batch)
        else:
            self.graphs["metadata"].run(bucket, lambda: self._prepare(batch, bucket))
            attn = self._attn[bucket]
        record(1)
        bodies = self._bodies(batch, attn, check_values=bucket is None)
        for i, phase in enumerate(PHASES[1:], start=2):
            if phase in bodies:
                if bucket is None:
                    bodies[phase]()
                else:
                    self.graphs[phase].run(bucket, bodies[phase])
            record(i)
        host = batch.outputs[:n].cpu()
        accept_lens = host[:, 0].tolist()
        committed = [row[1:1 + a] for row, a in zip(host.tolist(), accept_lens)]
        phase_ms = None
        if events:
            phase_ms = {phase: events[i].elapsed_time(events[i + 1]) for i, phase in enumerate(PHASES)}
        return StepResult(committed=committed, accept_lens=accept_lens, phase_ms=phase_ms)

    def _load(self, batch: _Batch, rows: list[int], forced: int) -> None:
        """The batch's rows (padded with the dummy row) and the forced accept length: one copy."""
        batch.inputs.copy_(self._padded_rows(rows, batch.n, forced))

    def _gather_lengths(self, batch: _Batch) -> None:
        torch.index_select(self.state.seq_lens, 0, batch.rows, out=batch.seq_lens)
        torch.add(batch.seq_lens, self.spec.num_draft_tokens, out=batch.extend_lens)

    def _prepare(self, batch: _Batch, bucket: int) -> None:
        """Lengths of the batch, then every phase's metadata into the static buffers (no sync)."""
        self._gather_lengths(batch)
        if self.multi_step is not None:
            self.multi_step.replay(bucket, batch.rows, batch.seq_lens, seeded=self.index_share)
        self.backend.replay(bucket, batch.rows, batch.seq_lens, Mode.TARGET_VERIFY)
        self.backend.replay(bucket, batch.rows, batch.extend_lens, Mode.DRAFT_EXTEND)

    def _prepare_eager(self, batch: _Batch) -> dict:
        """Lengths, then fresh metadata sized to the live lengths (reads them on the host);
        returns the phases' attention inputs."""
        self._gather_lengths(batch)

        def inputs(seq_lens, mode):
            return self.backend.eager_attention_inputs(batch.rows, seq_lens, mode)

        attn = {"verify": inputs(batch.seq_lens, Mode.TARGET_VERIFY),
                "extend": inputs(batch.extend_lens, Mode.DRAFT_EXTEND)}
        if self.multi_step is not None:
            attn["draft"] = [inputs(batch.seq_lens, Mode.DECODE)] * self.multi_step.num_step_backends
        return attn

    # ---- phase bodies (captured per bucket) ------------------------------------------------
    def _draft(self, batch: _Batch, attns: list[AttentionInputs], check_values: bool) -> None:
        """S - 1 MTP draft steps: ``drafts[:, 0] = d_1``, step i writes ``drafts[:, i + 1]``."""
        state, rows, lens = self.state, batch.rows, batch.seq_lens
        batch.drafts[:, 0] = state.draft_first[rows]
        hidden = state.draft_hidden[rows]
        seed = state.seed[rows] if self.index_share else None
        table = self.req_pool.req_to_token
        for i, attn in enumerate(attns):
            positions = lens + i
            loc = table[rows, positions].long()
            hidden = self.model.forward_mtp(batch.drafts[:, i], hidden, positions, loc, self.mtp_kv, attn,
                                            seed_slots=seed, check_values=check_values)
            batch.drafts[:, i + 1] = greedy_draft_step(self.processor, hidden, positions).tokens

    def _verify(self, batch: _Batch, attn: AttentionInputs, check_values: bool) -> None:
        """The target over ``[bonus, d_1 .. d_S]`` at ``L .. L + S``, greedy acceptance, and the new
        length and bonus written back."""
        state, rows, lens = self.state, batch.rows, batch.seq_lens
        steps = self.spec.num_steps
        batch.verify_ids[:, 0] = state.bonus[rows]
        batch.verify_ids[:, 1:] = batch.drafts
        torch.add(lens[:, None], torch.arange(steps + 1, device=self.device), out=batch.positions)
        batch.out_cache_loc.copy_(self.req_pool.req_to_token[rows[:, None], batch.positions])
        hidden = self.model(batch.verify_ids.flatten(), batch.positions.flatten(),
                            batch.out_cache_loc.flatten(), self.target_kv, attn, check_values=check_values)
        batch.verify_hidden.copy_(hidden)
        targets = greedy_target_tokens(self.model, hidden, self.processor).view(batch.n, steps + 1)
        accepted = greedy_accept(batch.drafts, targets, forced_accept_len=batch.forced, out=batch.acceptance)
        state.seq_lens[rows] = lens + accepted.accept_len
        state.bonus[rows] = accepted.bonus
        state.reset_dummy()

    def _extend(self, batch: _Batch, attn: AttentionInputs, check_values: bool) -> None:
        """The MTP layer over the verified rows with the committed tokens; the row of the new bonus
        gives the next first draft, its hidden and (IndexShare) the top-k seed."""
        state, rows = self.state, batch.rows
        width = self.spec.num_draft_tokens
        accepted = batch.acceptance
        out = self.model.forward_mtp(accepted.committed.flatten(), batch.verify_hidden, batch.positions.flatten(),
                                     batch.out_cache_loc.flatten(), self.mtp_kv, attn, check_values=check_values)
        select = torch.arange(batch.n, device=self.device) * width + accepted.accept_len - 1
        chosen = out[select]
        state.draft_first[rows] = greedy_draft_step(self.processor, chosen, batch.seq_lens).tokens
        state.draft_hidden[rows] = chosen
        if self.index_share:
            state.seed[rows] = attn.topk_slots[select]


def build_spec_worker(model: DSAModel, req_pool: ReqToTokenPool, target_kv: KVPool, mtp_kv: KVPool,
                      spec: SpecConfig, *, bucket_sizes, force_kernel: str | None = None,
                      use_cuda_graph: bool | None = None,
                      options: RuntimeOptions | None = None) -> SpecWorker:
    """A captured :class:`SpecWorker` with its parts: the DSA backend (N rows per request), the
    ``S - 1`` draft step backends, and the LogitsProcessor over the model's (vocab-parallel) LM
    head, opted in to the draft argmax exchange (collective at TP > 1). ``options`` (default
    ``model.options``) sets the metadata kernels, their budget and the exchanges; the indexer
    schedules have the default configurations' programs, the grouped verify rows' their own
    (:func:`~dsaspec.executor.worker.indexer_programs_for`)."""
    config = model.config
    options = model.options if options is None else options
    table = req_pool.req_to_token
    common = dict(index_topk=config.index_topk, page_size=PAGE_SIZE, bucket_sizes=bucket_sizes,
                  num_sms=indexer_programs_for(model, target_kv, table.device),
                  budget=options.metadata_program_budget, force_kernel=force_kernel,
                  bounded_metadata=options.bounded_replay_metadata)
    group_num_sms = indexer_programs_for(model, target_kv, table.device, spec.num_draft_tokens)
    grouped = not model.row_invariant and group_fits(spec.num_draft_tokens, config.index_n_heads)
    backend = DSAAttnBackend(table, num_draft_tokens=spec.num_draft_tokens, group_num_sms=group_num_sms,
                             group_verify_rows=grouped, **common)
    multi_step = None
    if spec.num_steps > 1:
        multi_step = DSAMultiStepDraftBackend.create(table, num_steps=spec.num_steps,
                                                     index_share=config.index_share_for_mtp_iteration, **common)
    rows = max(req_pool.max_reqs, backend.bucket_sizes[-1]) * spec.num_draft_tokens
    processor = LogitsProcessor(model.lm_head, max_rows=rows, draft_argmax_exchange=options.draft_argmax_exchange,
                                verify_argmax_exchange=options.verify_argmax_exchange)
    processor.enable_draft_argmax_exchange()
    processor.enable_verify_argmax_exchange()
    return SpecWorker(model, req_pool, target_kv, mtp_kv, backend, multi_step, processor, spec,
                      use_cuda_graph=use_cuda_graph).capture()
