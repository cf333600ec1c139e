"""The `tierkv` command (docs/design.md §14): run, info, ls, warm, verify, evict, export, import, serve, why, model, bench.

``main`` is the console-script entry point. It maps outcomes to exit codes
(0 success, 1 failure, 2 bad usage) and prints failures on one line; pass
``--debug`` anywhere on the command line for the traceback.
"""

from __future__ import annotations

import sys

import typer

try:  # typer >= 0.17 vendors click; older ones raise click's own exceptions
    from typer._click import ClickException as _ClickError
except ImportError:
    from click import ClickException as _ClickError

# Import order is the order of `tierkv --help`.
from tierkv.cli import run_cmd, info_cmd, store_cmds, engine_cmds, why_cmd, route_cmd, model_cmds, bench_cmd  # noqa: F401, I001  (registers commands)
from tierkv.cli.common import CLIError, app, err_console

__all__ = ["app", "main"]


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns (and exits with) the status."""
    args = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in args
    try:
        rv = app(args=args, prog_name="tierkv", standalone_mode=False)
        code = rv if isinstance(rv, int) else 0
    except typer.Exit as exc:
        code = exc.exit_code
    except typer.Abort:
        err_console.print("aborted")
        code = 1
    except _ClickError as exc:  # usage errors from typer's parser: exit_code 2, printed with usage
        exc.show()
        code = exc.exit_code
    except KeyboardInterrupt:
        err_console.print("interrupted")
        code = 130
    except CLIError as exc:
        if debug:
            raise
        err_console.print(f"error: {exc}", markup=False, soft_wrap=True)
        code = exc.code
    except (ValueError, OSError, RuntimeError) as exc:
        if debug:
            raise
        err_console.print(f"error: {exc}", markup=False, soft_wrap=True)
        code = 1
    except Exception as exc:  # anything else is a bug: still one line, traceback with --debug
        if debug:
            raise
        err_console.print(f"error: {type(exc).__name__}: {exc} (run with --debug for the traceback)",
                          markup=False, soft_wrap=True)
        code = 1
    if argv is None:
        sys.exit(code)
    return code
