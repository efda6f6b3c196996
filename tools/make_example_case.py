#!/usr/bin/env python3
"""Write a replay case (spec/cases.md) with NumPy alone: what an engine's dump hook would do.

The case is one decode step (or one prefill batch) of one layer: case.json, block_table.npy,
seq_lens.npy, keys.npy, q.npy (and query_start.npy for prefill). Keys and queries come from the
real fixture data/minilm_stdlib (keys.npy float16 [4, 33024, 128], queries.npy float16
[4, 256, 4, 128] for the last 256 positions) when it is present, else from a seeded normal
distribution. Replay it with

    build/bin/indexcp replay CASE_DIR --out OUT_DIR [--scores]

CASE_DIR must be new or empty; case files of an earlier run there (case.json, *.npy of the case
format) are replaced, and a directory holding anything else is refused.

Usage: python3 tools/make_example_case.py CASE_DIR [--phase decode|prefill] [--kv-dtype nvfp4|fp8|bf16]
           [--sharding on|off] [--tp W] [--page-size P] [--requests B] [--tokens L] [--query-len Q]
           [--prefill-tokens T] [--synthetic] [--seed N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

try:
    import numpy as np
except ImportError:
    sys.exit("make_example_case.py needs NumPy: apt-get install python3-numpy (Debian), "
             "or pip install numpy in a virtual environment")

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "data", "minilm_stdlib")


# Every file of the case format (spec/cases.md). A case directory is read as a whole, so stale
# files of an earlier case (a cache.npy beside the new keys.npy, an old expected_topk.npy, a
# prefill query_start.npy in a decode case) would change or break the replay.
CASE_FILES = ("case.json", "block_table.npy", "seq_lens.npy", "keys.npy", "cache.npy", "q.npy",
              "query_start.npy", "expected_topk.npy")


def prepare_case_dir(case_dir: str) -> None:
    """Makes `case_dir` an empty directory: creates it, or removes the case files an earlier run
    wrote there; refuses a directory that holds anything else (exit status 2)."""
    if os.path.exists(case_dir) and not os.path.isdir(case_dir):
        sys.exit(f"make_example_case.py: error: {case_dir}: exists and is not a directory")
    if os.path.isdir(case_dir):
        others = sorted(n for n in os.listdir(case_dir) if n not in CASE_FILES)
        if others:
            shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
            print(f"make_example_case.py: error: {case_dir}: not empty and holds files that are not part of a "
                  f"case ({shown}); give a new or empty directory", file=sys.stderr)
            sys.exit(2)
        for n in CASE_FILES:
            path = os.path.join(case_dir, n)
            if os.path.isdir(path):
                sys.exit(f"make_example_case.py: error: {path}: is a directory")
            if os.path.exists(path):
                os.remove(path)
    os.makedirs(case_dir, exist_ok=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("case_dir")
    ap.add_argument("--phase", choices=["decode", "prefill"], default="decode")
    ap.add_argument("--kv-dtype", choices=["nvfp4", "fp8", "bf16"], default="nvfp4")
    ap.add_argument("--sharding", choices=["on", "off"], default="on")
    # the values the library accepts (spec: config.md section 1): a case it would refuse is not written
    ap.add_argument("--tp", type=int, choices=[1, 2, 4, 8], default=2)
    ap.add_argument("--page-size", type=int, choices=[128, 256], default=128)
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=8192, help="KV length per request, this step's tokens included")
    ap.add_argument("--query-len", type=int, default=8, help="decode rows per request")
    ap.add_argument("--prefill-tokens", type=int, default=64, help="prefill chunk per request")
    ap.add_argument("--synthetic", action="store_true", help="random keys/queries even if the real data exists")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if not 1 <= a.query_len <= 16:
        ap.error(f"--query-len {a.query_len} is out of range 1..16")
    if a.requests < 1 or a.tokens < 1:
        ap.error("--requests and --tokens must be >= 1")
    if a.kv_dtype == "bf16" and a.sharding == "on":
        ap.error("--kv-dtype bf16 is never sharded (indexcp replay refuses such a case); add --sharding off")

    B, L, P, H = a.requests, a.tokens, a.page_size, 4
    T = a.query_len if a.phase == "decode" else a.prefill_tokens
    rng = np.random.default_rng(a.seed)
    real = not a.synthetic and os.path.exists(os.path.join(DATA, "keys.npy"))
    if real:
        keys_all = np.load(os.path.join(DATA, "keys.npy"), mmap_mode="r")  # [R, N, 128] float16
        q_all = np.load(os.path.join(DATA, "queries.npy"), mmap_mode="r")  # [R, Qn, H, 128] float16
        R, N, Qn = keys_all.shape[0], keys_all.shape[1], q_all.shape[1]
        H = q_all.shape[2]
        if B > R or L > N or T > Qn:
            sys.exit(f"the real data holds {R} requests x {N} tokens with queries for the last {Qn} positions")
        # the last L tokens of each request (positions renumbered from 0); queries of the last T
        keys_req = [np.asarray(keys_all[b, N - L:], dtype=np.float32) for b in range(B)]
        q_req = [np.asarray(q_all[b, Qn - T:], dtype=np.float32) for b in range(B)]
    else:
        keys_req = [rng.standard_normal((L, 128), dtype=np.float32) for _ in range(B)]
        q_req = [rng.standard_normal((T, H, 128), dtype=np.float32) for _ in range(B)]

    # physical pages: each request's pages scattered over a shuffled pool, one spare page
    pages_per_req = (L + P - 1) // P
    num_pages = B * pages_per_req + 1
    pool = rng.permutation(num_pages).astype(np.int32)
    block_table = np.full((B, pages_per_req + 1), -1, dtype=np.int32)  # last column: unused, -1
    keys = np.zeros((num_pages * P, 128), dtype=np.float32)  # slots of no request stay zero
    for b in range(B):
        block_table[b, :pages_per_req] = pool[b * pages_per_req:(b + 1) * pages_per_req]
        pos = np.arange(L)
        slots = block_table[b, pos // P].astype(np.int64) * P + pos % P
        keys[slots] = keys_req[b]
    seq_lens = np.full(B, L, dtype=np.int32)
    q = np.concatenate(q_req, axis=0).astype(np.float32)  # [B*T, H, 128], request-major

    case = {
        "phase": a.phase,
        "attention_config": {"indexer_kv_dtype": a.kv_dtype, "indexer_cache_sharding": a.sharding},
        "tp": a.tp,
        "page_size": P,
        "heads": H,
        "topk": 16,
        "init_blocks": 0,
        "local_blocks": 1,
        "comment": ("real keys/queries from data/minilm_stdlib" if real else f"synthetic, seed {a.seed}"),
    }
    if a.phase == "decode":
        case["query_len"] = T
    prepare_case_dir(a.case_dir)
    with open(os.path.join(a.case_dir, "case.json"), "w") as f:
        json.dump(case, f, indent=2)
        f.write("\n")
    np.save(os.path.join(a.case_dir, "block_table.npy"), block_table)
    np.save(os.path.join(a.case_dir, "seq_lens.npy"), seq_lens)
    np.save(os.path.join(a.case_dir, "keys.npy"), keys)
    np.save(os.path.join(a.case_dir, "q.npy"), q)
    if a.phase == "prefill":
        np.save(os.path.join(a.case_dir, "query_start.npy"), (np.arange(B + 1) * T).astype(np.int32))
    print(f"wrote {a.case_dir}: {a.phase}, {B} requests x {L} tokens, {q.shape[0]} rows x {H} heads, "
          f"{a.kv_dtype} sharding {a.sharding} TP{a.tp} P{P} ({'real' if real else 'synthetic'} data)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
