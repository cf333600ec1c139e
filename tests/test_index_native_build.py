"""How the native loops are built: real C files as package data, a cache key that names the compiler
and its flags, and the pure-Python path where no compiler exists or TIERKV_NATIVE=0 (same replay JSON)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from fnmatch import fnmatch
from pathlib import Path

from _env import ROOT, load_tool

from tierkv import native

TINY_C = "int tierkv_probe(void) { return 7; }\n"


def test_no_python_file_holds_c_source_and_every_c_file_ships_as_package_data():
    for folder in ("src", "engine", "connectors"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text()
            assert "#include <" not in text and "PyMODINIT_FUNC" not in text, path
    sources = sorted(p.relative_to(ROOT / "src" / "tierkv").as_posix() for p in native.SOURCES.glob("*.c"))
    assert {"index.c", "sha256_chain.c", "block_copy.c"} <= {Path(s).name for s in sources}
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["tierkv"]
    assert all(any(fnmatch(s, g) for g in globs) for s in sources), (sources, globs)


def test_the_build_cache_key_names_the_compiler_and_its_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERKV_CACHE_DIR", str(tmp_path / "cache"))
    built = lambda: sorted(p.name for p in (tmp_path / "cache" / "native").glob("probe-*.so"))  # noqa: E731
    monkeypatch.setenv("CC", "cc")
    first = native._compile("probe", TINY_C, "", [])
    assert native._compile("probe", TINY_C, "", []) == first and len(built()) == 1  # cached
    wrapper = tmp_path / "bin" / "mycc"  # another compiler (a different file on PATH): a new build
    wrapper.parent.mkdir()
    wrapper.write_text('#!/bin/sh\nexec cc "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    assert native._compile("probe", TINY_C, "", []) != first and len(built()) == 2
    monkeypatch.setenv("CC", "cc")
    monkeypatch.setattr(native, "FLAGS", (*native.FLAGS, "-DTIERKV_PROBE=1"))  # other flags: a new build
    assert native._compile("probe", TINY_C, "", []) != first and len(built()) == 3
    assert "-ffp-contract=off" in native.FLAGS


_NO_COMPILER = """
import json, logging
from tierkv import index_native, sha256_chain
from tierkv.index import PrefixIndex
from tierkv.policy import make_policy
index = PrefixIndex([make_policy("hit_density", t) for t in range(3)])
entries = index.save_chain([bytes([i]) * 16 for i in range(4)], 0, 0)
index.unpin(entries)
print(json.dumps({"index": index_native.load() is not None, "c": index._c is not None,
                  "sha": sha256_chain.available(), "victims": [e.depth for e in index.evict(0, 2)]}))
"""


def test_without_a_compiler_everything_runs_in_python(tmp_path):
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"), "TIERKV_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("TIERKV_NATIVE", None)
    proc = subprocess.run([sys.executable, "-c", _NO_COMPILER], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"index": False, "c": False, "sha": False,
                                                                 "victims": [3, 2]}
    assert "no C compiler" in proc.stderr and "using the Python path" in proc.stderr
    assert not list((tmp_path / "cache").rglob("*.so"))


_TIMING = {"seconds", "cpu_seconds", "accesses_per_s", "accesses_per_cpu_s", "accesses_per_cpu_s_by_policy", "native"}


def _decisions(data):
    """The replay JSON without what measures time or names the path (everything the policies decided)."""
    if isinstance(data, dict):
        return {k: _decisions(v) for k, v in data.items() if k not in _TIMING}
    if isinstance(data, list):
        return [_decisions(v) for v in data]
    return data


def test_replay_json_is_the_same_bit_for_bit_with_the_c_loops_and_without(tmp_path):
    tracegen = load_tool("tracegen")
    trace = tmp_path / "mixed.jsonl"
    tracegen.write(tracegen.generate("mixed", 5, 700), trace)
    out = {}
    for flag in ("0", "1"):
        path = tmp_path / f"replay{flag}.json"
        env = {**os.environ, "TIERKV_NATIVE": flag, "TIERKV_CACHE_DIR": str(tmp_path / "cache")}
        proc = subprocess.run([sys.executable, str(ROOT / "tools" / "replay.py"), str(trace), "--capacity", "120,400",
                               "--tiers", "l1=60,l2=200,l3=600", "--policy", "lru,cost_aware,hit_density,lfu,belady",
                               "--json", str(path)], env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[flag] = json.loads(path.read_text())
    assert (out["0"]["native"], out["1"]["native"]) == (False, True)
    assert json.dumps(_decisions(out["0"])) == json.dumps(_decisions(out["1"]))
    assert all(r["hit_rate"] > 0 for r in out["0"]["results"])
