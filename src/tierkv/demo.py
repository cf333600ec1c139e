"""The main job's workload: a multi-turn chat replayed through the engine, one pass per process.

One long system prompt (an assistant's instructions and reference notes) is
shared by every user; each user asks a few real questions, one per turn, and
each turn's prompt is the whole conversation so far rendered with the model's
own chat template (``tierkv.engine.chat_template``) — the shape of real chat
traffic, where almost every prompt token was already computed once. A model
without a chat template (the random test presets) gets the same conversation
as plain ``System:/User:/Assistant:`` text.

A pass replays the conversation twice inside one process: through an engine
with the cache (timed, hits per tier recorded, its answers kept as the chat's
history) and through an engine with the cache disabled (the same prompts, the
cold baseline). After each turn the cached engine persists the turn's blocks to
L3 (``store.persist``), so the next process — `tierkv run`'s restarted pass —
finds them on disk.

``python -m tierkv.demo PLAN.json`` runs one pass and writes JSON lines on
stdout: ``{"event": "turn", ...}`` per turn, then ``{"event": "pass", ...}``.
`tierkv run` (cli/run_cmd.py) starts it twice and draws the tables.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tierkv.metrics import TIER_NAMES

NAMESPACE = "tierkv-demo"

IDENTITY = ("You are a helpful AI assistant named SmolLM, trained by Hugging Face. Answer the user's question "
            "in one or two sentences.")
#: Reference notes the system prompt repeats until it is long enough: a knowledge base every user shares.
NOTES = (
    "Paris is the capital of France and sits on the river Seine.",
    "Rome is the capital of Italy; the Tiber flows through it.",
    "Madrid is the capital of Spain and lies on the Manzanares.",
    "Lisbon is the capital of Portugal, on the Tagus estuary.",
    "Berlin is the capital of Germany and stands on the Spree.",
    "Amsterdam is the capital of the Netherlands and is known for its canals.",
    "Vienna is the capital of Austria, on the Danube.",
    "Prague is the capital of the Czech Republic, on the Vltava.",
)
#: One list of questions per user, one question per turn.
QUESTIONS = (
    ("What is the capital of France?", "Which river flows through it?", "What is it famous for?"),
    ("What is the capital of Germany?", "How many people live there?", "What should a visitor see first?"),
    ("Why is the sky blue?", "Why are sunsets red?", "What is the speed of light?"),
    ("What is the capital of Italy?", "Which river flows through it?", "What food is it known for?"),
)


@dataclass(frozen=True)
class Workload:
    """Size of the chat: users x turns, a system prompt of about ``system_tokens``, answers of up to ``max_tokens``."""

    users: int
    turns: int
    system_tokens: int
    max_tokens: int

    def __post_init__(self) -> None:
        for name in ("users", "turns", "system_tokens", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"workload.{name}: expected an integer >= 1, got {value!r}")
        if self.users > len(QUESTIONS) or self.turns > len(QUESTIONS[0]):
            raise ValueError(f"workload: at most {len(QUESTIONS)} users and {len(QUESTIONS[0])} turns, "
                             f"got {self.users} x {self.turns}")


FIRST_TOKENS = 4  # greedy tokens of each turn compared between the cached and the cold engine
QUICK = Workload(users=2, turns=2, system_tokens=512, max_tokens=24)
FULL = Workload(users=3, turns=3, system_tokens=1024, max_tokens=48)


class Chat:
    """Renders a conversation to token ids: the model's chat template, else plain text. Stateless."""

    def __init__(self, model_dir: str | Path, vocab_size: int) -> None:
        from tierkv.engine.chat_template import ChatTemplate
        from tierkv.engine.tokenizer import Tokenizer

        self.tok = Tokenizer(model_dir, vocab_size)
        self.template = ChatTemplate.from_model_dir(model_dir)

    def ids(self, messages: list[dict]) -> list[int]:
        if self.template is not None:
            return self.tok.encode(self.template.render(messages, add_generation_prompt=True),
                                   add_special_tokens=False)
        text = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages) + "Assistant:"
        return self.tok.encode(text)

    def system_prompt(self, tokens: int) -> str:
        """The identity line, then reference notes until the prompt holds about ``tokens`` tokens."""
        lines, i = [IDENTITY], 0
        while len(self.tok.encode("\n".join(lines))) < tokens:
            lines.append(NOTES[i % len(NOTES)])
            i += 1
        return "\n".join(lines)


def run_pass(plan: dict, emit) -> dict:
    """Replay the workload with and without the cache in this process; returns the pass summary."""
    import torch

    from tierkv.catalog import Catalog
    from tierkv.config import StoreConfig
    from tierkv.engine import LLM, EngineConfig
    from tierkv.engine.loader import read_config

    torch.set_num_threads(1)
    work = Workload(**plan["workload"])
    started = time.perf_counter()
    chat = Chat(plan["model"], read_config(plan["model"]).vocab_size)
    system = {"role": "system", "content": chat.system_prompt(work.system_tokens)}
    sys_ids = chat.ids([system])
    longest = len(sys_ids) + work.turns * (64 + work.max_tokens)
    # L1 holds the longest conversation and a little more, so other users' blocks demote to L2.
    num_blocks = -(-longest // EngineConfig().block_size) + 2
    engine_cfg = EngineConfig(num_blocks=num_blocks, num_threads=1, max_model_len=longest + 64)
    cached = LLM(plan["model"], StoreConfig.from_dict(plan["store_config"]), engine_cfg)
    nocache = LLM(plan["model"], None, engine_cfg, enable_cache=False)
    load_s = time.perf_counter() - started
    catalog = Catalog(Path(cached.store.config.l3.path)) if cached.store.l3 is not None else None
    history = {u: [system] for u in range(work.users)}
    turns, written = [], 0
    try:
        _warm_up(cached, nocache, sys_ids)
        for turn in range(work.turns):
            for user in range(work.users):
                question = QUESTIONS[user][turn]
                messages = history[user] + [{"role": "user", "content": question}]
                row, answer, n = _turn(cached, nocache, catalog, chat.ids(messages), work.max_tokens)
                text = chat.tok.decode(answer).strip()
                row = {"user": user + 1, "turn": turn + 1, "question": question, "answer": text, **row}
                turns.append(row)
                written += n
                emit({"event": "turn", **row})
                history[user] = messages + [{"role": "assistant", "content": text}]
    finally:
        if catalog is not None:
            catalog.close()
        stats = cached.stats()
        cached.close()
        nocache.close()
    return summarize(turns, load_s, written, stats, cached.layout.to_dict(), cached.store.config.model_id)


def _warm_up(cached, nocache, ids: list[int]) -> None:
    """Take first-call overheads out of the measurement; under one block, so nothing gets cached."""
    from tierkv.engine import SamplingParams

    for llm in (cached, nocache):
        llm.generate([ids[: llm.store.block_size - 1]], SamplingParams(max_tokens=1), namespace=NAMESPACE + "-warmup")


def _turn(cached, nocache, catalog, prompt: list[int], max_tokens: int) -> tuple[dict, list[int], int]:
    """One turn: timed with the cache, persisted to L3, then timed to first token with the cache disabled."""
    from tierkv.engine import SamplingParams

    t0 = time.perf_counter()
    out = cached.generate([prompt], SamplingParams(max_tokens=max_tokens), namespace=NAMESPACE)[0]
    elapsed = time.perf_counter() - t0
    keys = cached.store.hash(prompt + out.token_ids, NAMESPACE)
    written = cached.store.persist(keys)
    if catalog is not None:
        catalog.record(keys, NAMESPACE, sum(out.hit_tokens.values()) // cached.store.block_size)
    n_first = min(FIRST_TOKENS, max_tokens)
    ref = nocache.generate([prompt], SamplingParams(max_tokens=n_first))[0]  # TTFT is its first token's time
    row = {
        "prompt_tokens": len(prompt),
        "hit_tokens": {t: out.hit_tokens.get(t, 0) for t in TIER_NAMES},
        "ttft_cached_ms": round(out.ttft_s * 1e3, 2), "ttft_nocache_ms": round(ref.ttft_s * 1e3, 2),
        "tokens_per_s": round((len(out.token_ids) - 1) / max(elapsed - out.ttft_s, 1e-6), 1),
        "first_tokens": {"cached": out.token_ids[:n_first], "cold": ref.token_ids[:n_first]},
        "first_token_match": out.token_ids[:n_first] == ref.token_ids[:n_first],
    }
    return row, out.token_ids, written


def summarize(turns: list[dict], load_s: float, written: int, stats: dict, layout: dict, model_id: str) -> dict:
    prompt_tokens = sum(r["prompt_tokens"] for r in turns)
    hits = {t: sum(r["hit_tokens"][t] for r in turns) for t in TIER_NAMES}
    cached = sum(r["ttft_cached_ms"] for r in turns) / len(turns)
    nocache = sum(r["ttft_nocache_ms"] for r in turns) / len(turns)
    return {
        "turns": turns,
        "ttft_cached_ms": round(cached, 2),
        "ttft_nocache_ms": round(nocache, 2),
        "speedup": round(nocache / cached, 2) if cached > 0 else None,
        "prefill_saved_ms": round(sum(r["ttft_nocache_ms"] - r["ttft_cached_ms"] for r in turns), 1),
        "prompt_tokens": prompt_tokens,
        "hit_tokens_by_tier": hits,
        "hit_rate_by_tier": {t: round(n / prompt_tokens, 4) for t, n in hits.items()},
        "first_tokens_match": all(r["first_token_match"] for r in turns),
        "l3_blocks_written": written,
        "evictions": stats.get("evictions", {}),
        "engine_load_s": round(load_s, 2),
        "layout": layout,
        "model_id": model_id,
    }


def write_chart(result: dict, path: Path) -> None:
    """A PNG of time to first token per turn, cold vs cached, each cached bar coloured by the tier that served most."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"l1": "#2b8a3e", "l2": "#1971c2", "l3": "#e8590c", "l4": "#862e9c", "none": "#868e96"}
    fig, ax = plt.subplots(figsize=(10, 5), dpi=100)
    x = 0
    ticks, labels = [], []
    for p, ps in enumerate(result["passes"]):
        for r in ps["turns"]:
            top = max(r["hit_tokens"], key=r["hit_tokens"].get)
            top = top if r["hit_tokens"][top] > 0 else "none"
            ax.bar(x - 0.2, r["ttft_nocache_ms"], 0.4, color="#ced4da")
            ax.bar(x + 0.2, r["ttft_cached_ms"], 0.4, color=colors[top])
            ticks.append(x)
            labels.append(f"p{p + 1} u{r['user']} t{r['turn']}")
            x += 1
        x += 0.6
    handles = [plt.Rectangle((0, 0), 1, 1, color="#ced4da")] + [plt.Rectangle((0, 0), 1, 1, color=c)
                                                                for c in colors.values()]
    fig.legend(handles, ["cache disabled"] + [f"cached, mostly {t.upper() if t != 'none' else 'no hit'}"
                                              for t in colors], fontsize=8, ncol=6, loc="lower center")
    ax.set_xticks(ticks, labels, rotation=45, fontsize=7, ha="right")
    ax.set_ylabel("time to first token (ms)")
    ax.set_yscale("log")
    ax.set_title("tierkv run: pass 1 = fresh process, pass 2 = restarted process (L3 survived)")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.stderr.write("usage: python -m tierkv.demo PLAN.json  (run by `tierkv run`)\n")
        return 2
    plan = json.loads(Path(args[0]).read_text())

    def emit(event: dict) -> None:
        sys.stdout.write(json.dumps(event) + "\n")
        sys.stdout.flush()

    emit({"event": "pass", **run_pass(plan, emit)})
    return 0


if __name__ == "__main__":
    sys.exit(main())

