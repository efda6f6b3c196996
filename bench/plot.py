#!/usr/bin/env python3
"""Turns decode benchmark records (spec/bench.md section 3) into PNG charts.

    python3 bench/plot.py bench/results/decode-h200-2026-11-29.json [--out bench/charts]

Needs matplotlib (`pip install matplotlib` or Debian's python3-matplotlib). Writes, per record:
  <name>-time.png      per-layer, per-rank decode time of each variant and configuration
  <name>-ratio.png     ICP / replicated-stock time ratio, with the upstream design's 1.77x
  <name>-bandwidth.png fraction of the measured copy bandwidth reached by the scorers
"""
import argparse, json, os, sys

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("records", nargs="+", help="JSON records written by the decode benchmark")
ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "charts"))
a = ap.parse_args()
try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    sys.exit("bench/plot.py: error: matplotlib is missing (pip install matplotlib)")

VARIANTS = [("replicated_stock", "replicated stock"), ("icp_general", "ICP general"), ("icp_stock", "ICP stock scorer")]
os.makedirs(a.out, exist_ok=True)
for path in a.records:
    try:
        rec = json.load(open(path))
        results = rec["results"]
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"bench/plot.py: error: {path}: not a benchmark record ({e})")
    name = os.path.splitext(os.path.basename(path))[0]
    cells = sorted({(r["page_size"], r["requests"], r["context"]) for r in results if r["variant"] == "replicated_stock"},
                   key=lambda c: (-c[0], c[1], c[2]))
    label = [f"P{p}\n{n}x{c // 1024}K" for p, n, c in cells]
    get = lambda v, c: next((r for r in results if r["variant"] == v and (r["page_size"], r["requests"], r["context"]) == c), None)
    title = f"{rec.get('device', '?')}, TP{results[0].get('tp', 2)}, Q={results[0].get('query_len', 8)}, NVFP4 (git {rec.get('git_rev', '?')})"

    fig, ax = plt.subplots(figsize=(9, 4.5))
    w = 0.8 / len(VARIANTS)
    for i, (v, txt) in enumerate(VARIANTS):
        xs = [k + (i - 1) * w for k, c in enumerate(cells) if get(v, c)]
        ys = [get(v, c)["median_us"] for c in cells if get(v, c)]
        ax.bar(xs, ys, w, label=txt)
    ax.set_xticks(range(len(cells)), label)
    ax.set_ylabel("us per layer per rank (median of 200)")
    ax.set_title("Decode indexer time: " + title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(a.out, f"{name}-time.png"), dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, (v, txt) in enumerate(VARIANTS[1:]):
        xs = [k + (i - 0.5) * 0.35 for k, c in enumerate(cells) if get(v, c)]
        ys = [get(v, c)["median_us"] / get("replicated_stock", c)["median_us"] for c in cells if get(v, c)]
        ax.bar(xs, ys, 0.35, label=txt)
    ax.axhline(1.77, color="gray", ls="--", lw=1, label="upstream ICP general (GB200/GB300): 1.77x")
    ax.axhline(0.6, color="red", ls=":", lw=1, label="our target: 0.6x")
    ax.axhline(0.5, color="black", ls="-", lw=0.5, label="half the bytes: 0.5x")
    ax.set_xticks(range(len(cells)), label)
    ax.set_ylabel("ICP time / replicated stock time")
    ax.set_title("ICP cost relative to the replicated cache: " + title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(a.out, f"{name}-ratio.png"), dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, (v, txt) in enumerate([("replicated_stock_score", "stock scorer (replicated)"), ("icp_general_score", "general scorer (ICP shard)")]):
        xs = [k + (i - 0.5) * 0.35 for k, c in enumerate(cells) if get(v, c)]
        ys = [get(v, c)["bandwidth_fraction"] for c in cells if get(v, c)]
        ax.bar(xs, ys, 0.35, label=txt)
    ax.axhline(0.8, color="red", ls=":", lw=1, label="target: 80% of copy bandwidth")
    ax.set_ylim(0, 1)
    ax.set_xticks(range(len(cells)), label)
    ax.set_ylabel(f"fraction of copy bandwidth ({rec.get('copy_bandwidth_gbs', 0):.0f} GB/s)")
    ax.set_title("Index-cache bytes read / time: " + title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(a.out, f"{name}-bandwidth.png"), dpi=110)
    plt.close(fig)
    print(f"wrote {a.out}/{name}-{{time,ratio,bandwidth}}.png")
