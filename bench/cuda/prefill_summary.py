#!/usr/bin/env python3
"""One line per (record, run, context, precision mode) of `indexcp bench prefill` records: the
scorers' median times and their fraction of the matrix rate measured in the same run (the fp16
rate for fp32-mode cells, the FP8 rate for fp8_mma cells; n/a where the record has none). A record
whose "runs" is a list of whole bench prefill records (the A/B records of bench/NOTES.md, v17)
gives one group of lines per run.
    python3 bench/cuda/prefill_summary.py RECORD.json [...]"""
import json
import sys

VARIANTS = ("prefill_score", "prefill_gather_score", "prefill_plan_replicated", "prefill_plan_gather")


def runs_of(rec):
    if "results" in rec:
        return [("", rec)]
    runs = rec.get("runs")
    if isinstance(runs, list) and all(isinstance(r, dict) and "results" in r for r in runs):
        return [(r.get("variant_of_run", f"run {i}").split(":")[0] + " ", r) for i, r in enumerate(runs)]
    return []


for path in sys.argv[1:]:
    name = path.rsplit("/", 1)[-1]
    runs = runs_of(json.load(open(path)))
    if not runs:
        print(f"{name}: no bench prefill results")
        continue
    for label, rec in runs:
        rows = {}
        for cell in rec["results"]:
            if cell.get("variant") in VARIANTS and "context" in cell:
                key = (cell["context"], cell.get("score_precision", "fp32"), cell.get("kv_dtype", ""),
                       cell.get("chunk", ""), cell.get("tp", ""))
                rows.setdefault(key, {})[cell["variant"]] = cell
        if not rows:
            print(f"{name} {label}: no bench prefill scorer cells")
        for (ctx, prec, _dt, _chunk, _tp), cells in sorted(rows.items(), key=lambda kv: (kv[0][0], str(kv[0][1:]))):
            frac_key = "fp8_matrix_fraction" if prec == "fp8_mma" else "fp16_matrix_fraction"
            parts = []
            for v in VARIANTS:
                c = cells.get(v)
                if c is None:
                    continue
                f = c.get(frac_key)
                parts.append(f"{v} {c['median_us']:.1f} us ({'n/a' if f is None else f'{100 * f:.1f}%'})")
            print(f"{name} {label}{prec} L={ctx}: " + "; ".join(parts))
