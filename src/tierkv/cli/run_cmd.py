"""`tierkv run`: the main job — the bundled engine on a multi-turn chat, in a fresh and a restarted process."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from tierkv.catalog import evict_namespace
from tierkv.cli.common import MODEL_HELP, CacheDir, CLIError, ConfigFile, Debug, app, console, model_path, settings
from tierkv.demo import FULL, NAMESPACE, QUICK, write_chart
from tierkv.metrics import TIER_NAMES
from tierkv.models import DEFAULT_MODEL
from tierkv.tiers.disk_open import DamagedL3

PASS_NAMES = ("fresh process", "restarted process")


def _last_line(text: str) -> str:
    lines = [x for x in text.strip().splitlines() if x.strip()]
    return lines[-1] if lines else "(no output)"


def _run_pass(plan_path: Path, index: int, bar: Progress, task, debug: bool) -> dict:
    bar.update(task, description=f"pass {index + 1} ({PASS_NAMES[index]}): loading the engine")
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", "tierkv.demo", str(plan_path)], stdout=subprocess.PIPE,
                                stderr=None if debug else err, text=True)
        result = None
        for line in proc.stdout:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:  # a library printing to stdout; not ours
                continue
            if not isinstance(event, dict) or "event" not in event:
                continue
            if event["event"] == "turn":
                bar.update(task, advance=1, description=f"pass {index + 1} ({PASS_NAMES[index]}): "
                                                        f"user {event['user']} turn {event['turn']}")
            elif event["event"] == "pass":
                result = event
        proc.wait()
        err.seek(0)
        if proc.returncode != 0 or result is None:
            raise CLIError(f"pass {index + 1} failed: {_last_line(err.read())} (rerun with --debug)")
    result.pop("event")
    return {"name": PASS_NAMES[index], **result}


def _table(index: int, ps: dict) -> Table:
    tiers = [t for t in TIER_NAMES if t != "l4" or ps["hit_tokens_by_tier"]["l4"]]
    table = Table(title=f"pass {index + 1}: {ps['name']} — prompt tokens hit per tier; time to first token "
                        "with the cache disabled (cold) and enabled (cached)", title_justify="left", box=box.SIMPLE_HEAD)
    for col in ("turn", "prompt", *[t.upper() for t in tiers], "cold ms", "cached ms", "speedup", "tok/s"):
        table.add_column(col, justify="right")
    for r in ps["turns"]:
        table.add_row(f"u{r['user']} t{r['turn']}", str(r["prompt_tokens"]), *[str(r["hit_tokens"][t]) for t in tiers],
                      f"{r['ttft_nocache_ms']:.0f}", f"{r['ttft_cached_ms']:.0f}",
                      f"{r['ttft_nocache_ms'] / max(r['ttft_cached_ms'], 1e-3):.1f}x", f"{r['tokens_per_s']:.1f}")
    return table


def answers_text(ps: dict) -> str:
    """Each user's first question and the model's answer (from the cached engine of pass 1)."""
    lines = ["first answers (pass 1, served with the cache; the cold engine starts each the same way):"]
    for r in ps["turns"]:
        if r["turn"] == 1:
            answer = " ".join(r["answer"].split())
            lines.append(f"  u{r['user']}: {r['question']}\n      -> {answer[:240]}{'...' if len(answer) > 240 else ''}")
    return "\n".join(lines)


def summary_line(index: int, ps: dict) -> str:
    rates = ps["hit_rate_by_tier"]
    by_tier = ", ".join(f"{t.upper()} {rates[t] * 100:.0f}%" for t in TIER_NAMES if rates[t] > 0) or "none"
    return (f"pass {index + 1} ({ps['name']}): {sum(rates.values()) * 100:.0f}% of prompt tokens from the cache "
            f"({by_tier}); prefill time saved {ps['prefill_saved_ms'] / 1e3:.2f} s; mean TTFT "
            f"{ps['ttft_nocache_ms']:.0f} ms cold -> {ps['ttft_cached_ms']:.0f} ms cached ({ps['speedup']}x)")


@app.command("run", epilog="Examples: `tierkv run`, `tierkv run --quick --json out/run.json`, "
                           "`tierkv run --model ~/models/Llama-3.2-1B`, `tierkv run --quick --model tiny`")
def run_cmd(
    model: Annotated[str, typer.Option("--model", "-m", help=MODEL_HELP + " `tiny` / `small`: seeded random "
                                                              "weights, for fast tests.")] = DEFAULT_MODEL,
    quick: Annotated[bool, typer.Option("--quick", help="A shorter chat: 2 users x 2 turns, a 512-token system prompt, 24-token answers.")] = False,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the figures to this JSON file (the PNG chart goes next to it).")] = None,
    cache_dir: CacheDir = None, config: ConfigFile = None, debug: Debug = False,
) -> None:
    """The main job: replay a multi-turn chat through the engine in a fresh process, then in a restarted one.

    The chat's questions are real and rendered with the model's chat template
    (SmolLM2-135M-Instruct by default, pulled on first use); each user's first
    answer is printed. Prints hits per tier and time to first token with the cache vs without it
    (the same prompts, measured in the same process), and writes a JSON of the
    figures and a PNG chart.
    """
    started = time.perf_counter()
    s = settings(cache_dir, config, debug)
    work = QUICK if quick else FULL
    out_json = json_path or s.cache_dir / "run" / "last-run.json"
    out_json.parent.mkdir(parents=True, exist_ok=True)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task(f"preparing the model {model}", total=2 * work.users * work.turns)
        model_dir = model_path(model)
        try:
            evict_namespace(s.l3_path, NAMESPACE)  # pass 1 starts cold whatever an earlier run left
        except DamagedL3:
            pass  # pass 1's store moves the damaged files aside and starts with an empty L3: cold too
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
            json.dump({"model": str(model_dir), "store_config": s.config.to_dict(),
                       "workload": dataclasses.asdict(work)}, fh)
        try:
            passes = [_run_pass(Path(fh.name), i, bar, task, debug) for i in range(2)]
        finally:
            os.unlink(fh.name)
    result = {"model": str(model_dir), "model_id": passes[0]["model_id"], "cache_dir": str(s.cache_dir),
              "l3_path": str(s.l3_path), "workload": dataclasses.asdict(work), "passes": passes,
              "wall_s": round(time.perf_counter() - started, 1),
              "host": {"cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2), "torch_threads": 1}}
    for i, ps in enumerate(passes):
        console.print(_table(i, ps))
    console.print(answers_text(passes[0]), markup=False, soft_wrap=True)
    for i, ps in enumerate(passes):
        console.print(summary_line(i, ps))
    out_json.write_text(json.dumps(result, indent=2) + "\n")
    chart = out_json.with_suffix(".png")
    try:
        write_chart(result, chart)
        wrote = f"{out_json} and {chart}"
    except ImportError:
        wrote = f"{out_json} (no PNG: matplotlib is missing; pip install 'tierkv[dev]')"
    console.print(f"wrote {wrote} in {result['wall_s']:.1f} s")
    if passes[1]["hit_tokens_by_tier"]["l3"] == 0 and s.config.l3_enabled:
        raise CLIError("the restarted pass found nothing in L3: blocks did not survive the restart")
