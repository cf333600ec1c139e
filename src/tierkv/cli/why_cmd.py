"""`tierkv why`: per block of a prompt, the tier that holds its KV or why none does (``tierkv.why``)."""

from __future__ import annotations

import dataclasses
import json
import time
import urllib.request
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from tierkv.cli.common import (
    MODEL_HELP, CacheDir, CLIError, ConfigFile, Debug, Json, app, console, model_path, print_json, settings,
)
from tierkv.config import L1Config, L2Config, L4Config


def _ids(text: str) -> list[int]:
    raw = Path(text[1:]).read_text() if text.startswith("@") else text
    try:
        ids = json.loads(raw) if raw.lstrip().startswith("[") else [int(t) for t in raw.replace(",", " ").split()]
    except ValueError:
        raise CLIError("--ids: expected token ids as '1,2,3', a JSON list, or @FILE holding either", 2) from None
    if not ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise CLIError("--ids: expected a non-empty list of token ids >= 0", 2)
    return ids


def _runs(blocks: list[dict]) -> list[tuple[int, int, int, int, str]]:
    """Consecutive blocks with the same answer as (first, last, first token, end token, answer)."""
    out: list[list] = []
    for b in blocks:
        text = b["describe"]
        if out and out[-1][4] == text and out[-1][1] == b["block"] - 1:
            out[-1][1], out[-1][3] = b["block"], b["tokens"][1]
        else:
            out.append([b["block"], b["block"], b["tokens"][0], b["tokens"][1], text])
    return [tuple(r) for r in out]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url.rstrip("/") + "/v1/kv/why", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise CLIError(f"{url}: {exc.code} {exc.read().decode(errors='replace')[:300]}") from None
    except OSError as exc:
        raise CLIError(f"{url}: cannot reach the server ({exc})") from None


def _local(s, model: str | None, identity: str | None, prompt: str | None, ids: list[int] | None,
           namespace: str | None, salt: str | None, dtype: str, hf_overrides: dict | None) -> dict:
    from tierkv.catalog import stored_layouts
    from tierkv.identity import recorded, salt_keys
    from tierkv.layout import KVLayout
    from tierkv.store import TierKVStore
    from tierkv.seeds import SeedLog
    from tierkv.why import EvictionLog, explain, summary

    stored = stored_layouts(s.l3_path)
    if not stored:
        raise CLIError(f"no L3 cache at {s.l3_path} (pass --cache-dir, or ask a server with --url)")
    # (identity, last opened, layout) over every layout's directory, newest first
    records = sorted(((ident, seen, lay) for _, lay, _, meta in stored for ident, seen in recorded(meta)),
                     key=lambda r: -r[1])
    if model is not None:
        from tierkv.engine.loader import engine_identity, read_config
        from tierkv.engine.tokenizer import Tokenizer

        mdir = model_path(model)
        ident = engine_identity(mdir, dtype, dtype, hf_overrides)
        mc = read_config(mdir, hf_overrides)
        # the layout that engine would write: its shape and dtype, the block size this L3 was written with
        layout = KVLayout(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, stored[0][1].block_size, dtype)
        tokenizer = Tokenizer(mdir, mc.vocab_size)
        if ids is None:
            ids = tokenizer.encode(prompt)
    else:
        if prompt is not None:
            raise CLIError("a text prompt needs --model (its tokenizer); without one pass --ids", 2)
        if not records:
            raise CLIError(f"{s.l3_path} records no model identity; pass --model")
        want = (identity or "latest").lower()
        picked = records if want == "latest" else [r for r in records if r[0].digest.startswith(want)]
        if not picked:
            raise CLIError(f"--identity: none of the identities L3 records starts with {want!r}; recorded: "
                           f"{', '.join(r[0].digest[:12] for r in records)}", 2)
        ident, _, layout = picked[0]
    mine = [d for d, lay, _, _ in stored if lay.fingerprint == layout.fingerprint]
    cfg = dataclasses.replace(s.config, l1=L1Config(num_blocks=0), l2=L2Config(capacity=0, shared_name="", pin=False)
                              if not s.config.l2.shared_name else s.config.l2, l4=s.config.l4 if s.config.l4.url else L4Config())
    # No L3 of this layout: look without creating one (explain still searches the other layouts').
    cfg = dataclasses.replace(cfg, cost=dataclasses.replace(cfg.cost, calibrate=False), l3_enabled=bool(mine))
    store = TierKVStore(cfg, layout, identity=ident, record_identity=False)
    try:
        log = EvictionLog()
        if mine:
            log.load(mine[0])
        store.evictions = log
        store.seed_log = SeedLog(mine[0]) if mine else None
        # Other cache_salts too: whoever reads the L3 directory can read every block in it.
        blocks = explain(store, ids, namespace, salt_keys(salt), other_salts=True)
        store.evictions = store.seed_log = None  # read only: nothing to save back
    finally:
        store.close()
    now = time.time()
    return {"identity": ident.digest, "block_size": layout.block_size, "prompt_tokens": len(ids),
            "summary": summary(blocks), "blocks": [{**b.to_dict(), "describe": b.describe(now)} for b in blocks]}


@app.command("why", epilog="Examples: `tierkv why -m smollm2-135m \"Hello there\"`, "
                           "`tierkv why --ids @prompt.json --identity latest`, `tierkv why --url http://127.0.0.1:8000 \"Hi\"`")
def why_cmd(
    prompt: Annotated[str | None, typer.Argument(help="The prompt text (tokenized with --model's tokenizer).")] = None,
    model: Annotated[str | None, typer.Option("--model", "-m", help=MODEL_HELP + " Its identity is the one asked about.")] = None,
    ids: Annotated[str | None, typer.Option("--ids", help="Token ids instead of text: '1,2,3', a JSON list, or @FILE.")] = None,
    identity: Annotated[str | None, typer.Option("--identity", help="Without --model: a recorded identity's digest prefix, or 'latest'.")] = None,
    namespace: Annotated[str | None, typer.Option("--namespace", "-n", help="The namespace the prompt was hashed under.")] = None,
    salt: Annotated[str | None, typer.Option("--cache-salt", help="The request's cache_salt.")] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="With --model: the engine's dtype.")] = "float32",
    hf_overrides: Annotated[str | None, typer.Option("--hf-overrides", help="With --model: the engine's hf_overrides as JSON.")] = None,
    url: Annotated[str | None, typer.Option("--url", help="Ask a running `tierkv serve` (its eviction log, its L1/L2).")] = None,
    json_out: Json = False, cache_dir: CacheDir = None, config: ConfigFile = None, debug: Debug = False,
) -> None:
    """Per block of a prompt: which tier holds its KV, or why it missed (evicted, damaged, held under
    another model identity and which field differs, held under another cache_salt or LoRA, not
    computed yet). Locally it looks under every cache_salt seen (never showing one); a server
    (--url) does not look under other salts."""
    if (prompt is None) == (ids is None):
        raise CLIError("give a prompt or --ids (one of them)", 2)
    token_ids = _ids(ids) if ids is not None else None
    overrides = None
    if hf_overrides is not None:
        try:
            overrides = json.loads(hf_overrides)
        except ValueError:
            raise CLIError("--hf-overrides: expected a JSON object", 2) from None
        if not isinstance(overrides, dict):
            raise CLIError("--hf-overrides: expected a JSON object", 2)
    if url is not None:
        body = {"prompt": token_ids if token_ids is not None else prompt, "namespace": namespace, "cache_salt": salt}
        data = _post(url, {k: v for k, v in body.items() if v is not None})
        now = time.time()
        from tierkv.why import BlockWhy

        for b in data["blocks"]:
            fields = {k: (tuple(v) if isinstance(v, list) else v) for k, v in b.items()}
            b["describe"] = BlockWhy(**fields).describe(now)
    else:
        data = _local(settings(cache_dir, config, debug), model, identity, prompt, token_ids, namespace, salt,
                      dtype, overrides)
    if json_out:
        print_json(data)
        return
    console.print(f"identity {data['identity'][:12]}, {data['prompt_tokens']} tokens, "
                  f"{len(data['blocks'])} full blocks of {data['block_size']}: "
                  + ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in data["summary"].items()), soft_wrap=True)
    table = Table()
    for col in ("blocks", "tokens", "where / why"):
        table.add_column(col)
    for first, last, t0, t1, text in _runs(data["blocks"]):
        table.add_row(f"{first}" if first == last else f"{first}-{last}", f"{t0}-{t1}", text)
    console.print(table)
