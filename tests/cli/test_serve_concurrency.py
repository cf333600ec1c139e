"""The server batches concurrent HTTP requests on one engine-loop thread (a real server, in process, over HTTP).

Requests are made to arrive together deterministically: the test holds
``engine_lock`` (the loop blocks before admitting the first one) until every
request sits in the loop's inbox, so the loop admits them all before its
next step.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from cli_helpers import tiny_model  # noqa: F401  (fixture)

from tierkv.config import L2Config, StoreConfig
from tierkv.engine.config import EngineConfig
from tierkv.engine.llm import LLM
from tierkv.engine.sampler import SamplingParams
from tierkv.engine.server import EngineServer, ServerConfig
from tierkv.engine.serving import EngineStopped
from tierkv.index import Tier

NUM_BLOCKS = 96
PROMPTS = ["leave early", "a long goodbye", "stream please", "request 0 " * 5]


@pytest.fixture(scope="module")
def llm(tiny_model):
    llm = LLM(tiny_model, StoreConfig(l2=L2Config(capacity=0), l3_enabled=False),
              EngineConfig(num_blocks=NUM_BLOCKS, max_model_len=1024))
    yield llm
    llm.close()


@pytest.fixture
def server(llm):
    server = EngineServer(llm, ServerConfig(port=0, model_name="tiny")).start()
    yield server
    server.shutdown()


def post(server, body: dict, path: str = "/v1/completions"):
    conn = http.client.HTTPConnection(*server.address, timeout=60)
    conn.request("POST", path, body=json.dumps({"model": "tiny", **body}))
    resp = conn.getresponse()
    out = json.loads(resp.read())
    conn.close()
    return resp.status, out


def read_events(resp) -> list[dict]:
    events = []
    while True:
        line = resp.readline()
        assert line, "stream ended without [DONE]"
        if not line.strip():
            continue
        data = line.removeprefix(b"data: ").strip()
        if data == b"[DONE]":
            return events
        events.append(json.loads(data))


def stream(server, body: dict) -> list[dict]:
    conn = http.client.HTTPConnection(*server.address, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps({"model": "tiny", "stream": True,
                                                             "stream_options": {"include_usage": True}, **body}))
    resp = conn.getresponse()
    assert resp.status == 200
    events = read_events(resp)
    conn.close()
    return events


def together(server, n: int, calls):
    """Run ``calls`` on threads while the engine is held, releasing it once ``n`` requests wait in the inbox."""
    pool = ThreadPoolExecutor(len(calls))
    with server.engine_lock:
        futures = [pool.submit(c) for c in calls]
        deadline = time.monotonic() + 20
        while server.loop._inbox.qsize() < n - 1:  # the first one is in the loop's hands, blocked on the lock
            assert time.monotonic() < deadline, "the requests never reached the engine loop"
            time.sleep(0.005)
    results = [f.result(timeout=60) for f in futures]
    pool.shutdown()
    return results


def assert_engine_idle(server) -> None:
    """No sequence left in the scheduler, no private L1 slot, no pinned block."""
    llm = server.llm
    deadline = time.monotonic() + 10
    while llm.scheduler.has_work():
        assert time.monotonic() < deadline, "sequences left in the scheduler"
        time.sleep(0.01)
    with server.engine_lock:
        store = llm.store
        assert store.l1.num_free + store.index.counts[Tier.L1] == NUM_BLOCKS
        assert [e for e in store.index.entries() if e.ref_count] == []


def test_concurrent_requests_are_batched_and_match_one_at_a_time(server):
    bodies = [{"prompt": p, "max_tokens": 24 + 4 * i, "temperature": 0} for i, p in enumerate(PROMPTS)]
    alone = [post(server, b) for b in bodies]
    assert server.stats()["batch"]["max_batch"] == 1
    batched = together(server, len(bodies), [lambda b=b: post(server, b) for b in bodies])
    for (s1, a), (s2, b) in zip(alone, batched):
        assert s1 == s2 == 200
        assert b["choices"][0]["text"] == a["choices"][0]["text"]
        assert b["usage"]["prompt_tokens"] == a["usage"]["prompt_tokens"]
        assert b["usage"]["completion_tokens"] == a["usage"]["completion_tokens"]
        assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == (a["usage"]["prompt_tokens"] - 1) // 16 * 16
    stats = server.stats()["batch"]
    assert stats["max_batch"] == len(bodies) and stats["avg_batch"] > 1
    conn = http.client.HTTPConnection(*server.address, timeout=60)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    assert f"tierkv_engine_batch_size_max {len(bodies)}.0" in text.splitlines()
    assert_engine_idle(server)


def test_concurrent_streams_each_get_their_own_tokens_in_order(server):
    bodies = [{"prompt": p, "max_tokens": 10 + 3 * i, "temperature": 0} for i, p in enumerate(PROMPTS[:3])]
    alone = [post(server, b)[1] for b in bodies]
    results = together(server, len(bodies), [lambda b=b: stream(server, b) for b in bodies])
    for body, ref, events in zip(bodies, alone, results):
        usage = events.pop()["usage"]
        assert 1 < len(events) <= body["max_tokens"]
        assert [e["choices"][0]["finish_reason"] for e in events] == [None] * (len(events) - 1) + ["length"]
        assert "".join(e["choices"][0]["text"] for e in events) == ref["choices"][0]["text"]
        assert usage["completion_tokens"] == ref["usage"]["completion_tokens"] == body["max_tokens"]
    assert server.stats()["batch"]["max_batch"] >= len(bodies)
    assert_engine_idle(server)


def test_a_client_leaving_mid_stream_aborts_only_its_own_sequence(server):
    other = {"prompt": PROMPTS[1], "max_tokens": 60, "temperature": 0}
    alone = post(server, other)
    leaver_body = json.dumps({"prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0}).replace(
        "{", '{"stream": true, ', 1).encode()

    def leave():
        with socket.create_connection(server.address, timeout=60) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                      % (len(leaver_body), leaver_body))
            seen = b""
            while seen.count(b"data: ") < 2:
                chunk = s.recv(4096)
                assert chunk, "the stream closed before its second event"
                seen += chunk
        return seen

    seen, batched = together(server, 2, [leave, lambda: post(server, other)])
    assert seen.startswith(b"HTTP/1.1 200")
    assert alone[0] == batched[0] == 200
    assert batched[1]["choices"] == alone[1]["choices"]
    assert batched[1]["usage"]["completion_tokens"] == alone[1]["usage"]["completion_tokens"]
    deadline = time.monotonic() + 20
    while server.loop.batch_stats()["aborted"] < 1:  # noticed at its next write after the close
        assert time.monotonic() < deadline, "the leaver was never aborted"
        time.sleep(0.01)
    assert server.stats()["completion_tokens"] == 2 * 60  # the leaver never finished
    assert_engine_idle(server)


def test_an_engine_error_fails_the_requests_in_flight_and_the_server_keeps_serving(server, monkeypatch):
    real_step, calls = server.llm.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected step failure")
        return real_step()

    monkeypatch.setattr(server.llm, "step", failing_step)
    bodies = [{"prompt": p, "max_tokens": 20} for p in PROMPTS[:2]]
    results = together(server, 2, [lambda b=b: post(server, b) for b in bodies])
    assert [status for status, _ in results] == [500, 500]
    assert "injected step failure" in results[0][1]["error"]["message"]
    assert_engine_idle(server)
    status, out = post(server, {"prompt": "after the failure", "max_tokens": 5})
    assert status == 200 and out["usage"]["completion_tokens"] == 5


def test_shutdown_lets_the_stream_in_flight_finish_and_stops_the_loop_thread(llm):
    server = EngineServer(llm, ServerConfig(port=0, model_name="tiny")).start()
    conn = http.client.HTTPConnection(*server.address, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": PROMPTS[2], "max_tokens": 200, "stream": True,
                                                             "stream_options": {"include_usage": True}}))
    resp = conn.getresponse()
    assert resp.readline().startswith(b"data: ")  # the request is in flight
    stopper = threading.Thread(target=server.shutdown)
    stopper.start()
    events = read_events(resp)
    conn.close()
    stopper.join(30)
    assert not stopper.is_alive() and not server.loop.running
    assert events[-2]["choices"][0]["finish_reason"] == "length" and events[-1]["usage"]["completion_tokens"] == 200
    with pytest.raises(EngineStopped):
        server.loop.submit([1, 2, 3], SamplingParams(max_tokens=2), None, stream=False)
    assert not llm.scheduler.has_work()


def test_a_client_leaving_before_its_non_streaming_answer_aborts_it(server):
    body = json.dumps({"model": "tiny", "prompt": PROMPTS[3], "max_tokens": 900, "temperature": 0,
                       "ignore_eos": True}).encode()
    with socket.create_connection(server.address, timeout=60) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 20
        while server.loop.gauges()["sequences"] < 1:  # wait until it is generating, then hang up
            assert time.monotonic() < deadline, "the request never reached the engine"
            time.sleep(0.01)
    deadline = time.monotonic() + 20
    while server.loop.batch_stats()["aborted"] < 1:
        assert time.monotonic() < deadline, "the request of the client that left was never aborted"
        time.sleep(0.01)
    assert server.stats()["completion_tokens"] == 0  # it never finished
    assert_engine_idle(server)
