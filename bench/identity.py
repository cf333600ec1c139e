"""What naming the model by the content of its weights costs at start-up (issue 31, docs/design.md §3).

On SmolLM2-135M-Instruct (fp32, one 540 MB safetensors file), interleaved:

- ``start``: a whole engine start (``tierkv.engine.LLM``: weights loaded, prepacked, store
  opened) on a restart, the file digests remembered (one ``stat`` per file);
- ``identity_restart``: ``engine_identity`` with the digests remembered;
- ``identity_first``: ``engine_identity`` with an empty digest cache (every byte hashed; the
  file in the page cache, as right after a download);
- ``read``: the floor under hashing: reading every byte into the same buffer without hashing.

Start without hashing = ``start - identity_restart``. Targets: a restart's identity costs <= 1 %
of that start; hashing is within 2x of reading the bytes. The 16 GB figure scales the measured
hash rate. Verifies what it timed: the first and the restart digests are equal, and the digest
changes when one byte of a copy of the file changes.

    python bench/identity.py [--quick] [--json OUT] [--check]
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import finish, parser, print_table, target, verdict  # noqa: E402


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    import torch

    from tierkv.config import L2Config, StoreConfig
    from tierkv.engine import LLM, EngineConfig
    from tierkv.engine.loader import engine_identity, weight_files
    from tierkv.identity import _CHUNK, hash_file
    from tierkv.models import pull

    torch.set_num_threads(1)
    model = pull("smollm2-135m-instruct")
    files = weight_files(model)
    size = sum(f.stat().st_size for f in files)
    work = Path(tempfile.mkdtemp(prefix="tierkv-bench-identity-"))
    cache = work / "digests.json"
    os.environ["TIERKV_DIGEST_CACHE"] = str(cache)

    def ident():
        return engine_identity(model, "float32", "float32")

    def first():
        cache.unlink(missing_ok=True)
        return ident()

    def read():
        buf = bytearray(_CHUNK)
        for f in files:
            with open(f, "rb", buffering=0) as fh:
                while fh.readinto(buf):
                    pass

    def start():
        llm = LLM(model, StoreConfig(l2=L2Config(capacity=0), l3_enabled=False),
                  EngineConfig(num_blocks=64, num_threads=1), enable_cache=False)
        llm.close()

    read()  # the file in the page cache for every measurement
    d_first = first().digest
    d_restart = ident().digest
    assert d_first == d_restart, "a restart must find the same identity"
    reps = 2 if args.quick else 4
    times: dict[str, list[float]] = {"start": [], "identity_restart": [], "identity_first": [], "read": []}
    for _ in range(reps):  # interleaved: the box's load hits every measurement alike
        for name, fn in (("identity_first", first), ("read", read), ("identity_restart", ident), ("start", start)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    # Verify: one byte changed in a copy of the weights changes the digest.
    copy = work / files[0].name
    shutil.copy(files[0], copy)
    with open(copy, "r+b") as fh:
        fh.seek(size // 2)
        b = fh.read(1)
        fh.seek(size // 2)
        fh.write(bytes([b[0] ^ 0xFF]))
    changed = hash_file(copy) != hash_file(files[0])
    shutil.rmtree(work, ignore_errors=True)
    assert changed, "one changed byte must change the weights' digest"

    bare = med["start"] - med["identity_restart"]
    rate = size / med["identity_first"]
    rows = [
        ("weights", f"{size / 1e6:.0f} MB", f"{len(files)} file(s), {model.name}"),
        ("start (restart, no hashing)", f"{bare:.2f} s", "engine start minus the identity's stat"),
        ("identity, restart", f"{med['identity_restart'] * 1e3:.2f} ms", "stat per file, digests remembered"),
        ("identity, first start", f"{med['identity_first']:.3f} s", f"{rate / 1e9:.2f} GB/s xxh3_128, page cache"),
        ("read floor", f"{med['read']:.3f} s", f"{size / med['read'] / 1e9:.2f} GB/s, same buffer, no hash"),
        ("16 GB checkpoint, first start", f"{16e9 / rate:.1f} s", "at the measured hash rate (plus disk reads)"),
        ("restart overhead", f"{100 * med['identity_restart'] / bare:.3f} %", "of a start without hashing"),
        ("first-start overhead", f"{100 * med['identity_first'] / bare:.1f} %", "of a start without hashing"),
    ]
    print_table("model identity: hashing the weights at start (SmolLM2-135M, fp32)", rows)
    targets = [
        target("restart_overhead", med["identity_restart"] / bare, "<=", 0.01, "start without hashing"),
        target("hash_over_read", med["identity_first"] / med["read"], "<=", 2.0, "reading the bytes"),
    ]
    for t in targets:
        print(f"{t['metric']}: {verdict(t)}")
    finish(args, "identity", {"bytes": size, "median_s": med, "samples_s": times, "start_without_hash_s": bare,
                              "hash_gb_s": rate / 1e9, "est_16gb_first_s": 16e9 / rate,
                              "digest": d_first}, targets)


if __name__ == "__main__":
    main()
