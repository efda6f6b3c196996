"""What one array argument costs a binding call on the host, by the kind of array: a call with no
array (check_num_tokens), then reset_status with a numpy array and with a torch CPU tensor, and the
tensor's own __dlpack__ export (which nanobind calls to import a torch tensor). Microseconds per
call, best of --repeats runs of --iters calls. Prints one JSON object (--out FILE writes it).

    python python/bench/arg_cost.py [--out FILE]
"""

import argparse
import json
import platform
import time

import numpy as np
import torch

import indexcp


def per_call(fn, iters, repeats):
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - t0) / iters * 1e6)
    return round(best, 3)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out")
    a = ap.parse_args()
    st_np = np.zeros(indexcp.STATUS_BYTES, dtype=np.uint8)
    st_t = torch.zeros(indexcp.STATUS_BYTES, dtype=torch.uint8)
    res = {"benchmark": "binding_arg_cost", "machine": platform.processor() or platform.machine(),
           "python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
           "indexcp": indexcp.__version__, "unit": "microseconds per call (best of the repeats)",
           "no array (check_num_tokens)": per_call(lambda: indexcp.check_num_tokens(1), a.iters, a.repeats),
           "one numpy array (reset_status)": per_call(lambda: indexcp.reset_status(st_np), a.iters, a.repeats),
           "one torch CPU tensor (reset_status)": per_call(lambda: indexcp.reset_status(st_t), a.iters, a.repeats),
           "torch tensor __dlpack__ alone": per_call(lambda: st_t.__dlpack__(), a.iters, a.repeats),
           "numpy __dlpack__ alone": per_call(lambda: st_np.__dlpack__(), a.iters, a.repeats)}
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        open(a.out, "w").write(text + "\n")


if __name__ == "__main__":
    main()
