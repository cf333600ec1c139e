"""Runs one scheduled batch through the model: builds the flat inputs, samples the next tokens."""

from __future__ import annotations

import numpy as np
import torch

from tierkv.engine.attention import AttentionMetadata
from tierkv.engine.models.llama import LlamaForCausalLM
from tierkv.engine.sampler import Sampler
from tierkv.engine.scheduler import Scheduled


class ModelRunner:
    """Owns the model and the sampler; reads and writes the KV ``pool`` it is given.

    Not thread-safe: the engine thread calls ``run`` once per step.
    """

    def __init__(self, model: LlamaForCausalLM, pool: torch.Tensor, block_size: int) -> None:
        self.model = model
        self.pool = pool
        self.block_size = block_size
        self.device = pool.device
        self.sampler = Sampler()

    def prepare(self, batch: list[Scheduled]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flat input ids and positions, attention metadata, and the rows whose logits are sampled."""
        bs = self.block_size
        ids: list[int] = []
        pos_parts, slot_parts, ctx, qsl, sample_rows = [], [], [], [0], []
        width = max(len(item.seq.block_table) for item in batch)
        tables = np.zeros((len(batch), width), dtype=np.int32)
        for s, item in enumerate(batch):
            seq, start, n = item.seq, item.seq.num_computed, item.num_tokens
            end = start + n
            ids += seq.token_ids[start:end]
            pos = np.arange(start, end, dtype=np.int64)
            table = np.asarray(seq.block_table, dtype=np.int64)
            tables[s, : len(table)] = table
            pos_parts.append(pos)
            slot_parts.append(table[pos // bs] * bs + pos % bs)
            ctx.append(end)
            qsl.append(qsl[-1] + n)
            if end == seq.num_tokens:
                sample_rows.append(qsl[-1] - 1)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slot_parts)).to(dev),
            block_tables=torch.from_numpy(tables).to(dev),
            context_lens=torch.tensor(ctx, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        positions = torch.from_numpy(np.concatenate(pos_parts)).to(dev)
        return input_ids, positions, meta, sample_rows

    @torch.inference_mode()
    def run(self, batch: list[Scheduled]) -> list[int | None]:
        """One forward pass; per scheduled sequence the sampled token, or None mid-prefill."""
        input_ids, positions, meta, rows = self.prepare(batch)
        hidden = self.model(input_ids, positions, self.pool, meta)
        out: list[int | None] = [None] * len(batch)
        if not rows:
            return out
        logits = self.model.logits(hidden[rows])
        # Exactly the sequences whose chunk reaches their last token have a row in ``rows``.
        sampled = [i for i, item in enumerate(batch) if item.seq.num_computed + item.num_tokens == item.seq.num_tokens]
        seqs = [batch[i].seq for i in sampled]
        tokens = self.sampler(logits, [s.params for s in seqs], [s.generator for s in seqs])
        for i, tok in zip(sampled, tokens):
            out[i] = tok
        return out

    @torch.inference_mode()
    def logits(self, batch: list[Scheduled]) -> torch.Tensor:
        """Logits of every new token of ``batch`` (tests compare them with transformers)."""
        input_ids, positions, meta, _ = self.prepare(batch)
        return self.model.logits(self.model(input_ids, positions, self.pool, meta))
