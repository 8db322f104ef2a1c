"""Pieces the benchmark scripts share that have no side effects on import.

(bench_forward.py clears FLEXGEN_POISON when imported; gpu_check.py sets it, so
what both use lives here.)
"""
from __future__ import annotations

import statistics
import time

import torch


class Timer:
    """do_bench medians on CUDA; perf_counter medians on CPU (smoke runs only)."""

    def __init__(self, cuda: bool, warmup_ms=25, rep_ms=100):
        self.cuda, self.warmup_ms, self.rep_ms = cuda, warmup_ms, rep_ms

    def __call__(self, fn) -> float:
        """Median milliseconds of one call of ``fn``."""
        if self.cuda:
            from triton.testing import do_bench
            return float(do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median"))
        fn()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()


def doc_ids(B, L, device, gen, mean_len, min_docs=2) -> torch.Tensor:
    """int32 [B, L]: each row cut at random points into about L / mean_len documents."""
    n_docs = max(min_docs, L // mean_len)
    rows = []
    for _ in range(B):
        cuts = torch.randperm(L - 1, generator=gen)[: n_docs - 1] + 1
        starts = torch.zeros(L, dtype=torch.int32)
        starts[cuts] = 1
        rows.append(torch.cumsum(starts, 0, dtype=torch.int32))
    return torch.stack(rows).to(device)
