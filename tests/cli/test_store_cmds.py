"""The store-only commands through the real `tierkv` command: ls, info, verify, evict, export, import, bench."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from _servers import redis_server  # noqa: F401  (fixture)
from cli_helpers import LAYOUT, cache, populate, run_tierkv  # noqa: F401  (fixtures)

from tierkv import KVLayout
from tierkv.catalog import open_l3

COMMANDS = ["run", "info", "ls", "warm", "verify", "evict", "export", "import", "bench", "serve"]

RUN_MANY = """
import contextlib, io, json, sys
from tierkv.cli import main
out = []
for argv in json.loads(sys.argv[1]):
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(argv)
    out.append([code, stdout.getvalue(), stderr.getvalue()])
print(json.dumps(out))
"""


def run_many(*argvs: list[str]) -> list[tuple[int, str, str]]:
    """Several `tierkv` invocations through ``main`` in one real subprocess (one torch import, not one each)."""
    proc = subprocess.run([sys.executable, "-c", RUN_MANY, json.dumps(argvs)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr
    return [tuple(x) for x in json.loads(proc.stdout)]


def test_every_command_has_help_with_an_example():
    for name, (code, text, _) in zip(COMMANDS, run_many(*[[name, "--help"] for name in COMMANDS])):
        assert code == 0, name
        assert "Example" in text and f"tierkv {name}" in text, name


def test_bad_usage_exits_2_failures_exit_1_on_one_line(cache):
    (c1, _, e1), (c2, _, e2), (c3, _, e3), (c4, _, e4) = run_many(
        ["evict", "--cache-dir", str(cache)], ["evict", "--older-than", "soon", "--cache-dir", str(cache)],
        ["ls", "--no-such-flag"], ["ls", "--cache-dir", str(cache)])
    assert c1 == 2 and e1.strip() == "error: evict: give exactly one of --namespace, --older-than, --all"
    assert c2 == 2 and "--older-than" in e2
    assert c3 == 2 and "No such option" in e3
    assert c4 == 1 and e4.count("\n") == 1 and "no L3 cache at" in e4 and "Traceback" not in e4
    r = run_tierkv("verify", "--cache-dir", str(cache))  # and as a process exit status
    assert r.code == 1 and r.err.startswith("error: no L3 cache at")


def test_ls_shows_the_tree_by_namespace(cache):
    populate(cache)
    r = run_tierkv("ls", "--json", "--cache-dir", str(cache))
    assert r.code == 0, r.err
    segs = r.json()["segments"]
    # chain a: a shared run of 5 blocks, then two branches; chain b: one run of 4 blocks
    shapes = sorted((g["namespace"], tuple(g["depth"]), g["parent"] is None) for g in segs)
    assert shapes == [("a", (0, 4), True), ("a", (5, 7), False), ("a", (5, 9), False), ("b", (0, 3), True)]
    text = run_tierkv("ls", "--namespace", "a", "--cache-dir", str(cache)).out
    assert "namespace a" in text and "blocks 5..9 (20 tokens)" in text and "tier l3" in text
    assert "namespace b" not in text


def test_info_reports_l3_usage_and_layout(cache):
    populate(cache)
    r = run_tierkv("info", "--json", "--cache-dir", str(cache))
    assert r.code == 0, r.err
    info = r.json()
    assert info["tiers"]["l3"]["used_blocks"] == 17
    assert info["layout"]["fingerprint"] == LAYOUT.fingerprint
    assert info["tiers"]["l3"]["model_id"] == "m"


def _flip_byte(cache, key: bytes) -> None:
    l3 = open_l3(cache / "l3")
    slot = next(r.slot for r in l3.records() if r.key == key)
    stride = l3.stride
    l3.close()
    with open(cache / "l3" / "slots.bin", "r+b") as f:
        f.seek(slot * stride + 17)
        b = f.read(1)
        f.seek(slot * stride + 17)
        f.write(bytes([b[0] ^ 0x5A]))


def test_verify_detects_flipped_bytes_and_repair_removes_them(cache):
    keys = populate(cache)
    bad = keys["a"][0][7]  # depth 7 of the 10-block chain: blocks 8 and 9 hang below it
    _flip_byte(cache, bad)
    r = run_tierkv("verify", "--json", "--cache-dir", str(cache))
    assert r.code == 1
    assert r.json()["bad"] == [bad.hex()] and r.json()["checked"] == 17
    r = run_tierkv("verify", "--repair", "--json", "--cache-dir", str(cache))
    assert r.code == 0, r.err
    assert r.json()["removed"] == 3 and r.json()["orphans_removed"] == 2
    r = run_tierkv("verify", "--json", "--cache-dir", str(cache))
    assert r.code == 0 and r.json()["checked"] == 14 and r.json()["bad"] == []


def test_evict_by_namespace_and_age(cache):
    populate(cache)
    r = run_tierkv("evict", "--namespace", "b", "--json", "--cache-dir", str(cache))
    assert r.code == 0 and r.json()["removed"] == 4 and r.json()["left"] == 13
    r = run_tierkv("evict", "--older-than", "1h", "--json", "--cache-dir", str(cache))
    assert r.json()["removed"] == 0
    r = run_tierkv("evict", "--older-than", "0s", "--json", "--cache-dir", str(cache))
    assert r.json()["removed"] == 13 and r.json()["left"] == 0


def test_import_of_another_model_is_refused_and_another_layout_gets_its_own_directory(cache, tmp_path):
    populate(cache)
    snap = tmp_path / "snap.tar"
    assert run_tierkv("export", str(snap), "--cache-dir", str(cache)).code == 0
    third = tmp_path / "third"
    populate(third, model_id="another-model")
    r = run_tierkv("import", str(snap), "--cache-dir", str(third))
    assert r.code == 1 and "model_id 'm'" in r.err and "Traceback" not in r.err
    assert open_l3(third / "l3").used == 17  # nothing was written
    # Another layout under the same cache dir (another dtype, another model's shape): its blocks
    # go to their own directory, both layouts' blocks stay, and every tool sees both.
    other = tmp_path / "other"
    odd = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, block_size=4)
    populate(other, odd)
    r = run_tierkv("import", str(snap), "--json", "--cache-dir", str(other))
    assert r.code == 0 and r.json()["blocks"] == 17, r.err
    doc = run_tierkv("ls", "--json", "--cache-dir", str(other)).json()
    assert sorted(x["fingerprint"] for x in doc["layouts"]) == sorted([odd.fingerprint, LAYOUT.fingerprint])
    assert all(x["blocks"] == 17 for x in doc["layouts"])
    assert len({g["id"] for g in doc["segments"]}) == len(doc["segments"])
    assert {g["layout"] for g in doc["segments"]} == {odd.fingerprint, LAYOUT.fingerprint}
    r = run_tierkv("verify", "--json", "--cache-dir", str(other))
    assert r.code == 0 and r.json()["checked"] == 34
    info = run_tierkv("info", "--json", "--cache-dir", str(other)).json()
    assert [x["fingerprint"] for x in info["tiers"]["l3"]["layouts"]] == [odd.fingerprint, LAYOUT.fingerprint]
    r = run_tierkv("export", str(tmp_path / "again.tar"), "--cache-dir", str(other))
    assert r.code == 2 and "holds blocks of 2 layouts" in r.err and "--layout" in r.err
    r = run_tierkv("export", str(tmp_path / "again.tar"), "--layout", LAYOUT.fingerprint[:10], "--json",
                   "--cache-dir", str(other))
    assert r.code == 0 and r.json()["blocks"] == 17 and r.json()["layout_fingerprint"] == LAYOUT.fingerprint
    r = run_tierkv("evict", "--all", "--json", "--cache-dir", str(other))
    assert r.code == 0 and r.json()["removed"] == 34
    assert run_tierkv("ls", "--cache-dir", str(other)).code == 1  # nothing left of either
    # and into an emptied cache dir the snapshot imports as the only layout
    r = run_tierkv("import", str(snap), "--json", "--cache-dir", str(other))
    assert r.code == 0 and r.json()["blocks"] == 17, r.err
    segs = run_tierkv("ls", "--json", "--cache-dir", str(other)).json()["segments"]
    assert {(g["namespace"], g["hits"]) for g in segs if g["parent"] is None} == {("a", 0), ("b", 2)}


def test_import_of_a_damaged_snapshot_fails(cache, tmp_path):
    populate(cache)
    snap = tmp_path / "snap.tar"
    assert run_tierkv("export", str(snap), "--cache-dir", str(cache)).code == 0
    with tarfile.open(snap) as tar:
        offset = tar.getmember("blocks.bin").offset_data
    data = bytearray(snap.read_bytes())
    data[offset + 5000] ^= 0xFF
    snap.write_bytes(bytes(data))
    r = run_tierkv("import", str(snap), "--cache-dir", str(tmp_path / "fresh"))
    assert r.code == 1 and "damaged" in r.err


@pytest.mark.parametrize("blocks", [4])
def test_bench_inline_measures_l2_and_l3(cache, blocks):
    r = run_tierkv("bench", "--inline", "--blocks", str(blocks), "--json", "--cache-dir", str(cache))
    assert r.code == 0, r.err
    rows = r.json()["rows"]
    assert [(x["tier"].split()[0], x["op"]) for x in rows] == [("l2", "write"), ("l2", "read"), ("l3", "write"), ("l3", "read")]
    block_bytes = 16 * 2 * 16 * 8 * 128 * 2  # the inline bench's layout: 16 layers, 8 KV heads of 128, fp16
    for x in rows:
        assert x["blocks"] == blocks and x["block_bytes"] == block_bytes
        # Both figures come from one timing, and the bench checked every flag and the bytes it read back.
        assert x["gb_per_s"] == pytest.approx(block_bytes / x["us_per_block"] / 1e3, rel=0.02, abs=0.002)


@pytest.mark.slow
def test_bench_runs_the_checkouts_tier_benchmark(tmp_path):
    """Without --inline, in a checkout, `tierkv bench` is bench/tiers.py --quick (which verifies
    every block it reads) with its JSON passed through."""
    cache = tmp_path / "cache"
    r = run_tierkv("bench", "--json", "--cache-dir", str(cache), timeout=600)
    assert r.code == 0, r.err
    data = r.json()
    assert data["bench"] == "tiers" and data["rounds"] == 11  # the --quick run
    assert data["targets"] and {t["metric"] for t in data["targets"]} <= set(data)
    for t in data["targets"]:
        assert data[t["metric"]] == t["value"]
        assert t["ok"] == (t["value"] >= t["bound"] if t["op"] == ">=" else t["value"] <= t["bound"])
    assert cache.is_dir() and not list(cache.glob("tierkv-bench-*"))  # its work directory is gone


@pytest.mark.redis
def test_info_probes_a_real_l4_pool(cache, redis_server):
    populate(cache)
    env = {"TIERKV_L4_URL": f"redis://127.0.0.1:{redis_server.port}"}
    r = run_tierkv("info", "--json", "--cache-dir", str(cache), env=env)
    assert r.code == 0, r.err
    assert r.json()["tiers"]["l4"]["reachable"] is True and r.json()["tiers"]["l4"]["backend"] == "redis"
    redis_server.stop()
    r = run_tierkv("info", "--json", "--cache-dir", str(cache), env=env)
    assert r.code == 0 and r.json()["tiers"]["l4"]["reachable"] is False


def test_info_reports_rdma_devices_or_why_none(cache, tmp_path):
    # The kernel's own list is the ground truth: /sys/class/infiniband/<dev>/ports/<n>/state.
    sysfs = Path("/sys/class/infiniband")
    names = sorted(d.name for d in sysfs.iterdir()) if sysfs.is_dir() else []
    active = [n for n in names
              if any("ACTIVE" in (p / "state").read_text() for p in (sysfs / n / "ports").iterdir())]
    r = run_tierkv("info", "--cache-dir", str(cache))
    assert r.code == 0, r.err
    info = run_tierkv("info", "--json", "--cache-dir", str(cache)).json()["rdma"]
    assert sorted(d["name"] for d in info["devices"]) == names and info["usable"] == active
    if active:
        assert f"rdma: {', '.join(active)} usable (via " in r.out
    else:
        assert re.search(r"^rdma: none usable, .+; Mooncake L4 falls back to TCP$", r.out, re.M), r.out
        assert info["reason"]
    # pyverbs that cannot be imported (a shadow package that raises): still exit 0, the reason says so.
    shadow = tmp_path / "shadow" / "pyverbs"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('no verbs here')\n")
    r = run_tierkv("info", "--cache-dir", str(cache),
                   env={"PYTHONPATH": os.pathsep.join(filter(None, [str(shadow.parent), os.environ.get("PYTHONPATH")]))})
    assert r.code == 0, r.err
    assert re.search(r"rdma: none usable, pyverbs not importable \(no verbs here\).*; Mooncake L4 falls back to TCP",
                     r.out), r.out


FAKE_PYVERBS = """
class _Attr:
    phys_port_cnt = 2


class _Port:
    def __init__(self, num):
        self.state, self.link_layer, self.gid_tbl_len = (4, 2, 2) if num == 1 else (1, 1, 0)


class Context:
    def __init__(self, name):
        self.name = name

    def query_device(self):
        return _Attr()

    def query_port(self, num):
        return _Port(num)

    def query_gid(self, port, idx):
        if idx == 0:
            return "fe80:0000:0000:0000:0000:0000:0000:0001"
        raise OSError("unpopulated")

    def close(self):
        pass


class _Dev:
    name = b"mlx5_7"


def get_device_list():
    return [_Dev()]
"""


def test_info_shows_an_rdma_device_with_an_active_port(cache, tmp_path):
    # A stand-in for the pyverbs library (the kernel side we cannot have here): one device,
    # port 1 active on Ethernet (RoCE) with a GID, port 2 down.
    pkg = tmp_path / "verbs" / "pyverbs"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "device.py").write_text(FAKE_PYVERBS)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(pkg.parent), os.environ.get("PYTHONPATH")]))}
    r = run_tierkv("info", "--cache-dir", str(cache), env=env)
    assert r.code == 0, r.err
    lines = r.out.splitlines()
    assert "rdma device mlx5_7 port 1: active (ethernet), GIDs fe80:0000:0000:0000:0000:0000:0000:0001" in lines
    assert "rdma device mlx5_7 port 2: down (infiniband), no GID" in lines
    assert "rdma: mlx5_7 usable (via pyverbs); Mooncake L4 uses RDMA on them (protocol=auto)" in lines
    info = run_tierkv("info", "--json", "--cache-dir", str(cache), env=env).json()["rdma"]
    assert info["usable"] == ["mlx5_7"] and info["reason"] == "" and info["source"] == "pyverbs"
    assert [p["state"] for p in info["devices"][0]["ports"]] == ["active", "down"]
