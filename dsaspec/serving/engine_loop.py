"""The engine thread: an :class:`~dsaspec.engine.engine.EngineCore` stepped on a thread of its own,
with requests submitted and cancelled from any thread at any time.

Submissions and cancellations wait in an inbox that the thread drains at every iteration boundary,
so a request joins the running batch at the next step (continuous batching) and a cancelled one
frees its row and KV pages before the next step runs. At most ``max_waiting`` requests wait for a
row and pages (submitted, not yet admitted); beyond that :meth:`EngineLoop.submit` raises
:class:`Overloaded`. Each request's tokens go to its ``deliver`` callback, called (through the
dispatch below) once for its prefill token (as soon as it is prefilled, before the decode step of that
iteration), then once per decode step that gives it tokens; the last delivery says how it ended.
The metrics are updated before the deliveries of each step, so a client that has its request's last
delivery finds ``/metrics`` counting the request as ended (not running, its KV pages free).
The deliveries of one step (or command) go out together, in order, through one ``dispatch`` call
(:meth:`EngineLoop.start`), which a server uses to hand them to its event loop in one wake-up
(:class:`~dsaspec.serving.api.EventLoopDispatch`), or, in an engine process of its own
(:mod:`dsaspec.serving.engine_process`), to send them to the HTTP process in one message; there
the loop runs on the process's main thread (:meth:`EngineLoop.run`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from dsaspec.engine.engine import Engine, EngineCore

log = logging.getLogger("dsaspec.serve")

CANCELLED = "abort"


class Overloaded(RuntimeError):
    """The waiting queue is full, or the server is shutting down (the message says which)."""


@dataclass
class Delivery:
    """What a request's ``deliver`` callback gets: its new tokens, and when it ended its finish
    reason (``"length"``, ``"eos"`` or ``"abort"``) and, for ``"abort"`` by the server, why."""

    tokens: list[int]
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class Handle:
    """A submitted request, for :meth:`EngineLoop.cancel`."""

    request: object                                  # the EngineCore's checked request
    deliver: object                                  # what the dispatch gets with each delivery
    submitted_at: float = field(default_factory=time.perf_counter)
    core_id: int | None = None
    state: str = "inbox"                             # inbox, waiting, running, done
    first_at: float | None = None
    last_at: float | None = None
    num_tokens: int = 0


class EngineLoop:
    """Runs ``engine``'s scheduler on a thread (:meth:`start`); see the module docstring.

    ``metrics``: a :class:`~dsaspec.serving.metrics.ServerMetrics` updated at every step (or None).
    """

    def __init__(self, engine: Engine, *, max_waiting: int, metrics=None):
        if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 1:
            raise ValueError(f"max_waiting must be an int >= 1, got {max_waiting!r}")
        self.engine = engine
        self.core = EngineCore(engine)
        self.max_waiting = max_waiting
        self.metrics = metrics
        self._cond = threading.Condition()
        self._inbox: deque[tuple[str, Handle]] = deque()
        self._num_waiting = 0
        self._stopping: str | None = None            # why submissions are refused
        self._handles: dict[int, Handle] = {}          # core id -> handle, waiting or running
        self._outbox: list[tuple[Callable[[Delivery], None], Delivery]] = []   # sent by _send
        self._dispatch = deliver_all
        self._thread = threading.Thread(target=self.run, name="dsaspec-engine", daemon=True)
        self.failure: BaseException | None = None
        self.accepted_tokens = self.accept_steps = 0
        self.last_gen_throughput = 0.0
        if metrics is not None:
            metrics.kv_total.set(engine.allocator.num_pages - 1)

    # ---- any thread ------------------------------------------------------------------------
    def start(self, dispatch: Callable[[list[tuple[Callable[[Delivery], None], Delivery]]], None] | None = None,
              ) -> "EngineLoop":
        """Start the engine thread. ``dispatch`` is called on it with each step's (or command's)
        deliveries, a list of ``(deliver, Delivery)`` in order, to call every ``deliver(delivery)``
        in that order on any thread (default :func:`deliver_all`: on the engine thread); a
        ``RuntimeError`` it raises (a receiver's event loop closed) is ignored."""
        if dispatch is not None:
            self._dispatch = dispatch
        self._thread.start()
        return self

    def state(self) -> dict:
        """The scheduler's state now: ``num_waiting``, ``num_running``, ``mean_accept_length``,
        ``last_gen_throughput`` (what ``/get_server_info`` reports)."""
        return {"num_waiting": self._num_waiting, "num_running": len(self.core.running),
                "mean_accept_length": self.mean_accept_length, "last_gen_throughput": self.last_gen_throughput}

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._stopping is None

    @property
    def mean_accept_length(self) -> float | None:
        """Mean tokens committed per request per decode step since start; None before any step."""
        return self.accepted_tokens / self.accept_steps if self.accept_steps else None

    def submit(self, prompt, max_new_tokens: int, deliver, *, stop_token_ids=()) -> Handle:
        """Queue a request (checked here: ``RequestRefused`` / ``TypeError`` / ``ValueError`` as
        :meth:`EngineCore.check` raises them); :class:`Overloaded` if ``max_waiting`` requests
        wait already or the loop is stopping. ``deliver`` goes to the dispatch with each of the
        request's deliveries (the default dispatch calls it: ``deliver(Delivery)``)."""
        request = self.core.check(prompt, max_new_tokens, stop_token_ids=stop_token_ids)
        handle = Handle(request, deliver)
        with self._cond:
            if self._stopping is not None:
                raise Overloaded(self._stopping)
            if self._num_waiting >= self.max_waiting:
                raise Overloaded(f"{self._num_waiting} requests are waiting, the most this server queues "
                                 f"(--max-waiting {self.max_waiting}); retry later")
            self._num_waiting += 1
            self._inbox.append(("add", handle))
            self._cond.notify()
        return handle

    def cancel(self, handle: Handle) -> None:
        """Cancel a request at the next iteration boundary (its row and pages are freed there);
        nothing if it has ended."""
        with self._cond:
            self._inbox.append(("cancel", handle))
            self._cond.notify()

    def stop(self, timeout: float | None = None) -> None:
        """Refuse new requests, cancel the waiting and running ones (each gets an ``"abort"``
        delivery), free every row and page, and join the thread (``timeout`` seconds at most)."""
        with self._cond:
            if self._stopping is None:
                self._stopping = "the server is shutting down"
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- the engine thread -----------------------------------------------------------------
    def run(self, dispatch=None) -> None:
        """The engine loop on the calling thread (instead of :meth:`start`'s), until :meth:`stop`
        (from another thread) or a failure (kept in ``failure``); ``dispatch`` as :meth:`start`'s."""
        if dispatch is not None:
            self._dispatch = dispatch
        try:
            while True:
                with self._cond:
                    while not self._inbox and not self.core.has_work and self._stopping is None:
                        self._cond.wait()
                    commands = list(self._inbox)
                    self._inbox.clear()
                    stopping = self._stopping
                for command, handle in commands:
                    self._apply(command, handle)
                self._send()
                if stopping is not None:
                    break
                if self.core.has_work:
                    self._step()
        except BaseException as err:                  # a bug: every request learns it, the log has it
            self.failure = err
            log.exception("the engine loop failed; every request is aborted")
            with self._cond:
                self._stopping = f"the engine failed ({type(err).__name__}: {err})"
        finally:
            self._abort_all(self._stopping or "the server is shutting down")

    def _apply(self, command: str, handle: Handle) -> None:
        if command == "add":
            if handle.state == "inbox":
                handle.core_id = self.core.add(handle.request)
                handle.state = "waiting"
                self._handles[handle.core_id] = handle
            return
        if handle.state in ("waiting", "running"):   # commands apply in order: an add precedes its cancel
            self.core.cancel(handle.core_id)
            self._end(handle, CANCELLED)

    def _left_waiting(self) -> None:
        with self._cond:
            self._num_waiting -= 1

    def _end(self, handle: Handle, reason: str, error: str | None = None, tokens=()) -> None:
        if handle.state in ("inbox", "waiting"):
            self._left_waiting()
        handle.state = "done"
        self._handles.pop(handle.core_id, None)
        if self.metrics is not None:
            self.metrics.requests.labels(reason).inc()
            if handle.num_tokens > 1:
                self.metrics.tpot.observe((handle.last_at - handle.first_at) / (handle.num_tokens - 1))
        self._outbox.append((handle.deliver, Delivery(list(tokens), reason, error)))

    def _step(self) -> None:
        """Admit (prefill) and deliver the new requests' first tokens, then run the decode step
        and deliver its tokens: a request's first token does not wait for the decode step."""
        began = time.perf_counter()
        admitted = self.core.admit()
        if self.metrics is not None and admitted.new_tokens:
            self.metrics.prefill_seconds.inc(time.perf_counter() - began)
        self._deliver(admitted)
        self._send()
        began = time.perf_counter()
        out = self.core.decode()
        now = time.perf_counter()
        if out.batch:
            self.accepted_tokens += sum(out.accept_lens)
            self.accept_steps += len(out.accept_lens)
            self.last_gen_throughput = out.num_tokens / max(now - began, 1e-9)
            if self.metrics is not None:
                self.metrics.batch.set(out.batch)
                self.metrics.accept.set(self.mean_accept_length)
        self._deliver(out)
        self._send()

    def _deliver(self, out) -> None:
        """Queue each request's tokens of ``out`` for its receiver (the last delivery of one that
        ended carries its finish reason) and count them in the metrics."""
        now = time.perf_counter()
        metrics = self.metrics
        for core_id, tokens in out.new_tokens.items():
            handle = self._handles[core_id]
            if handle.state == "waiting":
                handle.state = "running"
                self._left_waiting()
                handle.first_at = now
                if metrics is not None:
                    metrics.ttft.observe(now - handle.submitted_at)
                    metrics.prompt_tokens.inc(len(handle.request.prompt))
            elif metrics is not None:
                metrics.itl.observe(now - handle.last_at)
            handle.last_at = now
            handle.num_tokens += len(tokens)
            finish = out.finished.get(core_id)
            if finish is None:
                self._outbox.append((handle.deliver, Delivery(tokens)))
            else:
                self._end(handle, finish, tokens=tokens)
        if metrics is not None:
            metrics.generation_tokens.inc(out.num_tokens)

    def _send(self) -> None:
        """Update the gauges, then send the queued deliveries: once a client has a delivery, the
        gauges show the scheduler's state after the step (or command) that made it."""
        if self.metrics is not None:
            allocator = self.engine.allocator
            self.metrics.running.set(len(self.core.running))
            self.metrics.waiting.set(self._num_waiting)
            self.metrics.kv_used.set(allocator.num_pages - 1 - allocator.num_free_pages)
        outbox, self._outbox = self._outbox, []
        if outbox:
            try:
                self._dispatch(outbox)
            except RuntimeError:                     # the receivers' event loop is closed
                pass

    def _abort_all(self, why: str) -> None:
        self.core.abort()
        with self._cond:
            pending = [h for command, h in self._inbox if command == "add" and h.state == "inbox"]
            self._inbox.clear()
        for handle in [*self._handles.values(), *pending]:
            self._end(handle, CANCELLED, why)
        self._send()


def deliver_all(batch: list[tuple[Callable[[Delivery], None], Delivery]]) -> None:
    """Call every ``deliver(delivery)`` of ``batch`` in order; a receiver that raises
    ``RuntimeError`` (its event loop closed) does not keep the others from theirs."""
    for deliver, delivery in batch:
        try:
            deliver(delivery)
        except RuntimeError:
            pass
