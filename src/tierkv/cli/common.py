"""What every `tierkv` command shares: the typer app, common options, config and errors.

Conventions (docs/design.md §14): exit 0 on success, 1 on failure, 2 on bad usage;
errors are one line without a traceback unless ``--debug``; ``--json`` prints
the figures as JSON on stdout instead of tables.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from tierkv.config import L3Config, StoreConfig

app = typer.Typer(
    name="tierkv",
    help="tierkv: a hierarchical KV-cache store for LLM inference (L1 device, L2 DRAM, L3 disk, L4 remote).\n\n"
         "Start with `tierkv run`: a real chat model (SmolLM2-135M-Instruct, pulled on first use) shows the cache at work.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)
console = Console(stderr=False, highlight=False)
err_console = Console(stderr=True, highlight=False)

DEFAULT_CACHE_DIR = "~/.cache/tierkv"

CacheDir = Annotated[Path | None, typer.Option(
    "--cache-dir", envvar="TIERKV_CACHE_DIR", show_envvar=True,
    help=f"Cache directory: L3 lives in CACHE_DIR/l3 [default: {DEFAULT_CACHE_DIR}]; models live in TIERKV_MODELS_DIR (~/.cache/tierkv/models).")]
ConfigFile = Annotated[Path | None, typer.Option(
    "--config", "-c", envvar="TIERKV_CONFIG", help="A TOML store config (see docs/design.md); TIERKV_* env overrides it.")]
Debug = Annotated[bool, typer.Option("--debug", help="Show tracebacks and debug logs.")]
Json = Annotated[bool, typer.Option("--json", help="Print the figures as JSON instead of tables.")]


class CLIError(Exception):
    """A failure to report on one line; ``code`` is the exit status (1 failure, 2 bad usage)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Settings:
    """Resolved common options: where the cache lives and the store config that goes with it."""

    cache_dir: Path
    config: StoreConfig

    @property
    def l3_path(self) -> Path:
        return Path(self.config.l3.path).expanduser()


def settings(cache_dir: Path | None, config_file: Path | None, debug: bool = False,
             overrides: dict[str, Any] | None = None) -> Settings:
    """The cache directory and store config for a command; L3 moves under ``cache_dir`` unless configured."""
    if debug:
        import logging

        logging.basicConfig(level=logging.DEBUG)
    root = Path(cache_dir if cache_dir is not None else DEFAULT_CACHE_DIR).expanduser()
    if config_file is not None and not config_file.exists():
        raise CLIError(f"--config: no such file {config_file}", 2)
    cfg = StoreConfig.load(config_file, overrides=overrides)
    if cfg.l3.path == L3Config.path:
        cfg = dataclasses.replace(cfg, l3=dataclasses.replace(cfg.l3, path=str(root / "l3")))
    return Settings(root, cfg)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    sys.stdout.flush()


_DURATION = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(s|m|h|d|w)?\s*$")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str, name: str) -> float:
    """Seconds from ``90``, ``90s``, ``15m``, ``2h``, ``3d``, ``1w``; CLIError (exit 2) otherwise."""
    m = _DURATION.match(text)
    if not m:
        raise CLIError(f"{name}: expected a duration like 90s, 15m, 2h, 3d or 1w, got {text!r}", 2)
    return float(m.group(1)) * _SECONDS[m.group(2) or "s"]


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_age(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    if seconds < 86400:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def repo_root() -> Path | None:
    """The source checkout this package runs from (for bench/ scripts), if any."""
    root = Path(__file__).resolve().parents[3]
    return root if (root / "pyproject.toml").exists() else None


MODEL_HELP = ("A registered model name (`tierkv model ls`), a .gguf file, or a local Hugging Face Llama "
              "directory (config.json + safetensors).")


def model_path(arg: str | Path, what: str = "--model") -> Path:
    """The model directory ``--model`` names (``tierkv.models.resolve_model``); CLIError (exit 2) on bad input.

    A registered name is pulled on first use and a GGUF file converted once
    (both cached under the models directory).
    """
    from tierkv.models import resolve_model
    from tierkv.models.gguf_convert import GGUFError

    try:
        return resolve_model(arg)
    except GGUFError as exc:
        raise CLIError(f"{what}: {exc}", 2) from None
    except ValueError as exc:
        raise CLIError(f"{what}: {str(exc).removeprefix('model: ')}", 2) from None
