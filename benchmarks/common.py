"""Pieces the benchmark scripts share that have no side effects on import.

(bench_forward.py clears FLEXGEN_POISON when imported; gpu_check.py sets it, so
what both use lives here.) flexgen and triton are imported inside the functions,
after each script has set its environment.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
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


def graph_ms(fn, timer, cuda, repeat: int = 1) -> float | None:
    """Median ms of ``fn`` replayed from a CUDA graph captured by hand, as a serving loop runs
    its decode steps (warmed up on a side stream first: nothing may synchronize during the
    capture). With ``repeat``, that many calls in one graph, per call: a model's step replays
    one graph for all its layers, so the graph's own launch (~3 us) is not paid per kernel.
    None on CPU."""
    if not cuda:
        return None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            fn()
    ms = timer(graph.replay) / repeat
    del graph
    return ms


def copy_gbps(timer, cuda) -> float | None:
    """Device-to-device copy bandwidth (GB/s: bytes read + written), a memory-bound kernel's ceiling."""
    if not cuda:
        return None
    n = 1 << 28                                        # 1 GiB of float32
    src = torch.empty(n, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    del src, dst
    return 2 * n * 4 / (ms * 1e-3) / 1e9


# The document ids' dtype (``--doc-ids``): int32 as flexgen's helpers make them; int64 as
# Hugging Face's packed-sequence ids arrive (compared in int64 by every peer).
DOC_IDS_DTYPE = torch.int32


def doc_ids(B, L, device, gen, mean_len, min_docs=2) -> torch.Tensor:
    """[B, L] of DOC_IDS_DTYPE: each row cut at random points into about L / mean_len documents."""
    n_docs = max(min_docs, L // mean_len)
    rows = []
    for _ in range(B):
        cuts = torch.randperm(L - 1, generator=gen)[: n_docs - 1] + 1
        starts = torch.zeros(L, dtype=torch.int32)
        starts[cuts] = 1
        rows.append(torch.cumsum(starts, 0, dtype=torch.int32))
    return torch.stack(rows).to(device=device, dtype=DOC_IDS_DTYPE)


def add_doc_ids_option(ap) -> None:
    ap.add_argument("--doc-ids", choices=("int32", "int64"), default="int32",
                    help="the document masks' id dtype (default int32; int64 as Hugging Face's)")


def set_doc_ids(args) -> None:
    global DOC_IDS_DTYPE
    DOC_IDS_DTYPE = getattr(torch, args.doc_ids)


def environment(cuda: bool, **extra) -> dict:
    """Date, host, versions and the device, for a results JSON (``extra`` added as is)."""
    import triton

    import flexgen
    info = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                host=platform.node(), python=platform.python_version(), torch=torch.__version__,
                triton=triton.__version__, flexgen=flexgen.__version__)
    if cuda:
        p = torch.cuda.get_device_properties(0)
        info.update(device_name=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                    memory_gib=round(p.total_memory / 2**30, 1), cuda=torch.version.cuda)
    else:
        info.update(device_name="cpu (smoke: Triton interpreter, numbers meaningless)")
    try:
        info["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                            text=True, timeout=5, cwd=os.path.dirname(__file__)).stdout.strip()
    except Exception:
        pass
    info.update(extra)
    return info


def report(summary: str, env_var: str, tail: str = "") -> None:
    """Print a script's summary table last (then ``tail``), and write it to the file named
    by ``$env_var`` when set (run_all.sh collects the summaries there)."""
    print("\n" + summary + tail, flush=True)
    summary_file = os.environ.get(env_var)
    if summary_file:
        with open(summary_file, "w") as f:
            f.write(summary + "\n")


def write_json(path, payload):
    """Write ``payload`` to ``path`` atomically (nothing when ``path`` is empty)."""
    if not path:
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1, default=str)
    os.replace(tmp, path)
