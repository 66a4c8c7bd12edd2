"""The HTTP API of ``dsaspec serve`` (a Starlette app): OpenAI-compatible completions and chat
completions, streamed as server-sent events or not, plus ``/v1/models``, ``/health``,
``/metrics`` and ``/get_server_info`` (alias ``/server_info``, the accept length where SGLang's
benchmark client reads it: ``internal_states[0].avg_spec_accept_length``).

Decoding is greedy, one choice per request. A field asking for anything else (sampling, several
choices, log-probabilities, penalties, stop strings, echo) or one this server does not know is a
400 naming it; so is a prompt that is malformed or can never fit. A full waiting queue, or a
server shutting down, is a 503 with the reason. Every error body is OpenAI's
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from dsaspec.engine.engine import EOS, LENGTH
from dsaspec.serving.engine_loop import Delivery, EngineLoop, Overloaded, deliver_all
from dsaspec.serving.text import TemplateError, TextCodec

FINISH_REASONS = {LENGTH: "length", EOS: "stop", "abort": "abort"}


class BadRequest(ValueError):
    """A request the server refuses (400): ``param`` is the field at fault."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _error(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _matches(value, allowed) -> bool:
    if allowed is None or isinstance(allowed, bool):
        return value is allowed
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == allowed


def _only(*allowed, why: str):
    """A field check: the value is one of ``allowed`` (None: null; numbers compare by value)."""
    def check(name, value):
        if not any(_matches(value, a) for a in allowed):
            shown = " or ".join("null" if a is None else json.dumps(a) for a in allowed)
            raise BadRequest(f"{name} must be {shown}: {why}, got {json.dumps(value)}", name)
    return check


def _of_type(kind, what: str):
    def check(name, value):
        if value is not None and (not isinstance(value, kind) or (kind is not bool and isinstance(value, bool))):
            raise BadRequest(f"{name} must be {what}, got {json.dumps(value)}", name)
    return check


def _max_tokens(name, value):
    if value is not None and (not _is_int(value) or value < 1):
        raise BadRequest(f"{name} must be an integer >= 1, got {json.dumps(value)}", name)


def _token_list(name, value):
    if value is not None and (not isinstance(value, list) or not all(_is_int(t) and t >= 0 for t in value)):
        raise BadRequest(f"{name} must be a list of token ids (integers >= 0), got {json.dumps(value)}", name)


def _stop(name, value):
    if value not in (None, []):
        raise BadRequest(f"stop strings are not implemented (got {json.dumps(value)}): give the stop tokens' "
                         "ids in stop_token_ids", name)


def _stream_options(name, value):
    if value is None:
        return
    if not isinstance(value, dict) or set(value) - {"include_usage"} or \
            not isinstance(value.get("include_usage", False), bool):
        raise BadRequest(f"{name} must be null or {{\"include_usage\": true|false}}, got {json.dumps(value)}", name)


GREEDY = "only greedy decoding is implemented"
COMMON_FIELDS = {
    "model": _of_type(str, "a string"),
    "max_tokens": _max_tokens,
    "stream": _of_type(bool, "true or false"),
    "stream_options": _stream_options,
    "stop": _stop,
    "stop_token_ids": _token_list,
    "ignore_eos": _of_type(bool, "true or false"),
    "seed": _of_type(int, "an integer (greedy decoding does not use it)"),
    "user": _of_type(str, "a string"),
    "temperature": _only(None, 0, why=GREEDY),
    "top_p": _only(None, 1, why=GREEDY),
    "top_k": _only(None, -1, 1, why=GREEDY),
    "min_p": _only(None, 0, why=GREEDY),
    "n": _only(None, 1, why="one greedy choice per request is implemented"),
    "presence_penalty": _only(None, 0, why="penalties are not implemented"),
    "frequency_penalty": _only(None, 0, why="penalties are not implemented"),
    "repetition_penalty": _only(None, 1, why="penalties are not implemented"),
}
COMPLETION_FIELDS = {
    **COMMON_FIELDS, "prompt": None,
    "best_of": _only(None, 1, why="one greedy choice per request is implemented"),
    "logprobs": _only(None, why="log-probabilities are not implemented"),
    "echo": _only(None, False, why="echoing the prompt is not implemented"),
}
CHAT_FIELDS = {
    **COMMON_FIELDS, "messages": None,
    "max_completion_tokens": _max_tokens,
    "logprobs": _only(None, False, why="log-probabilities are not implemented"),
    "top_logprobs": _only(None, 0, why="log-probabilities are not implemented"),
}


def check_fields(body, fields: dict) -> dict:
    """``body`` as a dict of known, allowed fields; BadRequest otherwise."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise BadRequest(f"unsupported field(s) {', '.join(unknown)}: this server implements greedy decoding "
                         f"with {', '.join(sorted(fields))} (see docs/serving.md)", unknown[0])
    for name, check in fields.items():
        if check is not None and name in body:
            check(name, body[name])
    return body


class InProcess:
    """An :class:`EngineLoop` on a thread of this process, behind the interface the server drives
    an :class:`~dsaspec.serving.engine_process.EngineProcess` through: :meth:`start` on the app's
    event loop, ``async`` :meth:`submit`, :meth:`cancel`, ``async`` :meth:`state`,
    :meth:`exposition` and :meth:`stop`, ``alive``, ``failure``, ``context_len``, ``max_waiting``."""

    def __init__(self, loop: EngineLoop):
        self.loop = loop
        self.context_len, self.max_waiting = loop.engine.context_len, loop.max_waiting
        self._dispatch: EventLoopDispatch | None = None

    @property
    def alive(self) -> bool:
        return self.loop.alive

    @property
    def failure(self) -> str | None:
        return None if self.loop.failure is None else str(self.loop.failure)

    def start(self, aio: asyncio.AbstractEventLoop) -> None:
        """Start the engine thread, its deliveries made on ``aio`` through an :class:`EventLoopDispatch`."""
        self._dispatch = EventLoopDispatch(aio)
        self.loop.start(self._dispatch)

    async def submit(self, prompt, max_new_tokens: int, deliver, *, stop_token_ids=()):
        """:meth:`EngineLoop.submit`."""
        return self.loop.submit(prompt, max_new_tokens, deliver, stop_token_ids=stop_token_ids)

    def cancel(self, handle) -> None:
        self.loop.cancel(handle)

    async def state(self) -> dict:
        """:meth:`EngineLoop.state`."""
        return self.loop.state()

    async def exposition(self) -> tuple[bytes, str]:
        return self.loop.metrics.exposition()

    async def stop(self) -> None:
        """Stop the engine thread (every row and page freed), then the dispatch thread."""
        self.loop.stop()
        if self._dispatch is not None:
            self._dispatch.close()


class Server:
    """The app's state: the engine (an :class:`EngineLoop`, run on a thread here, or an
    :class:`~dsaspec.serving.engine_process.EngineProcess`), the text codec (None: prompts and
    outputs are token ids), the served model's name and what ``/get_server_info`` reports.
    ``engine`` drives either through the same interface (:class:`InProcess`'s)."""

    def __init__(self, loop, *, model_name: str, text: TextCodec | None, info: dict):
        self.loop, self.model_name, self.text, self.info = loop, model_name, text, info
        self.engine = InProcess(loop) if isinstance(loop, EngineLoop) else loop
        self.context_len = self.engine.context_len
        self.created = int(time.time())

    # ---- prompts --------------------------------------------------------------------------
    def _completion_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]                       # a batch of one
        if isinstance(prompt, str):
            if self.text is None:
                raise BadRequest("this server has no tokenizer (no tokenizer.json): give the prompt as a list of "
                                 "token ids", "prompt")
            ids = self.text.encode(prompt)
            if not ids:
                raise BadRequest("the prompt encodes to no tokens", "prompt")
            return ids
        if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
            return prompt
        if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
            raise BadRequest(f"one prompt per request is implemented, got {len(prompt)}", "prompt")
        raise BadRequest("prompt must be a string or a non-empty list of token ids", "prompt")

    def _chat_prompt(self, messages) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list of {role, content} objects", "messages")
        plain = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise BadRequest(f"messages[{i}] must be an object with a string role", "messages")
            content = message.get("content")
            if isinstance(content, list):            # content parts: text only
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise BadRequest(f"messages[{i}].content: only text parts are implemented", "messages")
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise BadRequest(f"messages[{i}].content must be a string or a list of text parts", "messages")
            plain.append({"role": message["role"], "content": content})
        if self.text is None:
            raise BadRequest("this server has no tokenizer (no tokenizer.json), so no chat completions: use "
                             "/v1/completions with token ids", "messages")
        try:
            return self.text.chat_prompt(plain)
        except TemplateError as err:
            raise BadRequest(str(err), "messages") from None

    # ---- endpoints ------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, *, chat: bool) -> Response:
        try:
            body = check_fields(await _json(request), CHAT_FIELDS if chat else COMPLETION_FIELDS)
            if chat:
                ids = self._chat_prompt(body.get("messages"))
            elif "prompt" not in body:
                raise BadRequest("prompt is required", "prompt")
            else:
                ids = self._completion_prompt(body["prompt"])
            limit = body.get("max_completion_tokens") if chat else None
            limit = limit or body.get("max_tokens")
            if limit is None:   # OpenAI's defaults: 16 for completions, up to the context for chat
                limit = 16 if not chat else max(1, self.context_len - len(ids) + 1)
            stops = set(body.get("stop_token_ids") or ())
            if not body.get("ignore_eos") and self.text is not None:
                stops |= self.text.eos_token_ids
        except BadRequest as err:
            return _error(400, str(err), "invalid_request_error", err.param)
        queue: asyncio.Queue[Delivery] = asyncio.Queue()
        try:   # put_nowait runs on this event loop: build_app's lifespan dispatches the deliveries to it
            handle = await self.engine.submit(ids, limit, queue.put_nowait, stop_token_ids=sorted(stops))
        except Overloaded as err:
            return _error(503, str(err), "service_unavailable")
        except (TypeError, ValueError) as err:       # bad token ids, or a request that can never fit
            return _error(400, str(err).replace("max_new_tokens", "max_tokens"), "invalid_request_error",
                          "prompt")
        reply = _Reply(self, chat, len(ids), bool((body.get("stream_options") or {}).get("include_usage")))
        if body.get("stream"):
            return StreamingResponse(self._events(queue, handle, reply), media_type="text/event-stream")
        return await self._whole(request, queue, handle, reply)

    async def _events(self, queue, handle, reply: "_Reply"):
        ended = False
        try:
            while True:
                delivery = await queue.get()
                if delivery.finish_reason is None:
                    yield _event(reply.chunk(delivery.tokens, None))
                    continue
                ended = True
                if delivery.error is not None:
                    yield _event({"error": {"message": delivery.error, "type": "service_unavailable",
                                            "param": None, "code": 503}})
                yield _event(reply.chunk(delivery.tokens, delivery.finish_reason))
                if reply.include_usage:
                    yield _event(reply.usage_chunk())
                yield "data: [DONE]\n\n"
                return
        finally:
            if not ended:                            # the client went away (or the server stops)
                self.engine.cancel(handle)

    async def _whole(self, request: Request, queue, handle, reply: "_Reply") -> Response:
        gone = asyncio.ensure_future(_disconnected(request))
        ended = False
        try:
            tokens = []
            while True:
                got = asyncio.ensure_future(queue.get())
                await asyncio.wait({got, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not got.done():
                    got.cancel()
                    return Response(status_code=499)  # nobody reads it
                delivery = got.result()
                tokens += delivery.tokens
                if delivery.finish_reason is not None:
                    ended = True
                    if delivery.error is not None:
                        return _error(503, delivery.error, "service_unavailable")
                    return JSONResponse(reply.whole(tokens, delivery.finish_reason))
        finally:
            gone.cancel()
            if not ended:
                self.engine.cancel(handle)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "dsaspec",
            "root": self.model_name, "max_model_len": self.context_len}]})

    async def health(self, request: Request) -> Response:
        engine = self.engine
        if engine.alive:
            return JSONResponse({"status": "ok"})
        return _error(503, engine.failure and f"the engine failed: {engine.failure}" or "shutting down",
                      "service_unavailable")

    async def metrics(self, request: Request) -> Response:
        try:
            body, content_type = await self.engine.exposition()
        except Overloaded as err:                    # the engine process has ended
            return _error(503, str(err), "service_unavailable")
        return Response(body, media_type=content_type)

    async def server_info(self, request: Request) -> Response:
        try:
            state = await self.engine.state()
        except Overloaded as err:
            return _error(503, str(err), "service_unavailable")
        return JSONResponse({**self.info, "model": self.model_name, "max_waiting": self.engine.max_waiting,
                             "num_waiting": state["num_waiting"], "num_running": state["num_running"],
                             "internal_states": [{"avg_spec_accept_length": state["mean_accept_length"],
                                                  "last_gen_throughput": state["last_gen_throughput"]}]})


class _Reply:
    """The JSON of one request's answer: streamed chunks (text decoded incrementally) or the whole."""

    def __init__(self, server: Server, chat: bool, prompt_tokens: int, include_usage: bool):
        self.server, self.chat, self.prompt_tokens, self.include_usage = server, chat, prompt_tokens, include_usage
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.detok = server.text.detokenizer() if server.text is not None else None
        self.completion_tokens = 0
        self.first = True

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": int(time.time()), "model": self.server.model_name}

    def _usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def chunk(self, tokens: list[int], finish: str | None) -> dict:
        self.completion_tokens += len(tokens)
        text = ""
        if self.detok is not None:
            text = self.detok.add(tokens) + (self.detok.flush() if finish is not None else "")
        reason = None if finish is None else FINISH_REASONS[finish]
        if self.chat:
            delta = {"content": text}
            if self.first:
                delta["role"] = "assistant"
            self.first = False
            choice = {"index": 0, "delta": delta, "token_ids": tokens, "finish_reason": reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text, "token_ids": tokens, "logprobs": None, "finish_reason": reason}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(kind), "choices": [], "usage": self._usage()}

    def whole(self, tokens: list[int], finish: str) -> dict:
        self.completion_tokens = len(tokens)
        text = self.server.text.decode(tokens) if self.server.text is not None else ""
        reason = FINISH_REASONS[finish]
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "token_ids": tokens,
                      "finish_reason": reason}
            return {**self._head("chat.completion"), "choices": [choice], "usage": self._usage()}
        choice = {"index": 0, "text": text, "token_ids": tokens, "logprobs": None, "finish_reason": reason}
        return {**self._head("text_completion"), "choices": [choice], "usage": self._usage()}


def _event(data: dict) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


async def _json(request: Request):
    try:
        return json.loads(await request.body())
    except ValueError as err:
        raise BadRequest(f"the request body is not JSON ({err})") from None


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class EventLoopDispatch:
    """The engine loop's ``dispatch`` for an asyncio event loop ``aio``: every delivery is made on
    ``aio``, in order, through a thread of its own that wakes ``aio``.

    Called on the engine thread, it only queues the step's deliveries and notifies that thread,
    which needs the GIL to run and so gets it when the engine thread next lets go of it: while it
    waits for the device. There the thread hands every batch queued so far to ``aio`` in one
    ``call_soon_threadsafe``, and the event loop's work (a chunk per request) overlaps the step on
    the device instead of delaying the host work of the next step. :meth:`close` sends what is
    queued and ends the thread.
    """

    def __init__(self, aio: asyncio.AbstractEventLoop):
        self.aio = aio
        self._cond = threading.Condition()
        self._queued: list = []
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="dsaspec-dispatch", daemon=True)
        self._thread.start()

    def __call__(self, batch) -> None:
        with self._cond:
            self._queued.append(batch)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queued and not self._closing:
                    self._cond.wait()
                batches, self._queued = self._queued, []
            if not batches:
                return                               # closing, nothing left to send
            try:
                self.aio.call_soon_threadsafe(_deliver_batches, batches)
            except RuntimeError:                     # the event loop is closed: nobody reads them
                pass


def _deliver_batches(batches) -> None:
    for batch in batches:
        deliver_all(batch)


def build_app(server: Server) -> Starlette:
    """The Starlette app of ``server``; its lifespan starts the engine (its deliveries made on the
    app's event loop) and, at shutdown, stops it (every row and page freed)."""

    @asynccontextmanager
    async def lifespan(app):
        server.engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await server.engine.stop()

    routes = [
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.metrics, methods=["GET"]),
        Route("/get_server_info", server.server_info, methods=["GET"]),
        Route("/server_info", server.server_info, methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)
