#!/usr/bin/env python3
"""Sanity report for data/minilm_stdlib (numpy only).

Checks shapes/dtypes/sha256 against meta.json, finiteness, per-token RMS, that nearby tokens'
keys are more similar than far ones, and how peaked the block scores of the last query are
(block score = max over the 128 tokens of a block of q.k, as in spec/indexer.md section 3).
Exits non-zero when a hard check fails.
"""

import argparse
import hashlib
import json
import os
import sys

import numpy as np

BLOCK = 128
TOPK = 15


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", nargs="?", default=os.path.join(here, "..", "data", "minilm_stdlib"))
    d = os.path.normpath(ap.parse_args().dir)
    with open(os.path.join(d, "meta.json")) as f:
        meta = json.load(f)
    ok = True
    arrs = {}
    for fn, shape in meta["shapes"].items():
        p = os.path.join(d, fn)
        sha = hashlib.sha256(open(p, "rb").read()).hexdigest()
        a = np.load(p)
        good = (a.dtype == np.dtype("<f2") and list(a.shape) == shape
                and sha == meta["sha256"][fn] and a.flags.c_contiguous)
        print(f"{fn}: {a.dtype} {a.shape} {os.path.getsize(p)} bytes sha256 "
              f"{'matches' if sha == meta['sha256'][fn] else 'MISMATCH'} meta.json")
        ok &= good
        arrs[fn] = a.astype(np.float64)
    keys, queries = arrs["keys.npy"], arrs["queries.npy"]
    n_req, n, dim = keys.shape

    finite = bool(np.isfinite(keys).all() and np.isfinite(queries).all())
    print(f"all finite: {finite}")
    ok &= finite
    krms = np.sqrt((keys ** 2).mean(-1))
    qrms = np.sqrt((queries ** 2).mean(-1))
    print(f"key RMS per token: min {krms.min():.4f} mean {krms.mean():.4f} max {krms.max():.4f}; "
          f"|key| max {np.abs(keys).max():.2f}")
    print(f"query RMS per (token, head): min {qrms.min():.4f} mean {qrms.mean():.4f} "
          f"max {qrms.max():.4f}; |query| max {np.abs(queries).max():.2f}")
    ok &= bool(np.abs(krms - 1).max() < 0.01)

    # cosine similarity of keys vs token distance (mean over requests, tokens 1024..)
    dists = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384)
    cos = []
    kn = keys / np.linalg.norm(keys, axis=-1, keepdims=True)
    for dd in dists:
        a, b = kn[:, 1024:n - dd], kn[:, 1024 + dd:]
        cos.append(float((a * b).sum(-1).mean()))
    print("mean key cosine vs distance: " + " ".join(f"{dd}:{c:.3f}" for dd, c in zip(dists, cos)))
    other = float((kn[0, 1024:] * kn[1, 1024:]).sum(-1).mean())
    print(f"  (request 0 vs request 1, same position: {other:.3f})")
    ok &= cos[0] > cos[4] > cos[-1]

    # block scores of the last query position
    n_hist = (n - 1) // BLOCK  # historical blocks, all before the query's own block
    print(f"last query (position {n - 1}), {n_hist} historical blocks, top-{TOPK} of them:")
    print("  share = top-15 share of softmax(block_score / sqrt(128)) (uniform would be "
          f"{TOPK / n_hist:.3f}); z15 = (15th best - mean) / std; recent = top-15 blocks among the "
          "last 16 historical")
    shares = []
    for r in range(n_req):
        cells = []
        for h in range(queries.shape[2]):
            s = (keys[r, : n_hist * BLOCK] @ queries[r, -1, h]).reshape(n_hist, BLOCK).max(1)
            order = np.argsort(-s, kind="stable")
            e = np.exp((s - s.max()) / np.sqrt(dim))
            share = np.sort(e)[::-1][:TOPK].sum() / e.sum()
            shares.append(share)
            z15 = (s[order[TOPK - 1]] - s.mean()) / s.std()
            recent = int((order[:TOPK] >= n_hist - 16).sum())
            cells.append(f"h{h}: share {share:.2f} z15 {z15:.2f} max {s.max():.1f} "
                         f"med {np.median(s):.1f} recent {recent}")
        print(f"  request {r}: " + " | ".join(cells))
    print(f"  mean top-15 softmax share {np.mean(shares):.3f} (min {np.min(shares):.3f}, "
          f"max {np.max(shares):.3f})")
    # do the 4 heads pick different blocks?
    jac = []
    for r in range(n_req):
        sets = []
        for h in range(queries.shape[2]):
            s = (keys[r, : n_hist * BLOCK] @ queries[r, -1, h]).reshape(n_hist, BLOCK).max(1)
            sets.append(set(np.argsort(-s, kind="stable")[:TOPK].tolist()))
        for i in range(len(sets)):
            for j in range(i + 1, len(sets)):
                jac.append(len(sets[i] & sets[j]) / TOPK)
    print(f"  top-15 overlap between heads (same request, last query): mean {np.mean(jac):.2f}")
    print("OK" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
