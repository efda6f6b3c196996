"""A plain numpy implementation of the contract (spec/formats.md, spec/indexer.md 2-5), written
from the spec's text for the tests only: the package's results are compared with it bit for bit.
It shares no code with the library."""

import numpy as np

F32 = np.float32

# ---- E4M3 (formats.md 2) and E2M1 (formats.md 1) ------------------------------------------------


def e4m3_value(code):
    """Decoded value of E4M3 codes (uint8 array); NaN for 0x7F / 0xFF."""
    code = np.asarray(code, np.uint8).astype(np.int64)
    s = np.where(code & 0x80, -1.0, 1.0)
    e = (code >> 3) & 0xF
    m = code & 7
    mag = np.where(e == 0, m * 2.0**-9, (8 + m) * np.exp2(e.astype(np.float64) - 10))
    mag = np.where((code & 0x7F) == 0x7F, np.nan, mag)
    return (s * mag).astype(np.float32)


# the positive finite E4M3 values by code (0..126), plus the first value beyond (480, code 127),
# so that rounding to nearest with ties to the even code gives the saturating rule (464 -> 448)
_E4M3_POS = np.array([float(e4m3_value(np.uint8(c))) for c in range(127)] + [480.0])
_E2M1_POS = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _nearest_even(a, table):
    """Index into `table` (ascending) nearest to a >= 0 (float64), ties to the even index,
    saturating at the last index."""
    hi = np.clip(np.searchsorted(table, a, side="left"), 0, len(table) - 1)
    lo = np.clip(hi - 1, 0, len(table) - 1)
    dlo = np.abs(a - table[lo])
    dhi = np.abs(table[hi] - a)
    pick_hi = (dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0))
    idx = np.where(pick_hi, hi, lo)
    return np.where(a >= table[-1], len(table) - 1, idx)


def e4m3_encode(x):
    """fp32 -> E4M3 code, round to nearest even, saturating (NaN -> 0x7F)."""
    x = np.asarray(x, np.float32)
    a = np.abs(x).astype(np.float64)
    a = np.where(np.isinf(a), 1e9, np.where(np.isnan(a), 0.0, a))
    idx = _nearest_even(a, _E4M3_POS)
    idx = np.where(idx == 127, 126, idx)  # 480 is not a finite E4M3 value: saturate to 448
    sign = (x.view(np.uint32) >> 31).astype(np.uint8) << 7
    code = (idx.astype(np.uint8) | sign).astype(np.uint8)
    return np.where(np.isnan(x), np.uint8(0x7F), code).astype(np.uint8)


def e2m1_encode(x):
    """fp32 -> E2M1 code (4 bits), round to nearest even, saturating; NaN -> 0x7."""
    x = np.asarray(x, np.float32)
    a = np.abs(x).astype(np.float64)
    a = np.where(np.isinf(a), 1e9, np.where(np.isnan(a), 0.0, a))
    idx = _nearest_even(a, _E2M1_POS)
    sign = (x.view(np.uint32) >> 31).astype(np.uint8) << 3
    code = (idx.astype(np.uint8) | sign).astype(np.uint8)
    return np.where(np.isnan(x), np.uint8(0x7), code).astype(np.uint8)


def e2m1_value(code):
    code = np.asarray(code, np.uint8)
    v = _E2M1_POS[code & 7]
    return np.where(code & 8, -v, v).astype(np.float32)


# ---- keys (formats.md 3-4) ----------------------------------------------------------------------


def nvfp4_quantize(key, S=1.0):
    """One key (fp32 [128]) -> (packed uint8 [64], scales uint8 [8]) by the canonical recipe."""
    x = np.asarray(key, np.float32).reshape(8, 16)
    S = F32(S)
    r6 = F32(1.0) / F32(6.0)
    codes = np.zeros((8, 16), np.uint8)
    scales = np.zeros(8, np.uint8)
    for g in range(8):
        ax = np.abs(x[g])
        amax = F32(np.max(np.where(np.isnan(ax), F32(0), ax), initial=F32(0)))
        sfv = F32(S * F32(amax * r6))
        sf = e4m3_encode(sfv)
        sff = e4m3_value(sf)
        osc = F32(0) if sff == 0 else F32(F32(1) / F32(sff * F32(F32(1) / S)))
        scales[g] = sf
        with np.errstate(invalid="ignore", over="ignore"):
            codes[g] = e2m1_encode((x[g] * osc).astype(np.float32))
    flat = codes.reshape(128)
    packed = (flat[0::2] | (flat[1::2] << 4)).astype(np.uint8)
    return packed, scales


def bf16_bits(x):
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def key_row_bytes(dtype, key, S=1.0):
    """The row bytes one key takes: nvfp4 64 data + 8 scales, fp8 128, bf16 256 (little-endian)."""
    if dtype == "nvfp4":
        p, s = nvfp4_quantize(key, S)
        return np.concatenate([p, s])
    if dtype == "fp8":
        return e4m3_encode(np.asarray(key, np.float32))
    return bf16_bits(key).view(np.uint8)


KEY_BYTES = {"nvfp4": 72, "fp8": 128, "bf16": 256}

# ---- pages and shards (formats.md 6-7) ----------------------------------------------------------


def page_bytes(dtype, P, W):
    return (P // W) * KEY_BYTES[dtype]


def write_row(cache, dtype, P, W, page_stride, layer_stride, layer, slot, row_bytes, rank):
    """Places one token's row bytes where formats.md 6-7 says rank `rank` stores slot `slot`
    (nothing when another rank owns it)."""
    R = P // W
    page, u = divmod(int(slot), P)
    if u // R != rank:
        return
    j = u % R
    base = layer * layer_stride + page * page_stride
    if dtype == "nvfp4":
        cache[base + j * 64: base + j * 64 + 64] = row_bytes[:64]
        cache[base + R * 64 + j * 8: base + R * 64 + j * 8 + 8] = row_bytes[64:]
    else:
        kb = KEY_BYTES[dtype]
        cache[base + j * kb: base + (j + 1) * kb] = row_bytes


def khat(dtype, row_bytes, mode="e4m3"):
    """Dequantized key k_hat (indexer.md 2) of a key's row bytes: fp32 [128]."""
    if dtype == "fp8":
        return e4m3_value(row_bytes)
    if dtype == "bf16":
        return (row_bytes.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    packed, scales = row_bytes[:64], row_bytes[64:]
    codes = np.empty(128, np.uint8)
    codes[0::2] = packed & 0xF
    codes[1::2] = packed >> 4
    prod = (e2m1_value(codes) * np.repeat(e4m3_value(scales), 16)).astype(np.float32)
    return prod if mode == "exact" else e4m3_value(e4m3_encode(prod))


# ---- scores and selection (indexer.md 3-5) ------------------------------------------------------


def dot(q_codes, k):
    """One (query, head, token) dot product: the exact sum (fp64 holds it exactly for E4M3 x
    k_hat products) rounded once to fp32 -- the CPU backend's documented arithmetic."""
    return F32(np.dot(e4m3_value(q_codes).astype(np.float64), np.asarray(k, np.float64)))


def block_scores(q_codes, keys_by_pos, pos, owner=None):
    """score[h][b] for b < pos // 128 of one query row: max over the block's positions (those in
    keys_by_pos, and of `owner`'s rows when given as (P, W, rank)) of the dot product; -inf where
    no position contributes. q_codes uint8 [H, 128]; keys_by_pos: {position: k_hat fp32 [128]}.
    Each dot product is the exact sum rounded once to fp32 (as dot())."""
    H = q_codes.shape[0]
    local = pos // 128
    s = np.full((H, max(local, 0)), -np.inf, np.float32)
    ps = [p for p in keys_by_pos if p // 128 < local]
    if owner is not None:
        P, W, rank = owner
        ps = [p for p in ps if (p % P) // (P // W) == rank]
    if not ps:
        return s
    k = np.stack([keys_by_pos[p] for p in ps]).astype(np.float64)  # [n, 128]
    d = (e4m3_value(q_codes).astype(np.float64) @ k.T).astype(np.float32)  # [H, n], exact then fp32
    blocks = np.array(ps) // 128
    for b in np.unique(blocks):
        s[:, b] = d[:, blocks == b].max(axis=1)
    return s


def select(scores_h, pos, K, init=0):
    """The selection of indexer.md 4 for one (row, head): int32 [K]."""
    out = np.full(K, -1, np.int32)
    if pos < 0:
        return out
    local = pos // 128
    n = local + 1
    if n <= K:
        out[:n] = np.arange(n)
        return out
    cand = [(-float(scores_h[b]), b) for b in range(init, local)]
    cand.sort()  # score descending, then block id ascending
    chosen = [b for _, b in cand[: K - 1 - init]] + list(range(init)) + [local]
    out[:] = np.sort(np.array(chosen, np.int32))
    return out


def preprocess(x, w=None, eps=1e-6, positions=None, theta=5e6):
    """indexer.md section 6, written from the spec: Gemma-style RMSNorm (ms = the fp32 sum of x_d^2
    in order d = 0..127, / 128; r = 1 / sqrt(ms + eps); y = (x * r) * (1 + w)) and then NeoX RoPE
    on the first 64 dims (pairs (d, d + 32), cos / sin in double rounded to fp32), every operation
    a separately rounded fp32 one. x: float32 [n, 128] (one vector per row); positions [n] or None."""
    f = np.float32
    y = np.array(x, dtype=f, copy=True)
    if w is not None:
        ss = np.zeros(y.shape[0], f)
        for d in range(128):
            ss = (ss + (y[:, d] * y[:, d]).astype(f)).astype(f)
        ms = (ss / f(128.0)).astype(f)
        r = (f(1.0) / np.sqrt((ms + f(eps)).astype(f))).astype(f)
        one_w = (f(1.0) + np.asarray(w, f)).astype(f)
        y = ((y * r[:, None]).astype(f) * one_w[None, :]).astype(f)
    if positions is not None:
        inv = np.array([theta ** (-2.0 * k / 64.0) for k in range(32)], np.float64)
        ang = np.asarray(positions, np.float64)[:, None] * inv[None, :]
        c, s = np.cos(ang).astype(f), np.sin(ang).astype(f)
        lo, hi = y[:, :32].copy(), y[:, 32:64].copy()
        y[:, :32] = ((lo * c).astype(f) - (hi * s).astype(f)).astype(f)
        y[:, 32:64] = ((hi * c).astype(f) + (lo * s).astype(f)).astype(f)
    return y
