"""Measure the bundled engine's step time and this machine's tier bandwidth; write tools/fleet.py's engine model.

Steps of ``tierkv.engine.LLM`` (store off, so only compute is timed) on
SmolLM2-135M-Instruct, fp32, one thread unless ``--threads``: single prompts
of several lengths prefilled in one step, four prompts prefilled in one step,
and decode steps of 1, 8 and 32 sequences. Each step's time is the best of
``--repeat``. A least-squares fit gives the engine model's step time::

    step_us = step_base_us + token_us·T + attention_us·Σctx + seq_us·S

(T tokens in the step, Σctx the positions they attend over, S sequences
sampled in it; ``tools/engine_model.py``). Per-tier load bandwidth comes from
``bench/tiers.py``'s JSON when ``--tiers-json`` names one (``l2_get_gbps``,
``l3_get_gbps``), else from ``tierkv.cost.calibrate`` (a host memmove and a
cold-page-cache file read). Every raw timing and the fit's residual per row go
into the JSON as well.

    python tools/calibrate_engine.py --out tools/engine_model.json     # ~1 min of one core
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from tools.engine_model import EngineParams, positions_sum  # noqa: E402

MODEL = "smollm2-135m-instruct"
PREFILL_LENGTHS = (128, 512, 1024, 2048)
BATCHED_PREFILL = (4, 256)  # four prompts of 256 tokens in one step
DECODE_BATCHES = (1, 8, 32)
DECODE_PROMPT = 64
BLOCK_SIZE = 16


def _engine(threads: int, max_tokens: int):
    from tierkv.config import StoreConfig
    from tierkv.engine import LLM, EngineConfig
    from tierkv.models import resolve_model

    cfg = EngineConfig(num_blocks=1024, block_size=BLOCK_SIZE, max_num_batched_tokens=max_tokens,
                       max_num_seqs=64, num_threads=threads, dtype="float32")
    return LLM(resolve_model(MODEL), StoreConfig(l3_enabled=False), cfg, enable_cache=False)


def _prompt(llm, n: int, seed: int, max_tokens: int):
    from tierkv.engine import SamplingParams

    rng = np.random.default_rng(seed)
    ids = rng.integers(100, llm.model_config.vocab_size - 100, n).tolist()
    return llm._sequence(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), None)


def _timed_step(llm) -> float:
    start = time.perf_counter()
    llm.step()
    return (time.perf_counter() - start) * 1e6


def prefill_row(llm, lengths: list[int], repeat: int, seed: int) -> dict:
    """Best time of one step that prefills ``lengths`` (one prompt each) from scratch."""
    best = float("inf")
    for r in range(repeat):
        seqs = [_prompt(llm, n, seed + 97 * r + i, 1) for i, n in enumerate(lengths)]
        for s in seqs:
            llm.scheduler.add(s)
        best = min(best, _timed_step(llm))
        llm.scheduler.abort_all()
    return {"kind": "prefill", "lengths": lengths, "tokens": sum(lengths),
            "ctx": sum(positions_sum(0, n) for n in lengths), "seqs": len(lengths), "us": best}


def decode_row(llm, batch: int, repeat: int, seed: int) -> dict:
    """Best decode step of ``batch`` sequences whose prompts are ``DECODE_PROMPT`` tokens."""
    best, steps = float("inf"), 4
    for r in range(repeat):
        seqs = [_prompt(llm, DECODE_PROMPT, seed + 31 * r + i, steps + 2) for i in range(batch)]
        for s in seqs:
            llm.scheduler.add(s)
        llm.step()  # the prefill
        best = min(best, *(_timed_step(llm) for _ in range(steps)))
        llm.scheduler.abort_all()
    ctx = batch * (DECODE_PROMPT + 2)  # a typical timed step's positions (prompt + 1..4 generated)
    return {"kind": "decode", "batch": batch, "tokens": batch, "ctx": ctx, "seqs": batch, "us": best}


def fit(rows: list[dict]) -> tuple[list[float], list[float]]:
    """(step_base_us, token_us, attention_us, seq_us) by least squares, clamped >= 0; residual per row (%)."""
    a = np.array([[1.0, r["tokens"], r["ctx"], r["seqs"]] for r in rows])
    y = np.array([r["us"] for r in rows])
    weights = 1.0 / y  # relative error: a 50 ms decode step counts as much as a 6 s prefill
    coef, *_ = np.linalg.lstsq(a * weights[:, None], y * weights, rcond=None)
    coef = np.maximum(coef, 0.0)
    residual = ((a @ coef) / y - 1.0) * 100.0
    return coef.tolist(), residual.tolist()


def tier_gbps(tiers_json: str | None, kv_bytes_per_token: int) -> tuple[dict, str]:
    """L2/L3/L4 load GB/s and where they came from."""
    from tierkv.cost import calibrate

    if tiers_json:
        f = json.loads(Path(tiers_json).read_text())
        return {"l2": f["l2_get_gbps"], "l3": f["l3_get_gbps"], "l4": 0.5}, f"bench/tiers.py JSON {tiers_json}"
    block_bytes = kv_bytes_per_token * BLOCK_SIZE
    with tempfile.TemporaryDirectory() as d:
        cost = calibrate(block_bytes, BLOCK_SIZE, disk_dir=d, blocks=64, repeat=5)
    gbps = {f"l{t + 1}": round(kv_bytes_per_token / (cost.load_us[t] * 1e3), 3) for t in (1, 2, 3)}
    return gbps, ("tierkv.cost.calibrate (host memmove; page-cache-dropped file read + memmove; "
                  "L4 its built-in estimate)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Calibrate tools/fleet.py's engine model on the bundled engine.")
    p.add_argument("--out", default=str(Path(__file__).with_name("engine_model.json")))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--tiers-json", default=None, help="bench/tiers.py --json output to take L2/L3 GB/s from")
    args = p.parse_args(argv)
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    llm = _engine(args.threads, max(PREFILL_LENGTHS))
    try:
        prefill_row(llm, [64], 1, 0)  # warm-up
        rows = [prefill_row(llm, [n], args.repeat, n) for n in PREFILL_LENGTHS]
        rows.append(prefill_row(llm, [BATCHED_PREFILL[1]] * BATCHED_PREFILL[0], args.repeat, 7))
        rows += [decode_row(llm, b, args.repeat, 1000 + b) for b in DECODE_BATCHES]
        mc = llm.model_config
        kv_bytes = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * 4  # K and V, fp32
    finally:
        llm.close()
    (base, token, attention, seq), residual = fit(rows)
    for row, res in zip(rows, residual):
        row["fit_error_pct"] = round(res, 1)
        row["us"] = round(row["us"], 1)
    gbps, gbps_source = tier_gbps(args.tiers_json, kv_bytes)
    params = EngineParams(
        name=f"{MODEL} fp32, {args.threads} thread(s), bundled engine on {platform.machine()}",
        step_base_us=round(base, 2), token_us=round(token, 4), attention_us=round(attention, 8),
        seq_us=round(seq, 2), max_num_batched_tokens=2048, max_num_seqs=64, chunked_prefill=True,
        kv_bytes_per_token=kv_bytes, load_gbps=(gbps["l2"], gbps["l3"], gbps["l4"]),
        block_size=BLOCK_SIZE)
    out = params.to_json()
    out["calibration"] = {
        "command": "python tools/calibrate_engine.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "seconds": round(time.perf_counter() - start, 1),
        "loadavg_before": round(load_before, 2), "loadavg_after": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(), "load_gbps_source": gbps_source, "steps": rows}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"step_us = {base:.0f} + {token:.1f}·tokens + {attention:.2e}·Σctx + {seq:.0f}·seqs; "
          f"load GB/s L2 {gbps['l2']} L3 {gbps['l3']}; wrote {args.out}")
    for row in rows:
        print(f"  {row['kind']:<8} tokens {row['tokens']:>5} seqs {row['seqs']:>3}  {row['us'] / 1e3:>9.1f} ms  "
              f"fit {row['fit_error_pct']:+.1f} %")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
