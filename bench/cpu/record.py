#!/usr/bin/env python3
"""Runs build/bench/bench_cpu_decode and writes a record in the format of spec/bench.md section 3
to bench/results/cpu-decode-<host>-<date>.json (CPU backend: no GPU fields).

    python3 bench/cpu/record.py [--build build] [--repetitions 3]
"""
import argparse, datetime, json, os, platform, socket, subprocess, sys

ap = argparse.ArgumentParser()
ap.add_argument("--build", default="build")
ap.add_argument("--repetitions", type=int, default=3)
a = ap.parse_args()
root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
exe = os.path.join(root, a.build, "bench", "bench_cpu_decode")
cmd = [exe, "--benchmark_format=json", f"--benchmark_repetitions={a.repetitions}"]
env = dict(os.environ, OMP_WAIT_POLICY="passive")
out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout)
rev = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
load = os.getloadavg()[0]
results = []
for b in out["benchmarks"]:
    if b.get("aggregate_name") != "median":
        continue
    name = b["run_name"].split("/")[0]
    P = int(b["run_name"].split("/")[1])
    results.append({
        "variant": "replicated" if "Replicated" in name else "icp_general",
        "tp": 2, "page_size": P, "requests": 16, "context": 32768, "query_len": 8, "heads": 4,
        "kv_dtype": "nvfp4", "median_ms": round(b["real_time"], 1), "samples": a.repetitions,
        "note": "both ranks simulated on the same cores; whole step (all ranks), not per rank",
    })
rec = {
    "benchmark": "cpu_decode", "device": f"CPU: {cpu}", "cores": os.cpu_count(), "num_gpus": 0, "processes": 1,
    "host": socket.gethostname(), "load_average_1min": round(load, 2), "git_rev": rev,
    "command": "python3 bench/cpu/record.py  # runs " + " ".join(os.path.relpath(c, root) if c == exe else c for c in cmd),
    "date": datetime.date.today().isoformat(), "results": results,
}
path = os.path.join(root, "bench", "results", f"cpu-decode-{socket.gethostname()}-{rec['date']}.json")
os.makedirs(os.path.dirname(path), exist_ok=True)
json.dump(rec, open(path, "w"), indent=2)
print(f"{'variant':<14}{'P':>5}{'median ms':>12}")
for r in results:
    print(f"{r['variant']:<14}{r['page_size']:>5}{r['median_ms']:>12}")
print("wrote", os.path.relpath(path, root), f"(1-min load average {load:.1f} on {os.cpu_count()} cores)")
