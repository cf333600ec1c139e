"""warm -> ls -> verify -> export -> evict --all -> import -> the same prompts hit L3 again (real subprocesses)."""

from __future__ import annotations

import json

from _servers import redis_server  # noqa: F401  (fixture)
from cli_helpers import cache, run_tierkv, tiny_model  # noqa: F401  (fixtures)

SYSTEM = "You are a careful assistant. " * 6  # 174 bytes: 10 full blocks of 16 tokens


def test_warm_ls_verify_export_evict_import_hits_again(cache, tiny_model, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(x) for x in [
        {"prompt": SYSTEM + "Question one?"},
        {"prompt": SYSTEM + "Question two, a longer one?", "namespace": "tenant-b"},
        {"prompt_token_ids": list(range(40, 90))},
    ]) + "\n")
    common = ["--model", str(tiny_model), "--json", "--cache-dir", str(cache)]
    r = run_tierkv("warm", str(prompts), *common)
    assert r.code == 0, r.err
    first = r.json()
    assert first["prompts"] == 3 and sum(first["hit_tokens"].values()) == 0
    assert first["blocks_written"] == {"l3": 11 + 12 + 3}

    segs = run_tierkv("ls", "--json", "--cache-dir", str(cache)).json()["segments"]
    assert sorted(g["namespace"] for g in segs if g["parent"] is None) == ["", "", "tenant-b"]
    assert run_tierkv("verify", "--cache-dir", str(cache)).code == 0

    snap = tmp_path / "warm.tar"
    r = run_tierkv("export", str(snap), "--json", "--cache-dir", str(cache))
    assert r.code == 0 and r.json()["blocks"] == 26 and r.json()["model_id"] == "tiny"
    assert run_tierkv("evict", "--all", "--cache-dir", str(cache)).code == 0
    r = run_tierkv("import", str(snap), "--json", "--cache-dir", str(cache))
    assert r.code == 0 and r.json()["blocks"] == 26, r.err
    # The snapshot carries the model identity that wrote the blocks: a fresh node importing it
    # records the same one (what `tierkv why` and `info` name), with the same field digests.
    idents = run_tierkv("info", "--json", "--cache-dir", str(cache)).json()["tiers"]["l3"]["identities"]
    fresh = tmp_path / "fresh-node"
    assert run_tierkv("import", str(snap), "--json", "--cache-dir", str(fresh)).code == 0
    theirs = run_tierkv("info", "--json", "--cache-dir", str(fresh)).json()["tiers"]["l3"]["identities"]
    assert len(idents) == 1 and [i["fields"] for i in theirs] == [idents[0]["fields"]]
    assert "weights" in idents[0]["fields"] and "config" in idents[0]["fields"]

    r = run_tierkv("warm", str(prompts), *common)
    assert r.code == 0, r.err
    again = r.json()
    # the last token of a prompt is always computed, so a prompt hits its full blocks before it
    assert again["hit_tokens"]["l3"] == (11 + 12 + 3) * 16
    assert again["blocks_written"] == {"l3": 0}
    segs = run_tierkv("ls", "--json", "--cache-dir", str(cache)).json()["segments"]
    roots = sorted((g["namespace"], g["hits"]) for g in segs if g["parent"] is None)
    assert roots == [("", 1), ("", 1), ("tenant-b", 1)]  # each chain was hit once, by the second warm


def test_warm_rejects_a_bad_prompts_file(cache, tiny_model, tmp_path):
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text('{"prompt": "fine"}\n{"prompt": 5}\n')
    r = run_tierkv("warm", str(prompts), "--model", str(tiny_model), "--cache-dir", str(cache))
    assert r.code == 1 and r.err.startswith(f"error: {prompts}:2:") and "Traceback" not in r.err


# Three chains of token ids (no tokenizer involved): 5, 3 and 7 full blocks of 16 tokens plus a tail.
ID_PROMPTS = [list(range(10, 10 + 16 * 5 + 3)), list(range(100, 100 + 16 * 3 + 1)),
              [7] * 20 + list(range(200, 200 + 16 * 7 - 20 + 5))]
FULL_BLOCKS = 5 + 3 + 7


def warm_ids(tmp_path, tiny_model, cache, env: dict) -> dict:
    prompts = tmp_path / "ids.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_token_ids": ids}) + "\n" for ids in ID_PROMPTS))
    r = run_tierkv("warm", str(prompts), "--model", str(tiny_model), "--json", "--cache-dir", str(cache), env=env)
    assert r.code == 0, r.err
    return r.json()


def test_warm_into_l4_is_hit_by_a_node_with_an_empty_l3(redis_server, tiny_model, tmp_path):
    env = {"TIERKV_L4_URL": redis_server.url}
    first = warm_ids(tmp_path, tiny_model, tmp_path / "node-a", env)
    assert first["blocks_written"] == {"l3": FULL_BLOCKS, "l4": FULL_BLOCKS}
    assert redis_server.client().dbsize() == FULL_BLOCKS
    # Another node (its own, empty L3) warming the same prompts finds every full block in L4,
    # each value checked against its trailer (key, layout, length, checksum) as it lands.
    second = warm_ids(tmp_path, tiny_model, tmp_path / "node-b", env)
    assert second["hit_tokens"] == {"l1": 0, "l2": 0, "l3": 0, "l4": FULL_BLOCKS * 16}
    assert second["blocks_written"]["l3"] == FULL_BLOCKS
    # (persist does not ask L4 first, so warm sends the 15 values again: the same names, no new keys)
    assert redis_server.client().dbsize() == FULL_BLOCKS


def test_warm_into_a_shared_l2_is_hit_by_the_next_process(shm_name, tiny_model, tmp_path):
    env = {"TIERKV_L2_SHARED_NAME": shm_name}
    first = warm_ids(tmp_path, tiny_model, tmp_path / "proc-a", env)
    assert first["blocks_written"] == {"l3": FULL_BLOCKS, "l2": FULL_BLOCKS}
    # The slab outlives the process that wrote it: the next one (its own, empty L3) hits it.
    second = warm_ids(tmp_path, tiny_model, tmp_path / "proc-b", env)
    assert second["hit_tokens"] == {"l1": 0, "l2": FULL_BLOCKS * 16, "l3": 0, "l4": 0}
    assert second["blocks_written"] == {"l3": FULL_BLOCKS, "l2": 0}
