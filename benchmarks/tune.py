"""Measure the rows of flexgen's checked-in tile table (``flexgen.runtime.tuning.TUNED``) on this GPU.

    python benchmarks/tune.py                          # D 64 and 128, bf16, forward and both backward parts
    python benchmarks/tune.py --dims 128 --jobs 8 --budget 300
    python benchmarks/tune.py --smoke                  # CPU: checks the script (no timing there)

For each head dim it runs flexgen's own autotuner (``flexgen.autotune``) on a
few representative cases (full and causal attention over 16k tokens),
forward and backward, so every candidate configuration of every kernel is
timed on the case's inputs. A table row is then the configuration with the
best geometric mean over the cases of (its time / the case's best time): one
configuration that is never far from the best, rather than the winner of one
shape.

Compiling ~45 configurations per kernel serially takes minutes, so first
``--jobs`` worker processes compile them (each a slice of the candidates,
sharing one Triton cache, timing nothing); then this process times them all
from that cache.

Prints the ``TUNED`` entries to paste into ``flexgen/tuning.py`` and writes
every timing to ``tune.json`` in ``--out`` ($OUT, else benchmarks/results/).
"""
from __future__ import annotations

import os

os.environ.pop("FLEXGEN_POISON", None)      # timings must not include NaN fills

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import multiprocessing  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

import flexgen  # noqa: E402
from flexgen.runtime import tuning  # noqa: E402

H = 16
TOKENS = 16384
CASES = (("full", 16384), ("causal", 16384))


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def run_case(variant, L, D, device, dtype, tokens, heads):
    """One forward + backward of a case (inside autotune mode this tunes its three kernels)."""
    B = max(1, tokens // L)
    gen = torch.Generator(device=device).manual_seed(L + D)
    q, k, v = (torch.randn(B, heads, L, D, device=device, dtype=dtype, generator=gen).requires_grad_()
               for _ in range(3))
    block_mask = None
    if variant == "causal":
        block_mask = flexgen.create_block_mask(causal, None, None, L, L, device=device)
    out = flexgen.flex_attention(q, k, v, block_mask=block_mask)
    out.backward(torch.randn_like(out))
    if device.type == "cuda":
        torch.cuda.synchronize()


def sweep(spec, sparse) -> list:
    """The autotuner's candidates, less the ones that never won in earlier sweeps on Hopper
    (32-row forward tiles, 4-stage backward pipelines), to keep a table run in minutes."""
    found = _ALL_CANDIDATES(spec, sparse)
    if spec.template == "forward":
        return [c for c in found if c["BLOCK_M"] >= 64]
    return [c for c in found if c["num_stages"] <= 3]


_ALL_CANDIDATES = tuning.candidates


def _compile_only(job, jobs, dims, cases, dtype_name, tokens, heads):
    """A worker: compile its slice of every kernel's candidates (launch each once, time nothing)."""
    import triton.testing
    sys.stderr = open(os.devnull, "w")      # twelve workers' progress bars would bury the log
    tuning.candidates = lambda spec, sparse: sweep(spec, sparse)[job::jobs]
    triton.testing.do_bench = lambda fn, **kw: (fn(), 1.0)[1]
    os.environ["FLEXGEN_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"flexgen-tune-{job}-")
    device = torch.device("cuda")
    with flexgen.autotune():
        for D in dims:
            for variant, L in cases:
                run_case(variant, L, D, device, getattr(torch, dtype_name), tokens, heads)


def precompile(jobs, dims, cases, dtype_name, tokens, heads, deadline):
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_compile_only, args=(j, jobs, dims, cases, dtype_name, tokens, heads))
             for j in range(jobs)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
        if p.is_alive():
            p.terminate()
            print(f"  compile worker {p.pid} ran out of time: the timing pass compiles the rest")


def table_rows(entries, specs_by_name) -> dict:
    """(kernel, D) -> (configuration, geometric mean slowdown vs each case's best, cases)."""
    groups: dict = {}
    for entry in entries.values():
        spec = specs_by_name.get(entry["kernel"])
        if spec is None or not entry.get("timings"):
            continue
        kernel = "forward" if spec.template == "forward" else f"backward.{spec.part}"
        groups.setdefault((kernel, max(spec.qk_head, spec.v_head)), []).append(entry["timings"])
    rows = {}
    for group, cases in groups.items():
        scores: dict = {}
        for timings in cases:
            done = [ms for _, ms in timings if ms]
            if not done:
                continue
            best = min(done)
            for config, ms in timings:
                key = json.dumps(config, sort_keys=True)
                scores.setdefault(key, []).append(math.log(ms / best) if ms else math.inf)
        complete = {k: v for k, v in scores.items() if len(v) == len(cases)}
        if complete:
            key = min(complete, key=lambda k: sum(complete[k]))
            rows[group] = (json.loads(key), math.exp(sum(complete[key]) / len(cases)), len(cases))
    return rows


def report(out, gpu, device, dtype_name, cases, tokens, heads, specs_by_name) -> dict:
    entries = tuning._load_store()
    rows = table_rows(entries, specs_by_name)
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "tune.json")
    with open(path, "w") as f:
        json.dump({"gpu": gpu, "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                   "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "torch": torch.__version__, "triton": __import__("triton").__version__,
                   "cases": cases, "tokens": tokens, "heads": heads,
                   "rows": [{"kernel": k, "head_dim": d, "config": c, "geomean_slowdown": g, "cases": n}
                            for (k, d), (c, g, n) in sorted(rows.items())],
                   "entries": entries}, f, indent=1)
    return rows


def print_rows(rows, gpu, dtype_name):
    dt = dtype_name       # the spec's dtype names are torch's
    print(f"\n# {gpu}, {dt}: geometric mean over the cases of time / the case's best "
          f"({datetime.date.today()}, benchmarks/tune.py)")
    for (kernel, D), (config, slowdown, n) in sorted(rows.items()):
        print(f'    ("{kernel}", "{gpu}", "{dt}", {D}): dict('
              + ", ".join(f"{k}={v}" for k, v in config.items())
              + f"),   # {slowdown:.3f}x best over {n} cases")
    for entry in sorted(tuning._load_store().values(), key=lambda e: e["kernel"]):
        print(f"  {entry['kernel']:<34} bucket {entry['bucket']}: best {entry['config']} "
              f"{entry['ms'] if entry['ms'] is None else round(entry['ms'], 4)} ms")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 1))
    ap.add_argument("--budget", type=float, default=420.0, help="seconds for the whole run")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny: exercise the script")
    args = ap.parse_args(argv)
    start = time.monotonic()
    dims = [int(d) for d in args.dims.split(",")]
    cases, tokens, heads, dtype_name = CASES, TOKENS, H, "bfloat16"
    if args.smoke:
        # The interpreter cannot time anything: a fake clock (every configuration 1 ms)
        # lets the search, the aggregation and the printing run end to end.
        import triton.testing
        dims, cases, tokens, heads, dtype_name = [16], (("full", 64), ("causal", 64)), 64, 1, "float32"
        triton.testing.do_bench = lambda fn, **kw: (fn(), 1.0)[1]
        tuning.candidates = lambda spec, sparse: [dict(BLOCK_M=64, BLOCK_N=n, num_warps=4, num_stages=1)
                                                  for n in (32, 64)]
        tuning.gpu_name = lambda device: "cpu-smoke"
        from flexgen.runtime import launch

        def run_tuned(spec, device, *inputs, tune_blocks=None):   # launch.run tunes CUDA launches only
            if tune_blocks is not None:
                spec = tuning.choose(spec, device, inputs, tune_blocks,
                                     lambda s: launch._launch(s, device, inputs))
            launch._launch(spec, device, inputs)
        launch.run = run_tuned
        device = torch.device("cpu")
        os.environ["FLEXGEN_CACHE_DIR"] = tempfile.mkdtemp(prefix="flexgen-tune-smoke-")
    else:
        device = torch.device("cuda")
        # Timings go into a store of their own: not the user's winners, not a stale file.
        os.environ["FLEXGEN_CACHE_DIR"] = tempfile.mkdtemp(prefix="flexgen-tune-")
        os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="triton-tune-"))
        if args.jobs > 1:
            print(f"== compiling candidates in {args.jobs} processes", flush=True)
            precompile(args.jobs, dims, cases, dtype_name, tokens, heads, start + 0.6 * args.budget)
            print(f"   done in {time.monotonic() - start:.0f}s", flush=True)
    tuning._STORED, tuning._CHOSEN = None, {}

    specs_by_name = {}
    original = tuning._search

    def search(spec, *a):
        specs_by_name[spec.kernel_name] = spec
        return original(spec, *a)
    tuning._search = search

    dtype = getattr(torch, dtype_name)
    gpu = tuning.gpu_name(device) if device.type == "cuda" else "cpu-smoke"
    rows = {}
    if device.type == "cuda":
        tuning.candidates = sweep
    with flexgen.autotune():
        for D in dims:
            for variant, L in cases:
                if time.monotonic() - start > args.budget:
                    print(f"  budget spent: skipping D={D} {variant} {L}")
                    continue
                t = time.monotonic()
                run_case(variant, L, D, device, dtype, tokens, heads)
                print(f"  tuned D={D} {variant:<6} L={L:<6} in {time.monotonic() - t:.0f}s", flush=True)
                # Written after every case: a run cut short keeps what it measured.
                rows = report(args.out, gpu, device, dtype_name, cases, tokens, heads, specs_by_name)
    print_rows(rows, gpu, dtype_name)
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
