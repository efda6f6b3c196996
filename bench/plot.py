#!/usr/bin/env python3
"""Draws PNG charts from the JSON records of `indexcp bench` (bench/results/*.json).

    python3 bench/plot.py RECORD.json [RECORD.json ...] [--out DIR]

Each record is drawn by the function of its chart family, chosen by the record's "benchmark"
field; each chart is written as <record name>-<chart>.png, where the record name is the file name
without .json (so a chart carries the record's version and date):

  decode   <name>-time.png       median time per layer and rank of the whole step of each variant
                                 (replicated stock, ICP general, ICP stock scorer, ICP over NCCL,
                                 the PyTorch baseline: those the record has), per cell (P, requests
                                 x context)
           <name>-ratio.png      ICP time / replicated stock time (the record's
                                 ratio_to_replicated_stock, else computed from the medians), with
                                 parity (1.0), the 0.6 target of bench/NOTES.md and, per cell, the
                                 ratio of bytes read (ICP / replicated)
           <name>-bandwidth.png  the scorers' bandwidth_fraction (bytes read / time / copy
                                 bandwidth of the same run), with the 80% target of bench/NOTES.md
           <name>-floor.png      each variant's median against its bandwidth floor (floor_us, or
                                 bytes_read / copy_bandwidth_gbs), labelled time / floor
  topk     <name>-time.png       median of select, ICP publish, ICP merge (and publish + merge)
           <name>-bandwidth.png  their bandwidth_fraction
  step     <name>-time.png       median of the whole step (all layers, one CUDA graph), sharding off
                                 vs on, labelled per layer and with ratio_to_sharding_off
           <name>-bandwidth.png  its bandwidth_fraction
  prefill  <name>-time.png       median of each prefill step (staging, all-gather, scorer, select,
                                 the whole gather), log scale
           <name>-rates.png      GB/s (gb_per_s) of staging and all-gather; TFLOP/s (tflops) of the
                                 scorer with the FP8 matrix rate measured in the same run
  insert   <name>-time.png       median of the synchronous and the graph-replayed asynchronous
                                 insert per tokens and key format, the asynchronous bars labelled
                                 with the record's speedup_vs_sync

Every chart's title names the record file, its git_rev and date, and the machine (the record's
device, number of GPUs and processes, driver, CUDA). A bar whose two repeats did not agree within
2% (repeats_agree_2pct false: its median is the first repeat's) is marked with *. Only fields the
record holds are drawn; optional fields may be missing. The record format is written by
src/bench/ (see src/bench/bench.hpp); bench/results/README.md says which records are current.

Exit status 1 if a file is not a benchmark record or has no chart family (the other files are
still drawn), else 0. Needs matplotlib (pip install matplotlib, or Debian's python3-matplotlib).
"""
import argparse
import json
import math
import os
import sys

PROG = "bench/plot.py"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
plt = None  # matplotlib.pyplot, imported by main()


# ------------------------------------------------------------------------------------------------
# The loader
# ------------------------------------------------------------------------------------------------

class NotARecord(Exception):
    pass


class Record:
    """One benchmark record: its fields (data), its result rows (results) and where it is."""

    def __init__(self, path, data):
        self.path = path
        self.name = os.path.splitext(os.path.basename(path))[0]
        full = os.path.abspath(path)
        self.display = os.path.relpath(full, REPO) if full.startswith(REPO + os.sep) else os.path.basename(path)
        self.data = data
        self.results = [r for r in data.get("results") or [] if isinstance(r, dict)]
        self.benchmark = data.get("benchmark")

    def get(self, key, default=None):
        return self.data.get(key, default)

    def machine(self):
        """The machine in words, from the record's fields: "NVIDIA H200 x 1, driver ..., CUDA ..."."""
        parts = [str(self.get("device", "unknown device"))]
        gpus, procs = self.get("num_gpus"), self.get("processes")
        if isinstance(gpus, int) and gpus > 0:
            parts[0] += f" x {gpus}"
        if isinstance(procs, int) and procs > 1:
            parts.append(f"{procs} processes")
        if self.get("driver"):
            parts.append(f"driver {self.get('driver')}")
        if self.get("cuda"):
            parts.append(f"CUDA {self.get('cuda')}")
        return ", ".join(parts)

    def title(self, what):
        """Three lines: what the chart shows; the record file, its commit and date; the machine."""
        origin = ", ".join(x for x in (f"git {self.get('git_rev')}" if self.get("git_rev") else "",
                                       str(self.get("date") or "")) if x)
        return f"{what}\nrecord {self.display}" + (f" ({origin})" if origin else "") + f"\non {self.machine()}"

    def rows(self, keys):
        """{(variant, cell): row} with cell the tuple of the keys' values; the first row wins."""
        out = {}
        for r in self.results:
            cell = tuple(r.get(k) for k in keys)
            out.setdefault((r.get("variant"), cell), r)
        return out

    def variants(self):
        return {r.get("variant") for r in self.results}

    def common(self, key):
        """The value of key if every result row that has it agrees, else None."""
        vals = {json.dumps(r[key]) for r in self.results if key in r}
        return json.loads(vals.pop()) if len(vals) == 1 else None


def load_record(path):
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise NotARecord(f"cannot read: {e.strerror or e}")
    except ValueError as e:
        raise NotARecord(f"not JSON ({e})")
    if not isinstance(data, dict) or "benchmark" not in data:
        raise NotARecord('not a benchmark record (a JSON object with "benchmark" and "results")')
    if not isinstance(data.get("results"), list):
        raise NotARecord('"results" is missing or not a list')
    return Record(path, data)


# ------------------------------------------------------------------------------------------------
# Shared drawing
# ------------------------------------------------------------------------------------------------

def num(x):
    """x as a finite float, or None."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x) if math.isfinite(x) else None


def fmt_tokens(v):
    return f"{v // 1024}K" if isinstance(v, int) and v >= 1024 and v % 1024 == 0 else str(v)


def fmt_us(v):
    return f"{v / 1000:.2f} ms" if v >= 1000 else f"{v:.1f} us"


def median_us(r):
    return num(r.get("median_us")) if r else None


def fraction(r):
    return num(r.get("bandwidth_fraction")) if r else None


def of_samples(rec):
    """ " (median of 200)" when every row has the same number of samples, else ""."""
    n = rec.common("samples")
    return f" (median of {n})" if n else ""


def bars(ax, rec, keys, cells, series, value, labels, note=None):
    """Grouped bars: one group per cell, one bar per (variant, legend text) of series with a row in
    the record; value(row) gives the height (None: no bar), note(row, height) an optional text
    above the bar. Marks with * a row whose repeats did not agree within 2%. Returns the heights."""
    index = rec.rows(keys)
    series = [(v, t) for v, t in series if any(value(index.get((v, c))) is not None
                                               for c in cells if index.get((v, c)))]
    w = 0.8 / max(1, len(series))
    heights, starred = [], False
    for i, (v, text) in enumerate(series):
        xs, ys, rows = [], [], []
        for k, c in enumerate(cells):
            r = index.get((v, c))
            y = value(r) if r else None
            if y is not None:
                xs.append(k + (i - (len(series) - 1) / 2) * w)
                ys.append(y)
                rows.append(r)
        ax.bar(xs, ys, w, label=text, color=COLOURS.get(v))
        for x, y, r in zip(xs, ys, rows):
            txt = note(r, y) if note else ""
            if r.get("repeats_agree_2pct") is False:
                txt = (txt + " *").strip()
                starred = True
            if txt:
                ax.annotate(txt, (x, y), ha="center", va="bottom", fontsize=6, xytext=(0, 1),
                            textcoords="offset points")
        heights += ys
    ax.set_xticks(range(len(cells)), labels, fontsize=8)
    if starred:
        ax.plot([], [], " ", label="* repeats not within 2%: first repeat's median")
    return heights


def save(fig, rec, out, chart, written):
    """Writes the figure as <out>/<record name>-<chart>.png."""
    fig.tight_layout()
    path = os.path.join(out, f"{rec.name}-{chart}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)


def finish(fig, ax, rec, out, chart, what, written, legend_outside=False):
    """Title (what, the record, the machine) and legend of a one-panel chart, then save."""
    ax.set_title(rec.title(what), fontsize=8)
    if legend_outside:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    else:
        ax.legend(fontsize=7)
    save(fig, rec, out, chart, written)


def log_if_wide(ax, heights, factor=20):
    pos = [h for h in heights if h > 0]
    if pos and max(pos) / min(pos) > factor:
        ax.set_yscale("log")


def shape(rec, *keys):
    """ "TP2, Q=8, NVFP4"-style text of the shape fields common to all rows."""
    words = {"tp": "TP{}", "query_len": "Q={}", "heads": "{} index heads", "page_size": "P{}",
             "layers": "{} layers", "chunk": "chunk of {} tokens", "requests": "{} requests",
             "context": "{} context"}
    out = []
    for k in keys:
        v = rec.common(k)
        if v is None:
            continue
        if k == "kv_dtype":
            out.append(str(v).upper())
        elif k == "requests" and v == 1:
            out.append("1 request")
        elif k == "context":
            out.append(words[k].format(fmt_tokens(v)))
        else:
            out.append(words[k].format(v))
    return ", ".join(out)


# ------------------------------------------------------------------------------------------------
# Chart families, one function each: (record, output folder) -> list of files written
# ------------------------------------------------------------------------------------------------

DECODE_STEPS = [("replicated_stock", "replicated stock (score + select)"), ("icp_general", "ICP general"),
                ("icp_stock", "ICP stock scorer"), ("icp_nccl", "ICP, exchange through NCCL"),
                ("torch_baseline", "PyTorch baseline")]
DECODE_SCORERS = [("replicated_stock_score", "stock scorer (replicated)"),
                  ("icp_general_score", "general scorer (ICP shard)"),
                  ("torch_baseline", "PyTorch baseline (whole step)")]


def plot_decode(rec, out):
    keys = ("page_size", "requests", "context")
    index = rec.rows(keys)
    cells = sorted({c for _, c in index if all(isinstance(x, int) for x in c)}, key=lambda c: (-c[0], c[1], c[2]))
    if not cells:
        print(f"{PROG}: note: {rec.display}: no decode rows with page_size, requests and context")
        return []
    labels = [f"P{p}\n{n} x {fmt_tokens(c)}" for p, n, c in cells]
    head = shape(rec, "tp", "query_len", "heads", "kv_dtype")
    copy_bw = num(rec.get("copy_bandwidth_gbs"))
    written = []

    fig, ax = plt.subplots(figsize=(10, 5))
    hs = bars(ax, rec, keys, cells, DECODE_STEPS, median_us, labels)
    log_if_wide(ax, hs)
    ax.set_ylabel("us per layer per rank" + of_samples(rec))
    finish(fig, ax, rec, out, "time", f"Decode indexer, one layer: {head}", written)

    icp = [(v, t) for v, t in DECODE_STEPS if v.startswith("icp_")]
    base = lambda c: median_us(index.get(("replicated_stock", c)))

    def ratio(r):
        if r is None:
            return None
        if num(r.get("ratio_to_replicated_stock")) is not None:
            return num(r["ratio_to_replicated_stock"])
        b = base(tuple(r.get(k) for k in keys))
        return median_us(r) / b if b and median_us(r) is not None else None

    if any(ratio(index.get((v, c))) is not None for v, _ in icp for c in cells):
        fig, ax = plt.subplots(figsize=(10, 5))
        bars(ax, rec, keys, cells, icp, ratio, labels, note=lambda r, y: f"{y:.2f}")
        ax.axhline(1.0, color="black", lw=0.6, label="parity: 1.0")
        ax.axhline(0.6, color="red", ls=":", lw=1, label="target (bench/NOTES.md): 0.6")
        first = True
        for k, c in enumerate(cells):
            rb = num((index.get(("replicated_stock", c)) or {}).get("bytes_read"))
            ib = next((num(index[(v, c)].get("bytes_read")) for v, _ in icp if (v, c) in index
                       and num(index[(v, c)].get("bytes_read"))), None)
            if rb and ib:
                ax.plot([k - 0.4, k + 0.4], [ib / rb] * 2, color="gray", ls="--", lw=1,
                        label="bytes read, ICP / replicated" if first else None)
                first = False
        ax.set_ylabel("ICP time / replicated stock time")
        finish(fig, ax, rec, out, "ratio", f"ICP decode relative to the replicated cache: {head}", written)

    if any(fraction(index.get((v, c))) is not None for v, _ in DECODE_SCORERS for c in cells):
        fig, ax = plt.subplots(figsize=(10, 5))
        hs = bars(ax, rec, keys, cells, DECODE_SCORERS, fraction, labels, note=lambda r, y: f"{100 * y:.0f}%")
        ax.axhline(0.8, color="red", ls=":", lw=1, label="target (bench/NOTES.md): 80%")
        ax.set_ylim(0, max([1.0] + [h * 1.1 for h in hs]))
        ax.set_ylabel("index-cache bytes read / time / copy bandwidth"
                      + (f"\n(copy bandwidth {copy_bw:,.0f} GB/s, same run)" if copy_bw else ""))
        finish(fig, ax, rec, out, "bandwidth", f"Decode scorers, fraction of the copy bandwidth: {head}", written)

    def floor(r):
        if not r:
            return None
        if num(r.get("floor_us")):
            return num(r["floor_us"])
        b = num(r.get("bytes_read"))
        return b / (copy_bw * 1e9) * 1e6 if b and copy_bw else None

    floored = [(v, t) for v, t in DECODE_STEPS if any(floor(index.get((v, c))) for c in cells)]
    if floored:
        fig, ax = plt.subplots(figsize=(12, 5))
        hs = bars(ax, rec, keys, cells, floored, median_us, labels,
                  note=lambda r, y: f"{y / floor(r):.1f}x" if floor(r) else "")
        present = [v for v, _ in floored if any(median_us(index.get((v, c))) is not None for c in cells)]
        w = 0.8 / max(1, len(present))
        first = True
        for i, v in enumerate(present):
            for k, c in enumerate(cells):
                f = floor(index.get((v, c)))
                if f and median_us(index.get((v, c))) is not None:
                    x = k + (i - (len(present) - 1) / 2) * w
                    ax.plot([x - w / 2, x + w / 2], [f, f], color="black", lw=2,
                            label="bandwidth floor: bytes read / copy bandwidth" if first else None)
                    first = False
        log_if_wide(ax, hs)
        ax.set_ylabel("us per layer per rank (bars); floor (black ticks)")
        finish(fig, ax, rec, out, "floor", "Decode time against the bandwidth floor"
               + (f" (copy {copy_bw:,.0f} GB/s)" if copy_bw else "") + f"; label: time / floor: {head}",
               written, legend_outside=True)
    return written


TOPK_STEPS = [("replicated_select", "select (replicated)"), ("icp_publish", "ICP publish"),
              ("icp_merge", "ICP merge"), ("icp_publish_merge", "ICP publish + merge")]


def plot_topk(rec, out):
    keys = ("page_size", "requests", "context")
    cells = sorted({c for _, c in rec.rows(keys) if all(isinstance(x, int) for x in c)},
                   key=lambda c: (-c[0], c[1], c[2]))
    if not cells:
        print(f"{PROG}: note: {rec.display}: no topk rows with page_size, requests and context")
        return []
    labels = [f"P{p}\n{n} x {fmt_tokens(c)}" for p, n, c in cells]
    head = shape(rec, "tp", "query_len", "heads", "kv_dtype")
    written = []
    fig, ax = plt.subplots(figsize=(11, 5))
    bars(ax, rec, keys, cells, TOPK_STEPS, median_us, labels)
    ax.set_ylabel("us per layer per rank" + of_samples(rec))
    finish(fig, ax, rec, out, "time", f"Selection and the ICP exchange steps alone: {head}", written)

    fig, ax = plt.subplots(figsize=(11, 5))
    bars(ax, rec, keys, cells, TOPK_STEPS, fraction, labels)
    ax.yaxis.set_major_formatter(lambda y, _: f"{100 * y:.1f}%")
    ax.set_ylabel("bytes read / time / copy bandwidth")
    finish(fig, ax, rec, out, "bandwidth", f"Selection and ICP steps, fraction of the copy bandwidth: {head}", written)
    return written


STEP_VARIANTS = [("step_sharding_off", "sharding off (replicated)"), ("step_sharding_on", "sharding on (ICP)")]


def plot_step(rec, out):
    keys = ("requests",)
    cells = sorted({c for _, c in rec.rows(keys) if isinstance(c[0], int)})
    if not cells:
        print(f"{PROG}: note: {rec.display}: no step rows with requests")
        return []
    labels = [f"{n} requests" for (n,) in cells]
    head = shape(rec, "layers", "tp", "page_size", "context", "query_len", "heads", "kv_dtype")
    written = []

    def note(r, y):
        per = num(r.get("per_layer_us"))
        ratio = num(r.get("ratio_to_sharding_off"))
        return "\n".join(x for x in (f"{per:.1f} us/layer" if per else "", f"{ratio:.2f}x" if ratio else "") if x)

    fig, ax = plt.subplots(figsize=(8, 5))
    ms = lambda r: median_us(r) / 1000 if median_us(r) else None
    bars(ax, rec, keys, cells, STEP_VARIANTS, ms, labels, note=note)
    ax.set_ylabel("ms per step, rank 0" + of_samples(rec))
    ax.margins(y=0.15)
    finish(fig, ax, rec, out, "time", f"Whole decode step in one CUDA graph: {head}", written)

    fig, ax = plt.subplots(figsize=(8, 5))
    bars(ax, rec, keys, cells, STEP_VARIANTS, fraction, labels, note=lambda r, y: f"{100 * y:.0f}%")
    ax.set_ylim(0, 1.0)
    ax.set_ylabel("index-cache bytes read / time / copy bandwidth")
    finish(fig, ax, rec, out, "bandwidth", f"Whole decode step, fraction of the copy bandwidth: {head}", written)
    return written


PREFILL_STEPS = [("stage_fp8", "FP8 staging of rank 0's rows"),
                 ("allgather_simulated", "all-gather (copies on one GPU)"), ("prefill_score", "prefill scorer"),
                 ("prefill_score_select", "synchronous prefill_select"),
                 ("prefill_gather_all_ranks", "whole gather prefill, both ranks (wall clock)")]


def plot_prefill(rec, out):
    keys = ("context",)
    cells = sorted({c for _, c in rec.rows(keys) if isinstance(c[0], int)})
    if not cells:
        print(f"{PROG}: note: {rec.display}: no prefill rows with context")
        return []
    labels = [f"{fmt_tokens(c)} context" for (c,) in cells]
    head = shape(rec, "requests", "chunk", "page_size", "tp", "heads", "kv_dtype")
    written = []
    fig, ax = plt.subplots(figsize=(10, 5))
    bars(ax, rec, keys, cells, PREFILL_STEPS, median_us, labels, note=lambda r, y: fmt_us(y))
    ax.set_yscale("log")
    ax.set_ylabel("us, median (log scale)")
    finish(fig, ax, rec, out, "time", f"Gather prefill of one chunk, per step: {head}", written, legend_outside=True)

    gbs = lambda r: num(r.get("gb_per_s")) if r else None
    tfl = lambda r: num(r.get("tflops")) if r else None
    if any(gbs(r) for r in rec.results) or any(tfl(r) for r in rec.results):
        fig, (a1, a2) = plt.subplots(2, 1, figsize=(10, 7.5))
        bars(a1, rec, keys, cells, PREFILL_STEPS, gbs, labels, note=lambda r, y: f"{y:,.0f}")
        a1.set_ylabel("GB/s (gb_per_s)")
        a1.set_title(rec.title(f"Gather prefill rates: {head}"), fontsize=8)
        a1.legend(fontsize=7)
        bars(a2, rec, keys, cells, PREFILL_STEPS, tfl, labels,
             note=lambda r, y: f"{y:.0f}" + (f" ({100 * num(r['fp8_matrix_fraction']):.1f}%)"
                                            if num(r.get("fp8_matrix_fraction")) else ""))
        peak = num(rec.get("fp8_matrix_tflops"))
        if peak:
            a2.axhline(peak, color="red", ls=":", lw=1, label=f"FP8 matrix rate, same run: {peak:,.0f} TFLOP/s")
            a2.set_yscale("log")
        a2.set_ylabel("TFLOP/s (tflops)")
        a2.legend(fontsize=7)
        save(fig, rec, out, "rates", written)
    return written


INSERT_VARIANTS = [("insert_replicated", "synchronous insert_keys, replicated"),
                   ("insert_sharded", "synchronous insert_keys, shard 0"),
                   ("insert_async_graph_replicated", "insert_keys_async in a CUDA graph, replicated"),
                   ("insert_async_graph_sharded", "insert_keys_async in a CUDA graph, shard 0")]


def plot_insert(rec, out):
    keys = ("tokens", "kv_dtype")
    cells = sorted({c for _, c in rec.rows(keys) if isinstance(c[0], int)}, key=lambda c: (c[0], str(c[1])))
    if not cells:
        print(f"{PROG}: note: {rec.display}: no insert rows with tokens")
        return []
    labels = [f"{t:,} tokens\n{str(d).upper()}" for t, d in cells]
    head = shape(rec, "page_size") + ", one layer"
    tps = {r.get("tp") for r in rec.results if "sharded" in str(r.get("variant"))} - {None}
    of = f"shard 0 of {next(iter(tps))}" if len(tps) == 1 else "shard 0"
    series = [(v, t.replace("shard 0", of)) for v, t in INSERT_VARIANTS]
    written = []
    fig, ax = plt.subplots(figsize=(10, 5))
    bars(ax, rec, keys, cells, series, median_us, labels,
         note=lambda r, y: f"{num(r['speedup_vs_sync']):.1f}x" if num(r.get("speedup_vs_sync")) else "")
    ax.set_ylabel("us per call" + of_samples(rec)
                  + ("\nlabel: speedup over the synchronous call" if "insert_async_graph_replicated" in rec.variants()
                     else ""))
    ax.margins(y=0.1)
    finish(fig, ax, rec, out, "time", f"Insert of one batch of keys: {head}", written)
    return written


def palette(*families):
    """A variant's colour: its place in its family's list, so that it keeps it in every chart."""
    out = {}
    for variants in families:
        for i, (v, _) in enumerate(variants):
            out.setdefault(v, f"C{i % 10}")
    return out


COLOURS = palette(DECODE_STEPS, DECODE_SCORERS, TOPK_STEPS, STEP_VARIANTS, PREFILL_STEPS, INSERT_VARIANTS)
FAMILIES = {"decode": plot_decode, "topk": plot_topk, "step": plot_step, "prefill": plot_prefill,
            "insert": plot_insert}


def main():
    global plt
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("records", nargs="+", metavar="RECORD.json",
                    help="JSON records written by indexcp bench (bench/results/*.json)")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "charts"), metavar="DIR",
                    help="folder for the PNG files (default: bench/charts of this repository)")
    a = ap.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as pyplot
    except ImportError:
        sys.exit(f"{PROG}: error: matplotlib is missing (pip install matplotlib)")
    plt = pyplot
    os.makedirs(a.out, exist_ok=True)
    failed = 0
    for path in a.records:
        try:
            rec = load_record(path)
        except NotARecord as e:
            print(f"{PROG}: error: {path}: {e}", file=sys.stderr)
            failed += 1
            continue
        family = FAMILIES.get(rec.benchmark)
        if family is None:
            print(f"{PROG}: error: {path}: no chart family for benchmark {rec.benchmark!r} "
                  f"(families: {', '.join(FAMILIES)})", file=sys.stderr)
            failed += 1
            continue
        written = family(rec, a.out)
        if written:
            print("wrote " + ", ".join(written))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
