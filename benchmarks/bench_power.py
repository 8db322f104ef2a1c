"""Sustained load: each peer's time, SM clock, power and energy per call, in one process.

    python benchmarks/bench_power.py                          # default cases, fwd+bwd
    python benchmarks/bench_power.py --cases full:128,causal:64 --phase fwd --seconds 5
    python benchmarks/bench_power.py --smoke                  # CPU: tiny sizes, checks the script

Why: the H200 runs these kernels at its power limit (700 W) within a fraction of a
second, and then lowers its clock to stay there, more for a kernel that keeps more of
the chip busy (2026-11-30: flexgen's document backward at 1792 MHz where torch's ran at
1928, cuDNN's full forward + backward at 1680 where flexgen's ran at 1740; NOTES.md).
A do_bench ratio under such load is a ratio of energy per call, not of cycles: this script
prints both, so a kernel change can be read as fewer cycles (a better schedule) or less
energy (fewer instructions, loads and spills), and a run's ratios against its clocks.

Per case (bf16, 16 heads, B x L = 16k tokens; variants as in ``bench_forward.make_mods``):
flexgen, ``torch.compile(flex_attention)`` (compiled fresh per case) and, for full and
causal, SDPA's cuDNN backend. Each peer runs ``--seconds`` back to back (a sync every 20
calls; warmed up first) while ``nvidia-smi`` samples the SM clock and the board's power
every 0.1 s; the samples of the second half count (the clock has settled there).
Reported: ms a call (CUDA events over the whole run), the medians of clock and power,
energy per call (power x time) and mega-cycles per call (clock x time).
"""
from __future__ import annotations

import os

os.environ.pop("FLEXGEN_POISON", None)      # timings must not include NaN fills

import argparse  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, report, write_json  # noqa: E402
from bench_forward import SDPA_VARIANTS, make_mods  # noqa: E402

import flexgen  # noqa: E402

DEFAULT_CASES = "full:128,causal:128,document:128,sliding_window:128,full:64"


def _sample(stop: threading.Event, samples: list) -> None:
    """(SM MHz, W) every 0.1 s until ``stop``."""
    query = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-i", "0"]
    while not stop.is_set():
        fields = subprocess.run(query, capture_output=True, text=True).stdout.strip().split(",")
        try:
            samples.append((float(fields[0]), float(fields[1])))
        except (ValueError, IndexError):
            pass
        time.sleep(0.1)


def sustained(fn, seconds: float, cuda: bool) -> dict:
    """``fn`` back to back for ``seconds``: ms a call, and on a GPU the settled clock and power."""
    for _ in range(3):
        fn()
    if not cuda:
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            fn()
            n += 1
        return dict(ms=(time.perf_counter() - t0) / n * 1e3, calls=n)
    torch.cuda.synchronize()
    stop, samples = threading.Event(), []
    sampler = threading.Thread(target=_sample, args=(stop, samples))
    sampler.start()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0, n = time.perf_counter(), 0
    start.record()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
        if n % 20 == 0:
            torch.cuda.synchronize()        # keeps the queue short: the samples match the calls
    end.record()
    torch.cuda.synchronize()
    stop.set()
    sampler.join()
    ms = start.elapsed_time(end) / n
    settled = samples[len(samples) // 2:]
    if not settled:
        return dict(ms=ms, calls=n)
    mhz = statistics.median(s[0] for s in settled)
    watts = statistics.median(s[1] for s in settled)
    return dict(ms=ms, calls=n, mhz=mhz, watts=watts, joules=watts * ms * 1e-3, mcycles=mhz * ms * 1e-3)


def peers(variant: str, D: int, L: int, B: int, H: int, phase: str, device: str, gen) -> dict:
    """name -> a call of one phase (fwd, or fwd+bwd through ``autograd.grad``)."""
    q, k, v = (torch.randn(B, H, L, D, generator=gen).to(device=device, dtype=torch.bfloat16).requires_grad_()
               for _ in range(3))
    dout = torch.randn_like(q)
    score_mod, mask_mod, mask_batch = make_mods(variant, B, H, L, device, gen)
    fg_mask = th_mask = None
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    if mask_mod is not None:
        fg_mask = flexgen.create_block_mask(mask_mod, mask_batch, None, L, L, device=device)
        th_mask = create_block_mask(mask_mod, mask_batch, None, L, L, device=device)
    torch._dynamo.reset()       # a fresh compile per case (torch falls back past 8 recompiles)
    compiled = torch.compile(flex_attention, dynamic=False, fullgraph=True) if device == "cuda" else flex_attention
    calls = {"flexgen": lambda: flexgen.flex_attention(q, k, v, score_mod=score_mod, block_mask=fg_mask),
             "torch": lambda: compiled(q, k, v, score_mod=score_mod, block_mask=th_mask)}
    if variant in SDPA_VARIANTS and device == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def cudnn():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=SDPA_VARIANTS[variant])
        calls["cudnn"] = cudnn
    if phase == "fwd":
        return {name: (lambda call=call: _no_grad(call)) for name, call in calls.items()}
    return {name: (lambda call=call: torch.autograd.grad(call(), (q, k, v), dout)) for name, call in calls.items()}


def _no_grad(call):
    with torch.no_grad():
        return call()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=DEFAULT_CASES, help="comma list of variant:head_dim")
    ap.add_argument("--phase", choices=("fwd", "fwdbwd"), default="fwdbwd")
    ap.add_argument("--seconds", type=float, default=3.0, help="sustained run per peer")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes: checks the script")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for bench_power.json")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda" if cuda else "cpu"
    L = args.tokens if cuda else 128
    H = args.heads if cuda else 2
    seconds = args.seconds if cuda else 0.2
    rows = []
    for case in args.cases.split(","):
        variant, D = case.split(":")
        D = int(D) if cuda else 16
        calls = peers(variant, D, L, max(1, args.tokens // L) if cuda else 1, H, args.phase, device,
                      torch.Generator().manual_seed(0))
        for name, call in calls.items():
            try:
                row = dict(variant=variant, D=D, peer=name, **sustained(call, seconds, cuda))
            except Exception as err:        # a peer that cannot run this case (torch on CPU)
                row = dict(variant=variant, D=D, peer=name, error=f"{type(err).__name__}: {str(err)[:200]}")
            rows.append(row)
            print(row, flush=True)
        if cuda:
            torch.cuda.empty_cache()
    write_json(args.out and os.path.join(args.out, "bench_power.json"),
               dict(env=environment(cuda), phase=args.phase, seconds=seconds, rows=rows))
    lines = [f"{args.phase}, bf16, H={H}, B x L = {args.tokens if cuda else L}; sustained {seconds} s a peer; "
             "ratios: the peer's / flexgen's (above 1: flexgen needs less)",
             f"{'case':>20} {'peer':>8} | {'ms':>8} {'MHz':>6} {'W':>5} {'J':>7} {'Mcyc':>7} | "
             f"{'time':>5} {'energy':>6} {'cycles':>6}"]
    for row in rows:
        if "error" in row:
            lines.append(f"{row['variant'] + ':' + str(row['D']):>20} {row['peer']:>8} | {row['error'][:60]}")
            continue
        base = next(r for r in rows if (r["variant"], r["D"], r["peer"]) == (row["variant"], row["D"], "flexgen"))
        ratio = {k: (row[k] / base[k] if row.get(k) and base.get(k) else float("nan"))
                 for k in ("ms", "joules", "mcycles")}
        lines.append(f"{row['variant'] + ':' + str(row['D']):>20} {row['peer']:>8} | {row['ms']:8.3f} "
                     f"{row.get('mhz', float('nan')):6.0f} {row.get('watts', float('nan')):5.0f} "
                     f"{row.get('joules', float('nan')):7.4f} {row.get('mcycles', float('nan')):7.2f} | "
                     f"{ratio['ms']:5.2f} {ratio['joules']:6.2f} {ratio['mcycles']:6.2f}")
    report("\n".join(lines), "BENCH_POWER_SUMMARY")
    return 0


if __name__ == "__main__":
    sys.exit(main())
