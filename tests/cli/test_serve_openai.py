"""The official `openai` client against `tierkv serve` (a subprocess) on SmolLM2-135M-Instruct.

A 3-turn chat whose later turns report cached prompt tokens and answer
exactly as a server with the cache disabled; streaming gives the
non-streaming text; a client that leaves mid-stream leaves no pinned block
behind; malformed requests get 4xx JSON errors; and the server's prompt ids
equal transformers' ``apply_chat_template`` on the same model directory.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import httpx
import openai
import pytest
from _models import smollm2_dir  # noqa: F401  (fixture)

MAX_BODY = 64 * 1024
MAX_MODEL_LEN = 2048
NUM_BLOCKS = 256

QUESTIONS = ["What is the capital of France?", "And of Italy?", "Which of the two cities is larger?"]


class Server:
    def __init__(self, model, cache, *extra: str) -> None:
        env = {**os.environ, "TIERKV_L3_CAPACITY": "64MiB"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tierkv.cli", "serve", "--model", str(model), "--port", "0", "--threads", "1",
             "--max-body", str(MAX_BODY), "--max-model-len", str(MAX_MODEL_LEN), "--num-blocks", str(NUM_BLOCKS),
             "--served-model-name", "m", "--cache-dir", str(cache), *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline()
        m = re.search(r"(http://[0-9.]+:\d+)", line)
        if not m:
            self.proc.kill()
            pytest.fail(f"serve did not start: {line!r} {self.proc.stderr.read()}")
        self.url = m.group(1)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        self.http = httpx.Client(base_url=self.url, timeout=300)

    def metrics(self) -> dict[str, float]:
        out = {}
        for line in self.http.get("/metrics").text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def stop(self) -> None:
        self.http.close()
        self.proc.terminate()
        assert self.proc.wait(timeout=60) == 0, self.proc.stderr.read()


@pytest.fixture(scope="module")
def server(smollm2_dir, tmp_path_factory):
    s = Server(smollm2_dir, tmp_path_factory.mktemp("serve-cache"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def uncached(smollm2_dir, tmp_path_factory):
    s = Server(smollm2_dir, tmp_path_factory.mktemp("serve-nocache"), "--no-cache")
    yield s
    s.stop()


def chat(server: Server, messages: list[dict], **kw):
    return server.client.chat.completions.create(**{"model": "m", "messages": messages, "temperature": 0,
                                                    "max_tokens": 40, **kw})


def test_three_turn_chat_hits_the_cache_and_answers_as_without_it(server, uncached):
    system = {"role": "system", "content": "You are a geography tutor."}  # no other test sends it: turn 1 is cold
    histories = {"cached": [system], "uncached": [system]}
    for turn, question in enumerate(QUESTIONS):
        answers = {}
        for name, s in (("cached", server), ("uncached", uncached)):
            history = histories[name]
            history.append({"role": "user", "content": question})
            out = chat(s, history)
            answer = out.choices[0].message.content
            history.append({"role": "assistant", "content": answer})
            answers[name] = (answer, out.choices[0].finish_reason, out.usage)
        (text, finish, usage), (ref_text, ref_finish, ref_usage) = answers["cached"], answers["uncached"]
        assert text == ref_text and finish == ref_finish, (turn, text, ref_text)
        assert usage.prompt_tokens == ref_usage.prompt_tokens and usage.completion_tokens == ref_usage.completion_tokens
        assert ref_usage.prompt_tokens_details.cached_tokens == 0
        cached = usage.prompt_tokens_details.cached_tokens
        if turn == 0:
            assert cached == 0
        else:  # the whole previous prompt at least, to the last full block
            assert cached >= prev_prompt // 16 * 16 > 0, (turn, cached, prev_prompt)
        prev_prompt = usage.prompt_tokens
    assert all(m["content"] for h in histories.values() for m in h)


def test_cache_salt_keeps_each_tenants_prefix_to_itself(server, uncached):
    # vLLM's request field: a prompt cached under one salt is not found under another, nor
    # without one, and the answer stays the cache-less one.
    messages = [{"role": "system", "content": "You answer questions about rivers, briefly."},
                {"role": "user", "content": "Which river flows through Vienna?"}]
    ref = chat(uncached, messages)
    first = chat(server, messages, extra_body={"cache_salt": "tenant-a"})
    again = chat(server, messages, extra_body={"cache_salt": "tenant-a"})
    other = chat(server, messages, extra_body={"cache_salt": "tenant-b"})
    plain = chat(server, messages)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == (again.usage.prompt_tokens - 1) // 16 * 16 > 0
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert plain.usage.prompt_tokens_details.cached_tokens == 0
    for out in (first, again, other, plain):
        assert out.choices[0].message.content == ref.choices[0].message.content
    bad = server.http.post("/v1/chat/completions", json={"model": "m", "messages": messages, "cache_salt": 7})
    assert bad.status_code == 400 and "cache_salt" in bad.text


def test_generation_stops_at_the_end_of_the_assistant_turn(server):
    out = chat(server, [{"role": "user", "content": "Say hello."}], max_tokens=200)
    assert out.choices[0].finish_reason == "stop"  # ended by <|im_end|>, SmolLM2's end-of-turn token
    assert out.usage.completion_tokens < 200 and out.choices[0].message.content.strip()
    assert "<|im_end|>" not in out.choices[0].message.content and "<|im_start|>" not in out.choices[0].message.content
    ids = server.http.post("/tokenize", json={"messages": [{"role": "user", "content": "Say hello."}]}).json()
    assert ids["count"] == out.usage.prompt_tokens


def test_stop_strings_cut_the_answer_streaming_or_not(server):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    full = chat(server, messages).choices[0].message.content
    assert "Paris" in full
    out = chat(server, messages, stop=["Paris", "never appears"])
    assert out.choices[0].message.content == full[:full.index("Paris")]
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens < len(full)
    chunks = list(chat(server, messages, stop="Paris", stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full[:full.index("Paris")]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens
    wait_idle(server)  # the requests cut short were aborted and left nothing pinned


def wait_idle(server: Server) -> dict[str, float]:
    """/metrics once no request is in the engine and no block is pinned (an abort lands at the next step)."""
    deadline = time.monotonic() + 30
    while True:
        m = server.metrics()
        if m["tierkv_engine_sequences"] == 0 and m["tierkv_engine_pinned_blocks"] == 0:
            return m
        assert time.monotonic() < deadline, f"still busy: {m['tierkv_engine_sequences']} sequences, " \
                                            f"{m['tierkv_engine_pinned_blocks']} pinned blocks"
        time.sleep(0.05)


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_streaming_gives_the_non_streaming_text(server, kind):
    if kind == "chat":
        messages = [{"role": "user", "content": "Name three colours."}]
        ref = chat(server, messages)
        stream = chat(server, messages, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        ref_text = ref.choices[0].message.content
        assert chunks[0].choices[0].delta.role == "assistant"
    else:
        kw = dict(model="m", prompt="Every painter learns this early, and every physicist agrees: the three primary colours of light are", max_tokens=30, temperature=0)
        ref = server.client.completions.create(**kw)
        chunks = list(server.client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        ref_text = ref.choices[0].text
    assert text == ref_text and text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == ref.choices[0].finish_reason and set(finishes[:-1]) <= {None}
    assert len([c for c in chunks if c.choices]) >= min(3, ref.usage.completion_tokens)  # token by token, not a blob
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.completion_tokens == ref.usage.completion_tokens
    assert usage.prompt_tokens == ref.usage.prompt_tokens and usage.prompt_tokens_details.cached_tokens > 0


def test_a_client_leaving_mid_stream_leaves_no_pinned_block(server):
    messages = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
    chat(server, messages, max_tokens=2)  # its prompt blocks are now cached: the stream below pins them
    before = server.metrics()
    body = {"model": "m", "messages": messages, "max_tokens": 1000, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with server.http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()  # held: dropping a half-read iterator closes the response
        events = 0
        for line in lines:
            events += line.startswith("data: ")
            if events == 4:
                break
        during = server.metrics()
        assert during["tierkv_engine_sequences"] == 1 and during["tierkv_engine_pinned_blocks"] > 0
    deadline = time.monotonic() + 30
    while (after := server.metrics())["tierkv_engine_aborted_requests_total"] == before[
            "tierkv_engine_aborted_requests_total"]:
        assert time.monotonic() < deadline, "the request of the client that left was never aborted"
        time.sleep(0.05)
    assert after["tierkv_engine_sequences"] == 0 and after["tierkv_engine_pinned_blocks"] == 0
    # every L1 slot is free or holds a cached block: none is still held by the request that left
    assert after["tierkv_engine_free_l1_blocks"] + after['tierkv_blocks{tier="l1"}'] == NUM_BLOCKS
    assert after["tierkv_completion_tokens_total"] == before["tierkv_completion_tokens_total"]  # it never finished


MALFORMED = [
    ("/v1/chat/completions", b'{"messages": [', 400),                                        # bad JSON
    ("/v1/chat/completions", b"[1, 2, 3]", 400),                                             # not an object
    ("/v1/chat/completions", b"\xff\xfe\x00", 400),                                          # not UTF-8 JSON
    ("/v1/chat/completions", b"", 400),                                                      # no body
    ("/v1/chat/completions", {"model": "m"}, 400),                                           # no messages
    ("/v1/chat/completions", {"messages": []}, 400),                                         # empty messages
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400),       # unknown role
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 7}]}, 400),           # content type
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400),                                                                                   # non-text part
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": "5"}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10 ** 6}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": 0}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 3}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "bogus": 1}, 400),  # unknown field
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "model": "gpt-4"}, 404),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "y " * 3000}]}, 400),  # > max_model_len
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "z" * (MAX_BODY + 10)}]}, 413),
    ("/v1/completions", {"prompt": [1, 2, 10 ** 7]}, 400),                                   # id outside the vocab
    ("/v1/completions", {"prompt": ["a", "b"]}, 400),                                        # a batch of prompts
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400),                                 # an empty stop string
    ("/v2/nothing", {"prompt": "x"}, 404),
]


def test_malformed_requests_get_4xx_json_and_the_server_keeps_serving(server):
    assert len(MALFORMED) >= 20
    for path, body, want in MALFORMED:
        if isinstance(body, bytes):
            resp = server.http.post(path, content=body, headers={"Content-Type": "application/json"})
        else:
            resp = server.http.post(path, json=body)
        assert resp.status_code == want, (path, body if isinstance(body, bytes) else list(body), resp.text)
        err = resp.json()["error"]
        assert isinstance(err["message"], str) and err["message"] and err["type"], err
    resp = server.http.get("/v1/chat/completions")
    assert resp.status_code == 405 and resp.json()["error"]["code"] == "method_not_allowed"
    with pytest.raises(openai.BadRequestError) as exc:  # the client sees the 400 and the field
        chat(server, [{"role": "user", "content": "x"}], top_p=0)
    assert exc.value.body["param"] == "top_p"
    out = chat(server, [{"role": "user", "content": "Still there?"}], max_tokens=3)
    assert out.choices[0].message.content and out.usage.completion_tokens <= 3


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Capital of Peru?"}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help you today?"},
     {"role": "user", "content": "Tell me a joke about caches.\n\nMake it short."}],
    [{"role": "user", "content": "Ünïcödé «quotes», emoji 🦀 and 日本語"}],
    [{"role": "user", "content": [{"type": "text", "text": "Two"}, {"type": "text", "text": "parts"}]}],
]


def test_prompt_ids_equal_transformers_apply_chat_template(server, smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    for messages in CONVERSATIONS:
        as_text = [{**m, "content": m["content"] if isinstance(m["content"], str) else
                    "\n".join(p["text"] for p in m["content"])} for m in messages]
        want = tok.apply_chat_template(as_text, add_generation_prompt=True, tokenize=True)
        want = list(want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want)
        got = server.http.post("/tokenize", json={"model": "m", "messages": messages}).json()
        assert got["tokens"] == want, messages
        out = chat(server, messages, max_tokens=1)  # the ids /tokenize shows are the ids the chat ran on
        assert out.usage.prompt_tokens == len(want)


def test_kv_why_says_per_block_where_a_chat_prefix_is_and_the_cli_reads_it(server):
    """After a chat, ``POST /v1/kv/why`` on the same messages plus a new turn: the blocks of the first
    turn are held in a tier, the new turn's are not computed yet; ``tierkv why --url`` prints the same."""
    first = [{"role": "user", "content": "Name three rivers of Europe and one fact about each."}]
    reply = chat(server, first).choices[0].message.content
    longer = [*first, {"role": "assistant", "content": reply},
              {"role": "user", "content": "Now list three mountains of Asia, each with its height in metres."}]
    r = server.http.post("/v1/kv/why", json={"messages": longer})
    assert r.status_code == 200, r.text
    data = r.json()
    blocks = data["blocks"]
    assert data["prompt_tokens"] // data["block_size"] == len(blocks) > 2
    statuses = [b["status"] for b in blocks]
    assert statuses[0] == "held" and statuses[-1] == "not_computed", statuses
    assert statuses == sorted(statuses, key=lambda s: s != "held")  # held prefix, then the new turn
    assert {b["tier"] for b in blocks if b["status"] == "held"} <= {"l1", "l2", "l3"}
    assert sum(data["summary"].values()) == len(blocks)
    bad = server.http.post("/v1/kv/why", json={"prompt": "x", "messages": first})
    assert bad.status_code == 400 and "exactly one" in bad.text
    ids = server.http.post("/tokenize", json={"messages": longer}).json()["tokens"]
    cli = subprocess.run([sys.executable, "-m", "tierkv.cli", "why", "--url", server.url, "--ids",
                          ",".join(map(str, ids)), "--json"], capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    assert [b["status"] for b in json.loads(cli.stdout)["blocks"]] == statuses
