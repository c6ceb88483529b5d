"""This machine's memory bandwidth, the bound for a memory-bound decode step.

A batch-1 decode step reads every weight once; once the weights are far larger
than the caches (SmolLM2's 269 MB against an 8 MB L3 here) it cannot run
faster than ``weight bytes / read bandwidth``. Measured with torch on all the
process's threads, as the engines run: a sum over a 1 GiB float32 buffer (pure
streaming read) and a 512 MiB copy (read + write). The best of several passes
is the bound (a bound is what the machine can do, not what it does on average).
Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import time


def measure(passes: int = 10) -> dict[str, float]:
    import torch

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    big = torch.ones(1 << 28, dtype=torch.float32)  # 1 GiB
    src = torch.ones(1 << 27, dtype=torch.float32)  # 512 MiB
    dst = torch.empty_like(src)
    best_read = best_copy = float("inf")
    for _ in range(passes):
        t = time.perf_counter()
        big.sum()
        best_read = min(best_read, time.perf_counter() - t)
        t = time.perf_counter()
        dst.copy_(src)
        best_copy = min(best_copy, time.perf_counter() - t)
    return {
        "read_gb_s": round(big.numel() * 4 / best_read / 1e9, 2),
        "copy_gb_s": round(2 * src.numel() * 4 / best_copy / 1e9, 2),
        "threads": torch.get_num_threads(),
        "load": os.getloadavg()[0],
    }


if __name__ == "__main__":
    print(json.dumps(measure()))
