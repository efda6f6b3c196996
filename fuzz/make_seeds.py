#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets into fuzz/corpus/<target>/ (committed; rerun after
changing an input format). Needs NumPy. Usage: python3 fuzz/make_seeds.py"""
import io
import json
import os
import struct

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")


def put(target, name, data):
    d = os.path.join(ROOT, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def npy(a, version=None):
    b = io.BytesIO()
    if version is None:
        np.save(b, a)
    else:
        np.lib.format.write_array(b, a, version=version)
    return b.getvalue()


# ---- fuzz_config: 6 engine bytes (tp, page, heads, query_len, connector, spec) + JSON
eng = bytes([1, 0, 0, 1, 0, 0])  # tp 2, P128, H4, Q1
put("fuzz_config", "nvfp4_on", eng + b'{"indexer_kv_dtype": "nvfp4", "indexer_cache_sharding": "on"}')
put("fuzz_config", "all_keys", bytes([2, 1, 0, 8, 0, 1]) + json.dumps({
    "indexer_kv_dtype": "fp8", "indexer_cache_sharding": "on", "indexer_prefill_cp": "local_score",
    "indexer_decode_cp": False, "indexer_k_rounding": "bf16", "indexer_prefill_gather_budget_mib": 64}).encode())
put("fuzz_config", "fp8_mma", eng + b'{"indexer_kv_dtype": "nvfp4", "indexer_k_rounding": "exact", "indexer_score_precision": "fp8_mma"}')
put("fuzz_config", "bf16_on", eng + b'{"indexer_kv_dtype": "bf16", "indexer_cache_sharding": "on"}')
put("fuzz_config", "decode_cp", bytes([3, 1, 0, 1, 1, 0]) + b'{"indexer_decode_cp": true}')
put("fuzz_config", "repeated_key", eng + b'{"indexer_kv_dtype": "fp8", "indexer_kv_dtype": "nvfp4"}')
put("fuzz_config", "budget_huge", eng + b'{"indexer_prefill_gather_budget_mib": 1e300}')
put("fuzz_config", "not_object", eng + b'[1, 2, 3]')
put("fuzz_config", "empty", eng + b'{}')

# ---- fuzz_model: 8 bytes (budget MiB int32 LE, dtypes, tp, page, flags) + JSON
m = {"name": "m", "layers": 60, "sparse_layers": 57, "q_heads": 64, "kv_heads": 4, "head_dim": 128,
     "index_heads": 4, "index_dim": 128}
pre = struct.pack("<i", 102400) + bytes([0, 1, 0, 0])
put("fuzz_model", "minimax", pre + json.dumps(m).encode())
put("fuzz_model", "tp8_fp8", struct.pack("<i", 4096) + bytes([5, 3, 1, 0]) + json.dumps(dict(m, kv_heads=1)).encode())
put("fuzz_model", "bad_index_dim", pre + json.dumps(dict(m, index_dim=64)).encode())
put("fuzz_model", "sparse_gt_layers", pre + json.dumps(dict(m, sparse_layers=61)).encode())
put("fuzz_model", "huge_budget", struct.pack("<i", 0) + bytes([0, 1, 0, 3]) + json.dumps(dict(m, layers=1, sparse_layers=1, head_dim=16)).encode())
put("fuzz_model", "unknown_key", pre + b'{"layers": 2, "experts": 8}')

# ---- fuzz_npy: file images
put("fuzz_npy", "f32_2x3", npy(np.arange(6, dtype=np.float32).reshape(2, 3)))
put("fuzz_npy", "i32_4", npy(np.array([1, -2, 3, 4], dtype=np.int32)))
put("fuzz_npy", "i64_0d", npy(np.int64(7)))
put("fuzz_npy", "u8_2x2x2", npy(np.arange(8, dtype=np.uint8).reshape(2, 2, 2)))
put("fuzz_npy", "f16_v2", npy(np.ones(3, dtype=np.float16), version=(2, 0)))
put("fuzz_npy", "fortran", npy(np.asfortranarray(np.ones((2, 3), dtype=np.float32))))
put("fuzz_npy", "big_endian", npy(np.ones(2, dtype=">i4")))
put("fuzz_npy", "truncated", npy(np.ones(16, dtype=np.float32))[:-5])
put("fuzz_npy", "empty_shape", npy(np.zeros((0, 128), dtype=np.float32)))

# ---- fuzz_replay: records. raw: id, u16 len, bytes. generated: id|0x80, dtype, ndim, dims u16, param
NAMES = ["case.json", "block_table.npy", "seq_lens.npy", "keys.npy", "cache.npy", "q.npy",
         "query_start.npy", "expected_topk.npy"]
DT = {"float16": 0, "float32": 1, "int32": 2, "int64": 3, "uint8": 4}


def raw(name, data):
    data = data.encode() if isinstance(data, str) else data
    return bytes([NAMES.index(name)]) + struct.pack("<H", len(data)) + data


def gen(name, dtype, shape, param):
    return (bytes([NAMES.index(name) | 0x80, DT[dtype], len(shape)]) +
            b"".join(struct.pack("<H", s) for s in shape) + bytes([param]))


def case(cfg, bt, sl, qs=None, keys_pages=3, rows=None, q_dtype="float32", cache=None):
    out = raw("case.json", json.dumps(cfg))
    out += raw("block_table.npy", npy(np.array(bt, dtype=np.int32)))
    out += raw("seq_lens.npy", npy(np.array(sl, dtype=np.int32)))
    if qs is not None:
        out += raw("query_start.npy", npy(np.array(qs, dtype=np.int32)))
    if cache is None:
        out += gen("keys.npy", "float32", [keys_pages * cfg.get("page_size", 128), 128], 3)
    else:
        out += gen("cache.npy", "uint8", [keys_pages, cache], 5)
    h = cfg.get("heads", 4)
    out += gen("q.npy", q_dtype, [rows, h, 128], 7)
    return out


dec = {"phase": "decode", "tp": 2, "page_size": 128, "query_len": 2,
       "attention_config": {"indexer_kv_dtype": "nvfp4", "indexer_cache_sharding": "on"}}
put("fuzz_replay", "decode_nvfp4_tp2", case(dec, [[2, 0, 1], [1, 2, -1]], [300, 200], rows=4))
put("fuzz_replay", "decode_fp8_decode_cp", case(dict(dec, tp=4, attention_config={"indexer_decode_cp": True}),
                                                [[0, 1, 2]], [384], rows=2, q_dtype="uint8"))
pre_c = {"phase": "prefill", "tp": 2, "page_size": 128, "topk": 4,
         "attention_config": {"indexer_kv_dtype": "fp8", "indexer_cache_sharding": "on"}}
put("fuzz_replay", "prefill_gather", case(pre_c, [[0, 2], [1, -1]], [256, 100], qs=[0, 3, 5], rows=5))
put("fuzz_replay", "prefill_local_score", case(dict(pre_c, attention_config={
    "indexer_kv_dtype": "nvfp4", "indexer_cache_sharding": "on", "indexer_prefill_cp": "local_score"}),
    [[0, 2], [1, -1]], [256, 100], qs=[0, 3, 5], rows=5))
put("fuzz_replay", "decode_cache_nvfp4", case(dict(dec, query_len=1), [[0, 1]], [200], rows=1, cache=128 * 72, keys_pages=2))
put("fuzz_replay", "bad_block_table", case(dec, [[7, 0, 1]], [300], rows=2))
put("fuzz_replay", "nan_q", case(dec, [[0, 1, 2]], [300], rows=2)[:-1] + bytes([0xFF]))
put("fuzz_replay", "bad_json", raw("case.json", '{"phase": "decode", "tp": 2, "page_size": 128, "query_len": 1,'))
put("fuzz_replay", "missing_arrays", raw("case.json", json.dumps(dec)))

# ---- fuzz_batch: a byte program (see fuzz/fuzz_batch.cpp); a few shapes of it
def batch(mode, pages, inserts, B, maxp, hsel, Q, bt, sl, qs, topk, init, extra=b""):
    out = bytes([mode, pages, len(inserts) - 1 if inserts else 0])
    for ins in inserts:
        out += bytes([len(ins)])
        for s in ins:
            out += bytes([0]) + struct.pack("<h", s) if s >= 0 else bytes([0xFF])  # slot
            out += bytes([0])  # no key overrides
        out += bytes([0, 0])  # encode scale, layer
    out += bytes([B, maxp, hsel, Q & 0xFF])
    out += bytes(b & 0xFF for b in bt)
    out += b"".join(struct.pack("<h", s) for s in sl)
    out += b"".join(struct.pack("<h", s) for s in qs)
    out += bytes([topk - 2, init, 0]) + extra
    return out


slots = list(range(0, 40, 3)) + [-1]
put("fuzz_batch", "decode_nvfp4", batch(0, 3, [slots], 2, 2, 0, 1, [0, 1, 2, 0, 0], [200, 150, 0], [0, 0, 0], 4, 0))
put("fuzz_batch", "decode_fp8_q4", batch(1, 4, [slots, [1, 2, 3]], 1, 3, 1, 4, [3, 1, 2, 0], [300, 0], [0, 0], 6, 1))
put("fuzz_batch", "prefill_bf16", batch(2 | 8, 2, [slots], 2, 2, 0, 1, [0, 1, 1, 0, 0], [250, 100, 0], [0, 5, 9], 3, 0))
put("fuzz_batch", "decode_p256", batch(4, 2, [slots], 1, 1, 3, 2, [1, 0], [256, 0], [0, 0], 2, 0))
put("fuzz_batch", "dup_slots", batch(0, 2, [[5, 5]], 1, 1, 0, 1, [0, 0], [10, 0], [0, 0], 4, 0))
put("fuzz_batch", "bad_page", batch(0, 2, [slots], 1, 2, 0, 1, [0, 9, 0], [200, 0], [0, 0], 4, 0))
put("fuzz_batch", "bad_query_len", batch(0, 2, [slots], 1, 2, 0, 17, [0, 1, 0], [200, 0], [0, 0], 4, 0))
print("seeds written under", ROOT)
