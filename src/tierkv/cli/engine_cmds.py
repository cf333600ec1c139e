"""Commands that drive the engine on a model directory: warm and serve."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from tierkv.catalog import Catalog
from tierkv.cli.common import (
    MODEL_HELP, CacheDir, CLIError, ConfigFile, Debug, Json, app, console, err_console, model_path, print_json, settings,
)
from tierkv.config import parse_size
from tierkv.index import Tier
from tierkv.metrics import TIER_NAMES

Model = Annotated[str, typer.Option("--model", "-m", help=MODEL_HELP)]
Threads = Annotated[int, typer.Option("--threads", min=0, help="torch threads for the model (0: torch's default).")]


def open_llm(s, model: Path, num_blocks: int, threads: int, max_model_len: int = 0, enable_cache: bool = True):
    """The engine over model directory ``model`` (see ``model_path``) with this command's store config."""
    from tierkv.engine import LLM, EngineConfig

    return LLM(model, s.config, EngineConfig(num_blocks=num_blocks, num_threads=threads, max_model_len=max_model_len),
               enable_cache=enable_cache)


class Recorder:
    """After each request: label its chain's namespace and count its hits in the L3 catalog, and with
    ``persist`` copy the blocks of its prompt and answer to L3 so a restarted process finds them.
    A no-op without L3."""

    def __init__(self, llm, persist: bool = False) -> None:
        self.llm = llm
        self.persist = persist
        self.catalog = Catalog(llm.store.config.l3.path) if llm.store.l3 is not None else None

    def __call__(self, prompt_ids: list[int], out, namespace: str | None) -> None:
        if self.catalog is None:
            return
        store = self.llm.store
        keys = store.hash(list(prompt_ids) + list(out.token_ids), namespace)
        if self.persist:
            store.persist(keys)
        self.catalog.record(keys, store.config.namespace if namespace is None else namespace,
                            sum(out.hit_tokens.values()) // store.block_size)

    def close(self) -> None:
        if self.catalog is not None:
            self.catalog.close()


def read_prompts(path: Path, encode) -> list[tuple[list[int], str | None]]:
    """(token ids, namespace) per line of a JSONL file: {"prompt": str} or {"prompt_token_ids": [int]}, optional "namespace"."""
    if not path.exists():
        raise CLIError(f"{path}: no such file")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CLIError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
        if not isinstance(item, dict):
            raise CLIError(f"{path}:{n}: expected an object with \"prompt\" or \"prompt_token_ids\"")
        ns = item.get("namespace")
        if ns is not None and not isinstance(ns, str):
            raise CLIError(f"{path}:{n}: namespace: expected a string")
        if isinstance(item.get("prompt"), str) and item["prompt"]:
            out.append((encode(item["prompt"]), ns))
        elif isinstance(item.get("prompt_token_ids"), list) and item["prompt_token_ids"] and all(
                isinstance(t, int) and not isinstance(t, bool) for t in item["prompt_token_ids"]):
            out.append((list(item["prompt_token_ids"]), ns))
        else:
            raise CLIError(f"{path}:{n}: expected \"prompt\" (a non-empty string) or \"prompt_token_ids\" (a list of ints)")
    if not out:
        raise CLIError(f"{path}: no prompts")
    return out


@app.command("warm", epilog="Example: `tierkv warm prompts.jsonl --model smollm2-135m-instruct` "
                            "with lines like {\"prompt\": \"You are ...\", \"namespace\": \"tenant-a\"}")
def warm_cmd(
    prompts: Annotated[Path, typer.Argument(help="JSONL: one {\"prompt\": str} or {\"prompt_token_ids\": [int]} per line, optional \"namespace\".")],
    model: Model,
    namespace: Annotated[str | None, typer.Option("--namespace", "-n", help="Namespace for lines that name none.")] = None,
    threads: Threads = 1,
    json_out: Json = False, cache_dir: CacheDir = None, config: ConfigFile = None, debug: Debug = False,
) -> None:
    """Prefill prompts and persist their blocks to L3 (and to a shared L2 and to L4 when configured)."""
    from tierkv.engine import SamplingParams
    from tierkv.engine.loader import read_config
    from tierkv.engine.tokenizer import Tokenizer

    s = settings(cache_dir, config, debug)
    model_dir = model_path(model)
    items = read_prompts(prompts, Tokenizer(model_dir, read_config(model_dir).vocab_size).encode)
    started = time.perf_counter()
    longest = max(len(ids) for ids, _ in items)
    llm = open_llm(s, model_dir, max(256, longest // 16 + 64), threads)
    if llm.store.l3 is None:
        llm.close()
        raise CLIError("warm: this store has no L3 (l3_enabled is false or l3.capacity is 0); nothing would persist")
    targets = [Tier.L3] + ([Tier.L2] if s.config.l2.shared_name else []) + ([Tier.L4] if llm.store.l4 else [])
    recorder = Recorder(llm)
    hits = dict.fromkeys(TIER_NAMES, 0)
    written = dict.fromkeys(TIER_NAMES, 0)
    tokens = 0
    try:
        with Progress(TextColumn("warming"), BarColumn(), TextColumn("{task.completed}/{task.total} prompts"),
                      TimeElapsedColumn(), console=console, disable=json_out) as bar:
            task = bar.add_task("warm", total=len(items))
            for ids, ns in items:
                ns = namespace if ns is None else ns
                out = llm.generate([ids], SamplingParams(max_tokens=1), namespace=ns)[0]
                recorder(ids, out, ns)
                keys = llm.store.hash(ids, ns)
                for tier in targets:
                    written[TIER_NAMES[tier]] += llm.store.persist(keys, tier)
                for t, n in out.hit_tokens.items():
                    hits[t] += n
                tokens += len(ids)
                bar.advance(task)
    finally:
        recorder.close()
        llm.close()
    report = {"prompts": len(items), "prompt_tokens": tokens, "hit_tokens": hits,
              "blocks_written": {t: n for t, n in written.items() if TIER_NAMES.index(t) in targets},
              "l3_path": str(s.l3_path), "seconds": round(time.perf_counter() - started, 2)}
    if json_out:
        print_json(report)
    else:
        cached = sum(hits.values())
        console.print(f"warmed {len(items)} prompts ({tokens} tokens, {cached} already cached); wrote "
                      + ", ".join(f"{n} blocks to {t.upper()}" for t, n in report["blocks_written"].items())
                      + f" in {report['seconds']:.1f} s")


@app.command("serve", epilog="Example: `tierkv serve --model smollm2-135m-instruct --port 8000`, then any "
                             "OpenAI client on http://127.0.0.1:8000/v1 (see docs/cli.md)")
def serve_cmd(
    model: Model,
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", "-p", min=0, max=65535, help="Port (0 picks a free one).")] = 8000,
    served_model_name: Annotated[str | None, typer.Option("--served-model-name", help="Model id clients must send [default: the directory name].")] = None,
    chat_template: Annotated[str | None, typer.Option("--chat-template", help="A jinja2 chat template file (or its text) "
                             "instead of the model's own.")] = None,
    max_body: Annotated[str, typer.Option("--max-body", help="Largest request body accepted (413 above).")] = "1MiB",
    max_tokens: Annotated[int, typer.Option("--max-tokens-limit", min=1, help="Largest max_tokens a request may ask.")] = 4096,
    num_blocks: Annotated[int, typer.Option("--num-blocks", min=1, help="L1 pool size in blocks.")] = 1024,
    max_model_len: Annotated[int, typer.Option("--max-model-len", min=0, help="Longest sequence (0: the model's).")] = 0,
    threads: Threads = 0,
    cache: Annotated[bool, typer.Option("--cache/--no-cache", help="Look prompts up in the store and save their "
                                        "blocks (--no-cache: recompute every prompt, L1 is only the KV pool).")] = True,
    persist: Annotated[bool, typer.Option("--persist/--no-persist", help="Copy each request's blocks to L3 as it "
                                          "finishes, so a restarted server hits them.")] = True,
    kv_events: Annotated[str, typer.Option("--kv-events", help="Publish the store's KV events (vLLM format, ZMQ) "
                                           "at tcp://HOST:PORT (replay at PORT+1; port 0: free ports), or off.")]
    = "tcp://127.0.0.1:0",
    cache_dir: CacheDir = None, config: ConfigFile = None, debug: Debug = False,
) -> None:
    """Serve the engine over an OpenAI-compatible HTTP API with /metrics (Prometheus) and /health."""
    from tierkv.engine.chat_template import ChatTemplate, ChatTemplateError
    from tierkv.engine.server import EngineServer, ServerConfig
    from tierkv.route.node_api import serve_kv

    s = settings(cache_dir, config, debug)
    model_dir = model_path(model)
    try:
        server_config = ServerConfig(host, port, served_model_name or model_dir.resolve().name,
                                     parse_size(max_body, "--max-body"), max_tokens)
        template = ChatTemplate.from_model_dir(model_dir, chat_template)
    except ChatTemplateError as exc:
        raise CLIError(f"--chat-template: {exc}", 2) from None
    except ValueError as exc:
        raise CLIError(str(exc), 2) from None
    llm = open_llm(s, model_dir, num_blocks, threads, max_model_len, enable_cache=cache)
    recorder = Recorder(llm, persist)
    name = server_config.model_name
    try:
        kv_router, publisher = serve_kv(llm.store, kv_events)
    except (ValueError, OSError) as exc:
        recorder.close()
        llm.close()
        raise CLIError(str(exc), 2) from None
    try:
        server = EngineServer(llm, server_config, on_request=recorder, model_dir=model_dir, chat_template=template,
                              routers=[kv_router])
    except OSError as exc:
        if publisher is not None:
            publisher.close()
        recorder.close()
        llm.close()
        raise CLIError(f"--port: cannot listen on {host}:{port}: {exc.strerror}") from None

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    l3 = s.l3_path if llm.store.l3 else "off"
    chat = "its own chat template" if template is not None and chat_template is None else (
        "--chat-template" if template is not None else "no chat template: /v1/chat/completions answers 400")
    console.print(f"tierkv serve: model {name} at {server.url} (L3 {l3}; {chat}); Ctrl-C to stop", soft_wrap=True)
    try:
        server.serve_forever()  # returns after SIGINT/SIGTERM, once the requests in flight are done
    except KeyboardInterrupt:
        pass
    finally:
        err_console.print("stopping")
        with server.engine_lock:  # the engine loop has stopped; nothing else touches the LLM
            recorder.close()
            llm.close()
            if publisher is not None:
                publisher.close()
