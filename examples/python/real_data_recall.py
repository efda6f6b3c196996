"""Recall of indexcp's selections against fp32 keys on the embedded real data
(data/minilm_stdlib: 4 requests x 33,024 tokens of index keys and queries of a pretrained
transformer), over the rows `indexcp run` reports: per request the 152 query rows at positions
32872 .. 33023 (its 128-row prefill chunk and 3 decode steps of 8). The keys go into an index cache
in a numpy array (nvfp4 or fp8) and the rows are selected with prefill_select (NVFP4 keys E4M3-rounded,
as the decode default does); the reference scores the unquantized keys and queries in float64.
Recall: the fraction of the reference's blocks that indexcp also selects, per head, averaged
over rows and heads (docs/cli.md).

    python examples/python/real_data_recall.py [--dtype nvfp4|fp8]
"""

import argparse
import os

import numpy as np

import indexcp

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "data", "minilm_stdlib")
FIRST, ROWS, K, P = 32872, 152, 16, 128


def reference_select(keys, q, pos0, K):
    """fp64 scores of the historical blocks, top K-1 by (score desc, id asc) plus the local block."""
    n, H = q.shape[0], q.shape[1]
    dots = np.einsum("rhd,td->rht", q.astype(np.float64), keys.astype(np.float64))  # [rows, H, tokens]
    nb = keys.shape[0] // 128
    blk = dots[:, :, : nb * 128].reshape(n, H, nb, 128).max(axis=3)
    out = np.full((n, H, K), -1, np.int32)
    for i in range(n):
        local = (pos0 + i) // 128
        for h in range(H):
            if local + 1 <= K:
                out[i, h, : local + 1] = np.arange(local + 1)
                continue
            s = blk[i, h, :local]
            order = np.lexsort((np.arange(local), -s))[: K - 1]  # score desc, then id asc
            out[i, h] = np.sort(np.append(order, local))
    return out


def recall(ref, sel):
    hits = [len(set(r[r >= 0]) & set(s[s >= 0])) / max(1, (r >= 0).sum()) for r, s in zip(ref.reshape(-1, K),
                                                                                    sel.reshape(-1, K))]
    return float(np.mean(hits))


def main(dtype="nvfp4", data=DATA):
    keys = np.load(os.path.join(data, "keys.npy"))  # float16 [4, 33024, 128]
    queries = np.load(os.path.join(data, "queries.npy"))  # float16 [4, 256, 4, 128], positions 32768..
    R, T, H = keys.shape[0], keys.shape[1], queries.shape[2]
    pages = T // P
    layout = indexcp.make_page_layout(indexcp.parse_kv_dtype(dtype), P, 1)
    cache = np.zeros(indexcp.view_bytes(layout, R * pages), np.uint8)
    view = indexcp.make_cache_view(layout, cache, R * pages)
    block_table = np.arange(R * pages, dtype=np.int32).reshape(R, pages)
    for r in range(R):
        slots = (block_table[r, np.arange(T) // P].astype(np.int64) * P + np.arange(T) % P)
        indexcp.insert_keys(view, 0, keys[r].astype(np.float32), slots)
    q32 = queries[:, FIRST - 32768:FIRST - 32768 + ROWS].astype(np.float32).reshape(R * ROWS, H, 128)
    q8 = np.zeros((R * ROWS, H, 128), np.uint8)
    indexcp.quantize_queries(q32, q8)
    seq = np.full(R, FIRST + ROWS, np.int32)
    query_start = (np.arange(R + 1) * ROWS).astype(np.int32)
    sel = np.zeros((R * ROWS, H, K), np.int32)
    indexcp.prefill_select(view, 0, q8, block_table, seq, query_start, 0, H, indexcp.SelectionParams(topk=K), sel)
    ref = np.concatenate([reference_select(keys[r], queries[r, FIRST - 32768:FIRST - 32768 + ROWS], FIRST, K)
                          for r in range(R)])
    return recall(ref, sel)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="nvfp4")
    a = ap.parse_args()
    print(f"{a.dtype}: recall vs fp32 keys {main(a.dtype):.4f}")
