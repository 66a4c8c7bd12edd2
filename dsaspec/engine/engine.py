"""Greedy generation with continuous batching: eager chunked prefill, decode from CUDA graphs,
plain or speculative (MTP, EAGLE chain).

:class:`Engine` owns the memory of one model (``ReqToTokenPool``, ``PageAllocator``, the target
``KVPool``, and with speculation the MTP layer's ``KVPool``) and one
:class:`~dsaspec.executor.worker.Worker` captured for the batch buckets: a
:class:`~dsaspec.executor.decode_worker.DecodeWorker` (plain greedy decoding) or a
:class:`~dsaspec.speculative.spec_worker.SpecWorker` (speculative decoding), each with its
:class:`~dsaspec.layers.attention.backend.DSAAttnBackend`. One scheduler step
(:meth:`EngineCore.step`, which :meth:`Engine.generate` loops over; the server's engine thread calls
its two halves apart, so that a new request's first token is delivered before the decode step),
through the worker protocol only:

1. admit waiting requests (:meth:`EngineCore.admit`) while a request row is free and the KV pool has the pages of the whole
   request (every position it will ever write: prompt + ``max_new_tokens - 1``, plus ``N - 1``
   verified positions past the last one with speculation), reserved up front so a running request
   never runs out of pages; ``worker.prefill(row, prompt)`` (eager, chunked) gives its first token;
2. (:meth:`EngineCore.decode`) ``worker.step(rows)`` for every running request (a decode step or a speculative iteration,
   padded to its bucket) gives each request's committed tokens;
3. append each request's new tokens one at a time and stop it exactly where plain greedy decoding
   would (``max_new_tokens`` reached, or one of its stop tokens generated); release its row and
   pages (``worker.release(row)``).

A request cancelled between steps (:meth:`EngineCore.cancel`) leaves the queue, or releases its
row and pages at once.

A request that could never fit (too long for the context, more pages than the pool has) is
refused up front (its result says why) and the others run; one that does not fit *now* waits for
running requests to finish.
"""

from __future__ import annotations

import numbers
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import torch
from tqdm import tqdm

from dsaspec.configs.runtime_options import RuntimeOptions
from dsaspec.executor.decode_worker import build_decode_worker
from dsaspec.executor.worker import Worker
from dsaspec.layers.attention.backend import DEFAULT_BUCKETS
from dsaspec.memory import (PAGE_SIZE, KVPool, PageAllocator, PoolExhaustedError, ReqToTokenPool,
                            RequestSlots)
from dsaspec.models.dsa_model import DEFAULT_PREFILL_CHUNK, DSAModel
from dsaspec.speculative.spec_worker import SpecConfig, build_spec_worker

LENGTH, EOS, REFUSED = "length", "eos", "refused"


@dataclass
class GenerationResult:
    """One request's greedy output.

    Attributes
    ----------
    token_ids : the generated tokens (prompt excluded; ends with ``eos_token_id`` when that
        stopped it); empty when refused.
    prompt_len : tokens in the prompt.
    finish_reason : ``"length"`` (``max_new_tokens`` reached), ``"eos"``, or ``"refused"`` (the
        request can never fit the engine: prompt + new tokens beyond ``context_len``, or more KV
        pages than the pool has; it did not run).
    ttft_s : seconds from the start of ``generate`` to the first token (waiting + prefill); None
        when refused.
    tpot_s : mean seconds between consecutive generated tokens; None with fewer than two.
    error : why the request was refused (one line); None otherwise.
    """

    token_ids: list[int]
    prompt_len: int
    finish_reason: str
    ttft_s: float | None
    tpot_s: float | None
    error: str | None = None


@dataclass
class GenerationStats:
    """What one ``generate`` call did: prefill work, decode steps (speculative iterations), their
    host wall times (each step ends with the new tokens on the host), the batch and bucket of each
    step (``None``: eager, above the largest bucket), the tokens each step kept, every request's
    accept length per step (1 without speculation) and, when timed with speculation, each
    iteration's device time per phase."""

    prefill_tokens: int = 0
    prefill_s: float = 0.0
    step_times_s: list[float] = field(default_factory=list)
    step_batches: list[int] = field(default_factory=list)
    step_buckets: list[int | None] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)
    accept_lens: list[int] = field(default_factory=list)
    phase_ms: list[dict] = field(default_factory=list)

    @property
    def decode_steps(self) -> int:
        return len(self.step_times_s)

    @property
    def decode_tokens(self) -> int:
        return sum(self.step_tokens)

    @property
    def mean_accept_len(self) -> float | None:
        """Mean tokens committed per request per step (1.0 without speculation); None before any step."""
        return statistics.fmean(self.accept_lens) if self.accept_lens else None

    @property
    def median_step_ms(self) -> float | None:
        """Median decode step wall time in ms (the batch's TPOT); None without decode steps."""
        return 1e3 * statistics.median(self.step_times_s) if self.step_times_s else None


@dataclass
class _Request:
    index: int                                    # the request's id in its EngineCore
    prompt: list[int]
    max_new_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    row: int = -1
    tokens: list[int] = field(default_factory=list)
    first_token_at: float = 0.0                   # time.perf_counter() of the first token
    last_token_at: float = 0.0
    finish_reason: str | None = None
    error: str | None = None


class RequestRefused(ValueError):
    """A request that can never fit the engine (prompt + new tokens beyond ``context_len``, or more
    KV pages than the pool has); the message says which."""


@dataclass
class StepOutput:
    """What one :meth:`EngineCore.step` did.

    Attributes
    ----------
    new_tokens : request id -> the tokens it appended this step, in order (a request admitted this
        step: its first token from prefill, then its decode step's tokens).
    finished : request id -> finish reason (``"length"`` or ``"eos"``) of the requests that ended
        this step; their rows and pages are free.
    batch : requests in this step's decode step (0: none ran).
    accept_lens : tokens each of them committed (1 per request without speculation).
    """

    new_tokens: dict[int, list[int]] = field(default_factory=dict)
    finished: dict[int, str] = field(default_factory=dict)
    batch: int = 0
    accept_lens: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(tokens) for tokens in self.new_tokens.values())


class Engine:
    """Greedy generation over one :class:`DSAModel` with continuous batching.

    Parameters
    ----------
    model : DSAModel
        Weights initialised or loaded; its device and dtype are the engine's.
    context_len : int
        Longest sequence (prompt + generated) a request may reach; the page-table width is
        ``context_len + 5``. Configuring a long context costs table memory, not step time.
    max_batch : int
        Request rows: at most this many requests decode together.
    num_slots : int or None
        KV slots (a multiple of 64, page 0 reserved); default: every row at full context.
    bucket_sizes : batch buckets captured as CUDA graphs (only those up to the first bucket
        holding ``max_batch`` are kept); larger batches run eagerly.
    use_cuda_graph : capture graphs (default: on CUDA with the Triton ops).
    prefill_chunk : rows per eager prefill forward (fewer at long prefixes: ``DSAModel.prefill_chunk_rows``).
    force_kernel : ``"bounded"`` / ``"context_wide"`` metadata kernels for tests and benchmarks
        (default: the backend's selection, see ``RuntimeOptions.bounded_replay_metadata``).
    progress : show a tqdm bar over generated tokens.
    speculative : SpecConfig to decode speculatively with the model's MTP layer; None: plain
        greedy decoding.
    time_phases : with speculation on CUDA, record each iteration's device time per phase.
    options : RuntimeOptions for the metadata kernels and the exchanges (default: ``model.options``).
    kv_cache_dtype : ``"auto"`` / ``"bf16"`` (caches in the model's dtype) or ``"fp8_e4m3"`` (the
        FP8 layouts of :mod:`dsaspec.memory`) for the target and MTP pools.
    """

    def __init__(self, model: DSAModel, *, context_len: int, max_batch: int = 8,
                 num_slots: int | None = None, bucket_sizes: Sequence[int] = DEFAULT_BUCKETS,
                 use_cuda_graph: bool | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 force_kernel: str | None = None, progress: bool = True,
                 speculative: SpecConfig | None = None, time_phases: bool = False,
                 options: RuntimeOptions | None = None, kv_cache_dtype: str = "auto"):
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be a positive int, got {max_batch!r}")
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be a positive int, got {prefill_chunk!r}")
        weight = model.lm_head.weight
        self.model, self.config = model, model.config
        self.device = weight.device
        self.prefill_chunk = prefill_chunk
        self.progress = progress
        self.spec = speculative
        options = model.options if options is None else options
        self.time_phases = time_phases
        draft_tokens = speculative.num_draft_tokens if speculative else 1
        self.req_pool = ReqToTokenPool(max_batch, context_len, num_draft_tokens=draft_tokens, device=self.device)
        if num_slots is None:
            num_slots = self.default_num_slots(max_batch, context_len, draft_tokens)
        self.allocator = PageAllocator(num_slots, PAGE_SIZE)
        self.slots = RequestSlots(self.req_pool, self.allocator)
        self.kv = KVPool.for_model(self.config, num_slots, dtype=weight.dtype, device=self.device,
                                   kv_cache_dtype=kv_cache_dtype)
        buckets = sorted(set(int(b) for b in bucket_sizes))
        holding = [b for b in buckets if b >= max_batch]
        buckets = [b for b in buckets if b < max_batch] + holding[:1]
        common = dict(bucket_sizes=buckets, force_kernel=force_kernel,
                      use_cuda_graph=use_cuda_graph, options=options)
        self.mtp_kv = None
        self.worker: Worker
        if speculative is None:
            self.worker = build_decode_worker(model, self.req_pool, self.kv, **common)
        else:
            self.mtp_kv = KVPool.for_model(self.config, num_slots, mtp=True, dtype=weight.dtype, device=self.device,
                                           kv_cache_dtype=kv_cache_dtype)
            self.worker = build_spec_worker(model, self.req_pool, self.kv, self.mtp_kv, speculative, **common)
        self.backend = self.worker.backend
        self.stats = GenerationStats()

    @staticmethod
    def default_num_slots(max_batch: int, context_len: int, num_draft_tokens: int = 1) -> int:
        """KV slots for every request row at the full table width, plus the reserved page."""
        width = ReqToTokenPool.width_for(context_len, num_draft_tokens)
        return PAGE_SIZE * (1 + max_batch * -(-width // PAGE_SIZE))

    @property
    def use_cuda_graph(self) -> bool:
        """Whether decode steps (or speculative phases) replay CUDA graphs."""
        return self.worker.use_cuda_graph

    def extra_positions(self) -> int:
        """Positions a request writes past its last token's: ``N - 1`` verified rows with
        speculation, 0 without."""
        return self.spec.num_draft_tokens - 1 if self.spec else 0

    @property
    def max_batch(self) -> int:
        return self.req_pool.max_reqs

    @property
    def context_len(self) -> int:
        return self.req_pool.context_len

    def generate(self, prompt_token_ids, max_new_tokens, *, eos_token_id: int | None = None,
                 progress: bool | None = None):
        """Greedy continuation of one prompt or of a list of prompts.

        Parameters
        ----------
        prompt_token_ids : a prompt (a sequence of token ids, or a 1-D tensor of an integer
            dtype) or a list of prompts. A token id is a Python int, a numpy integer or a 0-d
            integer tensor.
        max_new_tokens : int for every request, or one int per prompt; each >= 1.
        eos_token_id : stop a request after it generates this token (kept in its output).
        progress : override the engine's progress bar setting.

        Returns
        -------
        A :class:`GenerationResult` for a single prompt, a list of them (prompt order) for a list.
        ``self.stats`` holds the call's :class:`GenerationStats`. A request that can never fit
        (prompt + new tokens beyond ``context_len``, or more KV pages than the pool has) does not
        run: its result is ``"refused"`` with the reason in ``error``; the others run. A malformed
        call raises before any work: ``TypeError`` (a token id or ``eos_token_id`` that is not an
        integer, e.g. a float or bool; a prompt that is not a sequence or a tensor; a float or bool
        prompt tensor), ``ValueError`` (no prompts, an empty prompt, a token outside the
        vocabulary, a prompt tensor not 1-D, ``max_new_tokens`` not an int >= 1 or not one per
        prompt).
        """
        single = _is_single_prompt(prompt_token_ids)
        prompts = [prompt_token_ids] if single else list(prompt_token_ids)
        requests = self._validate(prompts, max_new_tokens, eos_token_id)
        runnable = [r for r in requests if r.error is None]
        self.stats = GenerationStats()
        core = EngineCore(self, stats=self.stats)
        for request in runnable:
            core.add(request)
        show = self.progress if progress is None else progress
        total = sum(r.max_new_tokens for r in runnable)
        start = time.perf_counter()
        with tqdm(total=total, desc="generate", unit="tok", disable=not show, leave=False) as bar:
            try:
                while core.has_work:
                    out = core.step()
                    bar.update(out.num_tokens)
                    if out.batch:
                        bar.set_postfix(bs=out.batch, waiting=len(core.waiting), refresh=False)
            finally:
                core.abort()
        results = [_result(r, start) for r in requests]
        return results[0] if single else results

    # ---- validation -------------------------------------------------------------------------
    def _validate(self, prompts, max_new_tokens, eos_token_id) -> list[_Request]:
        """The requests of ``generate`` (those that can never fit carry their ``error``); raises on
        a malformed call."""
        if not prompts:
            raise ValueError("prompt_token_ids is empty: expected a prompt (list of token ids) or a "
                             "non-empty list of prompts")
        if isinstance(max_new_tokens, int) and not isinstance(max_new_tokens, bool):
            limits = [max_new_tokens] * len(prompts)
        elif isinstance(max_new_tokens, Sequence) and not isinstance(max_new_tokens, (str, bytes)):
            limits = list(max_new_tokens)
            if len(limits) != len(prompts):
                raise ValueError(f"max_new_tokens has {len(limits)} entries for {len(prompts)} prompts")
        else:
            raise ValueError(f"max_new_tokens must be an int >= 1 or a list of one per prompt, "
                             f"got {max_new_tokens!r}")
        stops = frozenset() if eos_token_id is None else frozenset([self._vocab_token(eos_token_id, "eos_token_id")])
        return [self._request(i, prompt, limit, stops, f"prompt {i}")
                for i, (prompt, limit) in enumerate(zip(prompts, limits))]

    def _vocab_token(self, value, what: str) -> int:
        """``value`` as a token id of the vocabulary; TypeError / ValueError naming ``what``."""
        token = _token_id(value, what)
        if not 0 <= token < self.config.vocab_size:
            raise ValueError(f"{what} must be in [0, {self.config.vocab_size}), got {token}")
        return token

    def _request(self, index: int, prompt, limit, stops: frozenset[int], name: str = "prompt") -> _Request:
        """One request, its ``error`` set if it can never fit; raises if it is malformed (messages
        name the prompt as ``name``)."""
        vocab = self.config.vocab_size
        tokens = _token_ids(prompt, name)
        if not tokens:
            raise ValueError(f"{name} is empty: a request needs at least one prompt token")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {limit!r} ({name})")
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{name} has token id(s) {bad[:4]} outside the vocabulary [0, {vocab})")
        request = _Request(index, tokens, limit, stops)
        positions = len(tokens) + limit - 1           # positions of the request's tokens' KV
        pages = -(-(positions + self.extra_positions()) // PAGE_SIZE)
        usable_pages = self.allocator.num_pages - 1
        if positions > self.context_len:
            request.error = (f"{len(tokens)} prompt tokens + max_new_tokens={limit} need {positions} "
                             f"positions, more than context_len={self.context_len}")
        elif pages > usable_pages:
            request.error = (f"{positions} positions need {pages} KV pages of {PAGE_SIZE} slots, the "
                             f"pool has {usable_pages} (num_slots={self.allocator.num_slots}); raise "
                             f"num_slots")
        return request

    def _release(self, request: _Request) -> None:
        self.worker.release(request.row)
        self.slots.release(request.row)
        request.row = -1


class EngineCore:
    """The scheduler of one :class:`Engine`: a FIFO of waiting requests and the running batch,
    advanced one iteration at a time by :meth:`step`. Requests join (:meth:`add_request`) and leave
    (:meth:`cancel`, :meth:`abort`) between steps. Not thread-safe: one thread makes every call.

    ``stats``: a :class:`GenerationStats` each step records into (None: nothing is recorded, as a
    long-running server wants).
    """

    def __init__(self, engine: Engine, *, stats: GenerationStats | None = None):
        self.engine = engine
        self.stats = stats
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self._next_id = 0

    @property
    def has_work(self) -> bool:
        """Whether a request is waiting or running."""
        return bool(self.waiting or self.running)

    def check(self, prompt, max_new_tokens: int, *, stop_token_ids=()) -> _Request:
        """One greedy request, checked, for :meth:`add`; reads only the engine's sizes, so any
        thread may call it.

        ``prompt``: token ids as :meth:`Engine.generate` takes one; ``max_new_tokens``: int >= 1;
        ``stop_token_ids``: tokens that end the request when generated (kept in its output).
        Raises :class:`RequestRefused` if it can never fit, ``TypeError`` / ``ValueError`` (as
        ``generate`` does) if it is malformed.
        """
        engine = self.engine
        stops = frozenset(engine._vocab_token(t, "stop_token_ids") for t in stop_token_ids)
        request = engine._request(-1, prompt, max_new_tokens, stops)
        if request.error is not None:
            raise RequestRefused(request.error)
        return request

    def add(self, request: _Request) -> int:
        """Queue a request :meth:`check` made; returns its id (0, 1, ... in call order)."""
        request.index, self._next_id = self._next_id, self._next_id + 1
        self.waiting.append(request)
        return request.index

    def add_request(self, prompt, max_new_tokens: int, *, stop_token_ids=()) -> int:
        """:meth:`check` then :meth:`add`; returns the request's id."""
        return self.add(self.check(prompt, max_new_tokens, stop_token_ids=stop_token_ids))

    def cancel(self, request_id: int) -> bool:
        """Drop a waiting request, or release a running one's row and pages now. Returns False
        if no such request is waiting or running (it finished, or never was)."""
        for queue in (self.waiting, self.running):
            for request in queue:
                if request.index == request_id:
                    queue.remove(request)
                    if request.row >= 0:
                        self.engine._release(request)
                    return True
        return False

    def abort(self) -> None:
        """Drop every waiting request and release every running one (all rows and pages free)."""
        for request in self.running:
            if request.row >= 0:
                self.engine._release(request)
        self.running.clear()
        self.waiting.clear()

    def step(self) -> StepOutput:
        """One iteration: :meth:`admit` then :meth:`decode`, into one output."""
        out = StepOutput()
        self.admit(out)
        self.decode(out)
        return out

    def admit(self, out: StepOutput | None = None) -> StepOutput:
        """Admit waiting requests in order while a row is free and the KV pool has the pages of
        each whole request; each is prefilled (its first token) and ends there if that token
        stops it. Writes into ``out`` (default: a new one) and returns it."""
        engine = self.engine
        out = StepOutput() if out is None else out
        while self.waiting and engine.req_pool.num_free:
            request = self.waiting[0]
            try:
                request.row = engine.slots.admit(
                    len(request.prompt), reserve=request.max_new_tokens - 1 + engine.extra_positions())
            except PoolExhaustedError:
                if not self.running:
                    raise
                break                             # wait for running requests to free pages
            self.waiting.popleft()
            self.running.append(request)          # before prefill: abort() releases it if prefill raises
            self._prefill(request)
            out.new_tokens[request.index] = list(request.tokens)
            if self._finished(request, out):
                self.running.pop()
        return out

    def decode(self, out: StepOutput | None = None) -> StepOutput:
        """One decode step (or speculative iteration) of every running request (none: nothing
        runs); a request that ends releases its row and pages. Writes into ``out`` (default: a
        new one) and returns it."""
        out = StepOutput() if out is None else out
        if self.running:
            self._decode_step(out)
            self.running = [r for r in self.running if not self._finished(r, out)]
        return out

    def _finished(self, request: _Request, out: StepOutput) -> bool:
        if request.tokens[-1] in request.stop_token_ids:
            request.finish_reason = EOS
        elif len(request.tokens) >= request.max_new_tokens:
            request.finish_reason = LENGTH
        else:
            return False
        self.engine._release(request)
        out.finished[request.index] = request.finish_reason
        return True

    @torch.no_grad()
    def _prefill(self, request: _Request) -> None:
        engine = self.engine
        began = time.perf_counter()
        request.tokens.append(engine.worker.prefill(request.row, request.prompt, chunk_size=engine.prefill_chunk))
        request.first_token_at = request.last_token_at = now = time.perf_counter()
        if self.stats is not None:
            self.stats.prefill_tokens += len(request.prompt)
            self.stats.prefill_s += now - began

    def _decode_step(self, out: StepOutput) -> None:
        """One decode step (or speculative iteration) of the running requests; appends their new
        tokens up to where each stops."""
        engine, running = self.engine, self.running
        began = time.perf_counter()
        result = engine.worker.step([r.row for r in running], timed=engine.time_phases)
        now = time.perf_counter()
        kept = 0
        for request, tokens in zip(running, result.committed):
            new = out.new_tokens.setdefault(request.index, [])
            for token in tokens:
                request.tokens.append(token)
                new.append(token)
                kept += 1
                if _stops(request):
                    break
            request.last_token_at = now
        out.batch, out.accept_lens = len(running), list(result.accept_lens)
        if self.stats is not None:
            stats = self.stats
            stats.accept_lens.extend(result.accept_lens)
            if result.phase_ms is not None:
                stats.phase_ms.append(result.phase_ms)
            stats.step_times_s.append(now - began)
            stats.step_batches.append(len(running))
            stats.step_buckets.append(engine.worker.bucket_for(len(running)))
            stats.step_tokens.append(kept)


def _stops(request: _Request) -> bool:
    """Whether the request's last token ends it (a stop token, or ``max_new_tokens`` reached)."""
    return request.tokens[-1] in request.stop_token_ids or len(request.tokens) >= request.max_new_tokens


def _result(request: _Request, start: float) -> GenerationResult:
    """``request``'s result, its times counted from ``start`` (perf_counter)."""
    if request.error is not None:
        return GenerationResult([], len(request.prompt), REFUSED, None, None, request.error)
    tokens = request.tokens
    tpot = (request.last_token_at - request.first_token_at) / (len(tokens) - 1) if len(tokens) > 1 else None
    return GenerationResult(tokens, len(request.prompt), request.finish_reason, request.first_token_at - start,
                            tpot)


def _is_prompt(value) -> bool:
    """A prompt rather than a token: a sequence (not a string) or a tensor of at least one dim."""
    if isinstance(value, torch.Tensor):
        return value.dim() > 0
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def _is_single_prompt(prompt_token_ids) -> bool:
    if isinstance(prompt_token_ids, torch.Tensor):
        if prompt_token_ids.dim() != 1:
            raise ValueError(f"a prompt tensor must be 1-D, got shape {tuple(prompt_token_ids.shape)}")
        return True
    if not _is_prompt(prompt_token_ids):
        raise ValueError(f"prompt_token_ids must be a list of token ids or a list of prompts, "
                         f"got {type(prompt_token_ids).__name__}")
    return len(prompt_token_ids) > 0 and not _is_prompt(prompt_token_ids[0])


def _is_integer_dtype(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def _token_id(value, what: str) -> int:
    """``value`` as an int if it is an integer (Python int, numpy integer, 0-d integer tensor);
    else a ``TypeError`` naming ``what`` and the value (no float is truncated, no bool taken)."""
    if type(value) is int:
        return value
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 and _is_integer_dtype(value.dtype):
            return int(value)
    elif isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    raise TypeError(f"{what}: expected an integer token id, got {value!r} ({type(value).__name__})")


def _token_ids(prompt, name: str) -> list[int]:
    """The prompt's token ids as ints; ``TypeError`` / ``ValueError`` naming it as ``name``."""
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1:
            raise ValueError(f"{name}: a prompt tensor must be 1-D, got shape {tuple(prompt.shape)}")
        if not _is_integer_dtype(prompt.dtype):
            raise TypeError(f"{name}: a prompt tensor must have an integer dtype, got {prompt.dtype}")
        return prompt.tolist()
    if not _is_prompt(prompt):
        raise TypeError(f"{name}: expected a sequence of token ids or a 1-D integer tensor, "
                        f"got {prompt!r} ({type(prompt).__name__})")
    return [_token_id(token, f"{name}, token {j}") for j, token in enumerate(prompt)]
