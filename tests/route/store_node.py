"""A model-free stand-in for `tierkv serve` to test the router alone: a real store, real events, real HTTP.

``python store_node.py PORT L3_DIR`` (PORT 0: a free one) binds PORT, prints ``store node on
http://127.0.0.1:BOUND`` as its first stdout line, and serves /health, /v1/models, the node API of
``tierkv.route.node_api`` (``/v1/kv/match``, ``/v1/kv/status``) and a /v1/chat/completions whose "model"
tokenizes each message word as one token, looks the prompt up in the store (``cached_tokens``), saves its
blocks and answers with the serving node's port. Only the router is under test here; tests/route/test_route_serve.py runs real nodes.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from types import SimpleNamespace

import uvicorn
import xxhash
from fastapi import FastAPI, Request

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _kv import LAYOUT, save_prompt, store_config  # noqa: E402

from tierkv.config import PolicyConfig  # noqa: E402
from tierkv.route.node_api import serve_kv  # noqa: E402
from tierkv.store import TierKVStore  # noqa: E402


class WordTokens:
    """One token per whitespace-separated word (its xxhash mod 50,000)."""

    def completion_ids(self, prompt, add_special_tokens: bool = True) -> list[int]:
        return prompt if isinstance(prompt, list) else [xxhash.xxh32_intdigest(w.encode()) % 50_000 for w in prompt.split()]

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.completion_ids(" ".join(f"<{m['role']}> {m['content']}" for m in messages) + " <assistant>")


def main(port: int, l3_dir: str) -> None:
    sock = socket.create_server(("127.0.0.1", port))  # bound before anything else: a port in use fails fast
    port = sock.getsockname()[1]
    # write-through: every saved block reaches L3, so a restarted node still holds (and announces) it.
    cfg = store_config(LAYOUT, 64, 256, l3_dir, policy=PolicyConfig(name="lru", write="write_through"))
    store = TierKVStore(cfg, LAYOUT, l1_blocks=64)
    routes, publisher = serve_kv(store, "tcp://127.0.0.1:0")
    inflight = [0]
    app = FastAPI()
    app.state.server = SimpleNamespace(client=WordTokens(), llm=SimpleNamespace(store=store),
                                       loop=SimpleNamespace(gauges=lambda: {"sequences": inflight[0]}))
    app.include_router(routes)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "words", "object": "model", "owned_by": "tierkv"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict:
        body = await request.json()
        ids = app.state.server.client.chat_ids(body["messages"])
        m = store.lookup(ids)
        cached = m.num_tokens
        store.release(m)
        save_prompt(store, ids)
        return {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "words",
                "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                             "message": {"role": "assistant", "content": f"served by {port}"}}],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": 3, "total_tokens": len(ids) + 3,
                          "prompt_tokens_details": {"cached_tokens": cached}}}

    print(f"store node on http://127.0.0.1:{port}", flush=True)
    try:
        uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
    finally:
        sock.close()
        publisher.close()
        store.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
