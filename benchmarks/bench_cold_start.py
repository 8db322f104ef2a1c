"""Cold start of a never-seen mod: from nothing cached to the first correct result.

    python benchmarks/bench_cold_start.py                 # both mods, 2 repeats (~3-4 min on an H100, estimated)
    python benchmarks/bench_cold_start.py --repeats 3 --mods causal_softcap --budget 300
    python benchmarks/bench_cold_start.py --smoke         # tiny sizes on CPU: checks the script only
    python benchmarks/bench_cold_start.py --mods causal_softcap --repeats 1 --dtypes bfloat16,float32 --budget 150
                                                          # run_all.sh's cold step: both dtypes, ~150 s

flexgen against ``torch.compile(torch.nn.attention.flex_attention)``. Every
measurement is a fresh Python process (this script run with ``--child``)
with empty private cache directories: for flexgen ``FLEXGEN_CACHE_DIR`` and
``TRITON_CACHE_DIR``; for torch ``TORCHINDUCTOR_CACHE_DIR`` and
``TRITON_CACHE_DIR``, plus ``TORCHINDUCTOR_FX_GRAPH_CACHE=0`` and
``TORCHINDUCTOR_AUTOGRAD_CACHE=0``. The mods are defined in the child and
their constant (softcap value, ALiBi max bias) is drawn from the run's seed,
so the mod is new even to Python-level caches.

Mods (bf16, B=1, H=16, L=4096, D=128 on CUDA):

- ``causal_softcap``: causal mask_mod + ``cap * tanh(score / cap)``;
- ``document_alibi``: document mask (a captured ``[L]`` tensor of document
  ids, random lengths) + ALiBi ``score + 2^(-max_bias (h+1) / H) (kv - q)``.

In the child: ``import torch``; then the library, timed (``import flexgen``,
or torch's ``flex_attention`` module); a tiny CUDA op so that CUDA context
creation counts for neither side; the inputs. Then the first call, each
step synchronized and timed: ``create_block_mask`` (mask), for flexgen
``flexgen.kernel_source`` (plan: trace, sympy, render: what flexgen does in
Python before Triton sees the kernel; the call that follows repeats only its
memoized part), then the attention call (attn). ``first`` = their sum,
``cold`` = import + first. The same steps again in the same process give the
warm second call. The output is checked against a float32 softmax reference
(same mods, query rows in chunks): max abs error > 2e-2 (5e-2 in smoke runs: the
interpreter truncates to bf16), or a NaN, is FAIL.

Cases, per mod and implementation:

- ``cold``: as above, ``--repeats`` times (fresh directories and seed each time);
- ``warm-disk``: a fresh process reusing the cache directories a previous
  child filled for the same mod and seed (a user's second launch of the
  script). For flexgen, those of the first ``cold`` child; for torch those of
  a ``cold+caches`` child: a cold start with inductor's FX graph and
  AOTAutograd caches on (torch's default), since the ``cold`` children do not
  write them. Run once per mod (``--no-warm`` skips it).

Order: one ``cold`` child per mod and implementation, then the warm-disk
cases, then the other repeats, so that a short ``--budget`` still gets the
headline numbers. A child that would not fit in what is left is skipped; one
still running when the budget ends is killed and listed as SKIP, one that
outlasts ``--child-timeout`` as TIMEOUT.

Writes ``bench_cold_start.json`` (environment, every child's result, the
summary) to ``--out``, else ``$OUT``, else ``benchmarks/results/`` under a
name with the device and date. Prints a table last (also written to
``$BENCH_COLD_START_SUMMARY`` when set). Exit status 1 when a child failed,
errored or timed out; children skipped for the budget do not count.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

MODS = ("causal_softcap", "document_alibi")
IMPLS = ("flexgen", "torch")
TOL = 2e-2              # max abs error against the float32 reference
# The Triton interpreter rounds float32 to bf16 by truncation (benchmarks/README.md): about 2.5x the
# GPU's error, which at 2e-2 would make the smoke run fail now and then for nothing.
SMOKE_TOL = 5e-2
TARGET_S = 3.0          # the issue's target for flexgen's cold start of a new mod
DOC_AVG = 512           # mean document length of document_alibi
REF_ROWS = 512          # query rows per chunk of the reference


# ---------------------------------------------------------------------------
# child: one fresh process, one implementation, one mod

def mod_constants(mod: str, seed: int) -> dict:
    """The constant baked into this run's mod: a new value per seed, so a new kernel."""
    rng = random.Random(f"{mod}:{seed}")
    if mod == "causal_softcap":
        return dict(cap=round(rng.uniform(10.0, 50.0), 4))
    if mod == "document_alibi":
        return dict(max_bias=round(rng.uniform(4.0, 12.0), 4))
    raise ValueError(f"unknown mod {mod!r}; known: {', '.join(MODS)}")


def build_mods(torch, mod: str, consts: dict, H: int, L: int, device, gen):
    """(score_mod, mask_mod) written as a user would, closing over this run's constants."""
    if mod == "causal_softcap":
        cap = consts["cap"]

        def softcap_score_mod(score, b, h, q_idx, kv_idx):
            return cap * torch.tanh(score / cap)

        def causal_mask_mod(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

        return softcap_score_mod, causal_mask_mod

    step = -consts["max_bias"] / H
    n_docs = max(2, L // DOC_AVG)
    cuts = torch.randperm(L - 1, generator=gen)[: n_docs - 1] + 1
    starts = torch.zeros(L, dtype=torch.int32)
    starts[cuts] = 1
    doc = torch.cumsum(starts, 0, dtype=torch.int32).to(device)

    def alibi_score_mod(score, b, h, q_idx, kv_idx):
        return score + torch.exp2(step * (h + 1)) * (kv_idx - q_idx)

    def document_mask_mod(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    return alibi_score_mod, document_mask_mod


def reference(torch, q, k, v, score_mod, mask_mod):
    """Plain softmax attention in float32 (tf32 off), query rows in chunks to bound memory."""
    B, H, L, D = q.shape
    dev = q.device
    qf, kf, vf = (t.float() for t in (q, k, v))
    b = torch.zeros(1, 1, 1, 1, dtype=torch.int32, device=dev)
    h = torch.arange(H, dtype=torch.int32, device=dev).view(1, H, 1, 1)
    kv = torch.arange(L, dtype=torch.int32, device=dev).view(1, 1, 1, L)
    out = torch.empty(B, H, L, vf.shape[-1], dtype=torch.float32, device=dev)
    for s in range(0, L, REF_ROWS):
        e = min(L, s + REF_ROWS)
        qi = torch.arange(s, e, dtype=torch.int32, device=dev).view(1, 1, -1, 1)
        scores = (qf[:, :, s:e] @ kf.transpose(-1, -2)) / math.sqrt(D)
        scores = score_mod(scores, b, h, qi, kv)
        scores = scores.masked_fill(~mask_mod(b, h, qi, kv), -math.inf)
        out[:, :, s:e] = torch.softmax(scores, dim=-1) @ vf   # every row keeps its diagonal
    return out


def child_main(args) -> int:
    r = dict(impl=args.impl, mod=args.mod, case=args.case, seed=args.seed)
    try:
        t0 = time.perf_counter()
        import torch
        r["import_torch_s"] = time.perf_counter() - t0

        # The library, timed on its own: part of what a user's first launch pays.
        t0 = time.perf_counter()
        if args.impl == "flexgen":
            import flexgen
        else:
            from torch.nn.attention import flex_attention as torch_flex_module
        r["import_lib_s"] = time.perf_counter() - t0

        cuda = not args.smoke
        dev = torch.device("cuda" if cuda else "cpu")

        def sync():
            if cuda:
                torch.cuda.synchronize()

        # CUDA context creation is the same for both sides and not what is compared.
        t0 = time.perf_counter()
        if cuda:
            torch.ones(1, device=dev).add_(1)
            sync()
        r["cuda_init_s"] = time.perf_counter() - t0

        H, L, D = args.heads, args.length, args.dim
        gen = torch.Generator().manual_seed(args.seed)
        consts = mod_constants(args.mod, args.seed)
        r["constants"] = consts
        score_mod, mask_mod = build_mods(torch, args.mod, consts, H, L, dev, gen)
        q, k, v = (torch.randn(1, H, L, D, generator=gen).to(dev, getattr(torch, args.dtype))
                   for _ in range(3))
        sync()

        if args.impl == "flexgen":
            def make_mask():
                return flexgen.create_block_mask(mask_mod, None, None, L, L, device=dev)

            def plan(bm):
                return flexgen.kernel_source(q, k, v, score_mod=score_mod, block_mask=bm)

            def attend(bm):
                return flexgen.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)
        else:
            # Like bench_forward: fullgraph so a graph break raises instead of running unfused.
            # On CPU (smoke) torch's eager flex_attention: no compiler involved.
            fn = torch_flex_module.flex_attention
            compiled = torch.compile(fn, dynamic=False, fullgraph=True) if cuda else fn
            r["torch_mode"] = "compiled" if cuda else "eager (smoke)"

            def make_mask():
                return torch_flex_module.create_block_mask(mask_mod, None, None, L, L, device=dev)

            plan = None

            def attend(bm):
                return compiled(q, k, v, score_mod=score_mod, block_mask=bm)

        def run_once():
            """create_block_mask, (plan,) attention, each synchronized: (output, seconds per step)."""
            t = {}
            t0 = time.perf_counter()
            bm = make_mask()
            sync()
            t["mask_s"] = time.perf_counter() - t0
            if plan is not None:
                t1 = time.perf_counter()
                plan(bm)
                t["plan_s"] = time.perf_counter() - t1
            t1 = time.perf_counter()
            out = attend(bm)
            sync()
            t["attn_s"] = time.perf_counter() - t1
            t["total_s"] = time.perf_counter() - t0
            return out, t

        # The first call end to end, then the same steps again in this process (warm).
        out, t = run_once()
        r.update({name: t[name] for name in ("mask_s", "plan_s", "attn_s") if name in t})
        r["first_s"] = t["total_s"]
        r["cold_s"] = r["import_lib_s"] + r["first_s"]
        # Whether the first call needed sympy (flexgen: a mod of a form it does not ship,
        # flexgen.frontend.seeds, or a captured tensor's index checks; torch.compile always).
        r["sympy_loaded"] = "sympy" in sys.modules
        out2, t = run_once()
        r["second_s"] = t.pop("total_s")
        r["second_steps"] = t

        if args.impl == "torch":
            # Observable proof of the warm-disk case: inductor's own cache counters.
            try:
                from torch._dynamo.utils import counters
                r["inductor_counters"] = {f"{group}.{name}": n for group in ("inductor", "aot_autograd")
                                          for name, n in counters[group].items() if "cache" in name}
            except Exception:
                pass

        if cuda:
            torch.backends.cuda.matmul.allow_tf32 = False
        ref = reference(torch, q, k, v, score_mod, mask_mod)
        err = float((out.float() - ref).abs().max())
        err2 = float((out2.float() - ref).abs().max())
        r["maxerr"] = max(err, err2) if math.isfinite(err) and math.isfinite(err2) else float("nan")
        r["tol"] = TOL if cuda else SMOKE_TOL
        r["status"] = "PASS" if math.isfinite(r["maxerr"]) and r["maxerr"] <= r["tol"] else "FAIL"
    except Exception as e:
        r["status"] = "ERROR"
        r["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        r["traceback"] = traceback.format_exc(limit=12)[-3000:]
    # One JSON line on stdout: the parent reads the last line that parses.
    print(json.dumps(r, default=str), flush=True)
    return 0 if r["status"] in ("PASS", "FAIL") else 1


# ---------------------------------------------------------------------------
# parent: spawn the children, collect, summarize

class Stop(Exception):
    """SIGTERM (an outer timeout): stop starting children, write what was done."""


def _on_sigterm(signum, frame):
    raise Stop(f"signal {signum}")


def fresh_dirs(impl: str) -> dict:
    """Empty private cache directories for one child (mkdtemp makes them 0700, as flexgen wants)."""
    names = ("flexgen", "triton") if impl == "flexgen" else ("inductor", "triton")
    return {n: tempfile.mkdtemp(prefix=f"cold-{impl}-{n}-") for n in names}


def remove_dirs(dirs: dict, keep: bool):
    if not keep:
        for path in dirs.values():
            shutil.rmtree(path, ignore_errors=True)


def dir_stats(dirs: dict) -> dict:
    """What the caches hold: compiled kernels (.cubin), C extensions built (.so), files, MB."""
    stats = dict(cubin=0, so=0, files=0, mb=0.0)
    for path in dirs.values():
        for root, _, files in os.walk(path):
            for name in files:
                stats["files"] += 1
                stats["cubin"] += name.endswith(".cubin")
                stats["so"] += name.endswith(".so")
                try:
                    stats["mb"] += os.path.getsize(os.path.join(root, name)) / 2**20
                except OSError:
                    pass
    stats["mb"] = round(stats["mb"], 2)
    return stats


def child_env(impl: str, case: str, dirs: dict) -> dict:
    env = dict(os.environ)
    # NaN poisoning would add a fill kernel to flexgen's timings; flexgen picks the
    # Triton interpreter itself from the tensors' device, an inherited setting would confuse torch's side.
    env.pop("FLEXGEN_POISON", None)
    env.pop("TRITON_INTERPRET", None)
    env["TRITON_CACHE_DIR"] = dirs["triton"]
    if impl == "flexgen":
        env["FLEXGEN_CACHE_DIR"] = dirs["flexgen"]
    else:
        env["TORCHINDUCTOR_CACHE_DIR"] = dirs["inductor"]
        # cold: the graph caches off, belt and braces on top of the empty directory.
        # cold+caches and warm-disk: torch's default (on), so the first writes what the second reads.
        on = "0" if case == "cold" else "1"
        env["TORCHINDUCTOR_FX_GRAPH_CACHE"] = on
        env["TORCHINDUCTOR_AUTOGRAD_CACHE"] = on
    return env


def parse_result(stdout: str) -> dict | None:
    for line in reversed(stdout.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def spawn(args, impl, mod, case, seed, dirs, timeout) -> dict:
    """Run one child; its result with the process wall time and the caches' contents added."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--impl", impl, "--mod", mod,
           "--case", case, "--seed", str(seed), "--length", str(args.length), "--heads", str(args.heads),
           "--dtype", args.dtype,
           "--dim", str(args.dim)] + (["--smoke"] if args.smoke else [])
    before = dir_stats(dirs)
    t0 = time.monotonic()
    # A session of its own: on a timeout the whole group goes (inductor's compile workers too).
    proc = subprocess.Popen(cmd, env=child_env(impl, case, dirs), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    timed_out = False
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
    finally:
        if proc.poll() is None:         # Stop raised inside communicate
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    r = parse_result(stdout) or dict(impl=impl, mod=mod, case=case, seed=seed, status="ERROR")
    r["process_s"] = time.monotonic() - t0
    r["returncode"] = proc.returncode
    if timed_out and timeout < args.child_timeout:
        # Killed because the run's budget ran out, not for taking longer than a child may.
        r["status"] = "SKIP"
        r["skipped"] = f"budget: killed after {timeout:.0f} s"
    elif timed_out:
        r["status"] = "TIMEOUT"
        r["error"] = f"timeout after {timeout:.0f} s"
    elif "error" not in r and r["status"] == "ERROR":
        r["error"] = f"exit {proc.returncode}, no result line"
    if r["status"] in ("ERROR", "TIMEOUT"):
        r["stderr_tail"] = stderr[-2000:]
    after = dir_stats(dirs)
    r["cache"] = after
    r["new_cubins"] = after["cubin"] - before["cubin"]
    return r


def fmt(x, spec, missing="-"):
    return missing if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


CASE_ORDER = ("cold", "cold+caches", "warm-disk")


def summarize(runs: list) -> list:
    """One row per (mod, impl, case): medians over the children that passed, min of first and cold."""
    rows = []
    keys = sorted({(r["mod"], r["impl"], r["case"]) for r in runs},
                  key=lambda k: (MODS.index(k[0]), IMPLS.index(k[1]), CASE_ORDER.index(k[2])))
    for mod, impl, case in keys:
        group = [r for r in runs if (r["mod"], r["impl"], r["case"]) == (mod, impl, case)]
        done = [r for r in group if r["status"] != "SKIP"]
        ok = [r for r in done if r["status"] == "PASS"]
        row = dict(mod=mod, impl=impl, case=case, passed=len(ok), ran=len(done),
                   statuses=sorted({r["status"] for r in group}))
        for key in ("import_lib_s", "mask_s", "plan_s", "attn_s", "first_s", "cold_s", "second_s", "process_s"):
            vals = [r[key] for r in ok if r.get(key) is not None]
            if vals:
                row[key] = statistics.median(vals)
                if key in ("first_s", "cold_s"):
                    row[key.replace("_s", "_min_s")] = min(vals)
        errs = [r["maxerr"] for r in done if r.get("maxerr") is not None]
        if errs:
            row["maxerr"] = max(errs, key=lambda e: math.inf if math.isnan(e) else e)
        if ok:
            row["cubin"] = statistics.median(r["cache"]["cubin"] for r in ok)
            row["so"] = statistics.median(r["cache"]["so"] for r in ok)
            row["new_cubins"] = statistics.median(r["new_cubins"] for r in ok)
        rows.append(row)
    return rows


def table(payload) -> str:
    env, cfg = payload["env"], payload["config"]
    lines = [f"cold start of a never-seen mod: {cfg['dtype']} B=1 H={cfg['heads']} L={cfg['length']} D={cfg['dim']} on "
             f"{env.get('device_name')}, torch {env['torch']}, triton {env['triton']}, flexgen {env['flexgen']}"]
    head = (f"{'mod':<15} {'impl':<8} {'case':<11} {'ok':>4} | {'import':>6} {'mask':>6} {'plan':>6} {'attn':>6} | "
            f"{'first':>6} {'[min]':>7} | {'cold':>6} {'[min]':>7} | {'2nd ms':>7} {'maxerr':>7} | "
            f"{'proc':>5} {'cubin':>5} {'so':>3} {'new':>3}")
    lines += [head, "-" * len(head)]
    rows = payload.get("summary", [])
    for s in rows:
        if not s["ran"]:
            lines.append(f"{s['mod']:<15} {s['impl']:<8} {s['case']:<11}  SKIP (budget or missing prerequisite)")
            continue
        if not s["passed"]:
            lines.append(f"{s['mod']:<15} {s['impl']:<8} {s['case']:<11} {s['passed']:>2}/{s['ran']:<1} | "
                         + ", ".join(x for x in s["statuses"] if x != "SKIP") + " (below)")
            continue
        lines.append(
            f"{s['mod']:<15} {s['impl']:<8} {s['case']:<11} {s['passed']:>2}/{s['ran']:<1} | "
            f"{fmt(s.get('import_lib_s'), '6.2f'):>6} {fmt(s.get('mask_s'), '6.2f'):>6} "
            f"{fmt(s.get('plan_s'), '6.2f'):>6} {fmt(s.get('attn_s'), '6.2f'):>6} | "
            f"{fmt(s.get('first_s'), '6.2f'):>6} {'[' + fmt(s.get('first_min_s'), '.2f') + ']':>7} | "
            f"{fmt(s.get('cold_s'), '6.2f'):>6} {'[' + fmt(s.get('cold_min_s'), '.2f') + ']':>7} | "
            f"{fmt(s.get('second_s') and s['second_s'] * 1e3, '7.1f'):>7} {fmt(s.get('maxerr'), '7.1e'):>7} | "
            f"{fmt(s.get('process_s'), '5.1f'):>5} {fmt(s.get('cubin'), '5.0f'):>5} {fmt(s.get('so'), '3.0f'):>3} "
            f"{fmt(s.get('new_cubins'), '3.0f'):>3}")
    lines.append("seconds, medians over the children that passed ([min]); each child a fresh process. "
                 "first = mask + plan + attn of the first call (each synchronized); cold = import of the library "
                 "+ first; 2nd = the same steps again in that process; maxerr vs float32 reference (FAIL > "
                 f"{cfg['tol']:g}); proc = the child's wall time (python, import torch, CUDA init, calls, check); "
                 "cubin / so = kernels / C extensions in its caches after it, new = cubins it added.")
    lines.append("torch cold: empty TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR, FX graph and AOTAutograd caches "
                 "off; cold+caches: the same with those caches on (it fills the directories warm-disk reuses).")
    by = {(s["mod"], s["impl"], s["case"]): s for s in rows}
    verdicts = []
    for mod in cfg["mods"]:
        fg, th = by.get((mod, "flexgen", "cold"), {}), by.get((mod, "torch", "cold"), {})
        if fg.get("first_s") is None:
            continue
        v = (f"{mod}: first call {fg['first_s']:.2f} s {'OK' if fg['first_s'] <= TARGET_S else 'MISS'}, "
             f"with import {fg['cold_s']:.2f} s {'OK' if fg['cold_s'] <= TARGET_S else 'MISS'}")
        if th.get("cold_s"):
            v += f"; torch cold / flexgen cold = {th['cold_s'] / fg['cold_s']:.1f}x"
        verdicts.append(v)
    if verdicts:
        lines.append(f"target: flexgen cold start of a new mod <= {TARGET_S:g} s (medians). " + "; ".join(verdicts))
    for r in payload.get("runs", []):
        if r["status"] in ("FAIL", "ERROR", "TIMEOUT"):
            lines.append(f"  {r['status']} {r['mod']} {r['impl']} {r['case']} seed {r['seed']}: "
                         + (r.get("error") or f"maxerr {fmt(r.get('maxerr'), '.2e')}")[:200])
        elif r["status"] == "SKIP":
            lines.append(f"  SKIP {r['mod']} {r['impl']} {r['case']}: {r.get('skipped')}")
    if payload.get("stopped_early"):
        lines.append(f"stopped early: {payload['stopped_early']}")
    return "\n".join(lines)


def _each_dtype(argv, dtypes, budget) -> int:
    """main once per dtype (its own JSON and table), each given an even share of what is left."""
    rest, skip = [], False
    for a in argv:      # the run's own arguments without --dtypes / --dtype / --budget
        if skip:
            skip = False
        elif a in ("--dtypes", "--dtype", "--budget"):
            skip = True
        elif not a.startswith(("--dtypes=", "--dtype=", "--budget=")):
            rest.append(a)
    deadline, rc = time.monotonic() + budget, 0
    for i, dtype in enumerate(dtypes):
        share = (deadline - time.monotonic()) / (len(dtypes) - i)
        if share < 10:
            print(f"bench_cold_start: {dtype} skipped ({share:.0f} s left)", flush=True)
            continue
        rc |= main(rest + ["--dtype", dtype, "--budget", f"{share:.0f}"])
    return rc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=None, help="cold children per mod and implementation "
                    "(default 2; 1 with --smoke)")
    ap.add_argument("--budget", type=float, default=None, help="seconds for the whole run: no child is started "
                    "that would not fit (default 500; 110 with --smoke)")
    ap.add_argument("--child-timeout", type=float, default=None, help="seconds one child may take "
                    "(default 240; 60 with --smoke)")
    ap.add_argument("--mods", default=",".join(MODS), help=f"comma list among {','.join(MODS)}")
    ap.add_argument("--impls", default=",".join(IMPLS), help="comma list among flexgen,torch")
    ap.add_argument("--no-warm", action="store_true", help="skip the warm-disk cases")
    ap.add_argument("--seed", type=int, default=None, help="base seed (default: drawn at random, recorded)")
    ap.add_argument("--length", type=int, default=None, help="sequence length (default 4096; 256 with --smoke)")
    ap.add_argument("--heads", type=int, default=None, help="heads (default 16; 2 with --smoke)")
    ap.add_argument("--dim", type=int, default=None, help="head dim (default 128; 64 with --smoke)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                    help="the inputs' dtype (fp32 compiles other kernels: the issue's slow case)")
    ap.add_argument("--dtypes", default=None, help="comma list of dtypes, run one after the other with the "
                    "budget shared (e.g. bfloat16,float32: the issue's two cases in one run)")
    ap.add_argument("--keep-dirs", action="store_true", help="leave the children's cache directories in place")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (Triton interpreter, torch eager): "
                    "tests the script only")
    ap.add_argument("--out", default=None, help="output folder (default $OUT, else benchmarks/results)")
    # Internal: one measurement in this (fresh) process.
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--impl", choices=IMPLS, help=argparse.SUPPRESS)
    ap.add_argument("--mod", choices=MODS, help=argparse.SUPPRESS)
    ap.add_argument("--case", choices=CASE_ORDER, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    small = args.smoke
    for name, big, tiny in (("repeats", 2, 1), ("budget", 500.0, 110.0), ("child_timeout", 240.0, 60.0),
                            ("length", 4096, 256), ("heads", 16, 2), ("dim", 128, 64)):
        if getattr(args, name) is None:
            setattr(args, name, tiny if small else big)
    if args.child:
        return child_main(args)
    dtypes = [d.strip() for d in (args.dtypes or args.dtype).split(",") if d.strip()]
    if len(dtypes) > 1:
        return _each_dtype(argv if argv is not None else sys.argv[1:], dtypes, args.budget)

    mods = [m.strip() for m in args.mods.split(",") if m.strip()]
    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    if [m for m in mods if m not in MODS] or [i for i in impls if i not in IMPLS]:
        ap.error(f"--mods among {','.join(MODS)}, --impls among {','.join(IMPLS)}")
    base_seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 10**6)

    # bench_forward's environment report and JSON writer (it imports torch and flexgen:
    # fine here, the parent's own imports are not measured).
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch
    from bench_forward import environment, write_json
    from common import report

    cuda = not args.smoke
    if cuda and not torch.cuda.is_available():
        print("bench_cold_start: no CUDA device; use --smoke for the CPU run", file=sys.stderr)
        return 2
    env = environment(cuda)
    out_dir = args.out or os.environ.get("OUT")
    if out_dir or args.smoke:
        out_dir = out_dir or os.path.join(tempfile.gettempdir(), "flexgen_bench_smoke")
        stem = "bench_cold_start" + ("" if args.dtype == "bfloat16" else f"_{args.dtype}")
    else:   # several runs accumulate in benchmarks/results
        out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
        slug = re.sub(r"[^A-Za-z0-9]+", "-", env["device_name"]).strip("-").lower()
        stem = f"bench_cold_start_{slug}_{args.dtype}_{env['date'][:16].replace(':', '').replace('-', '')}"
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, stem + ".json")

    payload = dict(env=env, config=dict(length=args.length, heads=args.heads, dim=args.dim, batch=1,
                                        dtype=args.dtype, mods=mods, impls=impls, repeats=args.repeats,
                                        warm=not args.no_warm, base_seed=base_seed, budget_s=args.budget,
                                        child_timeout_s=args.child_timeout, target_s=TARGET_S,
                                        tol=SMOKE_TOL if args.smoke else TOL,
                                        doc_avg=DOC_AVG, smoke=args.smoke, argv=sys.argv[1:]),
                   runs=[])
    print(f"bench_cold_start on {env['device_name']}: torch {env['torch']}, triton {env['triton']}, "
          f"mods {','.join(mods)}, {args.repeats} repeats, seed {base_seed}, budget {args.budget:.0f} s "
          f"-> {json_path}", flush=True)

    t_start = time.monotonic()
    deadline = t_start + args.budget
    # Seconds a child is expected to take, until one has been seen (then the slowest seen).
    guess = {"flexgen": 8.0 if small else 25.0, "torch": 8.0 if small else 45.0}
    seen: dict = {}

    def run(impl, mod, case, seed, dirs) -> dict:
        left = deadline - time.monotonic()
        need = max(seen.get((impl, case), []) or seen.get(impl, []) or [guess[impl]])
        if left < need:
            r = dict(impl=impl, mod=mod, case=case, seed=seed, status="SKIP",
                     skipped=f"budget: {left:.0f} s left, a child takes ~{need:.0f} s")
        else:
            r = spawn(args, impl, mod, case, seed, dirs, timeout=min(args.child_timeout, left))
            seen.setdefault((impl, case), []).append(r["process_s"])
            seen.setdefault(impl, []).append(r["process_s"])
        payload["runs"].append(r)
        if r["status"] == "SKIP":
            print(f"  SKIP  {mod:<15} {impl:<8} {case:<11} ({r['skipped']})", flush=True)
        elif r["status"] in ("ERROR", "TIMEOUT"):
            print(f"  {r['status']:<5} {mod:<15} {impl:<8} {case:<11} {r.get('error', '')[:200]}", flush=True)
        else:
            print(f"  {r['status']:<5} {mod:<15} {impl:<8} {case:<11} seed {seed:<7} "
                  f"import {r['import_lib_s']:.2f}  mask {r['mask_s']:.2f}  "
                  + (f"plan {r['plan_s']:.2f}  " if "plan_s" in r else "")
                  + f"attn {r['attn_s']:.2f}  first {r['first_s']:.2f}  cold {r['cold_s']:.2f} s  "
                  f"2nd {r['second_s'] * 1e3:.1f} ms  maxerr {r['maxerr']:.1e}  "
                  f"(process {r['process_s']:.1f} s, {r['cache']['cubin']} cubins, {r['new_cubins']} new"
                  f"{', sympy' if r.get('sympy_loaded') else ''})",
                  flush=True)
        write_json(json_path, payload)
        return r

    def seed_of(rep, mod):
        # flexgen and torch get the same seed (inputs and constant) for a given repeat and mod.
        return base_seed + 1000 * rep + mods.index(mod)

    def warm_disk(impl, mod, dirs, source):
        if source["status"] in ("PASS", "FAIL"):
            run(impl, mod, "warm-disk", seed_of(0, mod), dirs)
        else:
            payload["runs"].append(dict(impl=impl, mod=mod, case="warm-disk", seed=seed_of(0, mod), status="SKIP",
                                        skipped=f"the child filling its caches: {source['status']}"))

    # Most telling first, so that a short budget still gets it: one cold start of each mod and
    # implementation, then the warm-disk cases, then the other repeats.
    kept = {}       # mod -> (dirs, result) of flexgen's first cold child, reused by its warm-disk child
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        for mod in mods:
            for impl in impls:
                dirs = fresh_dirs(impl)
                r = run(impl, mod, "cold", seed_of(0, mod), dirs)
                if impl == "flexgen" and not args.no_warm:
                    kept[mod] = (dirs, r)
                else:
                    remove_dirs(dirs, args.keep_dirs)
        if not args.no_warm:
            for mod in mods:
                for impl in impls:
                    if impl == "flexgen":
                        dirs, source = kept.pop(mod)
                    else:
                        # torch's cold children write no graph caches: a cold start with them on
                        # fills the directories its warm-disk child reuses.
                        dirs = fresh_dirs(impl)
                        source = run(impl, mod, "cold+caches", seed_of(0, mod), dirs)
                    try:
                        warm_disk(impl, mod, dirs, source)
                    finally:
                        remove_dirs(dirs, args.keep_dirs)
        for rep in range(1, args.repeats):
            for mod in mods:
                for impl in impls:
                    dirs = fresh_dirs(impl)
                    try:
                        run(impl, mod, "cold", seed_of(rep, mod), dirs)
                    finally:
                        remove_dirs(dirs, args.keep_dirs)
    except (Stop, KeyboardInterrupt) as e:
        print(f"bench_cold_start: stopped early ({e or type(e).__name__}); writing what was done", flush=True)
        payload["stopped_early"] = str(e) or type(e).__name__
    for dirs, _ in kept.values():
        remove_dirs(dirs, args.keep_dirs)
    payload["seconds"] = time.monotonic() - t_start
    payload["summary"] = summarize(payload["runs"])
    write_json(json_path, payload)
    report(table(payload), "BENCH_COLD_START_SUMMARY", f"\nwrote {json_path}")
    bad = [r for r in payload["runs"] if r["status"] in ("FAIL", "ERROR", "TIMEOUT")]
    if args.smoke:
        # torch's eager flex_attention on CPU is only a stand-in; its failure is noted, not fatal.
        bad = [r for r in bad if r["impl"] != "torch"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
