"""One real ``vllm.LLM`` in its own process, driven command by command (tests/vllm/_e2e.py).

``python e2e_driver.py SPEC_JSON`` builds the LLM from the spec (model dir,
connector extra config or none, LLM keyword arguments), prints ``@@READY``,
then reads one JSON command per stdin line and answers each with one
``@@RESULT {json}`` line on stdout (vLLM's own logs go around it):

- ``{"op": "generate", "prompts": [[ids]...], "max_tokens": n, "cache_salt": s, "lora": [name, id, path]}``: greedy, with
  the chosen tokens' logprobs; per prompt ``ids``, ``logprobs``, ``cached``
  (``num_cached_tokens``: vLLM's own prefix hit plus what the connector loaded);
- ``{"op": "reset"}``: ``reset_prefix_cache()``, retried after a tiny request
  while blocks of a finished request still wait for their saves;
- ``{"op": "metrics"}``: the ``tierkv_*`` and ``vllm:num_preemptions_total`` samples
  of vLLM's Prometheus registry, summed over the engine label;
- ``{"op": "pids"}``: ``[pid, name]`` of this process's descendants (EngineCore, worker);
- ``{"op": "exit"}``: ``del llm`` (vLLM's shutdown: the connector's too), then exit.
"""

from __future__ import annotations

import gc
import json
import sys
import time


def _metrics(llm) -> dict:
    """``tierkv_*`` samples of vLLM's Prometheus registry (what ``/metrics`` serves; ``get_metrics()``
    lists only ``vllm:`` names) and ``vllm:num_preemptions``, summed over the engine label."""
    from prometheus_client import REGISTRY

    out: dict = {}
    for family in REGISTRY.collect():
        for s in family.samples:
            if not (s.name.startswith("tierkv_") or s.name == "vllm:num_preemptions_total"):
                continue
            if s.name.endswith("_created"):
                continue
            labels = {k: v for k, v in s.labels.items() if k in ("tier", "reason", "direction")}
            name = s.name + "".join(f"|{k}={v}" for k, v in sorted(labels.items()))
            out[name] = out.get(name, 0) + s.value
    return out


def _reset(llm, SamplingParams) -> dict:
    for attempt in range(100):
        if llm.reset_prefix_cache():
            return {"ok": True, "attempts": attempt + 1}
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=1), use_tqdm=False)
        time.sleep(0.05)
    return {"ok": False, "attempts": 100}


def main() -> None:
    spec = json.loads(sys.argv[1])
    import psutil
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs = dict(spec.get("llm", {}))
    if spec.get("connector") is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="TierKVConnector", kv_connector_module_path="tierkv.connectors.vllm",
            kv_role="kv_both", kv_connector_extra_config=spec["connector"])
    llm = LLM(model=spec["model"], **kwargs)
    print("@@READY", flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "generate":
            sp = SamplingParams(temperature=0.0, max_tokens=cmd.get("max_tokens", 4), logprobs=0,
                                ignore_eos=True)
            salt = {"cache_salt": cmd["cache_salt"]} if cmd.get("cache_salt") else {}
            lora = {}
            if cmd.get("lora"):  # [name, int id, path]
                from vllm.lora.request import LoRARequest

                lora = {"lora_request": LoRARequest(*cmd["lora"])}
            outs = llm.generate([{"prompt_token_ids": p, **salt} for p in cmd["prompts"]], sp, use_tqdm=False,
                                **lora)
            result = []
            for o in outs:
                c = o.outputs[0]
                lps = [float(lp[t].logprob) for t, lp in zip(c.token_ids, c.logprobs or [])]
                result.append({"ids": list(c.token_ids), "logprobs": lps, "cached": o.num_cached_tokens})
        elif op == "reset":
            result = _reset(llm, SamplingParams)
        elif op == "metrics":
            result = _metrics(llm)
        elif op == "pids":
            # vLLM titles its processes (setproctitle): the command line reads "VLLM::Worker".
            result = [[p.pid, " ".join(p.cmdline()).strip()] for p in psutil.Process().children(recursive=True)]
        elif op == "exit":
            del llm
            gc.collect()
            print("@@RESULT " + json.dumps({"ok": True}), flush=True)
            return
        else:
            result = {"error": f"unknown op {op!r}"}
        print("@@RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
