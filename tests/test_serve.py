"""``dsaspec serve`` on CPU, over loopback only: the HTTP API against ``Engine.generate`` for the same
prompts (streamed and whole, text and token ids, chat through a template, concurrent clients), a
client that disconnects mid-stream (its row and pages freed), bad requests (400s naming the field),
the waiting bound (503), shutdown with requests in flight, and the command's option errors; then
the same behaviours with the engine in a process of its own (``EngineProcess``, as ``dsaspec serve``
runs by default), and that process failing to build or dying.

The server runs in-process (uvicorn on a thread, an ephemeral port) over the fp32 tiny model with
the torch reference ops and the tokenizer ``dsaspec.testing.tokenizer`` trains; an engine process
builds the same model (seed 0) from :func:`tiny_engine`. Every wait is bounded.
"""

import asyncio
import functools
import http.client
import json
import logging
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
import torch

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
pytest.importorskip("tokenizers")

import uvicorn  # noqa: E402

from dsaspec.configs.model_config import get_config  # noqa: E402
from dsaspec.engine.engine import Engine  # noqa: E402
from dsaspec.models.dsa_model import DSAModel  # noqa: E402
from dsaspec.serving.api import Server, build_app  # noqa: E402
from dsaspec.serving.engine_loop import EngineLoop, Overloaded  # noqa: E402
from dsaspec.serving.engine_process import EngineFailed, EngineProcess  # noqa: E402
from dsaspec.serving.metrics import ServerMetrics  # noqa: E402
from dsaspec.serving.text import load_text  # noqa: E402
from dsaspec.testing.tokenizer import build_tokenizer  # noqa: E402

CONTEXT = 256
WAIT_S = 60


@pytest.fixture(scope="module")
def model():
    return DSAModel(get_config("tiny"), dtype=torch.float32).init_weights(0)


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    return load_text(build_tokenizer(tmp_path_factory.mktemp("tokenizer")))


def _engine(model, **kwargs):
    kwargs.setdefault("context_len", CONTEXT)
    kwargs.setdefault("max_batch", 2)
    kwargs.setdefault("bucket_sizes", (1, 2))
    return Engine(model, progress=False, **kwargs)


def _until(condition, what: str):
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def tiny_engine(**kwargs):
    """An engine process's factory: the module's engine over the fp32 tiny model of seed 0."""
    torch.set_num_threads(1)
    return _engine(DSAModel(get_config("tiny"), dtype=torch.float32).init_weights(0), **kwargs)


@contextmanager
def serving(model, text, *, max_waiting=16, graceful_s=5.0, process=False, **engine_kwargs):
    """A server on 127.0.0.1 at a free port: yields (port, Server); stopped on exit. ``process``:
    the engine in an engine process (built by :func:`tiny_engine`), else on a thread."""
    if process:
        loop = EngineProcess(functools.partial(tiny_engine, **engine_kwargs), max_waiting=max_waiting)
    else:
        loop = EngineLoop(_engine(model, **engine_kwargs), max_waiting=max_waiting, metrics=ServerMetrics())
    server = Server(loop, model_name="tiny-test", text=text, info={})
    config = uvicorn.Config(build_app(server), host="127.0.0.1", port=0, log_level="warning",
                            timeout_graceful_shutdown=graceful_s)
    runner = uvicorn.Server(config)
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    _until(lambda: runner.started, "the server to start")
    port = runner.servers[0].sockets[0].getsockname()[1]
    try:
        yield port, server
    finally:
        runner.should_exit = True
        thread.join(WAIT_S)
        assert not thread.is_alive()


def _all_free(engine):
    return engine.req_pool.num_free == engine.max_batch and \
        engine.allocator.num_free_pages == engine.allocator.num_pages - 1


def post(port, path, body, raw=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    conn.request("POST", path, body=raw if raw is not None else json.dumps(body),
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    data = response.read()
    conn.close()
    return response.status, json.loads(data)


def get(port, path):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    conn.request("GET", path)
    response = conn.getresponse()
    data = response.read()
    conn.close()
    return response.status, data


def stream(port, path, body):
    """The decoded events of a streamed request (``[DONE]`` last, as the string)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    conn.request("POST", path, body=json.dumps({**body, "stream": True}), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and response.getheader("content-type").startswith("text/event-stream")
    events = []
    for line in response:
        line = line.strip()
        if line.startswith(b"data: "):
            payload = line[len(b"data: "):].decode()
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    conn.close()
    return events


def open_stream(port, body):
    """A raw socket streaming a completion, after its first event arrived (the request runs)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    payload = json.dumps({**body, "stream": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    seen = b""
    while b"data: " not in seen:
        seen += sock.recv(4096)
    assert seen.startswith(b"HTTP/1.1 200"), seen
    return sock


def _ids(port, body, path="/v1/completions"):
    status, reply = post(port, path, body)
    assert status == 200, reply
    return reply


# ---------------------------------------------------------------------------------------------

def test_completions_streamed_and_whole_equal_generate(model, text):
    prompt = "The quick brown fox"
    ids = text.encode(prompt)
    expected = _engine(model).generate(ids, 12).token_ids
    with serving(model, text) as (port, server):
        whole = _ids(port, {"prompt": prompt, "max_tokens": 12, "ignore_eos": True, "temperature": 0})
        events = stream(port, "/v1/completions", {"prompt": ids, "max_tokens": 12, "ignore_eos": True})
        stopped = _ids(port, {"prompt": [ids], "max_tokens": 12, "stop_token_ids": [expected[4]]})
        _until(lambda: _all_free(server.loop.engine), "pages to be freed")
    choice = whole["choices"][0]
    assert choice["token_ids"] == expected and choice["finish_reason"] == "length"
    assert choice["text"] == text.decode(expected)
    assert whole["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 12, "total_tokens": len(ids) + 12}
    assert events[-1] == "[DONE]"
    chunks = [e["choices"][0] for e in events[:-1]]
    assert [t for c in chunks for t in c["token_ids"]] == expected
    assert "".join(c["text"] for c in chunks) == choice["text"]
    assert [c["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    stop = expected.index(expected[4]) + 1
    assert stopped["choices"][0]["token_ids"] == expected[:stop] and stopped["choices"][0]["finish_reason"] == "stop"


def test_the_prefill_token_streams_before_the_decode_step(model, text):
    """The first SSE chunk holds the prefill token alone and reaches the client before the worker's
    first decode step of the request: the step waits (bounded) for the client to have read it."""
    ids = text.encode("The quick brown fox")
    expected = _engine(model).generate(ids, 6).token_ids
    got_first, seen_at_step = threading.Event(), []
    with serving(model, text) as (port, server):
        worker = server.loop.engine.worker
        real_step = worker.step

        def step(rows, **kwargs):
            seen_at_step.append(got_first.wait(WAIT_S))
            return real_step(rows, **kwargs)

        worker.step = step
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
        conn.request("POST", "/v1/completions", headers={"Content-Type": "application/json"},
                     body=json.dumps({"prompt": ids, "max_tokens": 6, "ignore_eos": True, "stream": True}))
        response = conn.getresponse()
        chunks = []
        for line in response:
            if line.startswith(b"data: {"):
                chunks.append(json.loads(line[len(b"data: "):])["choices"][0])
                got_first.set()
        conn.close()
    assert seen_at_step and seen_at_step[0], "the first decode step ran before the client had the prefill token"
    assert chunks[0]["token_ids"] == expected[:1] and chunks[0]["finish_reason"] is None
    assert [t for c in chunks for t in c["token_ids"]] == expected


def test_chat_through_the_template_and_usage_chunk(model, text):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, world!"}]
    ids = text.chat_prompt(messages)
    assert ids[0] == text.tokenizer.token_to_id("<|system|>") and ids[-1] == text.tokenizer.token_to_id("<|assistant|>")
    expected = _engine(model).generate(ids, 8).token_ids
    with serving(model, text) as (port, _):
        whole = _ids(port, {"messages": messages, "max_tokens": 8, "ignore_eos": True}, "/v1/chat/completions")
        events = stream(port, "/v1/chat/completions", {"messages": messages, "max_completion_tokens": 8,
                                                       "ignore_eos": True, "stream_options": {"include_usage": True}})
        status, bad = post(port, "/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]})
    assert whole["object"] == "chat.completion" and whole["choices"][0]["token_ids"] == expected
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": text.decode(expected)}
    assert whole["usage"]["prompt_tokens"] == len(ids)
    assert events[-1] == "[DONE]" and events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 8
    deltas = [e["choices"][0] for e in events[:-2]]
    assert deltas[0]["delta"]["role"] == "assistant"
    assert "".join(d["delta"]["content"] for d in deltas) == text.decode(expected)
    assert status == 400 and bad["error"]["param"] == "messages" and "unknown role tool" in bad["error"]["message"]


def _concurrent_clients(port, prompts, limits):
    """One client a prompt, all at once: odd ones stream (their chunks' ids joined), even ones not;
    returns each prompt's generated ids."""
    def one(i):
        body = {"prompt": prompts[i], "max_tokens": limits[i], "ignore_eos": True}
        if i % 2:
            return [t for e in stream(port, "/v1/completions", body)[:-1] for t in e["choices"][0]["token_ids"]]
        return _ids(port, body)["choices"][0]["token_ids"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, range(len(prompts))))


def test_concurrent_clients_equal_generate(model, text):
    """Six clients, two rows: requests join and leave the running batch between steps."""
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 1031, (n,), generator=generator).tolist() for n in (5, 70, 33, 9, 2, 17)]
    limits = [6, 4, 8, 3, 7, 5]
    expected = [r.token_ids for r in _engine(model).generate(prompts, limits)]
    with serving(model, text) as (port, server):
        got = _concurrent_clients(port, prompts, limits)
        assert _all_free(server.loop.engine)          # every response has ended: nothing left to wait for
        status, metrics = get(port, "/metrics")
        _, info = get(port, "/get_server_info")
        _, models = get(port, "/v1/models")
        health = get(port, "/health")[0]
    assert got == expected
    metrics = metrics.decode()
    assert status == 200
    for line in ('dsaspec_requests_total{finish_reason="length"} 6.0', "dsaspec_num_running_requests 0.0",
                 "dsaspec_kv_pages_used 0.0", f"dsaspec_generation_tokens_total {float(sum(limits))}",
                 "dsaspec_time_to_first_token_seconds_count 6.0", "dsaspec_mean_accept_length 1.0"):
        assert line in metrics, line
    prefill_s = float(re.search(r"^dsaspec_prefill_seconds_total (\S+)$", metrics, re.M).group(1))
    assert prefill_s > 0                              # six prompts were prefilled
    assert json.loads(info)["internal_states"][0]["avg_spec_accept_length"] == 1.0
    assert json.loads(models)["data"][0]["id"] == "tiny-test" and health == 200


def test_metrics_count_a_request_as_ended_before_its_last_delivery(model):
    """Each deliver callback reads the metrics: when A ends by length and when B, cancelled from A's
    last delivery, is aborted, the gauges and counters already count the step or cancel that ended it."""
    metrics = ServerMetrics()
    loop = EngineLoop(_engine(model), max_waiting=4, metrics=metrics)
    names = ("dsaspec_num_running_requests", "dsaspec_kv_pages_used", "dsaspec_generation_tokens_total")
    seen, done, handles = {}, threading.Event(), {}

    def receiver(name):
        def deliver(d):
            seen.setdefault((name, d.finish_reason), tuple(metrics.registry.get_sample_value(n) for n in names))
            if d.finish_reason is not None and name == "a":
                loop.cancel(handles["b"])
            elif d.finish_reason is not None:
                done.set()
        return deliver

    handles["a"] = loop.submit([1, 2, 3], 3, receiver("a"))
    handles["b"] = loop.submit([4, 5], 200, receiver("b"))
    loop.start()
    try:
        assert done.wait(WAIT_S), "request b was not cancelled"
    finally:
        loop.stop(WAIT_S)
    both_running = seen["b", None]                   # b's prefill token: a and b admitted
    assert both_running[0] == 2.0 and both_running[1] > 0
    running, kv_used, tokens = seen["a", "length"]   # a's 3 tokens and b's first 3, in 3 steps
    assert (running, tokens) == (1.0, 6.0) and 0 < kv_used < both_running[1]
    assert seen["b", "abort"] == (0.0, 0.0, 6.0)


def test_each_steps_deliveries_go_out_in_one_dispatch_in_order(model):
    """Two requests running together: each decode step's deliveries reach ``dispatch`` as one
    list holding both requests, and each request's deliveries, in dispatch order, are its tokens."""
    prompts, limits = [[1, 2, 3], [4, 5]], [5, 4]
    expected = [r.token_ids for r in _engine(model).generate(prompts, limits)]
    batches, got, done = [], {0: [], 1: []}, threading.Semaphore(0)

    def receiver(i):
        def deliver(d):
            got[i].append(d)
            if d.finish_reason is not None:
                done.release()
        return deliver

    loop = EngineLoop(_engine(model), max_waiting=4)
    for i in (0, 1):
        loop.submit(prompts[i], limits[i], receiver(i))

    def dispatch(batch):
        batches.append([deliver for deliver, _ in batch])
        for deliver, delivery in batch:
            deliver(delivery)

    loop.start(dispatch)
    try:
        for _ in (0, 1):
            assert done.acquire(timeout=WAIT_S), "a request did not end"
    finally:
        loop.stop(WAIT_S)
    assert max(len(b) for b in batches) == 2, batches  # one dispatch per step, not one per request
    for i in (0, 1):
        assert [t for d in got[i] for t in d.tokens] == expected[i]
        assert [d.finish_reason for d in got[i]][-1] == "length" and all(d.finish_reason is None for d in got[i][:-1])


def test_the_server_fans_deliveries_out_on_its_event_loop(model, text, monkeypatch):
    """Every delivery is made on the app's event loop (asyncio queues are not thread-safe), not
    on the engine thread nor the dispatch thread."""
    import asyncio

    import dsaspec.serving.api as api

    loops, fan_out = [], api.deliver_all
    monkeypatch.setattr(api, "deliver_all", lambda batch: (loops.append(asyncio._get_running_loop()),
                                                           fan_out(batch)))
    with serving(model, text) as (port, server):
        events = stream(port, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True})
    assert events[-1] == "[DONE]" and loops and all(loop is not None for loop in loops)


def test_event_loop_dispatch_keeps_order_and_sends_what_is_queued_at_close():
    import asyncio

    from dsaspec.serving.api import EventLoopDispatch

    aio, got = asyncio.new_event_loop(), []
    try:
        dispatch = EventLoopDispatch(aio)
        with dispatch._cond:                         # both batches queued before its thread takes them
            dispatch([(got.append, 1), (got.append, 2)])
            dispatch([(got.append, 3)])
        dispatch.close()
        aio.run_until_complete(asyncio.sleep(0))
    finally:
        aio.close()
    assert got == [1, 2, 3]


def test_a_client_that_disconnects_mid_stream_frees_its_pages(model, text):
    abort = 'dsaspec_requests_total{finish_reason="abort"} 1.0'
    with serving(model, text) as (port, server):
        engine = server.loop.engine
        sock = open_stream(port, {"prompt": [1, 2, 3], "max_tokens": 250, "ignore_eos": True})
        assert not _all_free(engine)
        sock.close()                                 # no response to order against: wait for the metrics
        _until(lambda: _all_free(engine) and abort in get(port, "/metrics")[1].decode(),
               "the disconnected request's pages to be freed and its abort counted")
        assert _ids(port, {"prompt": [4, 5], "max_tokens": 2})["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("body, param, message", [
    ({"prompt": "hi", "temperature": 0.7}, "temperature", "only greedy decoding"),
    ({"prompt": "hi", "n": 2}, "n", "one greedy choice"),
    ({"prompt": "hi", "best_of": 3}, "best_of", "one greedy choice"),
    ({"prompt": "hi", "logprobs": 1}, "logprobs", "log-probabilities"),
    ({"prompt": "hi", "stop": ["\n"]}, "stop", "stop_token_ids"),
    ({"prompt": "hi", "frobnicate": 1}, "frobnicate", "unsupported field(s) frobnicate"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "integer >= 1"),
    ({"prompt": "hi", "stop_token_ids": [1.5]}, "stop_token_ids", "list of token ids"),
    ({"prompt": ["a", "b"]}, "prompt", "one prompt per request"),
    ({"prompt": [1, 2000]}, "prompt", "outside the vocabulary [0, 1031)"),
    ({"prompt": [1] * 250, "max_tokens": 10}, "prompt", "more than context_len=256"),
    ({"max_tokens": 3}, "prompt", "prompt is required"),
    (None, None, "not JSON"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_requests_are_400s_naming_the_field(model, text, body, param, message, _bad_server):
    port = _bad_server
    status, reply = post(port, "/v1/completions", body, raw=None if body is not None else "{nope")
    assert status == 400, reply
    assert reply["error"]["param"] == param and message in reply["error"]["message"], reply


@pytest.fixture(scope="module")
def _bad_server(model, text):
    with serving(model, text) as (port, server):
        yield port
        # the refused requests left nothing behind and a good one still runs
        assert _ids(port, {"prompt": "hi", "max_tokens": 2})["usage"]["completion_tokens"] <= 2
        assert _all_free(server.loop.engine)


def test_token_id_server_refuses_text(model):
    with serving(model, None) as (port, _):
        status, reply = post(port, "/v1/completions", {"prompt": "hello"})
        whole = _ids(port, {"prompt": [7, 8, 9], "max_tokens": 3})
    assert status == 400 and "no tokenizer" in reply["error"]["message"]
    assert whole["choices"][0]["text"] == "" and len(whole["choices"][0]["token_ids"]) == 3


def test_the_waiting_bound_is_a_503_with_the_reason(model, text):
    with serving(model, text, max_batch=1, bucket_sizes=(1,), max_waiting=1) as (port, server):
        running = open_stream(port, {"prompt": [1, 2, 3], "max_tokens": 250, "ignore_eos": True})
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(post, port, "/v1/completions", {"prompt": [4, 5], "max_tokens": 2})
            _until(lambda: server.loop.num_waiting == 1, "the second request to wait")
            status, reply = post(port, "/v1/completions", {"prompt": [6], "max_tokens": 2})
            assert status == 503 and "--max-waiting 1" in reply["error"]["message"], reply
            assert len(server.loop.core.running) == 1          # the first was still running
            running.close()
            assert waiting.result(WAIT_S)[0] == 200
        _until(lambda: _all_free(server.loop.engine), "pages to be freed")


def test_shutdown_with_requests_in_flight_frees_everything(model, text, caplog):
    caplog.set_level(logging.ERROR)
    with serving(model, text, graceful_s=0.2) as (port, server):
        socks = [open_stream(port, {"prompt": [1, 2, i], "max_tokens": 250, "ignore_eos": True}) for i in (3, 4)]
        engine, loop = server.loop.engine, server.loop
        assert len(loop.core.running) == 2
    # the server has stopped: the streams were cut, the engine thread ended, nothing is held
    for sock in socks:
        sock.settimeout(WAIT_S)
        while sock.recv(4096):
            pass
        sock.close()
    assert not loop._thread.is_alive() and _all_free(engine) and not loop.core.has_work
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    with pytest.raises(Exception, match="shutting down"):
        loop.submit([1], 1, lambda d: None)


def test_incremental_detokenizer_holds_back_split_characters(text):
    words = "fox é ü — naïve"
    ids = text.encode(words)
    detok = text.detokenizer()
    pieces = [detok.add([t]) for t in ids] + [detok.flush()]
    assert "".join(pieces) == words and not any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("argv, named", [
    (["--port", "70000"], ["--port", "[0, 65535]"]),
    (["--max-waiting", "0"], ["--max-waiting", "positive integer"]),
    (["--shutdown-timeout", "-1"], ["--shutdown-timeout", ">= 0"]),
    (["--tokenizer", "/nonexistent/tok"], ["--tokenizer /nonexistent/tok", "no such directory"]),
    (["--num-slots", "100"], ["--num-slots 100", "multiple of 64"]),
    (["--speculative-num-steps", "2"], ["--speculative-num-steps needs --speculative-algorithm"]),
    (["--checkpoint", "/nonexistent/ckpt"], ["/nonexistent/ckpt", "does not exist"]),
    (["--max-batch", "100000"], ["--preset tiny needs at least", "--max-batch"]),   # in the engine process
    (["--max-batch", "100000", "--no-engine-process"], ["--preset tiny needs at least"]),
])
def test_serve_option_errors_are_one_line(capsys, argv, named):
    from test_cli import assert_one_line_error

    assert_one_line_error(capsys, ["serve", "--dtype", "fp32", *argv], *named)


def test_serve_chunked_prefill_size_reaches_the_engine():
    """--chunked-prefill-size is the engine's prefill chunk, and /get_server_info says it."""
    import argparse

    from dsaspec.commands import serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--dtype", "fp32", "--no-engine-process", "--chunked-prefill-size", "32"])
    server = serve.build_server(args)
    assert server.loop.engine.prefill_chunk == 32 and server.info["chunked_prefill_size"] == 32


def test_serve_refuses_fp8_fast_accumulation_with_row_invariant(capsys, monkeypatch):
    from test_cli import assert_one_line_error

    monkeypatch.setenv("DSASPEC_FP8_FAST_ACCUM", "1")
    assert_one_line_error(capsys, ["serve", "--row-invariant"], "--row-invariant", "DSASPEC_FP8_FAST_ACCUM")


def test_word_tokenizer_gives_every_token_text(tmp_path):
    from dsaspec.testing.tokenizer import build_word_tokenizer

    codec = load_text(build_word_tokenizer(tmp_path, 50))
    ids = list(range(1, 50))
    detok = codec.detokenizer()
    assert all(detok.add([i]) for i in ids)          # each streamed token carries text
    assert codec.encode(codec.decode(ids)) == ids
    assert codec.eos_token_ids == {0}


# ---- the engine in a process of its own -------------------------------------------------------

def _scheduler(port) -> dict:
    """The engine process's gauges, read through /metrics."""
    status, body = get(port, "/metrics")
    assert status == 200
    names = ("dsaspec_num_running_requests", "dsaspec_num_waiting_requests", "dsaspec_kv_pages_used")
    return {line.split()[0]: float(line.split()[1]) for line in body.decode().splitlines()
            if line.split(" ")[0] in names}


def _idle(port) -> bool:
    return set(_scheduler(port).values()) == {0.0}


def test_engine_process_concurrent_clients_equal_generate(model, text):
    """Six clients, two rows, the engine in its own process: outputs, metrics, accept length."""
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 1031, (n,), generator=generator).tolist() for n in (5, 70, 33, 9, 2, 17)]
    limits = [6, 4, 8, 3, 7, 5]
    expected = [r.token_ids for r in _engine(model).generate(prompts, limits)]
    words = "The quick brown fox"
    text_expected = _engine(model).generate(text.encode(words), 5).token_ids
    with serving(model, text, process=True) as (port, server):
        got = _concurrent_clients(port, prompts, limits)
        assert _idle(port)                            # every response has ended: nothing left to wait for
        status, metrics = get(port, "/metrics")
        _, info = get(port, "/get_server_info")
        health = get(port, "/health")[0]
        whole = _ids(port, {"prompt": words, "max_tokens": 5, "ignore_eos": True})["choices"][0]
        process = server.loop.process
    assert got == expected
    assert whole["token_ids"] == text_expected and whole["text"] == text.decode(text_expected)
    metrics = metrics.decode()
    for line in ('dsaspec_requests_total{finish_reason="length"} 6.0', "dsaspec_num_running_requests 0.0",
                 "dsaspec_kv_pages_used 0.0", f"dsaspec_generation_tokens_total {float(sum(limits))}",
                 "dsaspec_time_to_first_token_seconds_count 6.0", "dsaspec_mean_accept_length 1.0"):
        assert line in metrics, line
    info = json.loads(info)
    assert info["internal_states"][0]["avg_spec_accept_length"] == 1.0 and info["num_running"] == 0
    assert server.loop.info["chunked_prefill_size"] == 4096         # the child's engine, reported
    assert health == 200 and not process.is_alive() and process.exitcode == 0


def test_engine_process_disconnect_frees_pages(model, text):
    abort = 'dsaspec_requests_total{finish_reason="abort"} 1.0'
    with serving(model, text, process=True) as (port, _):
        sock = open_stream(port, {"prompt": [1, 2, 3], "max_tokens": 250, "ignore_eos": True})
        assert _scheduler(port)["dsaspec_num_running_requests"] == 1.0
        sock.close()
        _until(lambda: _idle(port) and abort in get(port, "/metrics")[1].decode(),
               "the disconnected request's pages to be freed and its abort counted")
        assert _ids(port, {"prompt": [4, 5], "max_tokens": 2})["choices"][0]["finish_reason"] == "length"


def test_engine_process_errors_and_the_waiting_bound(model, text):
    """400s checked in the HTTP process and in the engine's, then the 503 of a full queue."""
    with serving(model, text, process=True, max_batch=1, bucket_sizes=(1,), max_waiting=1) as (port, server):
        for body, param, message in [({"prompt": "hi", "temperature": 0.7}, "temperature", "only greedy"),
                                     ({"prompt": [1, 2000]}, "prompt", "outside the vocabulary [0, 1031)"),
                                     ({"prompt": [1] * 250, "max_tokens": 10}, "prompt", "more than context_len=256"),
                                     ({"prompt": [1], "stop_token_ids": [5000]}, "prompt", "stop_token_ids")]:
            status, reply = post(port, "/v1/completions", body)
            assert status == 400 and reply["error"]["param"] == param and message in reply["error"]["message"], reply
        running = open_stream(port, {"prompt": [1, 2, 3], "max_tokens": 250, "ignore_eos": True})
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(post, port, "/v1/completions", {"prompt": [4, 5], "max_tokens": 2})
            _until(lambda: json.loads(get(port, "/get_server_info")[1])["num_waiting"] == 1,
                   "the second request to wait")
            status, reply = post(port, "/v1/completions", {"prompt": [6], "max_tokens": 2})
            assert status == 503 and "--max-waiting 1" in reply["error"]["message"], reply
            assert _scheduler(port)["dsaspec_num_running_requests"] == 1.0
            running.close()
            assert waiting.result(WAIT_S)[0] == 200
        _until(lambda: _idle(port), "pages to be freed")


def test_engine_process_shutdown_with_requests_in_flight(model, text, caplog):
    caplog.set_level(logging.ERROR)
    with serving(model, text, process=True, graceful_s=0.2) as (port, server):
        socks = [open_stream(port, {"prompt": [1, 2, i], "max_tokens": 250, "ignore_eos": True}) for i in (3, 4)]
        assert _scheduler(port)["dsaspec_num_running_requests"] == 2.0
        engine = server.engine
    for sock in socks:                               # the streams were cut
        sock.settimeout(WAIT_S)
        while sock.recv(4096):
            pass
        sock.close()
    assert not engine.process.is_alive() and engine.process.exitcode == 0 and not engine.alive
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    with pytest.raises(Overloaded, match="shutting down"):
        asyncio.run(engine.submit([1], 1, lambda d: None))


def test_engine_process_that_dies_ends_its_requests(model, text):
    """The engine process killed mid-stream: the stream ends with an error event and an abort,
    /health is a 503 and new requests are refused."""
    with serving(model, text, process=True) as (port, server):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
        conn.request("POST", "/v1/completions", headers={"Content-Type": "application/json"},
                     body=json.dumps({"prompt": [1, 2, 3], "max_tokens": 250, "ignore_eos": True, "stream": True}))
        response = conn.getresponse()
        events = []
        for line in response:
            if line.startswith(b"data: "):
                payload = line[len(b"data: "):].strip().decode()
                events.append(payload if payload == "[DONE]" else json.loads(payload))
                if len(events) == 1:
                    server.loop.process.kill()
        conn.close()
        health = get(port, "/health")
        refused = post(port, "/v1/completions", {"prompt": [4], "max_tokens": 2})
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "abort"
    assert "the engine process exited (status -9)" in events[-3]["error"]["message"]
    assert health[0] == 503 and b"the engine process exited" in health[1]
    assert refused[0] == 503 and "the engine process exited" in refused[1]["error"]["message"]


def _broken_engine():
    raise RuntimeError("no weights here")


def test_engine_process_that_cannot_build_its_engine_says_why():
    with pytest.raises(EngineFailed, match=r"failed to build its engine \(RuntimeError: no weights here\)"):
        EngineProcess(_broken_engine, max_waiting=1)
