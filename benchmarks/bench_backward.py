"""Backward-pass speed of flexgen against its peers, in one process, on the same inputs.

    python benchmarks/bench_backward.py                      # the default subset (~200 s on an H100)
    python benchmarks/bench_backward.py --variants full,causal --lengths 1k,2k,4k,8k,16k --dims 64,128
    python benchmarks/bench_backward.py --smoke              # tiny sizes on CPU: checks the script only
    python benchmarks/bench_backward.py --flexgen-options '{"USE_TMA": true}'   # flexgen's TMA kernels

The companion of ``bench_forward.py`` (its helpers are imported from there:
inputs, mods, the exact unmasked count, the timer, the ceiling, the JSON
writer). Per case (bf16, H=16, B x L = 16k tokens), with q, k, v requiring grad:

- flexgen: ``flexgen.flex_attention(q, k, v, score_mod=..., block_mask=...)``;
- torch: ``torch.compile(torch.nn.attention.flex_attention, dynamic=False,
  fullgraph=True)`` with torch's own ``create_block_mask``, compiled fresh after
  ``torch._dynamo.reset()`` for every case (past 8 recompiles torch falls back,
  silently, to its unfused path, 40-70x slower);
- for ``full`` / ``causal``: ``F.scaled_dot_product_attention`` under each of
  the flash, efficient and cuDNN backends (one that errors is listed and skipped).

Three times per implementation (``triton.testing.do_bench`` medians, L2 flushed
before each call, inputs rotated among several sets):

- ``fwd``: the forward of a training step (grad enabled, so it saves what the
  backward needs);
- ``bwd``: the backward alone, ``torch.autograd.grad(out, (q, k, v), dout,
  retain_graph=True)`` on forwards done once beforehand (one per input set);
  ``retain_graph`` keeps the saved tensors so the same graph can be replayed;
- ``fwd+bwd``: ``torch.autograd.grad(attn(q, k, v), (q, k, v), dout)`` in one call
  (autograd.grad returns fresh gradients: nothing accumulates into ``.grad``).

Work counted (the usual convention): forward ``4 * B * H * D * n``, backward
2.5x that, ``10 * B * H * D * n`` (five matmuls against the forward's two), so
fwd+bwd ``14 * B * H * D * n``; ``n`` is the exact number of unmasked (query,
key) pairs per (batch, head) summed over the batch (``count_unmasked``), the
same for every implementation of a case. ``vs torch`` / ``vs sdpa`` are speed
ratios, peer time / flexgen time (above 1: flexgen is faster); the SDPA
figure is the fastest backend for that measurement.

Before timing, a correctness check on the first input set: flexgen's dq, dk,
dv against torch flex's (``max |g_flexgen - g_torch| / max |g_torch|`` per
gradient; the case is marked FAIL above 5e-2, and the run goes on). Where
torch flex cannot run (an error, or CPU in --smoke runs: torch has no CPU
flex backward) and the case is small, the dense float32 reference
(``flexgen.reference``) stands in.

``--backends tl,gluon`` also times flexgen once per kernel_options BACKEND in the same
case (on top of ``--flexgen-options``): "tl" (tl forward, tl backward), "gluon" (the Gluon
forward, dQ and dK/dV kernels; the tl dQ kernel where a captured tensor wants a gradient),
"AUTO"; each is checked like the main
flexgen run and printed as a table of its own (bwd and fwd+bwd ms, ratio to torch).

``--flexgen-options JSON`` passes a dict as flexgen's ``kernel_options`` in every
flexgen call (as in ``bench_forward.py``), e.g. ``{"USE_TMA": false}`` / ``{"USE_TMA":
true}`` to compare the pointer and TMA kernels (the backward follows the forward's
choice); the JSON records it (``config.flexgen_options``) and, per case, the path and
tiles of each kernel the first flexgen call launched (``flexgen_kernels``).

Writes ``bench_backward.json`` to ``--out``: ``$OUT`` when set, else
``benchmarks/results/`` under a name with the device and date. Prints a table
at the end (also to ``$BENCH_BACKWARD_SUMMARY`` when that is set).
"""
from __future__ import annotations

import os

# Timings must not include flexgen's NaN poisoning of outputs and gradients (extra fill kernels).
os.environ.pop("FLEXGEN_POISON", None)

import argparse  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import report  # noqa: E402
from common import add_doc_ids_option, set_doc_ids  # noqa: E402
from bench_forward import (DOC_AVG, SDPA_VARIANTS, SOFTCAP, WINDOW, Timeout, Timer,  # noqa: E402
                           _check_stop, _raise, count_unmasked, environment, f, make_mods,
                           make_sets, measure_ceiling, case_grid, output_path, rotating, write_json,
                           error_text, free_memory, run_grid, parse_options)

import flexgen  # noqa: E402

VARIANTS = ("full", "causal", "sliding_window", "alibi", "softcap", "document", "prefix_lm")
# The default run, most important first (the budget skips from the end): D=128 every
# variant at 16k, then at 2k, then D=64 full/causal at 16k (prefix LM: --variants). 198 s on an H100 with cold
# caches (torch 2.11, triton 3.6): 8-17 s a case, 27 s for the first.
DEFAULT_CASES = ([(128, v, L) for L in (16384, 2048) for v in VARIANTS[:-1]]
                 + [(64, "full", 16384), (64, "causal", 16384)])
CHECK_TOL = 5e-2            # max |g - g_ref| / max |g_ref| above this: FAIL
REFERENCE_MAX_SCORES = 1 << 27   # the dense fp32 reference only up to this many B*H*L*L scores
FWD_FLOPS, BWD_FLOPS = 4.0, 10.0   # per unmasked pair, per head-dim element, per head
PHASES = ("fwd", "bwd", "fwdbwd")


class SmokeTimer(Timer):
    """One timed call after the first (CPU smoke runs only: the interpreter is slow, the numbers meaningless)."""

    def __call__(self, fn) -> float:
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3


def kernel_path(r) -> str:
    """"tma", "pointer" or "mixed": how flexgen's backward kernels of a case addressed memory."""
    paths = {k["use_tma"] for name, k in (r.get("flexgen_kernels") or {}).items()
             if name.startswith("backward") and name != "backward_delta"}
    return "tma" if paths == {True} else "pointer" if paths == {False} else "mixed" if paths else "?"


def describe(r) -> str:
    return (f"{r['variant']:<14} D={r['D']:<3} L={r['L']:<6} bwd: flexgen {r['flexgen_bwd_ms']:.3f} ms "
            f"{r['flexgen_bwd_tflops']:.0f} TF/s ({kernel_path(r)}) | torch {f(r.get('torch_bwd_ms'), '.3f')} ms | "
            f"sdpa {f(r.get('sdpa_best_bwd_ms'), '.3f')} ms | check {r['check']}")


def grads(attn, q, k, v, dout):
    """(dq, dk, dv) of one forward + backward."""
    return torch.autograd.grad(attn(q, k, v), (q, k, v), dout)


def recording_kernels(fn):
    """(fn(), {kernel: path and tiles}) for the flexgen kernels that ``fn`` launched."""
    from flexgen.runtime import launch
    previous, launch.RECORDED = launch.RECORDED, []
    try:
        result = fn()
        recorded = launch.RECORDED
    finally:
        launch.RECORDED = previous
    kernels = {}
    for spec, _, _ in recorded:
        part = getattr(spec, "part", None)      # (the backward's parts; not its delta kernel)
        name = f"{spec.template}.{part}" if part else spec.template
        kernels[name] = dict(use_tma=spec.use_tma, block_m=spec.block_m, block_n=spec.block_n,
                             num_warps=spec.num_warps, num_stages=spec.num_stages)
    return result, kernels


def time_training(attn, sets, timer) -> dict:
    """fwd, bwd and fwd+bwd medians (ms) of ``attn(q, k, v)``; ``sets`` are (q, k, v, dout) tuples."""
    def fwd(q, k, v, dout):
        return attn(q, k, v)

    def fwdbwd(q, k, v, dout):
        return torch.autograd.grad(attn(q, k, v), (q, k, v), dout)

    def bwd(out, q, k, v, dout):
        return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

    ms = dict(fwd=timer(rotating(fwd, sets)), fwdbwd=timer(rotating(fwdbwd, sets)))
    # One forward per input set, kept with its graph: bwd replays only the backward.
    graphs = [(attn(q, k, v), q, k, v, dout) for q, k, v, dout in sets]
    ms["bwd"] = timer(rotating(bwd, graphs))
    del graphs
    return ms


def compare(got, want) -> dict:
    """Per gradient, max |got - want| / max |want| (NaN anywhere gives NaN)."""
    out = {}
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        g, w = g.float(), w.float()
        if not torch.isfinite(g).all():
            out[name] = float("nan")
            continue
        out[name] = float((g - w).abs().max() / w.abs().max().clamp_min(1e-30))
    return out


def worst(rel: dict) -> float:
    """The largest relative error, NaN if any is NaN (max() would keep or drop a NaN by its position)."""
    values = list(rel.values())
    return float("nan") if any(v != v for v in values) else max(values)


def run_case(D, variant, L, args, timer, cuda, seed) -> dict:
    dev = "cuda" if cuda else "cpu"
    H = args.heads
    B = max(1, args.tokens // L)
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(seed)
    r = dict(variant=variant, D=D, L=L, B=B, H=H, dtype="bfloat16")
    score_mod, mask_mod, mask_batch = make_mods(variant, B, H, L, dev, gen)
    # make_sets gives (q, k, v) sets sized so several do not fit in L2; add dout to each.
    sets = [(q.requires_grad_(), k.requires_grad_(), v.requires_grad_(),
             torch.randn(B, H, L, D, generator=gen).to(device=dev, dtype=dtype))
            for q, k, v in make_sets(B, H, L, D, dtype, dev, gen)]
    r["input_sets"] = len(sets)

    n = count_unmasked(mask_mod, mask_batch, B, L, dev)
    r["unmasked"] = n
    r["density"] = n / (B * L * L)
    flops = dict(fwd=FWD_FLOPS * H * D * n, bwd=BWD_FLOPS * H * D * n, fwdbwd=(FWD_FLOPS + BWD_FLOPS) * H * D * n)
    r["gflop"] = {p: flops[p] / 1e9 for p in PHASES}

    def record(prefix, ms):
        for p in PHASES:
            r[f"{prefix}_{p}_ms"] = ms[p]
            r[f"{prefix}_{p}_tflops"] = flops[p] / ms[p] / 1e9 if ms[p] > 0 else None

    # flexgen (a failure here fails the case: it is the subject)
    t0 = time.perf_counter()
    fg_mask = None
    if mask_mod is not None:
        fg_mask = flexgen.create_block_mask(mask_mod, mask_batch, None, L, L, device=dev)

    options = args.flexgen_options

    def fg(q, k, v):
        return flexgen.flex_attention(q, k, v, score_mod=score_mod, block_mask=fg_mask,
                                      kernel_options=options)
    # The first call compiles the forward and both backward kernels.
    fg_grads, r["flexgen_kernels"] = recording_kernels(lambda: grads(fg, *sets[0]))
    timer.sync()
    r["flexgen_first_call_s"] = time.perf_counter() - t0
    record("flexgen", time_training(fg, sets, timer))

    # torch.compile(flex_attention): a fresh compile for this case
    ref_grads = None
    if not args.skip_torch:
        try:
            from torch.nn.attention.flex_attention import create_block_mask as torch_cbm
            from torch.nn.attention.flex_attention import flex_attention as torch_flex
            torch._dynamo.reset()
            th_mask = None
            if mask_mod is not None:
                th_mask = torch_cbm(mask_mod, mask_batch, None, L, L, device=dev)
            # On CPU torch flex has no backward at all: eager, so the smoke run shows that error.
            compiled = torch.compile(torch_flex, dynamic=False, fullgraph=True) if cuda else torch_flex
            r["torch_mode"] = "compiled" if cuda else "eager (smoke)"

            def tf(q, k, v):
                return compiled(q, k, v, score_mod=score_mod, block_mask=th_mask)
            t0 = time.perf_counter()
            ref_grads = grads(tf, *sets[0])
            timer.sync()
            r["torch_first_call_s"] = time.perf_counter() - t0
            r["check_against"] = "torch flex"
            record("torch", time_training(tf, sets, timer))
        except Timeout:
            raise
        except Exception as e:
            _check_stop()
            r["torch_error"] = error_text(e)
            free_memory(cuda)

    # The check: torch flex's gradients, else (small cases only) the dense fp32 reference.
    if ref_grads is None and B * H * L * L <= REFERENCE_MAX_SCORES:
        try:
            from flexgen.reference import flex_attention_reference
            q, k, v, dout = sets[0]
            ref_grads = torch.autograd.grad(
                flex_attention_reference(q, k, v, score_mod, mask_mod, dtype=torch.float32),
                (q, k, v), dout.float())
            r["check_against"] = "reference fp32"
        except Timeout:
            raise
        except Exception as e:
            _check_stop()
            r["check_error"] = error_text(e)
            free_memory(cuda)
    if ref_grads is not None:
        rel = compare(fg_grads, ref_grads)
        r.update({f"check_rel_{k}": v for k, v in rel.items()})
        r["check_rel"] = worst(rel)
        r["check"] = "PASS" if r["check_rel"] <= CHECK_TOL else "FAIL"    # NaN fails (NaN <= x is False)
    else:
        r["check"] = "n/a"
    del fg_grads

    # SDPA backends (full and causal only)
    if variant in SDPA_VARIANTS and not args.skip_sdpa:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        is_causal = SDPA_VARIANTS[variant]

        def sd(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                              ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                              ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                # The backend is picked at the forward; its backward follows it.
                with sdpa_kernel([backend]):
                    grads(sd, *sets[0])      # fails fast here when the backend cannot run
                    record(f"sdpa_{name}", time_training(sd, sets, timer))
            except Timeout:
                raise
            except Exception as e:
                _check_stop()
                r[f"sdpa_{name}_error"] = error_text(e, 200)
                free_memory(cuda)
        for p in ("bwd", "fwdbwd"):
            got = {name: r[f"sdpa_{name}_{p}_ms"] for name in ("flash", "efficient", "cudnn")
                   if f"sdpa_{name}_{p}_ms" in r}
            if got:
                best = min(got, key=got.get)
                r[f"sdpa_best_{p}"], r[f"sdpa_best_{p}_ms"] = best, got[best]
                r[f"sdpa_best_{p}_tflops"] = r[f"sdpa_{best}_{p}_tflops"]

    # The other kernel families (--backends), on the same inputs, checked like the main run.
    for backend in args.backends:
        b_options = dict(options or {}, BACKEND=backend)
        prefix = f"backend_{backend}"
        try:
            def fb(q, k, v, b_options=b_options):
                return flexgen.flex_attention(q, k, v, score_mod=score_mod, block_mask=fg_mask,
                                              kernel_options=b_options)
            b_grads, r[f"{prefix}_kernels"] = recording_kernels(lambda: grads(fb, *sets[0]))
            record(prefix, time_training(fb, sets, timer))
            if ref_grads is not None:
                r[f"{prefix}_check_rel"] = worst(compare(b_grads, ref_grads))
            del b_grads
            if r.get("torch_bwd_ms"):
                r[f"{prefix}_vs_torch_bwd"] = r["torch_bwd_ms"] / r[f"{prefix}_bwd_ms"]
                r[f"{prefix}_vs_torch_fwdbwd"] = r["torch_fwdbwd_ms"] / r[f"{prefix}_fwdbwd_ms"]
        except Timeout:
            raise
        except Exception as e:
            _check_stop()
            r[f"{prefix}_error"] = error_text(e)
            free_memory(cuda)

    # flexgen's backward again: the spread between its two timings is the noise of this case
    graphs = [(fg(q, k, v), q, k, v, dout) for q, k, v, dout in sets]
    r["flexgen_bwd_ms_repeat"] = timer(rotating(
        lambda out, q, k, v, dout: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), graphs))
    del graphs, ref_grads
    r["flexgen_bwd_spread_pct"] = 100 * abs(r["flexgen_bwd_ms_repeat"] - r["flexgen_bwd_ms"]) / r["flexgen_bwd_ms"]
    for p in ("bwd", "fwdbwd"):
        if r.get(f"torch_{p}_ms"):
            r[f"vs_torch_{p}"] = r[f"torch_{p}_ms"] / r[f"flexgen_{p}_ms"]
        if r.get(f"sdpa_best_{p}_ms"):
            r[f"vs_sdpa_{p}"] = r[f"sdpa_best_{p}_ms"] / r[f"flexgen_{p}_ms"]
    return r


# ---------------------------------------------------------------------------
# output

def table(payload) -> str:
    ceil = payload.get("ceiling", {}).get("matmul_tflops")
    lines = []
    if ceil:
        c = payload["ceiling"]
        lines.append(f"backward, bf16, H={payload['config']['heads']}, B x L = {payload['config']['tokens']}; "
                     f"ceiling: bf16 matmul {c['matmul_n']}^3 {ceil:.0f} TFLOP/s"
                     + (f", copy {c['copy_gbps']:.0f} GB/s" if "copy_gbps" in c else ""))
    head = (f"{'D':>3} {'variant':<14} {'L':>6} {'B':>3} | {'bwd: flexgen':>12} {'TF/s':>5} {'±%':>4} | "
            f"{'torch':>5} {'ratio':>5} | {'sdpa':>5} {'which':<9} {'ratio':>5} | "
            f"{'fwd+bwd TF/s: flexgen':>21} {'torch':>5} {'ratio':>5} | {'check':<13}")
    if payload.get("config", {}).get("flexgen_options"):
        lines.append(f"flexgen kernel_options: {payload['config']['flexgen_options']}")
    lines += [head, "-" * len(head)]
    for r in payload.get("cases", []):
        if "skipped" in r or "error" in r:
            lines.append(f"{r['D']:>3} {r['variant']:<14} {r['L']:>6}  " + (
                f"SKIP ({r['skipped']})" if "skipped" in r else f"ERROR {r['error'][:100]}"))
            continue
        torch_missing = "err" if "torch_error" in r else "-"
        check = r["check"] + (f" {r['check_rel']:.1e}" if "check_rel" in r else "")
        lines.append(
            f"{r['D']:>3} {r['variant']:<14} {r['L']:>6} {r['B']:>3} | "
            f"{r['flexgen_bwd_ms']:9.3f} ms {r['flexgen_bwd_tflops']:5.0f} {r['flexgen_bwd_spread_pct']:4.1f} | "
            f"{f(r.get('torch_bwd_tflops'), '5.0f', torch_missing):>5} {f(r.get('vs_torch_bwd'), '5.2f'):>5} | "
            f"{f(r.get('sdpa_best_bwd_tflops'), '5.0f'):>5} {r.get('sdpa_best_bwd', '-'):<9} "
            f"{f(r.get('vs_sdpa_bwd'), '5.2f'):>5} | "
            f"{r['flexgen_fwdbwd_tflops']:21.0f} {f(r.get('torch_fwdbwd_tflops'), '5.0f', torch_missing):>5} "
            f"{f(r.get('vs_torch_fwdbwd'), '5.2f'):>5} | {check:<13}")
    lines.append("TF/s: useful work only (fwd 4, bwd 10, fwd+bwd 14 x B*H*D*unmasked pairs); ratio = peer ms / "
                 "flexgen ms (>1: flexgen faster); sdpa = fastest backend; ±%: flexgen bwd timed twice; "
                 f"check: max|dq,dk,dv - torch flex| / max|torch flex| (FAIL > {CHECK_TOL:g})")
    backends = payload.get("config", {}).get("backends") or []
    if backends:
        lines.append("")
        lines.append("per BACKEND (kernel_options), same inputs and run: ms, and torch ms / that ms")
        head = f"{'D':>3} {'variant':<14} {'L':>6} {'BACKEND':<7} | {'bwd ms':>8} {'vs torch':>8} | " \
               f"{'fwd+bwd ms':>10} {'vs torch':>8} | {'fwd ms':>7} | {'check':<7} | dQ, dK/dV kernels"
        lines += [head, "-" * len(head)]
        for r in payload.get("cases", []):
            for b in backends:
                p = f"backend_{b}"
                if f"{p}_bwd_ms" not in r:
                    if f"{p}_error" in r:
                        lines.append(f"{r['D']:>3} {r['variant']:<14} {r['L']:>6} {b:<7} | ERROR {r[f'{p}_error'][:100]}")
                    continue
                kernels = r.get(f"{p}_kernels") or {}
                dq, dkdv = ("gluon" if f"backward_gluon.{part}" in kernels else "tl" if f"backward.{part}" in kernels
                            else "?" for part in ("dq", "dkdv"))
                lines.append(
                    f"{r['D']:>3} {r['variant']:<14} {r['L']:>6} {b:<7} | {r[f'{p}_bwd_ms']:8.3f} "
                    f"{f(r.get(f'{p}_vs_torch_bwd'), '8.2f'):>8} | {r[f'{p}_fwdbwd_ms']:10.3f} "
                    f"{f(r.get(f'{p}_vs_torch_fwdbwd'), '8.2f'):>8} | {r[f'{p}_fwd_ms']:7.3f} | "
                    f"{f(r.get(f'{p}_check_rel'), '7.1e'):<7} | {dq}, {dkdv}")
    # Footnotes, one line per distinct message with the cases it concerns (a smoke run has the same
    # torch error six times).
    notes = {}
    for r in payload.get("cases", []):
        where = f"{r['variant']} D{r['D']} L{r['L']}"
        if "torch_error" in r:
            notes.setdefault(f"torch error: {r['torch_error'][:150]}", []).append(where)
        if r.get("check_against", "torch flex") != "torch flex":
            notes.setdefault(f"checked against the {r['check_against']}", []).append(where)
        if "check_error" in r:
            notes.setdefault(f"check error: {r['check_error'][:150]}", []).append(where)
    for text, where in notes.items():
        lines.append(f"  {text} ({', '.join(where) if len(where) < 4 else f'{len(where)} cases'})")
    sd_err = sorted({(k, r[k][:80]) for r in payload.get("cases", []) for k in r
                     if k.startswith("sdpa_") and k.endswith("_error")})
    for k, e in sd_err:
        lines.append(f"  {k[:-6]} unavailable: {e}")
    return "\n".join(line.rstrip() for line in lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default="", help=f"comma list among {','.join(VARIANTS)}")
    ap.add_argument("--lengths", default="", help="comma list, e.g. 1k,2k,4k,8k,16k")
    ap.add_argument("--dims", default="", help="comma list of head dims, e.g. 64,128")
    ap.add_argument("--tokens", type=int, default=16384, help="B x L (default 16384)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--budget", type=float, default=float(os.environ.get("BENCH_BACKWARD_BUDGET_S", 240)),
                    help="seconds for the whole script; cases that would not fit are skipped (default 240)")
    ap.add_argument("--case-timeout", type=float, default=150, help="seconds one case may take")
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--skip-sdpa", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (interpreter): tests the script")
    ap.add_argument("--out", default=None, help="output folder (default $OUT, else benchmarks/results)")
    ap.add_argument("--backends", default="", help="also time flexgen with these kernel_options BACKEND "
                    "values, e.g. tl,gluon,AUTO")
    ap.add_argument("--flexgen-options", type=parse_options, default=None, metavar="JSON",
                    help='flexgen kernel_options for every flexgen call, e.g. \'{"USE_TMA": true}\'')
    add_doc_ids_option(ap)
    args = ap.parse_args(argv)
    set_doc_ids(args)

    args.backends = [b for b in args.backends.split(",") if b]
    cuda = not args.smoke
    if cuda and not torch.cuda.is_available():
        print("bench_backward: no CUDA device; use --smoke for the CPU run", file=sys.stderr)
        return 2
    if args.smoke:
        args.tokens, args.heads = 128, 2
        args.lengths = args.lengths or "128"
        args.dims = args.dims or "64"
        args.variants = args.variants or ",".join(VARIANTS)
    grid = case_grid(args, VARIANTS, DEFAULT_CASES, ap)
    env = environment(cuda)
    json_path = output_path(args, "bench_backward", env)

    # Timing the backward alone replays one graph (retain_graph=True). AOTAutograd refuses
    # that when it compiled the backward with donated buffers (saved intermediates it may
    # overwrite, like the LSE); turning donation off only changes memory reuse, not kernels.
    import torch._functorch.config as functorch_config
    donated = getattr(functorch_config, "donated_buffer", None)
    if donated is not None:
        functorch_config.donated_buffer = False

    timer = SmokeTimer(cuda) if args.smoke else Timer(cuda, warmup_ms=25, rep_ms=150)
    signal.signal(signal.SIGTERM, _raise)
    signal.signal(signal.SIGALRM, _raise)
    t_start = time.monotonic()
    deadline = t_start + args.budget
    payload = dict(env=env, config=dict(tokens=args.tokens, heads=args.heads, dtype="bfloat16", window=WINDOW,
                                        doc_ids=args.doc_ids, softcap=SOFTCAP, doc_avg=DOC_AVG,
                                        budget_s=args.budget,
                                        flops_per_pair=dict(fwd=FWD_FLOPS, bwd=BWD_FLOPS,
                                                            fwdbwd=FWD_FLOPS + BWD_FLOPS),
                                        check_tol=CHECK_TOL, donated_buffer_was=donated,
                                        grid=[list(g) for g in grid], argv=sys.argv[1:],
                                        flexgen_options=args.flexgen_options, backends=args.backends),
                   cases=[])
    print(f"bench_backward on {env['device_name']}: torch {env['torch']}, triton {env['triton']}, "
          f"{len(grid)} cases, budget {args.budget:.0f} s -> {json_path}"
          + (f", flexgen kernel_options {args.flexgen_options}" if args.flexgen_options else ""), flush=True)
    try:
        payload["ceiling"] = measure_ceiling(timer, cuda, args.smoke)
        print(f"  ceiling: {payload['ceiling']['matmul_tflops']:.0f} TFLOP/s bf16 matmul"
              + (f", {payload['ceiling']['copy_gbps']:.0f} GB/s copy" if "copy_gbps" in payload["ceiling"] else ""),
              flush=True)
        write_json(json_path, payload)
        run_grid(grid, lambda D, variant, L, seed: run_case(D, variant, L, args, timer, cuda, seed),
                 describe, deadline, args.case_timeout, payload, json_path, cuda)
    except (Timeout, KeyboardInterrupt) as e:
        signal.setitimer(signal.ITIMER_REAL, 0)
        print(f"bench_backward: stopped early ({e}); writing what was done", flush=True)
        payload["stopped_early"] = str(e)
    payload["seconds"] = time.monotonic() - t_start
    write_json(json_path, payload)
    report(table(payload), "BENCH_BACKWARD_SUMMARY", f"\nwrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
