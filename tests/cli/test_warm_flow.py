"""warm -> ls -> verify -> export -> evict --all -> import -> the same prompts hit L3 again (real subprocesses)."""

from __future__ import annotations

import json

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
