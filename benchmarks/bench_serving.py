"""The serving path: packed varlen attention, the fused RoPE append, a mixed step, restarts.

    python benchmarks/bench_serving.py                      # the H100 run (~3-4 min with restarts)
    python benchmarks/bench_serving.py --parts varlen,rope  # the kernels only (~1 min)
    python benchmarks/bench_serving.py --smoke              # tiny sizes on CPU: checks the script only

1. **varlen** (bf16, D=128, 16 heads, 64 sequences of random lengths summing to 32k tokens,
   causal): ``flexgen.varlen_attention`` on the packed tensors against (a) flash-attn's
   ``flash_attn_varlen_func`` when its wheel imports, (b) flexgen's own document mask
   (``flex_attention`` on the same tokens as one [1, H, 32k, D] row, a document-causal
   block mask built once, outside the timing), (c) SDPA over the sequences padded to a batch
   (a boolean causal-and-valid mask). Each is checked against (b) first. ``vs doc`` = the
   document-mask path's ms / varlen ms (target >= 1.0). TFLOP/s count the causal half.
2. **rope**: a prefill append of 8 sequences x 2048 tokens (Hkv = 8, Hq = 32, D = 128, bf16,
   pages of 64) into a paged cache: the fused kernel (keys and query rotated while the keys
   are written) against the unfused path (``flexgen.kernels.rope.rotate`` on k and q in torch,
   then the plain paged write). GB/s count k, v, q read and k, v, q written once; ``%copy`` is
   that over the device-to-device copy bandwidth measured in the same run (target >= 80%).
   Both call the write kernel directly at fixed positions (no cache bookkeeping timed).
3. **mixed**: one step on the paged cache (bf16, pages of 64) of 8 prefill chunks of 512
   tokens after 1024 cached ones and 56 decode tokens with 2048 cached, packed
   (``PagedKVCache.attention`` with a [total, H, D] query and ``q_lengths``) against the same
   step padded to [64, H, 512, D]: ms and tokens/s, checked against each other.
4. **graphs**: ``examples/continuous_batching.py``'s serving loop with its decode steps in CUDA
   graphs against the same loop without (``--graphs off``): tokens must agree, ms per step.
   ``python benchmarks/bench_serving.py --parts graphs`` (~1 min).
5. **restart**: ``bench_cold_start.py`` (fresh processes; cold = empty caches, warm-disk = the
   caches a previous process filled) for the causal+softcap mod against torch's compiled
   FlexAttention, in bf16 and fp32 (targets: warm first call <= 0.2 s, cold <= 1.5 s bf16 /
   3 s fp32). Its JSONs land next to this script's.

Times are ``triton.testing.do_bench`` medians. A failing case prints its error and the run
goes on. Writes JSON under ``$OUT`` when set (``--out`` overrides), else ``benchmarks/results/``,
and prints a table last.
"""
from __future__ import annotations

import os

# Timings must not include flexgen's NaN poisoning of outputs (an extra fill kernel).
os.environ.pop("FLEXGEN_POISON", None)

import argparse  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Timer, copy_gbps, environment, write_json  # noqa: E402


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _lengths(total, n, gen, smallest=16):
    """n random lengths >= smallest summing to total."""
    cuts = torch.sort(torch.randperm(total - n * smallest - 1, generator=gen)[: n - 1] + 1).values
    edges = torch.cat([torch.tensor([0]), cuts, torch.tensor([total - n * smallest])])
    return (edges.diff() + smallest).tolist()


def _offsets(lengths, device):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def varlen_cases(args, timer, device):
    import flexgen
    gen = torch.Generator().manual_seed(0)
    H, D, total, n = args.heads, args.dim, args.tokens, args.seqs
    lens = _lengths(total, n, gen)
    cu = _offsets(lens, device)
    q, k, v = (torch.randn(total, H, D, generator=gen).to(device, torch.bfloat16) for _ in range(3))
    flops = sum(4 * L * (L + 1) / 2 * H * D for L in lens)
    rows = []

    def case(name, fn, ref=None):
        try:
            out = fn()
            err = None if ref is None else float((out.float() - ref.float()).abs().max())
            ms = timer(fn)
            row = dict(part="varlen", case=name, ms=ms, tflops=flops / (ms * 1e-3) / 1e12, maxerr=err)
        except Exception as exc:          # a peer that cannot run is reported, not fatal
            row = dict(part="varlen", case=name, error=f"{type(exc).__name__}: {exc}"[:300])
        rows.append(row)
        print(f"  {row}", flush=True)
        return row

    doc = torch.repeat_interleave(torch.arange(n, device=device), torch.tensor(lens, device=device))

    def doc_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    mask = flexgen.create_block_mask(doc_causal, 1, None, total, total, device=device)
    q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    ref = flexgen.flex_attention(q4, k4, v4, block_mask=mask)[0].transpose(0, 1)
    doc_row = case("flexgen document mask", lambda: flexgen.flex_attention(q4, k4, v4, block_mask=mask))
    var_row = case("flexgen varlen", lambda: flexgen.varlen_attention(
        q, k, v, cu, cu, max(lens), max(lens), mask_mod=causal), ref)
    # The Triton-language kernel (AUTO takes the Gluon one on sm_90 from 2^30 packed scores),
    # with the tile table's tiles and with the block-mask row's (128 x 128, 8 warps, 2 stages).
    tl_rows = [case(f"flexgen varlen, tl kernel{label}", lambda o=o: flexgen.varlen_attention(
        q, k, v, cu, cu, max(lens), max(lens), mask_mod=causal, kernel_options=o), ref)
        for label, o in (("", {"BACKEND": "tl"}),
                         (" 128x128 w8 s2", {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8,
                                             "num_stages": 2}))]
    for row in (var_row, *tl_rows):
        if "ms" in doc_row and "ms" in row:
            row["vs_doc"] = doc_row["ms"] / row["ms"]
    try:
        from flash_attn import flash_attn_varlen_func
        case("flash_attn_varlen_func", lambda: flash_attn_varlen_func(
            q, k, v, cu, cu, max(lens), max(lens), causal=True), ref)
    except ImportError as exc:
        rows.append(dict(part="varlen", case="flash_attn_varlen_func", error=f"not importable: {exc}"[:200]))
    # SDPA over the padded batch: [n, H, Lmax, D] with a causal-and-valid boolean mask.
    Lmax = max(lens)
    idx = torch.arange(Lmax, device=device)
    valid = idx[None, :] < torch.tensor(lens, device=device)[:, None]
    padded = [torch.zeros(n, Lmax, H, D, dtype=torch.bfloat16, device=device) for _ in range(3)]
    rows_b = torch.repeat_interleave(torch.arange(n, device=device), torch.tensor(lens, device=device))
    rows_i = torch.cat([torch.arange(L, device=device) for L in lens])
    for p, t in zip(padded, (q, k, v)):
        p[rows_b, rows_i] = t
    qp, kp, vp = (p.transpose(1, 2) for p in padded)
    keep = (idx[:, None] >= idx[None, :])[None, None] & valid[:, None, None, :]

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(qp, kp, vp, attn_mask=keep)

    sdpa_packed = lambda: sdpa().transpose(1, 2)[rows_b, rows_i]   # noqa: E731
    row = case("SDPA padded", sdpa, None)
    try:
        row["maxerr"] = float((sdpa_packed().float() - ref.float()).abs().max())
    except Exception:
        pass
    return rows


def rope_cases(args, timer, device, copy):
    import flexgen
    from flexgen.kernels.paged import run_paged_write
    from flexgen.kernels.rope import rotate
    B, L, Hkv, Hq, D, page = args.rope_batch, args.rope_tokens, args.rope_kv_heads, args.rope_q_heads, \
        args.dim, args.page
    cache = flexgen.PagedKVCache(num_pages=B * -(-L // page), page_size=page, num_kv_heads=Hkv,
                                 head_dim=D, max_batch=B, max_pages_per_seq=-(-L // page),
                                 dtype=torch.bfloat16, device=device)
    slots = [cache.add_sequence() for _ in range(B)]
    cache.reserve(slots, [L] * B)
    gen = torch.Generator().manual_seed(1)
    k, v = (torch.randn(B, Hkv, L, D, generator=gen).to(device, torch.bfloat16) for _ in range(2))
    q = torch.randn(B, Hq, L, D, generator=gen).to(device, torch.bfloat16)
    rope = flexgen.RoPE(theta=500000.0)
    freq = rope.inv_freq(D, device)
    slot_t = torch.arange(B, dtype=torch.int32, device=device)
    start = torch.zeros(B, dtype=torch.int32, device=device)      # positions 0 .. L-1, every call
    counts = torch.full((B,), L, dtype=torch.int32, device=device)
    pos = torch.arange(L, device=device)
    table = cache.page_table

    def fused():
        return run_paged_write(cache.k_cache, cache.v_cache, k, v, table, slot_t, start, counts, freq, D,
                               False, q)

    def unfused():
        k_rot, q_rot = rotate(k, pos, rope), rotate(q, pos, rope)
        run_paged_write(cache.k_cache, cache.v_cache, k_rot, v, table, slot_t, start, counts)
        return q_rot

    q_fused = fused()
    q_plain = unfused()
    err = float((q_fused.float() - q_plain.float()).abs().max())
    moved = 2 * (k.numel() + v.numel() + q.numel()) * 2       # bf16 read + written
    rows = []
    for name, fn in (("fused RoPE append", fused), ("rotate, then append", unfused)):
        ms = timer(fn)
        gbps = moved / (ms * 1e-3) / 1e9
        row = dict(part="rope", case=name, ms=ms, gbps=gbps, maxerr=err,
                   pct_copy=None if copy is None else 100 * gbps / copy)
        rows.append(row)
        print(f"  {row}", flush=True)
    return rows


def mixed_cases(args, timer, device):
    """A mixed step on the paged cache: prefill chunks after their cached prefix and decode
    tokens, packed in one call, against the same step padded to [B, H, chunk, D]."""
    import flexgen
    gen = torch.Generator().manual_seed(2)
    H, Hkv, D, page = args.heads, args.heads, args.dim, args.page
    n = args.prefills + args.decodes
    before = [args.prefix] * args.prefills + [args.context - 1] * args.decodes
    new = [args.chunk] * args.prefills + [1] * args.decodes
    per_seq = -(-max(b + c for b, c in zip(before, new)) // page)
    cache = flexgen.PagedKVCache(num_pages=n * per_seq, page_size=page, num_kv_heads=Hkv, head_dim=D,
                                 max_batch=n, max_pages_per_seq=per_seq, dtype=torch.bfloat16, device=device)
    slots = [cache.add_sequence() for _ in range(n)]
    for counts in (before, new):
        L = max(counts)
        k, v = (torch.randn(n, Hkv, L, D, generator=gen).to(device, torch.bfloat16) for _ in range(2))
        cache.append(slots, k, v, counts=counts)
    q = torch.randn(sum(new), H, D, generator=gen).to(device, torch.bfloat16)
    padded = torch.zeros(n, H, max(new), D, dtype=torch.bfloat16, device=device)
    start = 0
    for b, c in enumerate(new):
        padded[b, :, :c] = q[start:start + c].transpose(0, 1)
        start += c
    packed_out = cache.attention(q, slots, mask_mod=causal, q_lengths=new)
    padded_out = cache.attention(padded, slots, mask_mod=causal, q_lengths=new)
    err = float(max((packed_out[sum(new[:b]):sum(new[:b + 1])].float()
                     - padded_out[b, :, :new[b]].transpose(0, 1).float()).abs().max() for b in range(n)))
    rows = []
    for name, fn in (("packed", lambda: cache.attention(q, slots, mask_mod=causal, q_lengths=new)),
                     ("padded", lambda: cache.attention(padded, slots, mask_mod=causal, q_lengths=new))):
        ms = timer(fn)
        row = dict(part="mixed", case=f"{name}: {args.prefills}x{args.chunk} + {args.decodes}x1", ms=ms,
                   tokens_per_s=sum(new) / (ms * 1e-3), maxerr=err)
        rows.append(row)
        print(f"  {row}", flush=True)
    return rows


def graphs_cases(args, device):
    """examples/continuous_batching.py's loop with its decode steps in CUDA graphs and without:
    the same requests (more of them, longer: ``--graph-requests`` x ``--graph-tokens`` new tokens),
    tokens checked equal, logits close; ms per step of a second, warm run of each (the first
    compiles and captures). On CPU (--smoke) the graph body runs eagerly instead of captured."""
    import random

    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
    sys.path.insert(0, examples)
    import continuous_batching as cb
    from paged_generation import VOCAB, build_model, to_device

    model = to_device(build_model(), device)
    on = "auto" if device.type == "cuda" else "eager"

    def requests():
        rng = random.Random(5)
        return [cb.Request(i, i // 2, [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 40))],
                           args.graph_tokens) for i in range(args.graph_requests)]

    runs = {}
    for mode in ("off", on):
        for attempt in range(2):          # the second run is timed: kernels compiled, graphs captured anew
            reqs = requests()
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.no_grad():
                steps, _, decode = cb.serve(model, reqs, device, 16, args.graph_batch, graphs=mode)
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
        runs[mode] = (reqs, steps, seconds, decode)
    (ref, steps, off_s, _), (got, _, on_s, decode) = runs["off"], runs[on]
    same = all(a.tokens == b.tokens for a, b in zip(ref, got))
    err = max(float((torch.stack(a.logits) - torch.stack(b.logits)).abs().max()) for a, b in zip(ref, got))
    replays = decode.replays if decode is not None else 0
    rows = [dict(part="graphs", case=f"{mode}: {args.graph_requests} req x {args.graph_tokens} tok, batch "
                 f"{args.graph_batch}", ms=sec / steps * 1e3, steps=steps, tokens_equal=same, maxerr=err,
                 replays=replays if mode != "off" else 0)
            for mode, sec in (("off", off_s), (on, on_s))]
    rows[1]["speedup"] = off_s / on_s
    for row in rows:
        print(f"  {row}", flush=True)
    if not same or err > 1e-3:
        raise RuntimeError(f"graphs changed the output: tokens equal {same}, max |logit diff| {err:.2e}")
    return rows


def restart_cases(args, out_dir):
    rows = []
    for dtype in ("bfloat16", "float32"):
        cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_cold_start.py"),
               "--mods", "causal_softcap", "--repeats", "1", "--dtype", dtype, "--out", out_dir,
               "--budget", str(args.restart_budget)] + (["--smoke"] if args.smoke else [])
        t0 = time.monotonic()
        done = subprocess.run(cmd, capture_output=True, text=True)
        tail = "\n".join(done.stdout.strip().splitlines()[-12:])
        print(tail, flush=True)
        rows.append(dict(part="restart", case=dtype, rc=done.returncode, seconds=time.monotonic() - t0,
                         table=tail, stderr=done.stderr[-1000:] if done.returncode else ""))
    return rows


def table(payload) -> str:
    lines = [f"serving: {payload['env'].get('device_name')}, copy "
             f"{payload.get('copy_gbps') or float('nan'):.0f} GB/s"]
    for r in payload["cases"]:
        if "error" in r:
            lines.append(f"{r['part']:<8} {r['case']:<34} {r['error'][:90]}")
        elif r["part"] == "varlen":
            lines.append(f"{r['part']:<8} {r['case']:<34} {r['ms']:8.3f} ms {r['tflops']:7.1f} TFLOP/s"
                         + (f"  vs doc {r['vs_doc']:.2f}x" if "vs_doc" in r else "")
                         + ("" if r.get("maxerr") is None else f"  maxerr {r['maxerr']:.1e}"))
        elif r["part"] == "rope":
            pct = "" if r["pct_copy"] is None else f" {r['pct_copy']:5.1f}% copy"
            lines.append(f"{r['part']:<8} {r['case']:<34} {r['ms']:8.3f} ms {r['gbps']:7.0f} GB/s{pct}")
        elif r["part"] == "graphs":
            lines.append(f"{r['part']:<8} {r['case']:<34} {r['ms']:8.3f} ms/step  tokens equal {r['tokens_equal']}"
                         f"  maxerr {r['maxerr']:.1e}  replays {r['replays']}"
                         + (f"  {r['speedup']:.2f}x" if "speedup" in r else ""))
        elif r["part"] == "mixed":
            lines.append(f"{r['part']:<8} {r['case']:<34} {r['ms']:8.3f} ms {r['tokens_per_s']:9.0f} tok/s"
                         f"  maxerr {r['maxerr']:.1e}")
        else:
            lines.append(f"{r['part']:<8} {r['case']:<34} rc {r['rc']} ({r['seconds']:.0f} s): see "
                         "bench_cold_start's table above")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="varlen,rope,mixed,graphs,restart")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--rope-batch", type=int, default=8)
    ap.add_argument("--rope-tokens", type=int, default=2048)
    ap.add_argument("--rope-kv-heads", type=int, default=8)
    ap.add_argument("--rope-q-heads", type=int, default=32)
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--prefills", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--decodes", type=int, default=56)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--graph-requests", type=int, default=16)
    ap.add_argument("--graph-tokens", type=int, default=64, help="new tokens per request (graphs part)")
    ap.add_argument("--graph-batch", type=int, default=8)
    ap.add_argument("--restart-budget", type=float, default=150.0, help="seconds per dtype")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (interpreter): tests the script")
    ap.add_argument("--out", default=None, help="output folder (default $OUT, else benchmarks/results)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    if args.smoke:
        args.heads, args.dim, args.tokens, args.seqs = 2, 32, 256, 4
        args.rope_batch, args.rope_tokens, args.rope_kv_heads, args.rope_q_heads, args.page = 2, 40, 1, 2, 16
        args.prefills, args.chunk, args.prefix, args.decodes, args.context = 2, 16, 16, 3, 40
        args.restart_budget = 60.0
        args.graph_requests, args.graph_tokens, args.graph_batch = 3, 4, 2
    device = torch.device("cuda" if cuda else "cpu")
    timer = Timer(cuda)
    out_dir = args.out or os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, "bench_serving_smoke.json" if args.smoke else "bench_serving.json")
    payload = dict(env=environment(cuda), args=vars(args), cases=[])
    parts = args.parts.split(",")
    payload["copy_gbps"] = copy_gbps(timer, cuda)
    for part in parts:
        print(part, flush=True)
        try:
            if part == "varlen":
                payload["cases"] += varlen_cases(args, timer, device)
            elif part == "rope":
                payload["cases"] += rope_cases(args, timer, device, payload["copy_gbps"])
            elif part == "mixed":
                payload["cases"] += mixed_cases(args, timer, device)
            elif part == "graphs":
                payload["cases"] += graphs_cases(args, device)
            elif part == "restart":
                payload["cases"] += restart_cases(args, out_dir)
        except Exception as exc:
            payload["cases"].append(dict(part=part, case="(all)", error=f"{type(exc).__name__}: {exc}"[:300]))
        write_json(json_path, payload)
    print(f"wrote {json_path}")
    print("\n" + table(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
