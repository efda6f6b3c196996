#!/usr/bin/env python3
"""One line per (record, context) of `indexcp bench prefill` records: the scorers' median times and
their fraction of the fp16 (fp32 mode) or FP8 (fp8_mma) matrix rate measured in the same run.
    python3 bench/cuda/prefill_summary.py RECORD.json [...]"""
import json
import sys

VARIANTS = ("prefill_score", "prefill_gather_score", "prefill_plan_replicated", "prefill_plan_gather")

for path in sys.argv[1:]:
    rec = json.load(open(path))
    rows = {}
    for cell in rec["results"]:
        if cell.get("variant") in VARIANTS:
            rows.setdefault(cell["context"], {})[cell["variant"]] = cell
    for ctx, cells in sorted(rows.items()):
        parts = []
        for v in VARIANTS:
            c = cells.get(v)
            if c is None:
                continue
            key = "fp8_matrix_fraction" if c.get("score_precision") == "fp8_mma" else "fp16_matrix_fraction"
            parts.append(f"{v} {c['median_us']:.1f} us ({100 * c.get(key, 0.0):.1f}%)")
        print(f"{path.rsplit('/', 1)[-1]} L={ctx}: " + "; ".join(parts))
