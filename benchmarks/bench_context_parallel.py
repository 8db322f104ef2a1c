"""Context-parallel attention on 2 GPUs against 1 GPU and against torch's own context parallelism.

    torchrun --nproc_per_node 2 benchmarks/bench_context_parallel.py            # 128k and 256k
    torchrun --nproc_per_node 2 benchmarks/bench_context_parallel.py --lengths 128k --variants causal
    torchrun --nproc_per_node 2 benchmarks/bench_context_parallel.py --smoke    # CPU, gloo: the script only

One sequence of L tokens (bf16, B=1, 16 heads, head dim 128) split over the 2 ranks
(``flexgen.distributed.shard``, load-balanced layout unless said), per variant
(``causal``; ``documents``: causal documents of random lengths, mean 16k tokens, packed)
and per length:

- ``cp``: ``flexgen.distributed.context_parallel_attention`` on 2 GPUs (NCCL), forward
  (no grad) and forward + backward (``torch.autograd.grad``); the time is the slowest
  rank's (every rank runs the same fixed number of calls between barriers; do_bench's
  adaptive repetition would desynchronize the ranks).
- ``one``: ``flexgen.flex_attention`` on the whole sequence on ONE GPU (rank 0; rank 1
  waits), where it fits in memory. ``speedup`` = one-GPU time / 2-GPU time: the
  throughput ratio on the same tokens (target >= 1.7 at 128k causal). Its output also
  checks the CP output (max |difference|, bf16).
- ``torch``: torch's context-parallel FlexAttention when the installed torch has it
  (``torch.distributed.tensor.experimental._context_parallel``: K/V all-gathered with its
  ``flex_cp_allgather`` op, ``torch.compile(flex_attention)`` on the local queries against
  the whole K/V with its ``_create_cp_block_mask`` for the same head-tail layout).
  Private API: "unavailable: <reason>" when it is missing or fails.

Communication, per variant and length:

- ``overlap``: one forward + backward under ``torch.profiler`` on each rank; from the
  device kernels of the trace, the fraction of the NCCL kernels' time during which a
  compute kernel ran on the same GPU (1.0: all communication hidden behind compute),
  and the communication time left exposed (ms). NCCL send/receive kernels are launched
  early and spin until their peer arrives, so their time is an upper bound on transfer
  time. (CPU smoke runs have no device kernels: n/a.)
- ``bytes``: bytes each rank posted for sending in one forward (``flexgen.distributed.ring.STATS``),
  against a full exchange (every shard to every rank); pairs of shards skipped because
  the mask leaves them no block. ``--layout contiguous`` shows the skipping of causal
  and document masks best (a causal rank 0 needs nothing from rank 1).

Writes JSON (``--out``, default ``$OUT/bench_context_parallel.json`` when ``$OUT`` is set,
else ``benchmarks/results/bench_context_parallel_<device>_<date>.json``) and prints a table
(also to ``$BENCH_CP_SUMMARY``). Times are milliseconds.
"""
from __future__ import annotations

import os

os.environ.pop("FLEXGEN_POISON", None)       # timings without NaN-poisoning fills

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, report, write_json  # noqa: E402

import flexgen  # noqa: E402
from flexgen.distributed import context_parallel_attention, ring, shard, unshard  # noqa: E402
from flexgen.mods import and_masks, causal_mask, doc_ids_from_lengths, document_mask  # noqa: E402

FWD_FLOPS, BWD_FLOPS = 4.0, 10.0     # per kept (q, kv) pair, per head, per head-dim element


def parse_length(text: str) -> int:
    text = text.strip().lower()
    return int(float(text[:-1]) * 1024) if text.endswith("k") else int(text)


def log(*args):
    if dist.get_rank() == 0:
        print(*args, flush=True)


# ---------------------------------------------------------------------------------- inputs

def document_lengths(L: int, mean: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    sizes, n = [], 0
    while n < L:
        size = int(torch.randint(mean // 4, 2 * mean - mean // 4 + 1, (1,), generator=g))
        sizes.append(min(size, L - n))
        n += sizes[-1]
    return sizes


def make_case(variant: str, L: int, args, device):
    """(mask_mod, kept pairs per head, description) of a variant over global positions."""
    if variant == "causal":
        return causal_mask, L * (L + 1) // 2, "causal"
    if variant == "documents":
        sizes = document_lengths(L, args.doc_mean, seed=L)
        ids = doc_ids_from_lengths(sizes, device=device)
        kept = sum(n * (n + 1) // 2 for n in sizes)
        return and_masks(causal_mask, document_mask(ids)), kept, f"{len(sizes)} causal documents"
    raise ValueError(f"unknown variant {variant!r}")


def full_inputs(L: int, args, device, dtype):
    """The whole sequence's q, k, v, dout, identical on every rank (same seed)."""
    g = torch.Generator(device=device).manual_seed(1234)
    shape = (1, args.heads, L, args.dim)
    q, k, v, dout = (torch.randn(shape, generator=g, device=device, dtype=dtype) for _ in range(4))
    return q, k, v, dout


# ---------------------------------------------------------------------------------- timing

def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, iters: int, warmup: int, everyone: bool = True) -> float:
    """Mean ms of ``fn`` over ``iters`` calls after ``warmup``; with ``everyone`` the slowest
    rank's (every rank must call), else this rank's alone."""
    for _ in range(warmup):
        fn()
    sync(device)
    if everyone:
        dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    ms = (time.perf_counter() - start) * 1e3 / iters
    if everyone:
        t = torch.tensor([ms], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        ms = float(t)
    return ms


def overlap_of_trace(path: str) -> dict:
    """From a chrome trace: the NCCL kernels' total time, the part of it during which a
    compute kernel ran, and the fraction."""
    with open(path) as f:
        events = json.load(f).get("traceEvents", [])
    comm, compute = [], []
    for e in events:
        if e.get("cat") != "kernel" or "dur" not in e:
            continue
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        (comm if "nccl" in e.get("name", "").lower() else compute).append(span)
    if not comm:
        return {"comm_ms": 0.0, "overlapped_ms": 0.0, "overlap": None}

    def union(spans):
        merged = []
        for a, b in sorted(spans):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        return merged
    comm_u, compute_u = union(comm), union(compute)
    total = sum(b - a for a, b in comm_u)
    both, j = 0.0, 0
    for a, b in comm_u:
        while j < len(compute_u) and compute_u[j][1] <= a:
            j += 1
        k = j
        while k < len(compute_u) and compute_u[k][0] < b:
            both += min(b, compute_u[k][1]) - max(a, compute_u[k][0])
            k += 1
    return {"comm_ms": total / 1e3, "overlapped_ms": both / 1e3, "overlap": both / total if total else None}


def profile_overlap(step, device) -> dict:
    """Overlap of communication and compute in one call of ``step`` (all ranks; the worst rank's)."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    step()
    sync(device)
    dist.barrier()
    with profile(activities=activities) as prof:
        step()
        sync(device)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        mine = overlap_of_trace(path)
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, mine)
    known = [r for r in rows if r["overlap"] is not None]
    if not known:
        return {"overlap": None, "exposed_comm_ms": None, "per_rank": rows}
    worst = min(known, key=lambda r: r["overlap"])
    return {"overlap": worst["overlap"], "exposed_comm_ms": worst["comm_ms"] - worst["overlapped_ms"],
            "per_rank": rows}


# ---------------------------------------------------------------------------------- torch's CP

_MESH: dict = {}


def torch_cp(mask_mod, L, args, device, smoke):
    """A callable (q, k, v) -> out: torch's context-parallel FlexAttention on this rank's
    head-tail (= load_balanced) shards, or raise with the reason it is unavailable."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attention
    from torch.distributed.tensor.experimental._context_parallel._cp_custom_ops import flex_cp_allgather
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer
    from torch.nn.attention.flex_attention import flex_attention
    import torch.distributed.distributed_c10d as c10d
    world = dist.get_world_size()
    mesh = _MESH.get(device.type)
    if mesh is None:                  # one mesh (and its process group) for every case
        mesh = _MESH[device.type] = init_device_mesh(device.type, (world,))
    balancer = _HeadTailLoadBalancer(L, world, device)
    block_mask = cp_attention._create_cp_block_mask(mask_mod, 1, args.heads, L, L, mesh, balancer)
    attend = flex_attention if smoke else torch.compile(flex_attention, dynamic=False, fullgraph=True)
    pg_name = c10d._get_process_group_name(mesh.get_group())

    def run(q, k, v):
        k_all, v_all = flex_cp_allgather(k.contiguous(), v.contiguous(), 2, pg_name)
        return attend(q, k_all, v_all, block_mask=block_mask)
    return run


# ---------------------------------------------------------------------------------- one case

def run_case(variant, L, args, device, dtype) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    mask_mod, kept, what = make_case(variant, L, args, device)
    row = dict(variant=variant, L=L, layout=args.layout, mask=what, heads=args.heads, dim=args.dim,
               world=world)
    q, k, v, dout = full_inputs(L, args, device, dtype)
    mine = [shard(t, layout=args.layout) for t in (q, k, v, dout)]
    qs, ks, vs, douts = mine
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (qs, ks, vs))
    kw = dict(mask_mod=mask_mod, layout=args.layout, kernel_options=args.kernel_options)

    def cp_fwd():
        with torch.no_grad():
            return context_parallel_attention(qs, ks, vs, **kw)

    def cp_fwdbwd():
        out = context_parallel_attention(qg, kg, vg, **kw)
        return torch.autograd.grad(out, (qg, kg, vg), douts)

    flops = kept * args.heads * args.dim
    row["cp_fwd_ms"] = timed(cp_fwd, device, args.iters, args.warmup)
    row["cp_fwdbwd_ms"] = timed(cp_fwdbwd, device, args.iters, args.warmup)
    row["cp_fwd_tflops_per_gpu"] = FWD_FLOPS * flops / world / row["cp_fwd_ms"] / 1e9
    row["cp_fwdbwd_tflops_per_gpu"] = (FWD_FLOPS + BWD_FLOPS) * flops / world / row["cp_fwdbwd_ms"] / 1e9

    # What the mask sends: one forward's bytes per rank against a full exchange.
    ring.reset_stats()
    out_cp = cp_fwd()
    stats = dict(ring.STATS)
    shard_bytes = (ks.numel() + vs.numel()) * ks.element_size()
    gathered = [None] * world
    dist.all_gather_object(gathered, stats)
    row["bytes_sent_per_rank"] = [s["bytes_sent"] for s in gathered]
    row["bytes_full_exchange_per_rank"] = shard_bytes * (world - 1)
    row["pairs_skipped_per_rank"] = [s["pairs_skipped"] for s in gathered]

    row.update({f"comm_{k}": v for k, v in profile_overlap(cp_fwdbwd, device).items() if k != "per_rank"})

    # One GPU on the whole sequence (rank 0; the others wait).
    full_out = None
    if args.single:
        result = [None]
        if rank == 0:
            try:
                block_mask = flexgen.create_block_mask(mask_mod, None, None, L, L, device=device)
                qf, kf, vf = (t.detach().clone().requires_grad_() for t in (q, k, v))
                one = lambda: flexgen.flex_attention(q, k, v, block_mask=block_mask,  # noqa: E731
                                                     kernel_options=args.kernel_options)

                def one_fwd():
                    with torch.no_grad():
                        return one()

                def one_fwdbwd():
                    out = flexgen.flex_attention(qf, kf, vf, block_mask=block_mask,
                                                 kernel_options=args.kernel_options)
                    return torch.autograd.grad(out, (qf, kf, vf), dout)
                result[0] = dict(one_fwd_ms=timed(one_fwd, device, args.iters, args.warmup, everyone=False),
                                 one_fwdbwd_ms=timed(one_fwdbwd, device, args.iters, args.warmup,
                                                     everyone=False))
                full_out = one_fwd()
                del qf, kf, vf
            except torch.OutOfMemoryError:
                result[0] = dict(one="does not fit on one GPU")
            except Exception as err:
                result[0] = dict(one=f"error: {type(err).__name__}: {err}"[:300])
            if device.type == "cuda":
                torch.cuda.empty_cache()
        dist.broadcast_object_list(result, src=0)
        row.update(result[0])
        if "one_fwd_ms" in row:
            row["speedup_fwd"] = row["one_fwd_ms"] / row["cp_fwd_ms"]
            row["speedup_fwdbwd"] = row["one_fwdbwd_ms"] / row["cp_fwdbwd_ms"]
    gathered_out = unshard(out_cp, layout=args.layout)
    if rank == 0 and full_out is not None:
        row["max_abs_diff_vs_one_gpu"] = float((gathered_out.float() - full_out.float()).abs().max())
    del gathered_out, full_out

    # torch's context parallel FlexAttention (same shards: its head-tail layout is load_balanced).
    if args.torch_cp and args.layout == "load_balanced":
        try:
            run = torch_cp(mask_mod, L, args, device, args.smoke)
            qt, kt, vt = (t.detach().clone().requires_grad_() for t in (qs, ks, vs))

            def torch_fwd():
                with torch.no_grad():
                    return run(qs, ks, vs)

            def torch_fwdbwd():
                return torch.autograd.grad(run(qt, kt, vt), (qt, kt, vt), douts)
            row["torch_fwd_ms"] = timed(torch_fwd, device, args.iters, args.warmup)
            row["vs_torch_fwd"] = row["torch_fwd_ms"] / row["cp_fwd_ms"]
            diff = (torch_fwd().float() - out_cp.float()).abs().max()
            dist.all_reduce(diff, op=dist.ReduceOp.MAX)
            row["max_abs_diff_vs_torch_cp"] = float(diff)
            row["torch_fwdbwd_ms"] = timed(torch_fwdbwd, device, args.iters, args.warmup)
            row["vs_torch_fwdbwd"] = row["torch_fwdbwd_ms"] / row["cp_fwdbwd_ms"]
        except Exception as err:
            row["torch"] = f"unavailable: {type(err).__name__}: {err}"[:300]
            if args.verbose:
                log(traceback.format_exc())
    elif args.torch_cp:
        row["torch"] = "not run: torch's CP is compared on the load_balanced (head-tail) layout"
    return row


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f}" if n >= 2**24 else f"{n / 2**20:.3g}"


def fmt(x, spec=".1f"):
    return "-" if x is None else (format(x, spec) if isinstance(x, (int, float)) else str(x))


def table(rows) -> str:
    head = (f"{'variant':<10} {'L':>7} {'cp fwd':>9} {'cp f+b':>9} {'1gpu fwd':>9} {'1gpu f+b':>9} "
            f"{'x fwd':>6} {'x f+b':>6} {'torch fwd':>10} {'torch f+b':>10} {'overlap':>8} {'exposed':>8} "
            f"{'sent MiB/rank':>14} {'full MiB':>9} {'skipped':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['variant']:<10} {r['L']:>7} ERROR {r['error'][:120]}")
            continue
        sent = "/".join(_mib(b) for b in r["bytes_sent_per_rank"])
        lines.append(
            f"{r['variant']:<10} {r['L']:>7} {fmt(r['cp_fwd_ms']):>9} {fmt(r['cp_fwdbwd_ms']):>9} "
            f"{fmt(r.get('one_fwd_ms', r.get('one'))):>9} {fmt(r.get('one_fwdbwd_ms')):>9} "
            f"{fmt(r.get('speedup_fwd'), '.2f'):>6} {fmt(r.get('speedup_fwdbwd'), '.2f'):>6} "
            f"{fmt(r.get('torch_fwd_ms', 'n/a' if 'torch' in r else None)):>10} "
            f"{fmt(r.get('torch_fwdbwd_ms', 'n/a' if 'torch' in r else None)):>10} "
            f"{fmt(r.get('comm_overlap'), '.2f'):>8} {fmt(r.get('comm_exposed_comm_ms'), '.2f'):>8} "
            f"{sent:>14} {_mib(r['bytes_full_exchange_per_rank']):>9} "
            f"{'/'.join(map(str, r['pairs_skipped_per_rank'])):>8}")
    notes = [r for r in rows if r.get("torch", "").startswith("unavailable")]
    if notes:
        lines.append(f"torch CP: {notes[0]['torch']}")
    return "\n".join(lines)


def _slug(name: str) -> str:
    for short in ("h200", "h100", "a100", "b200"):
        if short in name.lower():
            return short
    return "".join(c for c in name.lower() if c.isalnum())[:16]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU with gloo (checks the script)")
    p.add_argument("--lengths", default=None, help="default 128k,256k (--smoke: 96)")
    p.add_argument("--variants", default="causal,documents")
    p.add_argument("--layout", default="load_balanced", choices=("load_balanced", "contiguous"))
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--doc-mean", type=int, default=16384, help="mean document length (documents variant)")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--no-single", dest="single", action="store_false", help="skip the one-GPU runs")
    p.add_argument("--no-torch", dest="torch_cp", action="store_false", help="skip torch's context parallel")
    p.add_argument("--kernel-options", type=json.loads, default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args()

    cuda = torch.cuda.is_available() and not args.smoke
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if args.smoke:
        world = dist.get_world_size()
        torch.set_num_threads(1)
        args.lengths = args.lengths or f"{2 * world * 24}"
        args.heads, args.dim, args.doc_mean, args.iters, args.warmup = 2, 16, 40, 1, 0
    args.lengths = args.lengths or "128k,256k"
    lengths = [parse_length(x) for x in args.lengths.split(",")]
    variants = args.variants.split(",")
    rows = []
    try:
        for variant in variants:
            for L in lengths:
                log(f"-- {variant} L={L}")
                try:
                    rows.append(run_case(variant, L, args, device, dtype))
                except Exception as err:
                    rows.append(dict(variant=variant, L=L, error=f"{type(err).__name__}: {err}"[:400]))
                    log(traceback.format_exc())
                if cuda:
                    torch.cuda.empty_cache()
                if dist.get_rank() == 0:
                    log(json.dumps(rows[-1], default=str))
    finally:
        if dist.get_rank() == 0:
            device_name = torch.cuda.get_device_name(0) if cuda else "cpu"
            out = args.out or (os.path.join(os.environ["OUT"], "bench_context_parallel.json")
                               if os.environ.get("OUT") else os.path.join(
                                   os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"bench_context_parallel_{_slug(device_name)}_"
                                   f"{datetime.date.today():%Y%m%d}.json"))
            write_json(out, dict(environment=environment(cuda, world=dist.get_world_size(),
                                                         backend=dist.get_backend()),
                                 config={k: v for k, v in vars(args).items()}, rows=rows))
            report(table(rows), "BENCH_CP_SUMMARY", f"\n(json: {out})")
        # Both ranks tear down together: a rank destroying its group while the other still
        # writes the report left gloo's threads to abort the process at exit (seen in CI).
        dist.barrier()
        dist.destroy_process_group()
    if any("error" in r for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
