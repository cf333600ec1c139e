"""LLM: the engine loop (generate, stream) over a TierKVStore whose L1 tier is the KV pool."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence as Seq
from pathlib import Path

import torch

from tierkv.config import L1Config, L2Config, L4Config, StoreConfig
from tierkv.engine.config import EngineConfig
from tierkv.engine.cpu_linear import pack_linears
from tierkv.engine.kv_cache import KVCacheManager
from tierkv.engine.loader import engine_identity, load_model
from tierkv.engine.model_runner import ModelRunner
from tierkv.engine.sampler import SamplingParams
from tierkv.engine.scheduler import Scheduler
from tierkv.engine.sequence import Output, Sequence
from tierkv.engine.tokenizer import Tokenizer
from tierkv.identity import salt_keys
from tierkv.why import BlockWhy, explain
from tierkv.layout import KVLayout
from tierkv.store import TierKVStore
from tierkv.tiers.device import resolve_device

Prompt = str | Seq[int]


class LLM:
    """A Llama model served with paged attention over the store's L1 pool.

    ``LLM(model_dir, store_config, engine_config, enable_cache)`` loads the
    checkpoint, builds ``store = TierKVStore(store_config, layout,
    l1_blocks=engine_config.num_blocks)`` and serves from ``store.l1.pool``.
    With ``enable_cache`` False the store is only the pool: no lookup, no save,
    no L2/L3/L4. Every key is rooted in ``self.identity`` (``loader.engine_identity``:
    the weights' full content, the effective config, the dtypes), so a fine-tune
    at the same path or a changed override never finds the old KV.

    Not thread-safe: one thread drives ``generate``/``stream``; the store's
    transfer threads run loads underneath.
    """

    def __init__(self, model_dir: str | Path, store_config: StoreConfig | None = None,
                 engine_config: EngineConfig | None = None, enable_cache: bool = True) -> None:
        self.config = ec = engine_config or EngineConfig()
        if ec.num_threads:
            torch.set_num_threads(ec.num_threads)
        if ec.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"engine.device: {ec.device!r} asked for but CUDA is not available; use 'auto' or 'cpu'")
        device = resolve_device(ec.device)
        self.model = load_model(model_dir, getattr(torch, ec.dtype), device, ec.hf_overrides)
        pack_linears(self.model)  # CPU fp32/bf16 only: oneDNN-prepacked projections and lm_head
        mc = self.model.config
        self.model_config = mc
        self.max_model_len = min(ec.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.layout = KVLayout(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, ec.block_size, ec.dtype)
        self.enable_cache = enable_cache
        self.identity = engine_identity(model_dir, ec.dtype, self.layout.dtype, ec.hf_overrides)
        self.store = TierKVStore(self._store_config(model_dir, store_config, device), self.layout,
                                 l1_blocks=ec.num_blocks, identity=self.identity)
        if enable_cache:
            self.store.keep_eviction_log()
            self.store.keep_seed_log()
        self.tokenizer = Tokenizer(model_dir, mc.vocab_size)
        self.scheduler = Scheduler(ec, KVCacheManager(self.store, enable_cache), mc.eos_token_id)
        self.runner = ModelRunner(self.model, self.store.l1.pool, ec.block_size)

    def _store_config(self, model_dir, cfg: StoreConfig | None, device: torch.device) -> StoreConfig:
        cfg = cfg or StoreConfig()
        if cfg.model_id == StoreConfig.model_id:  # a label for `tierkv info`; the identity is the key
            cfg = dataclasses.replace(cfg, model_id=Path(model_dir).resolve().name)
        cfg = dataclasses.replace(cfg, l1=L1Config(self.config.num_blocks, str(device)))
        if not self.enable_cache:
            cfg = dataclasses.replace(cfg, l2=L2Config(capacity=0), l3_enabled=False, l4=L4Config())
        return cfg

    # -- requests -------------------------------------------------------------

    def _sequence(self, prompt: Prompt, params: SamplingParams, namespace: str | None,
                  cache_salt: str | None = None) -> Sequence:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt: expected at least one token, got an empty prompt")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens leave no room under max_model_len={self.max_model_len}")
        bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]} outside the vocabulary [0, {self.model_config.vocab_size})")
        if -(-(len(ids) + 1) // self.config.block_size) > self.config.num_blocks:
            raise ValueError(f"prompt: {len(ids)} tokens need more than engine.num_blocks={self.config.num_blocks} blocks")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt: expected a non-empty string, got {cache_salt!r}")
        return Sequence(ids, params, namespace, self.max_model_len, salt_keys(cache_salt))

    def _output(self, seq: Sequence) -> Output:
        return seq.output(self.tokenizer.decode(seq.output_ids))

    def step(self) -> list[Sequence]:
        """Run one scheduled batch; returns the sequences that got a new token.

        With nothing runnable but loads in flight it blocks until a load lands. The step is the
        store's foreground work: background IO is paced meanwhile (``io.background_share``).
        """
        with self.store.foreground():
            return self._step()

    def _step(self) -> list[Sequence]:
        sched = self.scheduler
        batch = sched.schedule()
        if not batch:
            if sched.loading:
                sched.loading[0].load.ready.wait(self.config.load_wait_s)
                return []
            if sched.waiting and not sched.running:
                if self.store.mover.queued:  # blocks pinned by copies in flight (write-through): wait
                    self.store.flush()
                    return []
                seq = sched.waiting[0]
                raise RuntimeError(f"request {seq.request_id}: {seq.num_tokens} tokens do not fit in L1 "
                                   f"(engine.num_blocks={self.config.num_blocks}, all other blocks pinned)")
            return []
        tokens = self.runner.run(batch)
        return sched.finish_step(batch, tokens)

    def generate(self, prompts: Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None,
                 namespace: str | None = None, cache_salt: str | None = None) -> list[Output]:
        """Run every prompt to completion with continuous batching; Outputs in prompt order.

        ``namespace`` and ``cache_salt`` (as vLLM's: only requests with the same salt share cached
        blocks) enter every block key of these prompts."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            raise TypeError("prompts: expected a list of prompts (str or list[int]), got a single prompt")
        params = params or SamplingParams()
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise ValueError(f"params: expected 1 or {len(prompts)} SamplingParams, got {len(plist)}")
        seqs = [self._sequence(p, sp, namespace, cache_salt) for p, sp in zip(prompts, plist)]
        for seq in seqs:
            self.scheduler.add(seq)
        try:
            while not all(s.is_finished for s in seqs):
                self.step()
        except BaseException:
            self.scheduler.abort_all()
            raise
        return [self._output(s) for s in seqs]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None,
               namespace: str | None = None, cache_salt: str | None = None) -> Iterator[Output]:
        """Yield one Output per new token (``token_ids`` = all tokens so far); the last one has a finish_reason."""
        seq = self._sequence(prompt, params or SamplingParams(), namespace, cache_salt)
        self.scheduler.add(seq)
        try:
            sent = 0
            while not seq.is_finished:
                self.step()
                if len(seq.output_ids) > sent or seq.is_finished:
                    sent = len(seq.output_ids)
                    yield self._output(seq)
        except GeneratorExit:  # the consumer stopped early: drop this request only
            self.scheduler.abort(seq)
            raise
        except BaseException:
            self.scheduler.abort_all()
            raise

    def why(self, prompt: Prompt, namespace: str | None = None, cache_salt: str | None = None) -> list[BlockWhy]:
        """Per full block of ``prompt``: the tier that holds it, or why none does (``why.explain``:
        evicted when and from where, damaged, held under another model identity and which field
        differs, held under another request's LoRA or no cache_salt, or not computed yet; blocks
        under another cache_salt are not looked for, as a server answers any client). Read-only;
        safe beside a running ``step``."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        return explain(self.store, ids, namespace, salt_keys(cache_salt))

    # -- lifetime -------------------------------------------------------------

    def stats(self) -> dict:
        """The store's counters plus the engine's preemption count."""
        out = self.store.stats()
        out["preemptions"] = self.scheduler.num_preemptions
        return out

    def close(self) -> None:
        """Release every request and close the store (flushes pending transfers)."""
        self.scheduler.abort_all()
        self.store.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
