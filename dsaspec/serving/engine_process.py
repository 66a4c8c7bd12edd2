"""The engine in a process of its own: the :class:`~dsaspec.serving.engine_loop.EngineLoop` of an
engine built in a child process (``spawn``, so CUDA is only ever initialised there), driven from
the HTTP process's asyncio event loop over one pipe.

The HTTP process keeps the text (tokenization, detokenization), the SSE streams and JSON; the
child owns the model, its CUDA graphs, the :class:`~dsaspec.engine.engine.EngineCore` and the
server's metrics, so its engine thread shares its GIL with nobody busy: the event loop's work
(a chunk per request per step) no longer lands in the engine's host work between launches, which
releases and retakes the GIL at every torch call. Messages are small and batched, each a tuple
pickled by :class:`multiprocessing.connection.Connection`:

  to the child    ``("add", rid, prompt, max_new_tokens, stop_token_ids)``, ``("cancel", rid)``,
                  ``("state", qid)``, ``("metrics", qid)``, ``("stop",)``
  to the parent   ``("ready", info)`` or ``("failed", why)`` once, then ``("added", rid, error)``
                  (``error`` None or ``(kind, message)``), ``("step", [(rid, tokens,
                  finish_reason, error), ...])`` (one per step or command: the deliveries the
                  engine thread dispatches together, in order), ``("state", qid, dict)``,
                  ``("metrics", qid, (body, content_type))``, and last ``("ended", failure)``

The child gets its engine from ``factory``, a picklable callable of no arguments called there
(the CLI passes ``functools.partial(build_engine, args, plan)``: the parsed options and what the
parent checked, so nothing is read from the environment twice).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import signal
import threading
from typing import Callable

from dsaspec.engine.engine import RequestRefused
from dsaspec.errors import UserError
from dsaspec.serving.engine_loop import CANCELLED, Delivery, EngineLoop, Overloaded

_ERRORS = {"overloaded": Overloaded, "refused": RequestRefused, "type": TypeError, "value": ValueError}


class EngineFailed(RuntimeError):
    """The engine process could not build its engine (the message says why)."""


class EngineProcess:
    """An engine loop in a child process (see the module docstring); the engine is built and its
    ``("ready", ...)`` read in the constructor (:class:`EngineFailed` if building it raised).

    ``factory``: picklable, called with no arguments in the child, returns the
    :class:`~dsaspec.engine.engine.Engine`; ``max_waiting``: as :class:`EngineLoop`'s.
    ``info`` holds what the child reports of its engine: ``context_len``, ``max_batch``,
    ``cuda_graphs``, ``kv_cache_dtype``, ``chunked_prefill_size`` (its ``prefill_chunk``).
    """

    def __init__(self, factory: Callable[[], object], *, max_waiting: int):
        if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 1:
            raise ValueError(f"max_waiting must be an int >= 1, got {max_waiting!r}")
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self.process = context.Process(target=serve_engine, args=(child, factory, max_waiting),
                                       name="dsaspec-engine", daemon=True)
        self.process.start()
        child.close()
        try:
            kind, detail = self._conn.recv()
        except EOFError:
            self.process.join()
            raise EngineFailed(f"the engine process exited (status {self.process.exitcode}) before its "
                               "engine was built") from None
        if kind == "failed":
            self.process.join()
            raise EngineFailed(detail)
        self.info: dict = detail
        self.context_len: int = detail["context_len"]
        self.max_waiting = max_waiting
        self.failure: str | None = None
        self._stopping: str | None = None
        self._aio: asyncio.AbstractEventLoop | None = None
        self._receivers: dict[int, Callable[[Delivery], None]] = {}
        self._replies: dict[tuple[str, int], asyncio.Future] = {}
        self._ended: asyncio.Future | None = None
        self._next_id = 0

    # ---- the event loop's thread -----------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._stopping is None and self.failure is None and self.process.is_alive()

    def start(self, aio: asyncio.AbstractEventLoop) -> None:
        """Read the child's messages on ``aio`` (each delivery made there, in order)."""
        self._aio = aio
        self._ended = aio.create_future()
        aio.add_reader(self._conn.fileno(), self._read)

    async def submit(self, prompt, max_new_tokens: int, deliver: Callable[[Delivery], None], *,
                     stop_token_ids=()) -> int:
        """Queue a request in the child; returns its id for :meth:`cancel`. Raises as
        :meth:`EngineLoop.submit` does (the child checks it); ``deliver`` is called on the event
        loop with each :class:`Delivery`."""
        if self._stopping is not None or self.failure is not None:
            raise Overloaded(self._stopping or self.failure)
        rid, self._next_id = self._next_id, self._next_id + 1
        self._receivers[rid] = deliver               # its deliveries may come before the reply
        reply = self._replies[("added", rid)] = self._aio.create_future()
        self._send(("add", rid, prompt, max_new_tokens, tuple(stop_token_ids)))
        try:
            error = await reply
        except asyncio.CancelledError:               # the client went away while it was being queued
            self.cancel(rid)
            raise
        if error is not None:
            self._receivers.pop(rid, None)
            kind, message = error
            raise _ERRORS[kind](message)
        return rid

    def cancel(self, rid: int) -> None:
        """Cancel a request at the child's next iteration boundary; nothing if it has ended."""
        if rid in self._receivers:
            self._send(("cancel", rid))

    async def state(self) -> dict:
        """The scheduler's state now: ``num_waiting``, ``num_running``, ``mean_accept_length``,
        ``last_gen_throughput``."""
        return await self._ask("state")

    async def exposition(self) -> tuple[bytes, str]:
        """The child's Prometheus text and its content type."""
        return await self._ask("metrics")

    async def stop(self, timeout: float | None = 60.0) -> None:
        """Refuse new requests, have the child cancel the waiting and running ones (each gets its
        ``"abort"`` delivery) and free every row and page, wait for it to end (``timeout``
        seconds, then it is killed) and stop reading."""
        if self._stopping is None:
            self._stopping = "the server is shutting down"
        if not self._ended.done():
            self._send(("stop",))
            try:
                await asyncio.wait_for(asyncio.shield(self._ended), timeout)
            except asyncio.TimeoutError:
                self.process.kill()
        self._aio.remove_reader(self._conn.fileno())
        await asyncio.get_running_loop().run_in_executor(None, self.process.join)
        self._conn.close()

    # ---- internals -------------------------------------------------------------------------
    async def _ask(self, what: str):
        if self._ended.done():
            raise Overloaded(self._stopping or self.failure or "the engine process has ended")
        qid, self._next_id = self._next_id, self._next_id + 1
        reply = self._replies[(what, qid)] = self._aio.create_future()
        self._send((what, qid))
        return await reply

    def _send(self, message) -> None:
        try:
            self._conn.send(message)
        except OSError:                              # the child is gone: _read learns it at EOF
            pass

    def _read(self) -> None:
        try:
            while self._conn.poll():
                self._handle(self._conn.recv())
        except (EOFError, OSError):
            self._aio.remove_reader(self._conn.fileno())
            self.process.join(5)                     # it has closed its end: its exit status is due
            self._gone(f"the engine process exited (status {self.process.exitcode})")

    def _handle(self, message) -> None:
        kind = message[0]
        if kind == "step":
            for rid, tokens, finish, error in message[1]:
                deliver = self._receivers.get(rid) if finish is None else self._receivers.pop(rid, None)
                if deliver is not None:
                    deliver(Delivery(tokens, finish, error))
        elif kind == "ended":
            self._gone(message[1])
        else:                                        # added, state, metrics
            reply = self._replies.pop((kind, message[1]), None)
            if reply is not None and not reply.done():
                reply.set_result(message[2])

    def _gone(self, failure: str | None) -> None:
        """The child ended (stopped: ``failure`` None) or died: every request still open ends."""
        if failure is not None and self._stopping is None:
            self.failure = failure
        why = self.failure or self._stopping or "the server is shutting down"
        receivers, self._receivers = self._receivers, {}
        for deliver in receivers.values():
            deliver(Delivery([], CANCELLED, why))
        for reply in self._replies.values():
            if not reply.done():
                reply.set_exception(Overloaded(why))
        self._replies.clear()
        if not self._ended.done():
            self._ended.set_result(None)


def serve_engine(conn, factory, max_waiting: int) -> None:
    """The child's main: build the engine and its loop, report ``("ready", info)``, read commands
    on a thread and run the engine loop on this one until stopped (or failed), then ``("ended",
    failure)``. A step's message is sent from the engine thread itself: a thread of its own for it
    would take the GIL back from the engine's launches (the stand-in measured that worse than the
    write). Ignores SIGINT (the parent, in the same process group, decides when to stop)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    lock = threading.Lock()

    def send(message) -> None:
        with lock:
            conn.send(message)

    try:
        from dsaspec.serving.metrics import ServerMetrics

        engine = factory()
        loop = EngineLoop(engine, max_waiting=max_waiting, metrics=ServerMetrics())
        info = {"context_len": engine.context_len, "max_batch": engine.max_batch,
                "cuda_graphs": engine.use_cuda_graph, "kv_cache_dtype": engine.kv.kv_cache_dtype,
                "chunked_prefill_size": engine.prefill_chunk}
    except UserError as err:                         # options the engine cannot honour: the message says why
        send(("failed", str(err)))
        return
    except BaseException as err:
        send(("failed", f"the engine process failed to build its engine ({type(err).__name__}: {err})"))
        raise
    send(("ready", info))
    handles: dict = {}

    def dispatch(batch) -> None:
        items = []
        for rid, delivery in batch:
            if delivery.finish_reason is not None:
                handles.pop(rid, None)
            items.append((rid, delivery.tokens, delivery.finish_reason, delivery.error))
        send(("step", items))

    reader = threading.Thread(target=_read_commands, args=(conn, loop, handles, send), name="dsaspec-commands",
                              daemon=True)
    reader.start()
    loop.run(dispatch)
    send(("ended", None if loop.failure is None else f"the engine failed ({type(loop.failure).__name__}: "
                                                      f"{loop.failure})"))
    conn.close()


def _read_commands(conn, loop: EngineLoop, handles: dict, send) -> None:
    """The child's command thread: apply the parent's commands to ``loop`` until ``stop`` (or the
    parent is gone)."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            loop.stop()
            return
        kind = message[0]
        if kind == "add":
            _, rid, prompt, max_new_tokens, stops = message
            try:
                handle = loop.submit(prompt, max_new_tokens, rid, stop_token_ids=stops)
            except Overloaded as err:
                send(("added", rid, ("overloaded", str(err))))
            except RequestRefused as err:
                send(("added", rid, ("refused", str(err))))
            except TypeError as err:
                send(("added", rid, ("type", str(err))))
            except ValueError as err:
                send(("added", rid, ("value", str(err))))
            else:
                handles[rid] = handle
                if handle.state == "done":           # it ended before it was stored here
                    handles.pop(rid, None)
                send(("added", rid, None))
        elif kind == "cancel":
            handle = handles.get(message[1])
            if handle is not None:
                loop.cancel(handle)
        elif kind == "state":
            send(("state", message[1], loop.state()))
        elif kind == "metrics":
            send(("metrics", message[1], loop.metrics.exposition()))
        elif kind == "stop":
            loop.stop()
            return
