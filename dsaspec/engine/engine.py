"""Greedy generation with continuous batching: eager chunked prefill, decode from CUDA graphs,
plain or speculative (MTP, EAGLE chain).

:class:`Engine` owns the memory of one model (``ReqToTokenPool``, ``PageAllocator``, the target
``KVPool``, and with speculation the MTP layer's ``KVPool``) and one
:class:`~dsaspec.executor.worker.Worker` captured for the batch buckets: a
:class:`~dsaspec.executor.decode_worker.DecodeWorker` (plain greedy decoding) or a
:class:`~dsaspec.speculative.spec_worker.SpecWorker` (speculative decoding), each with its
:class:`~dsaspec.layers.attention.backend.DSAAttnBackend`. The scheduler loop of
:meth:`Engine.generate`, through the worker protocol only:

1. admit waiting requests while a request row is free and the KV pool has the pages of the whole
   request (every position it will ever write: prompt + ``max_new_tokens - 1``, plus ``N - 1``
   verified positions past the last one with speculation), reserved up front so a running request
   never runs out of pages; ``worker.prefill(row, prompt)`` (eager, chunked) gives its first token;
2. ``worker.step(rows)`` for every running request (a decode step or a speculative iteration,
   padded to its bucket) gives each request's committed tokens;
3. append each request's new tokens one at a time and stop it exactly where plain greedy decoding
   would (``max_new_tokens`` reached, or ``eos_token_id`` generated); release its row and pages
   (``worker.release(row)``).

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
from dsaspec.ops.indexer_schedule import indexer_programs
from dsaspec.models.dsa_model import DSAModel
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
    index: int
    prompt: list[int]
    max_new_tokens: int
    row: int = -1
    tokens: list[int] = field(default_factory=list)
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    finish_reason: str | None = None
    error: str | None = None


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
    prefill_chunk : rows per eager prefill forward.
    force_kernel : ``"bounded"`` / ``"context_wide"`` metadata kernels for tests and benchmarks
        (default: the backend's selection, see ``RuntimeOptions.bounded_replay_metadata``).
    progress : show a tqdm bar over generated tokens.
    speculative : SpecConfig to decode speculatively with the model's MTP layer; None: plain
        greedy decoding.
    time_phases : with speculation on CUDA, record each iteration's device time per phase.
    options : RuntimeOptions for the metadata kernels and the exchanges (default: ``model.options``).
    """

    def __init__(self, model: DSAModel, *, context_len: int, max_batch: int = 8,
                 num_slots: int | None = None, bucket_sizes: Sequence[int] = DEFAULT_BUCKETS,
                 use_cuda_graph: bool | None = None, prefill_chunk: int = 512,
                 force_kernel: str | None = None, progress: bool = True,
                 speculative: SpecConfig | None = None, time_phases: bool = False,
                 options: RuntimeOptions | None = None):
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
        self.kv = KVPool.for_model(self.config, num_slots, dtype=weight.dtype, device=self.device)
        buckets = sorted(set(int(b) for b in bucket_sizes))
        holding = [b for b in buckets if b >= max_batch]
        buckets = [b for b in buckets if b < max_batch] + holding[:1]
        common = dict(bucket_sizes=buckets, num_sms=indexer_programs(self.device), force_kernel=force_kernel,
                      use_cuda_graph=use_cuda_graph, options=options)
        self.mtp_kv = None
        self.worker: Worker
        if speculative is None:
            self.worker = build_decode_worker(model, self.req_pool, self.kv, **common)
        else:
            self.mtp_kv = KVPool.for_model(self.config, num_slots, mtp=True, dtype=weight.dtype, device=self.device)
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
        requests, eos_token_id = self._validate(prompts, max_new_tokens, eos_token_id)
        runnable = [r for r in requests if r.error is None]
        self.stats = GenerationStats()
        show = self.progress if progress is None else progress
        total = sum(r.max_new_tokens for r in runnable)
        with tqdm(total=total, desc="generate", unit="tok", disable=not show, leave=False) as bar:
            self._schedule(runnable, eos_token_id, bar, time.perf_counter())
        results = [_result(r) for r in requests]
        return results[0] if single else results

    # ---- validation -------------------------------------------------------------------------
    def _validate(self, prompts, max_new_tokens, eos_token_id) -> tuple[list[_Request], int | None]:
        """The requests (those that can never fit carry their ``error``) and ``eos_token_id`` as
        an int; raises on a malformed call."""
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
        vocab = self.config.vocab_size
        if eos_token_id is not None:
            eos_token_id = _token_id(eos_token_id, "eos_token_id")
            if not 0 <= eos_token_id < vocab:
                raise ValueError(f"eos_token_id must be in [0, {vocab}), got {eos_token_id}")
        usable_pages = self.allocator.num_pages - 1
        requests = []
        for i, (prompt, limit) in enumerate(zip(prompts, limits)):
            tokens = _token_ids(prompt, i)
            if not tokens:
                raise ValueError(f"prompt {i} is empty: a request needs at least one prompt token")
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
                raise ValueError(f"max_new_tokens must be an int >= 1, got {limit!r} (prompt {i})")
            bad = [t for t in tokens if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt {i} has token id(s) {bad[:4]} outside the vocabulary [0, {vocab})")
            request = _Request(i, tokens, limit)
            positions = len(tokens) + limit - 1           # positions of the request's tokens' KV
            pages = -(-(positions + self.extra_positions()) // PAGE_SIZE)
            if positions > self.context_len:
                request.error = (f"{len(tokens)} prompt tokens + max_new_tokens={limit} need {positions} "
                                 f"positions, more than context_len={self.context_len}")
            elif pages > usable_pages:
                request.error = (f"{positions} positions need {pages} KV pages of {PAGE_SIZE} slots, the "
                                 f"pool has {usable_pages} (num_slots={self.allocator.num_slots}); raise "
                                 f"num_slots")
            requests.append(request)
        return requests, eos_token_id

    # ---- scheduling -------------------------------------------------------------------------
    def _schedule(self, requests: list[_Request], eos_token_id, bar, start: float) -> None:
        waiting, running = deque(requests), []
        try:
            while waiting or running:
                while waiting and self.req_pool.num_free:
                    request = waiting[0]
                    try:
                        request.row = self.slots.admit(
                            len(request.prompt), reserve=request.max_new_tokens - 1 + self.extra_positions())
                    except PoolExhaustedError:
                        if not running:
                            raise
                        break                         # wait for running requests to free pages
                    waiting.popleft()
                    self._prefill(request, start)
                    bar.update(1)
                    if not self._finished(request, eos_token_id):
                        running.append(request)
                if running:
                    bar.update(self._decode_step(running, start, eos_token_id))
                    bar.set_postfix(bs=len(running), waiting=len(waiting), refresh=False)
                    running = [r for r in running if not self._finished(r, eos_token_id)]
        finally:
            for request in requests:
                if request.row >= 0:
                    self._release(request)

    def _finished(self, request: _Request, eos_token_id) -> bool:
        if eos_token_id is not None and request.tokens[-1] == eos_token_id:
            request.finish_reason = EOS
        elif len(request.tokens) >= request.max_new_tokens:
            request.finish_reason = LENGTH
        else:
            return False
        self._release(request)
        return True

    def _release(self, request: _Request) -> None:
        self.worker.release(request.row)
        self.slots.release(request.row)
        request.row = -1

    @torch.no_grad()
    def _prefill(self, request: _Request, start: float) -> None:
        began = time.perf_counter()
        request.tokens.append(self.worker.prefill(request.row, request.prompt, chunk_size=self.prefill_chunk))
        now = time.perf_counter()
        request.first_token_at = request.last_token_at = now - start
        self.stats.prefill_tokens += len(request.prompt)
        self.stats.prefill_s += now - began

    def _decode_step(self, running: list[_Request], start: float, eos_token_id) -> int:
        """One decode step (or speculative iteration) of the running requests; appends their new
        tokens up to where each stops. Returns the number of tokens kept."""
        began = time.perf_counter()
        result = self.worker.step([r.row for r in running], timed=self.time_phases)
        now = time.perf_counter()
        self.stats.accept_lens.extend(result.accept_lens)
        if result.phase_ms is not None:
            self.stats.phase_ms.append(result.phase_ms)
        kept = 0
        for request, tokens in zip(running, result.committed):
            for token in tokens:
                request.tokens.append(token)
                kept += 1
                if _stops(request, eos_token_id):
                    break
            request.last_token_at = now - start
        self.stats.step_times_s.append(now - began)
        self.stats.step_batches.append(len(running))
        self.stats.step_buckets.append(self.worker.bucket_for(len(running)))
        self.stats.step_tokens.append(kept)
        return kept


def _stops(request: _Request, eos_token_id) -> bool:
    """Whether the request's last token ends it (``eos_token_id``, or ``max_new_tokens`` reached)."""
    return (eos_token_id is not None and request.tokens[-1] == eos_token_id) or \
        len(request.tokens) >= request.max_new_tokens


def _result(request: _Request) -> GenerationResult:
    if request.error is not None:
        return GenerationResult([], len(request.prompt), REFUSED, None, None, request.error)
    tokens = request.tokens
    tpot = (request.last_token_at - request.first_token_at) / (len(tokens) - 1) if len(tokens) > 1 else None
    return GenerationResult(tokens, len(request.prompt), request.finish_reason, request.first_token_at, tpot)


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


def _token_ids(prompt, index: int) -> list[int]:
    """Prompt ``index``'s token ids as ints; ``TypeError`` / ``ValueError`` naming the prompt."""
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1:
            raise ValueError(f"prompt {index}: a prompt tensor must be 1-D, got shape {tuple(prompt.shape)}")
        if not _is_integer_dtype(prompt.dtype):
            raise TypeError(f"prompt {index}: a prompt tensor must have an integer dtype, got {prompt.dtype}")
        return prompt.tolist()
    if not _is_prompt(prompt):
        raise TypeError(f"prompt {index}: expected a sequence of token ids or a 1-D integer tensor, "
                        f"got {prompt!r} ({type(prompt).__name__})")
    return [_token_id(token, f"prompt {index}, token {j}") for j, token in enumerate(prompt)]
