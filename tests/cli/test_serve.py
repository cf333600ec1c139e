"""`tierkv serve` over real HTTP: completions, chat, SSE streaming, /metrics, and 4xx JSON for malformed requests."""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import subprocess
import sys
import urllib.request

import pytest
from cli_helpers import tiny_model  # noqa: F401  (fixture)
from serve_helpers import CHATML

MAX_BODY = 64 * 1024


def start_server(model, cache):
    env = {**os.environ, "TIERKV_L3_CAPACITY": "4MiB"}
    template = cache.parent / "chatml.jinja"
    template.write_text(CHATML)
    proc = subprocess.Popen([sys.executable, "-m", "tierkv.cli", "serve", "--model", str(model), "--port", "0",
                             "--max-body", str(MAX_BODY), "--max-model-len", "1024", "--num-blocks", "48", "--threads", "1",
                             "--chat-template", str(template), "--cache-dir", str(cache)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    m = re.search(r"http://([0-9.]+):(\d+)", line)
    if not m:
        proc.kill()
        pytest.fail(f"serve did not start: {line!r} {proc.stderr.read()}")
    return proc, (m.group(1), int(m.group(2)))


@pytest.fixture(scope="module")
def serve_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("serve-cache")


@pytest.fixture(scope="module")
def server(tiny_model, serve_cache):
    proc, address = start_server(tiny_model, serve_cache)
    yield address
    proc.terminate()
    assert proc.wait(timeout=30) == 0


def request(server, method: str, path: str, body=None, raw: bytes | None = None, headers=None):
    conn = http.client.HTTPConnection(*server, timeout=60)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    payload = resp.read()
    conn.close()
    ctype = resp.getheader("Content-Type", "")
    return resp.status, json.loads(payload) if ctype.startswith("application/json") else payload.decode()


def metric(text: str, name: str, **labels) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(name + ("{" + want + "}" if want else " ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_health_models_completion_and_chat(server):
    assert request(server, "GET", "/health") == (200, {"status": "ok"})
    status, models = request(server, "GET", "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == ["tiny"]
    status, out = request(server, "POST", "/v1/completions",
                          {"model": "tiny", "prompt": "Hello, tiered caches!", "max_tokens": 5, "temperature": 0})
    assert status == 200, out
    assert out["object"] == "text_completion" and out["choices"][0]["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": 21, "completion_tokens": 5, "total_tokens": 26,
                            "prompt_tokens_details": {"cached_tokens": 0}}
    status, out = request(server, "POST", "/v1/chat/completions",
                          {"model": "tiny", "messages": [{"role": "system", "content": "Be brief."},
                                                         {"role": "user", "content": "Hi"}], "max_tokens": 3})
    assert status == 200, out  # rendered with --chat-template (the tiny model has none of its own)
    assert out["object"] == "chat.completion" and out["choices"][0]["message"]["role"] == "assistant"
    assert 1 <= out["usage"]["completion_tokens"] <= 3


@pytest.mark.parametrize("chat", [False, True])
def test_streaming_events_arrive_one_by_one(server, chat):
    body = {"model": "tiny", "max_tokens": 6, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    body.update({"messages": [{"role": "user", "content": "stream please"}]} if chat else {"prompt": "stream please"})
    conn = http.client.HTTPConnection(*server, timeout=60)
    conn.request("POST", "/v1/chat/completions" if chat else "/v1/completions", body=json.dumps(body))
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/event-stream")
    events = []
    while True:
        line = resp.readline()  # one SSE line at a time, as the server flushes it
        assert line, "stream ended without [DONE]"
        if not line.strip():
            continue
        assert line.startswith(b"data: ")
        data = line[6:].strip()
        if data == b"[DONE]":
            break
        events.append(json.loads(data))
    conn.close()
    usage = events.pop()
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    tokens = [e for e in events if not (chat and "role" in e["choices"][0]["delta"])]
    assert 1 < len(tokens) <= 6  # one event per step that completed a character (bytes may split one)
    assert [e["choices"][0]["finish_reason"] for e in tokens] == [None] * (len(tokens) - 1) + ["length"]
    assert all(e["object"] == ("chat.completion.chunk" if chat else "text_completion") for e in events)


def test_metrics_counters_move(server):
    before = request(server, "GET", "/metrics")[1]
    prompt = list(range(1, 70))  # 4 full blocks before the last token
    for _ in range(2):
        status, _ = request(server, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 2})
        assert status == 200
    after = request(server, "GET", "/metrics")[1]
    assert metric(after, "tierkv_hits_total", tier="l1") - metric(before, "tierkv_hits_total", tier="l1") >= 4
    assert metric(after, "tierkv_lookups_total") - metric(before, "tierkv_lookups_total") >= 2
    moved = (metric(after, "tierkv_http_requests_total", endpoint="completions", status="200")
             - metric(before, "tierkv_http_requests_total", endpoint="completions", status="200"))
    assert moved == 2
    assert metric(after, "tierkv_prompt_tokens_total") - metric(before, "tierkv_prompt_tokens_total") == 2 * 69


MALFORMED = [
    ("POST", "/v1/completions", b'{"prompt": "x", ', None, 400),                       # bad JSON
    ("POST", "/v1/completions", b'[1, 2, 3]', None, 400),                              # not an object
    ("POST", "/v1/completions", b'\xff\xfe', None, 400),                               # not UTF-8
    ("POST", "/v1/completions", {"prompt": 5}, None, 400),                             # wrong type
    ("POST", "/v1/completions", {"prompt": ""}, None, 400),                            # empty prompt
    ("POST", "/v1/completions", {"prompt": ["a", "b"]}, None, 400),                    # batch of prompts
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": -1}, None, 400),         # negative max_tokens
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": "5"}, None, 400),        # string max_tokens
    ("POST", "/v1/completions", {"prompt": "x", "temperature": "hot"}, None, 400),
    ("POST", "/v1/completions", {"prompt": "x", "top_p": 0}, None, 400),
    ("POST", "/v1/completions", {"prompt": "x", "n": 3}, None, 400),
    ("POST", "/v1/completions", {"prompt": "x", "stream": "yes"}, None, 400),
    ("POST", "/v1/completions", {"prompt": "x", "model": "gpt-4"}, None, 404),         # unknown model
    ("POST", "/v1/completions", {"prompt": "y" * 5000}, None, 400),                    # huge prompt (> max_model_len)
    ("POST", "/v1/completions", {"prompt": [1, 2, 99999]}, None, 400),                 # token id outside the vocabulary
    ("POST", "/v1/completions", {"prompt": "y" * 500, "max_tokens": 400}, None, 400),  # more KV than the pool holds
    ("POST", "/v1/completions", {"prompt": "z" * (MAX_BODY + 10)}, None, 413),         # body over --max-body
    ("POST", "/v1/chat/completions", {"prompt": "no messages"}, None, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, None, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": 7}]}, None, 400),
    ("POST", "/v1/completions", {"prompt": "x", "namespace": 5}, None, 400),
    ("GET", "/v1/completions", None, None, 405),
    ("POST", "/v2/nothing", {"prompt": "x"}, None, 404),
    ("POST", "/tokenize", {"prompt": "x", "messages": []}, None, 400),                 # both
]


def test_malformed_requests_get_4xx_json_and_the_server_keeps_serving(server):
    for method, path, body, headers, want in MALFORMED:
        raw = body if isinstance(body, bytes) else None
        status, out = request(server, method, path, None if raw is not None else body, raw=raw, headers=headers)
        assert status == want, (path, body if not isinstance(body, dict) else list(body), status, out)
        assert isinstance(out, dict) and isinstance(out["error"]["message"], str), out
    # what the HTTP parser refuses (not HTTP at all, a bad Content-Length) is a 400 from uvicorn itself
    for raw in (b"GARBAGE\r\n\r\n", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}"):
        with socket.create_connection(server, timeout=10) as s:
            s.sendall(raw)
            reply = b""
            while chunk := s.recv(4096):  # the server closes the connection after an error
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 400"), reply
    status, out = request(server, "POST", "/v1/completions", {"prompt": "still here?", "max_tokens": 2})
    assert status == 200 and out["usage"]["completion_tokens"] == 2


def test_info_reads_a_running_server(server):
    url = f"http://{server[0]}:{server[1]}"
    urllib.request.urlopen(url + "/health", timeout=10).read()
    proc = subprocess.run([sys.executable, "-m", "tierkv.cli", "info", "--url", url, "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["tiers"]["l1"]["capacity_blocks"] == 48 and info["totals"]["tierkv_lookups_total"] >= 1


def test_a_second_server_process_hits_what_the_first_persisted(server, tiny_model, serve_cache):
    prompt = list(range(100, 150))  # 3 full blocks before the last token
    status, out = request(server, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 2, "namespace": "r"})
    assert status == 200 and out["tierkv"]["hit_tokens"]["l3"] == 0
    proc, second = start_server(tiny_model, serve_cache)
    try:
        status, out = request(second, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 2, "namespace": "r"})
        assert status == 200 and out["tierkv"]["hit_tokens"]["l3"] == 48
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_concurrent_requests_and_a_client_leaving_mid_stream(server):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: request(server, "POST", "/v1/completions",
                                                  {"prompt": f"request {i} " * 5, "max_tokens": 3}), range(4)))
    assert [status for status, _ in results] == [200] * 4
    assert all(out["usage"]["completion_tokens"] == 3 for _, out in results)
    body = json.dumps({"prompt": "leave early", "max_tokens": 200, "stream": True}).encode()
    with socket.create_connection(server, timeout=60) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        seen = b""
        while b"data: " not in seen:
            chunk = s.recv(4096)
            assert chunk, "the stream closed before its first event"
            seen += chunk
    assert seen.startswith(b"HTTP/1.1 200")  # gone after the first event: the server must abort and free the engine
    status, out = request(server, "POST", "/v1/completions", {"prompt": "after the leaver", "max_tokens": 2})
    assert status == 200 and out["usage"]["completion_tokens"] == 2
