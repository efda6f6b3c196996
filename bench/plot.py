#!/usr/bin/env python3
"""Turns benchmark records (spec/bench.md section 3) into PNG charts.

    python3 bench/plot.py bench/results/decode-h200-2026-11-29.json [more records...] [--out bench/charts]

Needs matplotlib (`pip install matplotlib` or Debian's python3-matplotlib). Writes, per record
<name> (the file name without .json):

decode records ("benchmark": "decode"):
  <name>-time.png      per-layer, per-rank decode time of each variant and configuration
                       (with the PyTorch baseline when the record has torch_baseline results)
  <name>-ratio.png     ICP / replicated-stock time ratio, with the upstream design's 1.77x
  <name>-bandwidth.png fraction of the measured copy bandwidth reached by the scorers
  <name>-floor.png     time of each variant against its bandwidth floor (bytes read / copy bandwidth)

any other record with a "results" list (topk, insert, prefill, step, cpu_decode, ...):
  <name>-time.png      median time per variant and cell; cells are labelled from the shape fields
                       that vary across the results (page size, requests, context, ...)
  <name>-rates.png     only if results carry bandwidth_fraction, tflops or other rate fields
                       (*_fraction, *gbs, *_per_s): one panel per field

Optional fields may be missing anywhere; a file that is not a benchmark record is reported as an
error (exit status 1) and the other files are still plotted.
"""
import argparse
import json
import math
import os
import re
import sys

PROG = "bench/plot.py"


class NotARecord(Exception):
    pass


def num(x):
    """x as a finite float, or None."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x) if math.isfinite(x) else None


def load_record(path):
    try:
        with open(path) as f:
            rec = json.load(f)
    except OSError as e:
        raise NotARecord(f"cannot read: {e.strerror or e}")
    except ValueError as e:
        raise NotARecord(f"not JSON ({e})")
    if not isinstance(rec, dict) or not ("benchmark" in rec or "results" in rec):
        raise NotARecord("not a benchmark record (a JSON object with \"benchmark\" and \"results\")")
    res = rec.get("results")
    if res is not None and not isinstance(res, list):
        raise NotARecord("\"results\" is not a list")
    rec["results"] = [r for r in (res or []) if isinstance(r, dict)]
    return rec


def save(fig, out, name, suffix, written):
    path = os.path.join(out, f"{name}-{suffix}.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)


def fmt_tokens(v):
    return f"{v // 1024}K" if isinstance(v, int) and v >= 1024 and v % 1024 == 0 else str(v)


# ------------------------------------------------------------------------------------------------
# Decode records
# ------------------------------------------------------------------------------------------------

DECODE_VARIANTS = [("replicated_stock", "replicated stock"), ("icp_general", "ICP general"),
                   ("icp_stock", "ICP stock scorer"), ("torch_baseline", "PyTorch baseline")]


def plot_decode(rec, name, out):
    results = rec["results"]
    written = []
    cell_of = lambda r: (r.get("page_size"), r.get("requests"), r.get("context"))
    cells = sorted({cell_of(r) for r in results if all(isinstance(v, int) for v in cell_of(r))},
                   key=lambda c: (-c[0], c[1], c[2]))
    if not cells:
        print(f"{PROG}: note: {name}: no decode results with page_size, requests and context; nothing to plot")
        return written
    label = [f"P{p}\n{n}x{fmt_tokens(c)}" for p, n, c in cells]

    def get(v, c, field="median_us"):
        r = next((r for r in results if r.get("variant") == v and cell_of(r) == c and num(r.get(field)) is not None),
                 None)
        return r

    first = next((r for r in results if r.get("variant") == "replicated_stock"), results[0])
    title = (f"{rec.get('device', '?')}, TP{first.get('tp', '?')}, Q={first.get('query_len', '?')}, "
             f"{str(first.get('kv_dtype', 'nvfp4')).upper()} (git {rec.get('git_rev', '?')})")
    samples = first.get("samples")
    copy_bw = num(rec.get("copy_bandwidth_gbs"))
    present = [(v, t) for v, t in DECODE_VARIANTS if any(get(v, c) for c in cells)]

    def grouped(ax, variants, value, width=None):
        """Bars of value(r) per variant per cell; returns the plotted values."""
        w = width or 0.8 / max(1, len(variants))
        vals = []
        for i, (v, txt) in enumerate(variants):
            xs, ys = [], []
            for k, c in enumerate(cells):
                r = get(v, c)
                y = value(r, c) if r else None
                if y is not None:
                    xs.append(k + (i - (len(variants) - 1) / 2) * w)
                    ys.append(y)
            ax.bar(xs, ys, w, label=txt)
            vals += ys
        ax.set_xticks(range(len(cells)), label)
        return vals

    # time
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ys = grouped(ax, present, lambda r, c: num(r["median_us"]))
    if ys and min(ys) > 0 and max(ys) / min(ys) > 20:
        ax.set_yscale("log")
    ax.set_ylabel(f"us per layer per rank (median{f' of {samples}' if samples else ''})")
    ax.set_title("Decode indexer time: " + title, fontsize=9)
    ax.legend(fontsize=8)
    save(fig, out, name, "time", written)

    # ratio to replicated stock
    icp = [(v, t) for v, t in present if v in ("icp_general", "icp_stock")]
    if icp and any(get("replicated_stock", c) for c in cells):
        fig, ax = plt.subplots(figsize=(9, 4.5))

        def ratio(r, c):
            s = get("replicated_stock", c)
            return num(r["median_us"]) / num(s["median_us"]) if s and num(s["median_us"]) else None

        grouped(ax, icp, ratio, width=0.35)
        ax.axhline(1.77, color="gray", ls="--", lw=1, label="upstream ICP general (GB200/GB300): 1.77x")
        ax.axhline(0.6, color="red", ls=":", lw=1, label="our target: 0.6x")
        ax.axhline(0.5, color="black", ls="-", lw=0.5, label="half the bytes: 0.5x")
        ax.set_ylabel("ICP time / replicated stock time")
        ax.set_title("ICP cost relative to the replicated cache: " + title, fontsize=9)
        ax.legend(fontsize=8)
        save(fig, out, name, "ratio", written)

    # bandwidth fraction
    bwv = [(v, t) for v, t in [("replicated_stock_score", "stock scorer (replicated)"),
                               ("icp_general_score", "general scorer (ICP shard)"),
                               ("torch_baseline", "PyTorch baseline (whole step)")]
           if any(get(v, c, "bandwidth_fraction") for c in cells)]
    if bwv:
        fig, ax = plt.subplots(figsize=(9, 4.5))
        ys = grouped(ax, bwv, lambda r, c: num(r.get("bandwidth_fraction")))
        ax.axhline(0.8, color="red", ls=":", lw=1, label="target: 80% of copy bandwidth")
        ax.set_ylim(0, max([1.0] + [y * 1.05 for y in ys]))
        ax.set_ylabel("fraction of copy bandwidth" + (f" ({copy_bw:.0f} GB/s)" if copy_bw else ""))
        ax.set_title("Index-cache bytes read / time: " + title, fontsize=9)
        ax.legend(fontsize=8)
        save(fig, out, name, "bandwidth", written)

    # time against the bandwidth floor
    floorable = [(v, t) for v, t in present
                 if any(get(v, c) and num(get(v, c).get("bytes_read")) for c in cells)]
    if copy_bw and floorable:
        fig, ax = plt.subplots(figsize=(12, 5))
        w = 0.8 / len(floorable)
        ys = grouped(ax, floorable, lambda r, c: num(r["median_us"]))
        first_tick = True
        for i, (v, _) in enumerate(floorable):
            for k, c in enumerate(cells):
                r = get(v, c)
                b = num(r.get("bytes_read")) if r else None
                if not b:
                    continue
                floor = num(r.get("floor_us")) or b / (copy_bw * 1e9) * 1e6
                x = k + (i - (len(floorable) - 1) / 2) * w
                ax.plot([x - w / 2, x + w / 2], [floor, floor], color="black", lw=2,
                        label="bandwidth floor: bytes read / copy bandwidth" if first_tick else None)
                first_tick = False
                t = num(r["median_us"])
                ax.annotate(f"{t / floor:.1f}x", (x, t), ha="center", va="bottom", fontsize=6,
                            xytext=(0, 1), textcoords="offset points")
        if ys and min(ys) > 0 and max(ys) / min(ys) > 20:
            ax.set_yscale("log")
        ax.set_ylabel("us per layer per rank (bars), floor (black ticks)")
        ax.set_title(f"Decode time vs bandwidth floor (copy {copy_bw:.0f} GB/s; label: time / floor): " + title,
                     fontsize=8)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        save(fig, out, name, "floor", written)
    elif not copy_bw:
        print(f"{PROG}: note: {name}: no copy_bandwidth_gbs, no floor chart")
    return written


# ------------------------------------------------------------------------------------------------
# Every other record: generic charts
# ------------------------------------------------------------------------------------------------

NOT_SHAPE = {"variant", "cell", "timing", "note", "command", "device", "method", "date", "unit"}
METRIC = re.compile(r"(^samples$|bytes|_us$|_ms$|_ns$|_s$|per_s|gbs|tflops|fraction|ratio|^median|^min|^max|"
                    r"^mean|^std|^p\d+|equal|agree|differ|error|^git|captured|^time|^rate|speedup)")
SHAPE_ORDER = ["tp", "world", "page_size", "requests", "batch", "context", "query_len", "rows", "heads", "blocks",
               "topk", "tokens", "chunk", "layers", "kv_dtype", "k_rounding", "sharding", "mode"]
RATE = re.compile(r"(^bandwidth_fraction$|tflops|_fraction$|gbs$|_per_s$)")
TIME_KEYS = [("median_us", 1.0), ("median_ms", 1e3), ("median_ns", 1e-3), ("median_s", 1e6)]


def median_us(r):
    for k, f in TIME_KEYS:
        v = num(r.get(k))
        if v is not None:
            return v * f, f
    return None, None


def shape_label(field, v):
    if v is None:
        return f"no {field}"
    if isinstance(v, bool):
        return field if v else f"no {field}"
    if field == "page_size":
        return f"P{v}"
    if field == "tp":
        return f"TP{v}"
    if field == "query_len":
        return f"Q{v}"
    if field == "heads":
        return f"H{v}"
    if field in ("context", "tokens"):
        return f"{fmt_tokens(v)} {'ctx' if field == 'context' else 'tok'}"
    if field == "requests":
        return f"{v} req"
    if field in ("kv_dtype", "k_rounding", "mode", "sharding") and isinstance(v, str):
        return v
    return f"{field}={v}"


def plot_generic(rec, name, out):
    written = []
    results = [r for r in rec["results"] if median_us(r)[0] is not None]
    if not results:
        print(f"{PROG}: note: {name}: no results with a median time (median_us/median_ms); no time chart")
    keys = {k for r in rec["results"] for k, v in r.items()
            if k not in NOT_SHAPE and not METRIC.search(k) and (isinstance(v, (int, str, bool)) or v is None)}
    varying = [k for k in keys if len({json.dumps(r.get(k)) for r in rec["results"]}) > 1]
    constant = [k for k in keys if k not in varying]
    # a field that only follows the variant (e.g. "sharding" of sharding_off/sharding_on) is not a cell
    by_variant = {}
    for r in rec["results"]:
        by_variant.setdefault(str(r.get("variant", "?")), []).append(r)
    varying = [k for k in varying
               if any(len({json.dumps(r.get(k)) for r in rs}) > 1 for rs in by_variant.values())]

    # a field that only some variants carry and that follows the other shape fields (e.g. "pages"
    # of the prefill staging rows, a function of the context) would split one cell in two
    # ("pages=255" / "no pages"): not a cell either
    def follows_others(k):
        seen = {}
        for r in rec["results"]:
            if r.get(k) is None:
                continue
            cell = tuple(json.dumps(r.get(x)) for x in varying if x != k)
            if seen.setdefault(cell, json.dumps(r[k])) != json.dumps(r[k]):
                return False
        return True

    varying = [k for k in varying if all(r.get(k) is not None for r in rec["results"]) or not follows_others(k)]
    order = lambda k: (SHAPE_ORDER.index(k) if k in SHAPE_ORDER else len(SHAPE_ORDER), k)
    varying.sort(key=order)
    constant.sort(key=order)
    sort_key = lambda c: tuple((0, v, "") if isinstance(v, (int, float)) else (1, 0, str(v)) for v in c)
    cell_of = lambda r: tuple(r.get(k) for k in varying)
    variants = list(dict.fromkeys(str(r.get("variant", "?")) for r in rec["results"]))
    some = rec["results"][0] if rec["results"] else {}
    title = (f"{rec.get('benchmark', '?')}: {rec.get('device', '?')}"
             + "".join(f", {shape_label(k, some.get(k))}" for k in constant if k in some)
             + (f" (git {rec['git_rev']})" if rec.get("git_rev") else ""))

    def chart(rows, value, ylabel, ax, errors=None, log_ok=True):
        cells = sorted({cell_of(r) for r in rows}, key=sort_key)
        vs = [v for v in variants if any(str(r.get("variant", "?")) == v for r in rows)]
        w = 0.8 / max(1, len(vs))
        allv = []
        for i, v in enumerate(vs):
            xs, ys, lo, hi = [], [], [], []
            for k, c in enumerate(cells):
                r = next((r for r in rows if str(r.get("variant", "?")) == v and cell_of(r) == c), None)
                y = value(r) if r else None
                if y is None:
                    continue
                xs.append(k + (i - (len(vs) - 1) / 2) * w)
                ys.append(y)
                e = errors(r) if errors else None
                lo.append(max(0.0, y - e[0]) if e and e[0] is not None else 0.0)
                hi.append(max(0.0, e[1] - y) if e and e[1] is not None else 0.0)
            kw = {"yerr": [lo, hi], "capsize": 2, "error_kw": {"lw": 0.7}} if errors and any(lo + hi) else {}
            ax.bar(xs, ys, w, label=v, **kw)
            allv += ys
        labels = ["\n".join(shape_label(k, x) for k, x in zip(varying, c)) or rec.get("benchmark", "") for c in cells]
        ax.set_xticks(range(len(cells)), labels, fontsize=7 if len(cells) > 8 else 8,
                      rotation=45 if len(cells) > 12 else 0)
        pos = [y for y in allv if y > 0]
        if log_ok and pos and max(pos) / min(pos) > 30:
            ax.set_yscale("log")
        ax.set_ylabel(ylabel)
        if len(vs) > 1 or vs != ["?"]:
            ax.legend(fontsize=7)
        return len(cells)

    def figsize(rows, h):
        n = len({cell_of(r) for r in rows}) * max(1, len(variants))
        return (min(30.0, max(8.0, 0.35 * n + 2)), h)

    if results:
        unit_f = 1e3 if max(median_us(r)[0] for r in results) >= 1e4 else 1.0
        unit = "ms" if unit_f == 1e3 else "us"

        def errs(r):
            _, f = median_us(r)
            suffix = {1.0: "us", 1e3: "ms", 1e-3: "ns", 1e6: "s"}[f]
            lo, hi = num(r.get(f"min_{suffix}")), num(r.get(f"max_{suffix}"))
            return (None if lo is None else lo * f / unit_f, None if hi is None else hi * f / unit_f)

        fig, ax = plt.subplots(figsize=figsize(results, 4.8))
        samples = {r.get("samples") for r in results} - {None}
        chart(results, lambda r: median_us(r)[0] / unit_f,
              f"median {unit}" + (f" of {samples.pop()}" if len(samples) == 1 else "") + " (bars: min-max)",
              ax, errors=errs)
        ax.set_title(title, fontsize=9)
        save(fig, out, name, "time", written)

    rates = sorted({k for r in rec["results"] for k, v in r.items() if RATE.search(k) and num(v) is not None},
                   key=lambda k: (k != "bandwidth_fraction", "tflops" not in k, k))
    if rates:
        rows_of = {k: [r for r in rec["results"] if num(r.get(k)) is not None] for k in rates}
        h = 3.4 * len(rates) + 0.6
        fig, axes = plt.subplots(len(rates), 1, figsize=figsize(max(rows_of.values(), key=len), h), squeeze=False)
        for ax, k in zip(axes[:, 0], rates):
            chart(rows_of[k], lambda r, k=k: num(r.get(k)), k, ax, log_ok=False)
            if k == "bandwidth_fraction" or k.endswith("_fraction"):
                ax.axhline(1.0, color="black", lw=0.5)
                ax.set_ylim(0, max(1.0, max(num(r[k]) for r in rows_of[k]) * 1.05))
            if k == "bandwidth_fraction" and num(rec.get("copy_bandwidth_gbs")):
                ax.set_ylabel(f"fraction of copy bw\n({num(rec['copy_bandwidth_gbs']):.0f} GB/s)")
            peak = next((num(v) for kk, v in rec.items() if "tflops" in kk and num(v)), None)
            if "tflops" in k and peak:
                ax.axhline(peak, color="red", ls=":", lw=1, label="measured FP8 matrix rate")
                ax.legend(fontsize=7)
        axes[0, 0].set_title(title, fontsize=9)
        save(fig, out, name, "rates", written)
    return written


def main():
    global plt
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("records", nargs="+", help="JSON records written by the benchmarks")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "charts"),
                    help="output directory (default: bench/charts next to this script)")
    a = ap.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit(f"{PROG}: error: matplotlib is missing (pip install matplotlib)")
    os.makedirs(a.out, exist_ok=True)
    failed = 0
    for path in a.records:
        name = os.path.splitext(os.path.basename(path))[0]
        try:
            rec = load_record(path)
        except NotARecord as e:
            print(f"{PROG}: error: {path}: {e}", file=sys.stderr)
            failed += 1
            continue
        if not rec["results"]:
            print(f"{PROG}: note: {path}: benchmark {rec.get('benchmark', '?')!r} has no results list; nothing to plot")
            continue
        written = plot_decode(rec, name, a.out) if rec.get("benchmark") == "decode" else plot_generic(rec, name, a.out)
        if written:
            print("wrote " + ", ".join(written))
    sys.exit(1 if failed else 0)


plt = None
if __name__ == "__main__":
    main()
