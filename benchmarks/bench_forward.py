"""Forward-pass speed of flexgen against its peers, in one process, on the same inputs.

    python benchmarks/bench_forward.py                       # the default subset (~5 min on an H100)
    python benchmarks/bench_forward.py --variants full,causal --lengths 2k,16k --dims 128
    python benchmarks/bench_forward.py --smoke               # tiny sizes on CPU: checks the script only
    python benchmarks/bench_forward.py --flexgen-options '{"USE_TMA": true}'   # flexgen's TMA kernel

Peers, per case: ``torch.compile(torch.nn.attention.flex_attention)`` (a fresh
compile after ``torch._dynamo.reset()`` for every case, ``fullgraph=True`` so a
graph break raises instead of silently running the unfused path), and for
``full`` / ``causal`` ``F.scaled_dot_product_attention`` under each of the
flash, efficient and cuDNN backends. Times are ``triton.testing.do_bench``
medians after warm-up (its L2 flush between calls, plus inputs rotated among
several sets). bf16, H=16, B x L = 16k tokens.

TFLOP/s count only the work the mask leaves: ``4 * B * H * D * n``, with ``n``
the exact number of unmasked (query, key) pairs (the mask evaluated in row
chunks), the same figure for every implementation of a case. ``vs torch`` and
``vs sdpa`` are speed ratios (peer time / flexgen time: above 1, flexgen is
faster); ``%ceil`` is flexgen's TFLOP/s over the bf16 matmul ceiling measured
in the same run (8192^3).

Also: ``create_block_mask`` at 32k and 128k (``--mask-lens``) for causal and
document masks (flexgen, torch eager, torch ``_compile=True``: median time and
peak extra GPU memory; torch eager is skipped where its dense temporaries,
~10 bytes per position, would not fit in free GPU memory: 128k on an H100),
and the warm per-call host overhead on tiny inputs (B=1, H=1, L=128, D=64).

``--flexgen-options JSON`` passes a dict as flexgen's ``kernel_options`` in
every timed flexgen call of the cases (not the mask or overhead sections),
e.g. ``{"USE_TMA": true}`` for the kernel that moves Q, K, V and the output
through TMA descriptors; the JSON records it (``config.flexgen_options``) and,
per case, the tiles and path of the kernel that ran (``flexgen_kernel``).
Two runs, one with and one without, compare the two paths (their torch and
sdpa peers anchor the runs to each other).

Writes ``bench_forward.json`` (and ``bench_forward.png`` when matplotlib is
there) to ``--out``: ``$OUT`` when set, else ``benchmarks/results/`` under a
name with the device and date. Prints a table at the end.
"""
from __future__ import annotations

import os

# Timings must not include flexgen's NaN poisoning of outputs (an extra fill kernel).
os.environ.pop("FLEXGEN_POISON", None)

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import flexgen  # noqa: E402
from flexgen import mods  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Timer, doc_ids, write_json  # noqa: E402,F401  (bench_backward imports them from here)
from common import add_doc_ids_option, set_doc_ids  # noqa: E402
from common import environment as common_environment  # noqa: E402
from common import report  # noqa: E402

ALL_VARIANTS = ("full", "causal", "sliding_window", "alibi", "softcap", "document", "prefix_lm",
                "document_causal", "softcap_causal")
SDPA_VARIANTS = {"full": False, "causal": True}          # variant -> is_causal
WINDOW = 1024
SOFTCAP = 50.0
DOC_AVG = 1024          # mean document length of the random document masks
# The default run: D=128 every main variant at 2k and 16k, then D=64 full/causal at 16k.
DEFAULT_CASES = ([(128, v, L) for L in (16384, 2048)
                  for v in ("full", "causal", "sliding_window", "alibi", "softcap", "document", "prefix_lm")]
                 + [(64, "full", 16384), (64, "causal", 16384)])


class Timeout(Exception):
    """A case ran past its limit, or the process got SIGTERM (the budget)."""


STOP = []   # non-empty once SIGTERM arrived: a library may wrap the Timeout, this stays


def _raise(signum, frame):
    if signum != signal.SIGALRM:
        STOP.append(signum)
    raise Timeout("case time limit" if signum == signal.SIGALRM else f"signal {signum}")


def _check_stop():
    if STOP:
        raise Timeout(f"signal {STOP[0]}")


# ---------------------------------------------------------------------------
# inputs and mods


def make_mods(variant, B, H, L, device, gen):
    """(score_mod, mask_mod, mask_batch): mask_batch is B for per-row masks, else None (broadcast)."""
    if variant == "full":
        return None, None, None
    if variant == "causal":
        return None, mods.causal_mask, None
    if variant == "sliding_window":
        return None, mods.sliding_window(WINDOW), None
    if variant == "alibi":
        return mods.alibi(num_heads=H), None, None
    if variant == "softcap":
        return mods.tanh_softcap(SOFTCAP), None, None
    if variant == "softcap_causal":
        return mods.tanh_softcap(SOFTCAP), mods.causal_mask, None
    if variant == "prefix_lm":
        return None, mods.prefix_lm(L // 4), None
    if variant == "document":
        return None, mods.document_mask(doc_ids(B, L, device, gen, DOC_AVG)), B
    if variant == "document_causal":
        return None, mods.and_masks(mods.causal_mask, mods.document_mask(doc_ids(B, L, device, gen, DOC_AVG))), B
    raise ValueError(f"unknown variant {variant!r}; known: {', '.join(ALL_VARIANTS)}")


def count_unmasked(mask_mod, mask_batch, B, L, device) -> int:
    """Exact number of kept (b, q, kv) positions over the whole batch (mask head-independent)."""
    if mask_mod is None:
        return B * L * L
    rows = max(1, (1 << 26) // L)
    kv = torch.arange(L, device=device, dtype=torch.int32).view(1, 1, 1, L)
    h = torch.zeros(1, 1, 1, 1, device=device, dtype=torch.int32)
    total = 0
    for b in range(mask_batch or 1):
        bt = torch.full((1, 1, 1, 1), b, device=device, dtype=torch.int32)
        for start in range(0, L, rows):
            q = torch.arange(start, min(L, start + rows), device=device, dtype=torch.int32).view(1, 1, -1, 1)
            keep = mask_mod(bt, h, q, kv)
            total += int(torch.broadcast_to(keep, (1, 1, q.shape[2], L)).sum())
    return total if mask_batch else total * B


def block_density(block_mask, B, L) -> float:
    """Fraction of the B x L x L scores inside blocks the kernel visits (partial or full)."""
    if block_mask is None:
        return 1.0
    qb, kb = block_mask.BLOCK_SIZE
    dense = block_mask.to_dense()[:, 0]                   # [B or 1, NQ, NKV]
    rows = torch.clamp(L - torch.arange(dense.shape[-2], device=dense.device) * qb, max=qb)
    cols = torch.clamp(L - torch.arange(dense.shape[-1], device=dense.device) * kb, max=kb)
    area = (dense * rows[:, None] * cols[None, :]).sum().item()
    if dense.shape[0] == 1:
        area *= B
    return area / (B * L * L)


# ---------------------------------------------------------------------------
# timing


def rotating(call, sets):
    """A no-argument function calling ``call(*sets[i])`` with i cycling: each call sees cold inputs."""
    state = [0]

    def fn():
        s = sets[state[0] % len(sets)]
        state[0] += 1
        return call(*s)
    return fn


def l2_bytes() -> int:
    if torch.cuda.is_available():
        return getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20) or (50 << 20)
    return 32 << 20


def make_sets(B, H, L, D, dtype, device, gen):
    set_bytes = 3 * B * H * L * D * torch.finfo(dtype).bits // 8
    n = max(2, min(4, math.ceil(3 * l2_bytes() / set_bytes)))
    return [tuple(torch.randn(B, H, L, D, generator=gen).to(device=device, dtype=dtype) for _ in range(3))
            for _ in range(n)]


def flexgen_kernel(inputs, score_mod, block_mask, options) -> dict | None:
    """The path and tiles of the forward kernel flexgen planned for a call (None if unknown)."""
    try:
        from flexgen import api
        from flexgen.runtime import launch
        spec = api.plan(*inputs, score_mod, block_mask, None, False, options).spec
        spec = launch._FITS.get(spec.key, spec)      # stepped down to tiles that fit, if it had to
        return dict(use_tma=getattr(spec, "use_tma", False), block_m=spec.block_m,
                    block_n=spec.block_n, num_warps=spec.num_warps, num_stages=spec.num_stages)
    except Exception:      # noqa: BLE001 - informational only
        return None


def parse_options(text):
    """--flexgen-options: a JSON object, or None for an empty string."""
    if not text:
        return None
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


# ---------------------------------------------------------------------------
# sections

def measure_ceiling(timer, cuda, smoke) -> dict:
    n = 1024 if smoke else 8192
    dev = "cuda" if cuda else "cpu"
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(n, n, generator=gen).to(dev, torch.bfloat16)
    b = torch.randn(n, n, generator=gen).to(dev, torch.bfloat16)
    ms = timer(lambda: a @ b)
    out = dict(matmul_n=n, matmul_ms=ms, matmul_tflops=2 * n**3 / ms / 1e9)
    del a, b
    if cuda:
        x = torch.empty(1 << 29, dtype=torch.float32, device=dev).normal_()   # 2 GiB
        y = torch.empty_like(x)
        ms = timer(lambda: y.copy_(x))
        out.update(copy_gib=2.0, copy_ms=ms, copy_gbps=2 * x.numel() * 4 / ms / 1e6)
        del x, y
        torch.cuda.empty_cache()
    return out


def run_case(D, variant, L, args, timer, cuda, seed) -> dict:
    dev = "cuda" if cuda else "cpu"
    H = args.heads
    B = max(1, args.tokens // L)
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(seed)
    r = dict(variant=variant, D=D, L=L, B=B, H=H, dtype="bfloat16")
    score_mod, mask_mod, mask_batch = make_mods(variant, B, H, L, dev, gen)
    sets = make_sets(B, H, L, D, dtype, dev, gen)
    r["input_sets"] = len(sets)

    n = count_unmasked(mask_mod, mask_batch, B, L, dev)
    r["unmasked"] = n
    r["density"] = n / (B * L * L)
    flops = 4.0 * H * D * n
    r["gflop"] = flops / 1e9

    def tflops(ms):
        return flops / ms / 1e9 if ms and ms > 0 else None

    # flexgen
    t0 = time.perf_counter()
    fg_mask = None
    if mask_mod is not None:
        fg_mask = flexgen.create_block_mask(mask_mod, mask_batch, None, L, L, device=dev)
    timer.sync()
    r["flexgen_mask_s"] = time.perf_counter() - t0
    r["block_density"] = block_density(fg_mask, B, L)

    options = args.flexgen_options

    def fg(q, k, v):
        return flexgen.flex_attention(q, k, v, score_mod=score_mod, block_mask=fg_mask,
                                      kernel_options=options)
    t0 = time.perf_counter()
    ref_out = fg(*sets[0])
    timer.sync()
    r["flexgen_first_call_s"] = time.perf_counter() - t0
    r["flexgen_kernel"] = flexgen_kernel(sets[0], score_mod, fg_mask, options)
    r["flexgen_ms"] = timer(rotating(fg, sets))
    r["flexgen_tflops"] = tflops(r["flexgen_ms"])

    # torch.compile(flex_attention): a fresh compile for this case
    if not args.skip_torch:
        try:
            from torch.nn.attention.flex_attention import create_block_mask as torch_cbm
            from torch.nn.attention.flex_attention import flex_attention as torch_flex
            torch._dynamo.reset()
            t0 = time.perf_counter()
            th_mask = None
            if mask_mod is not None:
                th_mask = torch_cbm(mask_mod, mask_batch, None, L, L, device=dev)
            timer.sync()
            r["torch_mask_s"] = time.perf_counter() - t0
            compiled = torch.compile(torch_flex, dynamic=False, fullgraph=True) if cuda else torch_flex
            r["torch_mode"] = "compiled" if cuda else "eager (smoke)"

            def tf(q, k, v):
                return compiled(q, k, v, score_mod=score_mod, block_mask=th_mask)
            t0 = time.perf_counter()
            out = tf(*sets[0])
            timer.sync()
            r["torch_first_call_s"] = time.perf_counter() - t0
            r["maxdiff_vs_torch"] = float((out.float() - ref_out.float()).abs().max())
            del out
            r["torch_ms"] = timer(rotating(tf, sets))
            r["torch_tflops"] = tflops(r["torch_ms"])
        except Timeout:
            raise
        except Exception as e:
            _check_stop()
            r["torch_error"] = f"{type(e).__name__}: {str(e)[:300]}"

    # SDPA backends (full and causal only)
    if variant in SDPA_VARIANTS and not args.skip_sdpa:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        is_causal = SDPA_VARIANTS[variant]
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                              ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                              ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                def sd(q, k, v):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
                with sdpa_kernel([backend]):
                    out = sd(*sets[0])
                    timer.sync()
                    r[f"sdpa_{name}_maxdiff"] = float((out.float() - ref_out.float()).abs().max())
                    del out
                    r[f"sdpa_{name}_ms"] = timer(rotating(sd, sets))
                r[f"sdpa_{name}_tflops"] = tflops(r[f"sdpa_{name}_ms"])
            except Timeout:
                raise
            except Exception as e:
                _check_stop()
                r[f"sdpa_{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        got = {k[5:-3]: v for k, v in r.items() if k.startswith("sdpa_") and k.endswith("_ms")}
        if got:
            best = min(got, key=got.get)
            r["sdpa_best"], r["sdpa_best_ms"] = best, got[best]

    # flexgen again: the spread between its two timings is the noise of this case
    r["flexgen_ms_repeat"] = timer(rotating(fg, sets))
    r["flexgen_spread_pct"] = 100 * abs(r["flexgen_ms_repeat"] - r["flexgen_ms"]) / r["flexgen_ms"]
    if r.get("torch_ms"):
        r["vs_torch"] = r["torch_ms"] / r["flexgen_ms"]
    if r.get("sdpa_best_ms"):
        r["vs_sdpa"] = r["sdpa_best_ms"] / r["flexgen_ms"]
    return r


def time_host(fn, sync, calls, repeats=5) -> float:
    """Median microseconds per call of ``fn`` over ``calls`` back-to-back calls (one sync at the end)."""
    for _ in range(max(3, calls // 10)):
        fn()
    sync()
    per = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        per.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(per)


# Peak extra memory of torch's eager create_block_mask per (q, kv) position: +10 GiB at
# 32k on the H100 (2026-11-23), i.e. ~10 bytes; at 128k that is ~160 GiB, so it is skipped.
EAGER_MASK_BYTES_PER_POSITION = 10


def bench_mask_build(L, timer, cuda, deadline) -> list:
    """create_block_mask at length L: flexgen vs torch eager vs torch _compile=True."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_cbm
    dev = "cuda" if cuda else "cpu"
    gen = torch.Generator().manual_seed(7)
    masks = [("causal", mods.causal_mask, None),
             ("document", mods.document_mask(doc_ids(1, L, dev, gen, DOC_AVG)), 1)]
    impls = [("flexgen", lambda m, b: flexgen.create_block_mask(m, b, None, L, L, device=dev)),
             ("torch_eager", lambda m, b: torch_cbm(m, b, None, L, L, device=dev)),
             ("torch_compiled", lambda m, b: torch_cbm(m, b, None, L, L, device=dev, _compile=True))]
    rows = []
    for mname, mod, mb in masks:
        for iname, build in impls:
            r = dict(mask=mname, impl=iname, L=L)
            if time.monotonic() > deadline:
                r["skipped"] = "budget"
                rows.append(r)
                continue
            if iname == "torch_eager" and cuda and EAGER_MASK_BYTES_PER_POSITION * L * L > torch.cuda.mem_get_info()[0]:
                # torch's eager builder materializes the dense mask and its temporaries.
                r["skipped"] = (f"would need ~{EAGER_MASK_BYTES_PER_POSITION * L * L / 2**30:.0f} GiB "
                                "(dense Q_LEN x KV_LEN temporaries)")
                rows.append(r)
                print(f"  mask build {mname:<9} {iname:<15} {r['skipped']}", flush=True)
                continue
            try:
                if iname == "torch_compiled":
                    if not cuda:
                        r["skipped"] = "no compile in smoke runs"
                        rows.append(r)
                        continue
                    torch._dynamo.reset()
                t0 = time.perf_counter()
                bm = build(mod, mb)
                timer.sync()
                r["first_call_s"] = time.perf_counter() - t0
                del bm
                if cuda:
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                times = []
                t_end = time.monotonic() + 4.0
                while len(times) < 10 and (len(times) < 3 or time.monotonic() < t_end):
                    t0 = time.perf_counter()
                    bm = build(mod, mb)
                    timer.sync()
                    times.append((time.perf_counter() - t0) * 1e3)
                    if cuda and len(times) == 1:
                        r["peak_extra_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
                    del bm
                r["ms"] = statistics.median(times)
                r["reps"] = len(times)
            except Timeout:
                raise
            except Exception as e:
                _check_stop()
                r["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(r)
            print(f"  mask build {mname:<9} {iname:<15} " + (f"{r['ms']:9.2f} ms" if "ms" in r else
                  r.get("error", r.get("skipped", ""))) + (f"  peak +{r['peak_extra_mib']:.0f} MiB"
                                                           if "peak_extra_mib" in r else ""), flush=True)
    return rows


def bench_overhead(timer, cuda, smoke, deadline) -> list:
    """Warm per-call host overhead on tiny inputs (B=1, H=1, L=128, D=64)."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_cbm
    from torch.nn.attention.flex_attention import flex_attention as torch_flex
    dev = "cuda" if cuda else "cpu"
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 1, 128, 64, generator=gen).to(dev, torch.bfloat16) for _ in range(3))
    softcap = mods.tanh_softcap(SOFTCAP)
    fg_mask = flexgen.create_block_mask(mods.causal_mask, None, None, 128, 128, device=dev)
    th_mask = torch_cbm(mods.causal_mask, None, None, 128, 128, device=dev)
    calls = 3 if smoke else 300

    def torch_fn(score_mod, block_mask):
        torch._dynamo.reset()
        compiled = torch.compile(torch_flex, dynamic=False, fullgraph=True) if cuda else torch_flex
        return lambda: compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)

    impls = [("flexgen", "plain", lambda: (lambda: flexgen.flex_attention(q, k, v))),
             ("flexgen", "softcap+causal",
              lambda: (lambda: flexgen.flex_attention(q, k, v, score_mod=softcap, block_mask=fg_mask))),
             ("torch_flex", "plain", lambda: torch_fn(None, None)),
             ("torch_flex", "softcap+causal", lambda: torch_fn(softcap, th_mask)),
             ("sdpa", "plain", lambda: (lambda: F.scaled_dot_product_attention(q, k, v)))]
    rows = []
    for impl, what, make in impls:
        r = dict(impl=impl, mods=what, shape="1,1,128,64")
        if time.monotonic() > deadline:
            r["skipped"] = "budget"
            rows.append(r)
            continue
        try:
            fn = make()
            t0 = time.perf_counter()
            fn()
            timer.sync()
            r["first_call_s"] = time.perf_counter() - t0
            r["us_per_call"] = time_host(fn, timer.sync, calls)
        except Timeout:
            raise
        except Exception as e:
            _check_stop()
            r["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(r)
        print(f"  overhead {impl:<10} {what:<15} " + (f"{r['us_per_call']:9.1f} us/call" if "us_per_call" in r
                                                       else r.get("error", "")), flush=True)
    return rows


# ---------------------------------------------------------------------------
# output

def environment(cuda) -> dict:
    return common_environment(cuda, **({"l2_mib": round(l2_bytes() / 2**20, 1)} if cuda else {}))


def f(x, spec, missing="-"):
    return missing if x is None else format(x, spec)


def table(payload) -> str:
    ceil = payload.get("ceiling", {}).get("matmul_tflops")
    lines = []
    if ceil:
        c = payload["ceiling"]
        lines.append(f"ceiling: bf16 matmul {c['matmul_n']}^3 {ceil:.0f} TFLOP/s"
                     + (f", copy {c['copy_gbps']:.0f} GB/s" if "copy_gbps" in c else ""))
    head = (f"{'variant':<15} {'D':>3} {'L':>6} {'B':>3} {'dens':>5} | {'flexgen':>8} {'TF/s':>5} {'±%':>4} | "
            f"{'torch':>8} {'TF/s':>5} | {'sdpa':>8} {'which':<9} | {'vs tor':>6} {'vs sdp':>6} {'%ceil':>5} "
            f"{'maxdiff':>8}")
    lines += [head, "-" * len(head)]
    for r in payload.get("cases", []):
        if "skipped" in r or "error" in r:
            lines.append(f"{r['variant']:<15} {r['D']:>3} {r['L']:>6}  " + (
                f"SKIP ({r['skipped']})" if "skipped" in r else f"ERROR {r['error'][:90]}"))
            continue
        tor = r.get("torch_ms")
        lines.append(
            f"{r['variant']:<15} {r['D']:>3} {r['L']:>6} {r['B']:>3} {r['density']:5.2f} | "
            f"{r['flexgen_ms']:8.3f} {r['flexgen_tflops']:5.0f} {r['flexgen_spread_pct']:4.1f} | "
            f"{f(tor, '8.3f', 'err' if 'torch_error' in r else '-'):>8} {f(r.get('torch_tflops'), '5.0f'):>5} | "
            f"{f(r.get('sdpa_best_ms'), '8.3f'):>8} {r.get('sdpa_best', '-'):<9} | "
            f"{f(r.get('vs_torch'), '6.2f'):>6} {f(r.get('vs_sdpa'), '6.2f'):>6} "
            f"{f(100 * r['flexgen_tflops'] / ceil if ceil else None, '5.1f'):>5} "
            f"{f(r.get('maxdiff_vs_torch'), '8.1e'):>8}")
    lines.append("ms: do_bench median; TF/s counts unmasked work only; vs tor / vs sdp = peer ms / flexgen ms "
                 "(>1: flexgen faster); ±%: flexgen timed twice; maxdiff: |flexgen - torch flex|")
    for r in payload.get("cases", []):
        if "torch_error" in r:
            lines.append(f"  torch error {r['variant']} D{r['D']} L{r['L']}: {r['torch_error'][:150]}")
    sd_err = sorted({(k, r[k][:80]) for r in payload.get("cases", []) for k in r
                     if k.startswith("sdpa_") and k.endswith("_error")})
    for k, e in sd_err:
        lines.append(f"  {k[:-6]} unavailable: {e}")
    mb = payload.get("mask_build", [])
    for L in dict.fromkeys(r["L"] for r in mb):
        lines.append(f"create_block_mask at L={L}: "
                     + "; ".join(f"{r['mask']}/{r['impl']} " + (
                         f"{r['ms']:.2f} ms" + (f" +{r['peak_extra_mib']:.0f} MiB" if "peak_extra_mib" in r else "")
                         if "ms" in r else r.get("skipped", "err")) for r in mb if r["L"] == L))
    oh = payload.get("overhead", [])
    if oh:
        lines.append("host overhead (us/call, warm, 1x1x128x64): "
                     + "; ".join(f"{r['impl']}/{r['mods']} " + f(r.get("us_per_call"), ".1f", "err") for r in oh))
    return "\n".join(lines)


def plot(payload, path) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return None
    cases = [r for r in payload.get("cases", []) if "flexgen_tflops" in r]
    if not cases:
        return None
    panels = sorted({(r["D"], r["variant"]) for r in cases}, key=lambda p: (-p[0], ALL_VARIANTS.index(p[1])))
    cols = min(4, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False)
    impls = [("flexgen", "flexgen_tflops"), ("torch.compile flex", "torch_tflops"),
             ("sdpa flash", "sdpa_flash_tflops"), ("sdpa efficient", "sdpa_efficient_tflops"),
             ("sdpa cudnn", "sdpa_cudnn_tflops")]
    ceil = payload.get("ceiling", {}).get("matmul_tflops")
    for ax, (D, variant) in zip(axes.flat, panels):
        sel = sorted((r for r in cases if r["D"] == D and r["variant"] == variant), key=lambda r: r["L"])
        for label, key in impls:
            pts = [(r["L"], r[key]) for r in sel if r.get(key)]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label)
        if ceil:
            ax.axhline(ceil, color="gray", linestyle="--", linewidth=0.8, label="bf16 matmul ceiling")
        ax.set_xscale("log", base=2)
        ticks = sorted({r["L"] for r in sel})
        ax.set_xticks(ticks, [f"{t // 1024}k" if t % 1024 == 0 else str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_title(f"{variant}, D={D}")
        ax.set_xlabel("sequence length (B x L = const)")
        ax.set_ylabel("TFLOP/s (unmasked work)")
        ax.set_ylim(bottom=0)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    env = payload["env"]
    fig.suptitle(f"flexgen forward, bf16, H={payload['config']['heads']}: {env.get('device_name')}, "
                 f"torch {env['torch']}, triton {env['triton']}, {env['date'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_lengths(text):
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if part:
            out.append(int(float(part[:-1]) * 1024) if part.endswith("k") else int(part))
    return out


def case_grid(args, known, default_cases, parser) -> list:
    """(D, variant, L) cases from --variants/--lengths/--dims, or the default list."""
    if not (args.variants or args.lengths or args.dims):
        return list(default_cases)
    variants = [v.strip() for v in (args.variants or "full,causal").split(",") if v.strip()]
    bad = [v for v in variants if v not in known]
    if bad:
        parser.error(f"unknown variants {bad}; known: {', '.join(known)}")
    lengths = parse_lengths(args.lengths or "2k,16k")
    dims = [int(d) for d in (args.dims or "128").split(",") if d.strip()]
    return [(D, v, L) for D in dims for L in sorted(lengths, reverse=True) for v in variants]


def output_path(args, name, env) -> str:
    """Where the JSON goes: --out or $OUT as ``name``.json, else a dated name in benchmarks/results."""
    out_dir = args.out or os.environ.get("OUT")
    if not out_dir:
        out_dir = (os.path.join("/tmp", "flexgen_bench_smoke") if args.smoke
                   else os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    os.makedirs(out_dir, exist_ok=True)
    if args.out or os.environ.get("OUT") or args.smoke:
        stem = name
    else:   # several runs accumulate in benchmarks/results
        slug = re.sub(r"[^A-Za-z0-9]+", "-", env["device_name"]).strip("-").lower()
        stem = f"{name}_{slug}_{env['date'][:16].replace(':', '').replace('-', '')}"
    return os.path.join(out_dir, stem + ".json")


def error_text(e, limit=300) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:limit] if text else ''}"


def free_memory(cuda):
    """After a case (an OOM above all): drop what the failed frames held and return it to the driver."""
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def run_grid(grid, run_one, describe, deadline, case_timeout, payload, json_path, cuda):
    """Run ``run_one(D, variant, L, seed)`` per case while the budget lasts; results into payload.

    A case is skipped when the time left is less than the slowest case so far; one
    that errors or passes ``case_timeout`` is recorded and the run goes on. The JSON
    is rewritten after every case, so a run cut short keeps what it measured.
    """
    default_estimate = 30.0 if cuda else 5.0   # before any case ran (compiles dominate on a GPU)
    slowest, durations = default_estimate, []
    for i, (D, variant, L) in enumerate(grid):
        left = deadline - time.monotonic()
        if left < slowest:
            payload["cases"].append(dict(variant=variant, D=D, L=L, skipped="budget"))
            print(f"  SKIP {variant} D={D} L={L} (budget: {left:.0f} s left, a case takes ~{slowest:.0f} s)",
                  flush=True)
            continue
        t0 = time.monotonic()
        signal.setitimer(signal.ITIMER_REAL, max(5.0, min(case_timeout, left)))
        try:
            r = run_one(D, variant, L, 100 + i)
        except Timeout as e:
            if "signal" in str(e):
                raise
            r = dict(variant=variant, D=D, L=L, error=f"timeout after {time.monotonic() - t0:.0f} s")
        except Exception as e:
            # A library may wrap the SIGTERM's Timeout (the interpreter does): say what it was.
            r = dict(variant=variant, D=D, L=L,
                     error=f"stopped by signal {STOP[0]}" if STOP else error_text(e),
                     traceback=traceback.format_exc(limit=8))
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        r["seconds"] = time.monotonic() - t0
        # The first case also pays torch's and Triton's one-time start-up: leave it out of the estimate.
        durations.append(r["seconds"])
        slowest = max(durations[1:]) if len(durations) > 1 else default_estimate
        payload["cases"].append(r)
        if "error" in r:
            print(f"  ERROR {variant} D={D} L={L}: {r['error']}", flush=True)
        else:
            print(f"  {describe(r)} ({r['seconds']:.1f} s)", flush=True)
        free_memory(cuda)
        write_json(json_path, payload)
        _check_stop()


def bounded(payload, name, seconds, fn) -> None:
    """payload[name] = fn(), or payload[name + "_error"] when it fails or runs past ``seconds``."""
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        payload[name] = fn()
    except Timeout as e:
        if "signal" in str(e):
            raise
        payload[f"{name}_error"] = "timeout"
    except Exception as e:
        payload[f"{name}_error"] = error_text(e)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def describe(r) -> str:
    return (f"{r['variant']:<15} D={r['D']:<3} L={r['L']:<6} flexgen {r['flexgen_ms']:.3f} ms "
            f"{r['flexgen_tflops']:.0f} TF/s | torch {f(r.get('torch_ms'), '.3f')} ms | "
            f"sdpa {f(r.get('sdpa_best_ms'), '.3f')} ms")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default="", help=f"comma list among {','.join(ALL_VARIANTS)}")
    ap.add_argument("--lengths", default="", help="comma list, e.g. 1k,2k,4k,8k,16k")
    ap.add_argument("--dims", default="", help="comma list of head dims, e.g. 64,128")
    ap.add_argument("--tokens", type=int, default=16384, help="B x L (default 16384)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--budget", type=float, default=float(os.environ.get("BENCH_FORWARD_BUDGET_S", 290)),
                    help="seconds for the whole script; cases that would not fit are skipped (default 290)")
    ap.add_argument("--case-timeout", type=float, default=120, help="seconds one case may take")
    ap.add_argument("--mask-lens", default="32k,128k",
                    help="comma list of lengths for the create_block_mask timing (default 32k,128k)")
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--skip-sdpa", action="store_true")
    ap.add_argument("--no-mask-bench", action="store_true")
    ap.add_argument("--no-overhead", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (interpreter): tests the script")
    ap.add_argument("--out", default=None, help="output folder (default $OUT, else benchmarks/results)")
    ap.add_argument("--flexgen-options", type=parse_options, default=None, metavar="JSON",
                    help='flexgen kernel_options for the timed calls, e.g. \'{"USE_TMA": true}\'')
    add_doc_ids_option(ap)
    args = ap.parse_args(argv)
    set_doc_ids(args)

    cuda = not args.smoke
    if cuda and not torch.cuda.is_available():
        print("bench_forward: no CUDA device; use --smoke for the CPU run", file=sys.stderr)
        return 2
    if args.smoke:
        args.tokens, args.heads = 512, 2
        args.mask_lens = "512,1024"
        if not args.lengths:
            args.lengths = "128,256"
        if not args.dims:
            args.dims = "64"
        if not args.variants:
            args.variants = ",".join(ALL_VARIANTS)
    grid = case_grid(args, ALL_VARIANTS, DEFAULT_CASES, ap)
    env = environment(cuda)
    json_path = output_path(args, "bench_forward", env)

    timer = Timer(cuda)
    signal.signal(signal.SIGTERM, _raise)
    signal.signal(signal.SIGALRM, _raise)
    t_start = time.monotonic()
    deadline = t_start + args.budget
    reserve = 0 if (args.no_mask_bench and args.no_overhead) else (10 if args.smoke else 60)
    payload = dict(env=env, config=dict(tokens=args.tokens, heads=args.heads, dtype="bfloat16", window=WINDOW,
                                        doc_ids=args.doc_ids, softcap=SOFTCAP, doc_avg=DOC_AVG,
                                        prefix="L/4", budget_s=args.budget,
                                        grid=[list(g) for g in grid], argv=sys.argv[1:],
                                        flexgen_options=args.flexgen_options),
                   cases=[])
    print(f"bench_forward on {env['device_name']}: torch {env['torch']}, triton {env['triton']}, "
          f"{len(grid)} cases, budget {args.budget:.0f} s -> {json_path}"
          + (f", flexgen kernel_options {args.flexgen_options}" if args.flexgen_options else ""), flush=True)
    try:
        payload["ceiling"] = measure_ceiling(timer, cuda, args.smoke)
        print(f"  ceiling: {payload['ceiling']['matmul_tflops']:.0f} TFLOP/s bf16 matmul"
              + (f", {payload['ceiling']['copy_gbps']:.0f} GB/s copy" if "copy_gbps" in payload["ceiling"] else ""),
              flush=True)
        write_json(json_path, payload)
        run_grid(grid, lambda D, variant, L, seed: run_case(D, variant, L, args, timer, cuda, seed),
                 describe, deadline - reserve, args.case_timeout, payload, json_path, cuda)

        end = t_start + args.budget
        if not args.no_mask_bench:
            rows = payload["mask_build"] = []
            for mask_len in parse_lengths(args.mask_lens):
                print(f"create_block_mask at {mask_len}:", flush=True)
                bounded(payload, "_mask_build", max(5.0, min(90.0, end - time.monotonic() - 15)),
                        lambda: bench_mask_build(mask_len, timer, cuda, end - 20))
                rows += payload.pop("_mask_build", None) or []
                if "_mask_build_error" in payload:
                    payload.setdefault("mask_build_error", {})[mask_len] = payload.pop("_mask_build_error")
                write_json(json_path, payload)
                _check_stop()
        if not args.no_overhead:
            print("host overhead:", flush=True)
            bounded(payload, "overhead", max(5.0, min(90.0, end - time.monotonic())),
                    lambda: bench_overhead(timer, cuda, args.smoke, end - 10))
    except (Timeout, KeyboardInterrupt) as e:
        signal.setitimer(signal.ITIMER_REAL, 0)
        print(f"bench_forward: stopped early ({e}); writing what was done", flush=True)
        payload["stopped_early"] = str(e)
    payload["seconds"] = time.monotonic() - t_start
    write_json(json_path, payload)
    png = None
    try:
        png = plot(payload, json_path[:-len(".json")] + ".png")
    except Exception as e:
        print(f"plot failed: {type(e).__name__}: {e}")
    report(table(payload), "BENCH_FORWARD_SUMMARY", f"\nwrote {json_path}" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
