"""Decode speed of flexgen (contiguous and paged KV) against its peers, in one process.

    python benchmarks/bench_decode.py                  # the full grid (~3-4 min on an H100)
    python benchmarks/bench_decode.py --batches 1,8 --contexts 1k,32k
    python benchmarks/bench_decode.py --smoke          # tiny sizes on CPU: checks the script only

One query token per sequence (q_len = 1), Hq = 32 query heads over Hkv = 8
KV heads (GQA 4), D = 128 (``--heads``, ``--head-dim`` change them), bf16, for B in {1, 8, 64} and contexts of 1k, 8k,
32k and 128k tokens. Per case:

- ``flexgen contiguous``: ``flexgen.decode_attention`` on K/V ``[B, Hkv, L, D]``;
- ``flexgen paged``: the same keys and values in a paged cache (page size 64,
  pages of all sequences shuffled in memory) read through a page table;
  checked against the contiguous output of the same data;
- ``torch flex``: ``torch.compile(torch.nn.attention.flex_attention)`` (a fresh
  compile after ``torch._dynamo.reset()`` for each case) on the contiguous K/V;
- ``sdpa``: ``F.scaled_dot_product_attention(..., enable_gqa=True)``.

Each is timed twice: called from Python (what an eager loop pays, host time
included where it exceeds the kernel), and replayed from a CUDA graph captured
after a warm-up (what a serving loop pays: kernel time). ``--sweep`` also times
the decode kernel's tiles and split counts per case under graphs.

First a correctness check (a paged GQA case with a score_mod and a block
mask against the float32 reference). Then two passes, so that a short budget
still covers every case: flexgen and SDPA on all cases, then torch's compiled
flex_attention (a compile per case is the slow part) while time remains.

Times are ``triton.testing.do_bench`` medians (L2 flushed before each call: the
cache is cold, as it is for the next layer in a real model). GB/s counts the
bytes that must move (K and V once, plus q and out); ``%copy`` is that over the
device-to-device copy bandwidth measured in the same run. ``vs torch`` /
``vs sdpa`` are peer time / flexgen contiguous time (above 1: flexgen is
faster). ``host us`` is flexgen's warm per-call wall time when calls are
issued back to back (Python planning plus launches). Cases whose tensors do
not fit in free GPU memory are skipped; a failing peer or case is printed and
recorded, and the run goes on.

Writes JSON (device name, environment, every case) to ``--out``: ``$OUT`` when
set, else ``benchmarks/results/``. Prints a table last.
"""
from __future__ import annotations

import os

# Timings must not include flexgen's NaN poisoning of outputs (an extra fill kernel).
os.environ.pop("FLEXGEN_POISON", None)

import argparse  # noqa: E402
import gc  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flexgen import decode_attention  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Timer, environment, graph_ms, write_json  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 64
DTYPE = torch.bfloat16
BATCHES = (1, 8, 64)
CONTEXTS = (1024, 8192, 32768, 131072)


class Timeout(BaseException):
    """A case ran past its limit, or the process got SIGTERM (not an Exception: peers' handlers let it pass)."""


def _raise(signum, frame):
    raise Timeout("case time limit" if signum == signal.SIGALRM else f"signal {signum}")

def host_us(fn, timer, calls=50) -> float:
    """Warm wall time per call (µs) of ``calls`` back-to-back calls."""
    fn()
    timer.sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    timer.sync()
    return (time.perf_counter() - t0) / calls * 1e6


def copy_gbps(timer, cuda) -> float | None:
    if not cuda:
        return None
    n = 1 << 29                                        # 1 GiB of bf16
    src = torch.empty(n, dtype=DTYPE, device="cuda")
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    del src, dst
    return 2 * n * 2 / (ms * 1e-3) / 1e9


def _free_bytes() -> int:
    free, _ = torch.cuda.mem_get_info()
    return free


def _cleanup(cuda):
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def sequence_kv(b, L, device, seed):
    """The keys and values [Hkv, L, D] of sequence ``b``: the same for both layouts."""
    g = torch.Generator(device=device)
    g.manual_seed(seed * 1000 + b)
    k = torch.randn(HKV, L, D, generator=g, device=device, dtype=torch.float32).to(DTYPE)
    v = torch.randn(HKV, L, D, generator=g, device=device, dtype=torch.float32).to(DTYPE)
    return k, v


def _err(exc) -> str:
    text = str(exc).splitlines()[0][:200] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"


def contiguous_kv(B, L, device, seed):
    k = torch.empty(B, HKV, L, D, dtype=DTYPE, device=device)
    v = torch.empty_like(k)
    for b in range(B):
        k[b], v[b] = sequence_kv(b, L, device, seed)
    return k, v


def make_query(B, device, seed):
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return torch.randn(B, HQ, 1, D, generator=gen, device=device, dtype=torch.float32).to(DTYPE)


def moved_bytes(B, L) -> int:
    """K and V once, plus q and out."""
    return 2 * B * HKV * L * D * 2 + 2 * B * HQ * D * 2


def run_case(B, L, args, timer, cuda, seed, bw) -> dict:
    """flexgen contiguous, SDPA and flexgen paged on one (B, L); torch flex comes in a second pass."""
    device = "cuda" if cuda else "cpu"
    row = dict(B=B, L=L)
    kv_bytes = 2 * B * HKV * L * D * 2
    need = kv_bytes * 1.15 + (1 << 30)
    if cuda and need > _free_bytes():
        row["skipped"] = f"needs ~{need / 2**30:.0f} GiB, {_free_bytes() / 2**30:.0f} GiB free"
        return row
    q = make_query(B, device, seed)

    def gbps(ms):
        return moved_bytes(B, L) / (ms * 1e-3) / 1e9

    # --- contiguous -----------------------------------------------------------------
    k, v = contiguous_kv(B, L, device, seed)

    def fg():
        return decode_attention(q, k, v, enable_gqa=True)

    out_ref = fg()
    timer.sync()
    ms = timer(fg)
    row.update(contig_ms=ms, contig_gbps=gbps(ms), host_us=host_us(fg, timer, 50 if cuda else 1))
    if bw:
        row["contig_pct_copy"] = 100 * row["contig_gbps"] / bw
    _graph_row(row, "contig", fg, timer, cuda, gbps, bw)
    if args.sweep:
        row["sweep_contig"] = sweep(lambda o: decode_attention(q, k, v, enable_gqa=True, kernel_options=o),
                                    timer, cuda, B, L)

    if not args.skip_sdpa:
        try:
            def sd():
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            out = sd()
            row["sdpa_err"] = (out.float() - out_ref.float()).abs().max().item()
            row["sdpa_ms"] = timer(sd)
            row["vs_sdpa"] = row["sdpa_ms"] / ms
            if cuda and row.get("contig_graph_ms"):
                row["sdpa_graph_ms"] = graph_ms(sd, timer, cuda)
                row["vs_sdpa_graph"] = row["sdpa_graph_ms"] / row["contig_graph_ms"]
        except Exception as exc:  # noqa: BLE001 - a peer failing must not stop the run
            row["sdpa_error"] = _err(exc)
            print(f"    sdpa failed: {row['sdpa_error']}", flush=True)
    del k, v
    _cleanup(cuda)

    # --- paged: the same sequences, pages shuffled over the whole cache ------------------
    try:
        pages_per_seq = -(-L // PAGE)
        num_pages = B * pages_per_seq
        k_cache = torch.empty(num_pages, PAGE, HKV, D, dtype=DTYPE, device=device)
        v_cache = torch.empty_like(k_cache)
        perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).to(device)
        table = perm.view(B, pages_per_seq).to(torch.int32)
        for b in range(B):
            kb, vb = sequence_kv(b, L, device, seed)
            pad = pages_per_seq * PAGE - L
            if pad:
                kb, vb = (F.pad(t, (0, 0, 0, pad)) for t in (kb, vb))
            idx = table[b].long()
            k_cache[idx] = kb.view(HKV, pages_per_seq, PAGE, D).permute(1, 2, 0, 3)
            v_cache[idx] = vb.view(HKV, pages_per_seq, PAGE, D).permute(1, 2, 0, 3)
            del kb, vb
        lengths = torch.full((B,), L, dtype=torch.int32, device=device)

        def fp():
            return decode_attention(q, k_cache, v_cache, enable_gqa=True, kv_lengths=lengths,
                                    page_table=table, max_kv_len=L)
        out = fp()
        row["paged_err"] = (out.float() - out_ref.float()).abs().max().item()
        ms_p = timer(fp)
        row.update(paged_ms=ms_p, paged_gbps=gbps(ms_p))
        if bw:
            row["paged_pct_copy"] = 100 * row["paged_gbps"] / bw
        _graph_row(row, "paged", fp, timer, cuda, gbps, bw)
        if args.sweep:
            row["sweep_paged"] = sweep(
                lambda o: decode_attention(q, k_cache, v_cache, enable_gqa=True, kv_lengths=lengths,
                                           page_table=table, max_kv_len=L, kernel_options=o),
                timer, cuda, B, L)
        del k_cache, v_cache
    except Exception as exc:  # noqa: BLE001
        row["paged_error"] = _err(exc)
        print(f"    paged failed: {row['paged_error']}", flush=True)
    _cleanup(cuda)
    return row


def _graph_row(row, name, fn, timer, cuda, gbps, bw):
    """Adds ``{name}_graph_ms`` (and GB/s, %copy) to ``row``: ``fn`` replayed from a CUDA graph."""
    if not cuda:
        return
    try:
        ms = graph_ms(fn, timer, cuda)
        row[f"{name}_graph_ms"] = ms
        row[f"{name}_graph_gbps"] = gbps(ms)
        if bw:
            row[f"{name}_graph_pct_copy"] = 100 * gbps(ms) / bw
    except Exception as exc:  # noqa: BLE001 - a capture failing is a finding, not the end of the run
        row[f"{name}_graph_error"] = _err(exc)
        print(f"    {name} graph failed: {row[f'{name}_graph_error']}", flush=True)


# The decode kernel's knobs (kernel_options), searched by --sweep under CUDA graphs (so
# that host time does not hide kernel differences). Splits only matter where the batch
# leaves SMs idle.
SWEEP_TILES = [dict(BLOCK_N=n, num_warps=w, num_stages=s)
               for n in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)]


def sweep(call, timer, cuda, B, L) -> list:
    """[(options, ms)] of ``call(options)`` over SWEEP_TILES (and split counts for small
    batches), fastest first; the default configuration is the entry with options {}."""
    if not cuda:
        return []
    options = [{}] + SWEEP_TILES
    if B <= 8:
        options += [dict(NUM_SPLITS=s) for s in (8, 16, 32, 64, 128) if s * 64 <= L]
    results = []
    for o in options:
        try:
            results.append((o, graph_ms(lambda o=o: call(o), timer, cuda)))
        except Exception as exc:  # noqa: BLE001 - a config that does not fit is skipped
            results.append((o, None))
            print(f"    sweep {o}: {_err(exc)}", flush=True)
    results.sort(key=lambda r: float("inf") if r[1] is None else r[1])
    best, default = results[0], next(r for r in results if r[0] == {})
    print(f"    sweep B={B} L={L}: default {_f(default[1] and default[1] * 1e3, '.1f')} us, best {best[0]} "
          f"{_f(best[1] and best[1] * 1e3, '.1f')} us; top 3 "
          + ", ".join(f"{o} {ms * 1e3:.1f}" for o, ms in results[:3] if ms), flush=True)
    return [[o, ms] for o, ms in results]


def run_torch(row, timer, cuda, seed):
    """torch.compile(flex_attention), fresh compile, on the case's contiguous K/V (adds to ``row``)."""
    from torch.nn.attention.flex_attention import flex_attention as torch_flex
    device = "cuda" if cuda else "cpu"
    B, L = row["B"], row["L"]
    q = make_query(B, device, seed)
    k, v = contiguous_kv(B, L, device, seed)
    try:
        out_ref = decode_attention(q, k, v, enable_gqa=True)
        torch._dynamo.reset()
        compiled = torch.compile(torch_flex, fullgraph=True, dynamic=False)

        def tf():
            return compiled(q, k, v, enable_gqa=True)
        t0 = time.perf_counter()
        out = tf()
        timer.sync()
        row["torch_compile_s"] = time.perf_counter() - t0
        row["torch_err"] = (out.float() - out_ref.float()).abs().max().item()
        row["torch_ms"] = timer(tf)
        if row.get("contig_ms"):
            row["vs_torch"] = row["torch_ms"] / row["contig_ms"]
        if cuda:
            try:
                row["torch_graph_ms"] = graph_ms(tf, timer, cuda)
                if row.get("contig_graph_ms"):
                    row["vs_torch_graph"] = row["torch_graph_ms"] / row["contig_graph_ms"]
            except Exception as exc:  # noqa: BLE001
                row["torch_graph_error"] = _err(exc)
                print(f"    torch flex graph failed: {row['torch_graph_error']}", flush=True)
    except Exception as exc:  # noqa: BLE001 - a peer failing must not stop the run
        row["torch_error"] = _err(exc)
        print(f"    torch flex failed: {row['torch_error']}", flush=True)
    finally:
        del k, v
        _cleanup(cuda)


def check_mods(cuda) -> dict:
    """One paged GQA case with a score_mod and a block mask, against the float32 reference."""
    from flexgen.mods import sliding_window, tanh_softcap
    from flexgen import PagedKVCache
    from flexgen.reference import flex_attention_reference
    device = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    Hq, Hkv, Dh = (32, 8, 128) if cuda else (4, 2, 32)
    lens = [3000, 517, 64] if cuda else [150, 37, 5]
    cache = PagedKVCache(num_pages=sum(-(-n // 16) for n in lens) + 8, page_size=16, num_kv_heads=Hkv,
                         head_dim=Dh, max_batch=4, max_pages_per_seq=256, dtype=DTYPE, device=device)
    cache._free_pages.reverse()                     # pages far from logical order
    slots = [cache.add_sequence() for _ in lens]
    Lmax = max(lens)
    k = torch.randn(len(lens), Hkv, Lmax, Dh, device=device, dtype=DTYPE)
    v = torch.randn_like(k)
    cache.append(slots, k, v, counts=lens)
    q = torch.randn(len(lens), Hq, 4, Dh, device=device, dtype=DTYPE)
    mask = sliding_window(300 if cuda else 40)
    score = tanh_softcap(20.0)
    out = cache.attention(q, slots, score_mod=score, block_mask=cache.block_mask(mask, BLOCK_SIZE=64))
    err = 0.0
    for b, n in enumerate(lens):
        kk, vv = cache.gather(slots[b])
        qq = torch.zeros(1, Hq, n, Dh, device=device, dtype=DTYPE)
        qq[:, :, n - 4:] = q[b:b + 1]
        ref = flex_attention_reference(qq, kk[None], vv[None], score, mask, enable_gqa=True,
                                       dtype=torch.float32)[:, :, n - 4:]
        err = max(err, (out[b:b + 1].float() - ref).abs().max().item())
    ok = err < 3e-2 and not out.isnan().any().item()

    # A serving loop: append one token per sequence, attend, repeat. From the second step
    # on the launches are replays (launch.Replay) with the step's new query and outputs,
    # the lengths grown in place: each step is checked.
    block_mask = cache.block_mask(mask, BLOCK_SIZE=64)
    loop_err = 0.0
    for step in range(4):
        k1 = torch.randn(len(lens), Hkv, 1, Dh, device=device, dtype=DTYPE)
        v1 = torch.randn_like(k1)
        cache.append(slots, k1, v1)
        q1 = torch.randn(len(lens), Hq, 1, Dh, device=device, dtype=DTYPE)
        out1 = cache.attention(q1, slots, score_mod=score, block_mask=block_mask)
        for b in range(len(lens)):
            kk, vv = cache.gather(slots[b])
            n = kk.shape[1]
            qq = torch.zeros(1, Hq, n, Dh, device=device, dtype=DTYPE)
            qq[:, :, n - 1:] = q1[b:b + 1]
            ref = flex_attention_reference(qq, kk[None], vv[None], score, mask, enable_gqa=True,
                                           dtype=torch.float32)[:, :, n - 1:]
            loop_err = max(loop_err, (out1[b:b + 1].float() - ref).abs().max().item())
        ok = ok and not out1.isnan().any().item()
    return dict(case="paged GQA decode, 4 queries, softcap + sliding-window block mask; "
                     "then 4 steps of append + attend (replayed launches)",
                max_err=err, loop_max_err=loop_err, ok=ok and loop_err < 3e-2)


def _f(x, spec, missing="-"):
    width = re.match(r"\d*", spec).group()
    return missing.rjust(int(width or 0)) if x is None else format(x, spec)


def _ctx(L) -> str:
    return f"{L // 1024}k" if L % 1024 == 0 else str(L)


def table(payload) -> str:
    bw = payload.get("copy_gbps")
    head = (f"{'B':>3} {'ctx':>6} | {'contig us':>9} {'GB/s':>6} {'%copy':>5} | {'paged us':>8} {'GB/s':>6} "
            f"{'%copy':>5} | {'torch us':>8} {'vs torch':>8} | {'sdpa us':>8} {'vs sdpa':>7} | {'host us':>7}  note")
    lines = [f"flexgen decode, q_len=1, Hq={HQ}, Hkv={HKV}, D={D}, bf16, page={PAGE}: "
             f"{payload['env'].get('device_name')}, copy {_f(bw, '.0f')} GB/s", head, "-" * len(head)]
    for r in payload["cases"]:
        us = lambda key: None if r.get(key) is None else r[key] * 1e3  # noqa: E731
        note = r.get("skipped") or r.get("error") or "; ".join(
            f"{k}: {r[k][:40]}" for k in ("paged_error", "torch_error", "sdpa_error") if k in r)
        lines.append(
            f"{r['B']:>3} {_ctx(r['L']):>6} | {_f(us('contig_ms'), '9.1f')} {_f(r.get('contig_gbps'), '6.0f')} "
            f"{_f(r.get('contig_pct_copy'), '5.0f')} | {_f(us('paged_ms'), '8.1f')} {_f(r.get('paged_gbps'), '6.0f')} "
            f"{_f(r.get('paged_pct_copy'), '5.0f')} | {_f(us('torch_ms'), '8.1f')} {_f(r.get('vs_torch'), '8.2f')} | "
            f"{_f(us('sdpa_ms'), '8.1f')} {_f(r.get('vs_sdpa'), '7.2f')} | {_f(r.get('host_us'), '7.0f')}  {note}")
    if any("contig_graph_ms" in r for r in payload["cases"]):
        head = (f"{'B':>3} {'ctx':>6} | {'contig us':>9} {'%copy':>5} | {'paged us':>8} {'%copy':>5} "
                f"{'vs contig':>9} | {'torch us':>8} {'vs torch':>8} | {'sdpa us':>8} {'vs sdpa':>7}")
        lines += ["", "the same, each call replayed from a CUDA graph (as a serving loop runs it): kernel time only",
                  head, "-" * len(head)]
        for r in payload["cases"]:
            if "contig_graph_ms" not in r:
                continue
            us = lambda key: None if r.get(key) is None else r[key] * 1e3  # noqa: E731
            paged_vs = (r["contig_graph_ms"] / r["paged_graph_ms"]) if r.get("paged_graph_ms") else None
            lines.append(
                f"{r['B']:>3} {_ctx(r['L']):>6} | {_f(us('contig_graph_ms'), '9.1f')} "
                f"{_f(r.get('contig_graph_pct_copy'), '5.0f')} | {_f(us('paged_graph_ms'), '8.1f')} "
                f"{_f(r.get('paged_graph_pct_copy'), '5.0f')} {_f(paged_vs, '9.2f')} | "
                f"{_f(us('torch_graph_ms'), '8.1f')} {_f(r.get('vs_torch_graph'), '8.2f')} | "
                f"{_f(us('sdpa_graph_ms'), '8.1f')} {_f(r.get('vs_sdpa_graph'), '7.2f')}")
    sweeps = [(r, name) for r in payload["cases"] for name in ("contig", "paged") if r.get(f"sweep_{name}")]
    if sweeps:
        lines += ["", "--sweep (CUDA graphs): default kernel options against the fastest found"]
        for r, name in sweeps:
            results = [x for x in r[f"sweep_{name}"] if x[1] is not None]
            default = next((ms for o, ms in results if o == {}), None)
            best_o, best_ms = results[0]
            lines.append(f"{r['B']:>3} {_ctx(r['L']):>6} {name:>6}: default {_f(default and default * 1e3, '.1f')} us, "
                         f"best {best_ms * 1e3:.1f} us with {best_o}")
    return "\n".join(lines)


def _sizes(text, default):
    if not text:
        return list(default)
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if part:
            out.append(int(float(part[:-1]) * 1024) if part.endswith("k") else int(part))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="", help="comma list (default 1,8,64)")
    ap.add_argument("--contexts", default="", help="comma list, e.g. 1k,8k,32k,128k (the default)")
    ap.add_argument("--budget", type=float, default=float(os.environ.get("BENCH_DECODE_BUDGET_S", 220)),
                    help="seconds for the whole script; what does not fit is skipped (default 220)")
    ap.add_argument("--case-timeout", type=float, default=60)
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--skip-sdpa", action="store_true")
    ap.add_argument("--sweep", action="store_true",
                    help="also time the decode kernel's tiles and split counts per case (CUDA graphs)")
    ap.add_argument("--heads", default="32/8", help="query / KV heads (default 32/8)")
    ap.add_argument("--head-dim", type=int, default=128, help="(default 128; Gemma's is 256)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (interpreter): tests the script")
    ap.add_argument("--out", default=None, help="output folder (default $OUT, else benchmarks/results)")
    args = ap.parse_args(argv)

    global HQ, HKV, D
    (HQ, HKV), D = (int(n) for n in args.heads.split("/")), args.head_dim
    cuda = not args.smoke
    if args.smoke:
        args.skip_torch = True          # inductor on CPU: slow, and not what this checks
        HQ, HKV, D = 4, 2, 32
    if cuda and not torch.cuda.is_available():
        print("bench_decode: no CUDA device; use --smoke for the CPU run", file=sys.stderr)
        return 2
    batches = _sizes(args.batches, (1, 2) if args.smoke else BATCHES)
    contexts = _sizes(args.contexts, (200, 300) if args.smoke else CONTEXTS)
    grid = [(B, L) for B in batches for L in contexts]

    out_dir = args.out or os.environ.get("OUT") or (
        "/tmp/flexgen_bench_smoke" if args.smoke
        else os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    os.makedirs(out_dir, exist_ok=True)
    env = environment(cuda)
    slug = re.sub(r"[^A-Za-z0-9]+", "-", env["device_name"]).strip("-").lower()[:40]
    json_path = os.path.join(out_dir, f"bench_decode_{slug}_{env['date'][:16].replace(':', '').replace('-', '')}.json")

    timer = Timer(cuda, warmup_ms=10, rep_ms=40)   # decode calls are short: shorter windows
    signal.signal(signal.SIGTERM, _raise)
    signal.signal(signal.SIGALRM, _raise)
    deadline = time.monotonic() + args.budget
    payload = dict(env=env, config=dict(hq=HQ, hkv=HKV, head_dim=D, page_size=PAGE, dtype="bfloat16",
                                        q_len=1, grid=grid, argv=sys.argv[1:]), cases=[])
    print(f"bench_decode on {env['device_name']}: torch {env['torch']}, triton {env['triton']}, "
          f"{len(grid)} cases, budget {args.budget:.0f} s -> {json_path}", flush=True)
    try:
        try:
            payload["copy_gbps"] = copy_gbps(timer, cuda)
            print(f"  copy bandwidth: {_f(payload['copy_gbps'], '.0f')} GB/s", flush=True)
        except Exception as exc:  # noqa: BLE001
            print(f"  copy bandwidth failed: {_err(exc)}", flush=True)
        try:
            payload["check"] = check_mods(cuda)
            print(f"  check: {payload['check']}", flush=True)
        except Exception as exc:  # noqa: BLE001
            payload["check"] = dict(error=_err(exc))
            print(f"  check failed: {payload['check']['error']}", flush=True)
        # Pass 1: flexgen (both layouts) and SDPA on every case; pass 2: torch's compiled
        # flex_attention (a compile per case is the slow part) while the budget lasts.
        passes = [("flexgen+sdpa", None)] + ([] if args.skip_torch else [("torch flex", None)])
        rows = {}
        for name, _ in passes:
            for i, (B, L) in enumerate(grid):
                row = rows.get((B, L))
                if name == "torch flex" and (row is None or "contig_ms" not in row):
                    continue
                left = deadline - time.monotonic()
                if left < (5 if name == "flexgen+sdpa" else 15):
                    if row is None:
                        row = rows[(B, L)] = dict(B=B, L=L, skipped="budget")
                        payload["cases"].append(row)
                    elif name == "torch flex":
                        row["torch_error"] = "skipped: budget"
                    print(f"  SKIP {name} B={B} L={L} (budget)", flush=True)
                    continue
                t0 = time.monotonic()
                signal.setitimer(signal.ITIMER_REAL, max(5.0, min(args.case_timeout, left)))
                try:
                    if name == "flexgen+sdpa":
                        row = run_case(B, L, args, timer, cuda, seed=100 + i, bw=payload.get("copy_gbps"))
                    else:
                        run_torch(row, timer, cuda, seed=100 + i)
                except Timeout as exc:
                    if str(exc) != "case time limit":
                        raise
                    row = row or dict(B=B, L=L)
                    row["error" if name == "flexgen+sdpa" else "torch_error"] = "case time limit"
                    print(f"  TIMEOUT {name} B={B} L={L}", flush=True)
                    _cleanup(cuda)
                except Exception as exc:  # noqa: BLE001 - one case failing must not stop the run
                    row = row or dict(B=B, L=L)
                    row["error" if name == "flexgen+sdpa" else "torch_error"] = _err(exc)
                    print(f"  ERROR {name} B={B} L={L}: {_err(exc)}", flush=True)
                    traceback.print_exc(limit=3)
                    _cleanup(cuda)
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                row[f"seconds_{name.split()[0].split('+')[0]}"] = round(time.monotonic() - t0, 1)
                if (B, L) not in rows:
                    rows[(B, L)] = row
                    payload["cases"].append(row)
                print(f"  {name} B={B:>3} L={L:>6}: " + ", ".join(
                    f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                    if k not in ("B", "L")), flush=True)
                write_json(json_path, payload)
    except Timeout as exc:
        print(f"  stopped: {exc}", flush=True)
    write_json(json_path, payload)
    print(f"wrote {json_path}")
    print(table(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
