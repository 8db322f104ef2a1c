"""Tiles of linear attention's chunked kernels, one kernel at a time, against fla's kernels.

    python benchmarks/sweep_linear.py                # the H100 sweep (~3 min)
    python benchmarks/sweep_linear.py --smoke        # a few variants on CPU (interpreter): checks the script

bf16, B=1, H=16, T=16k, D=128 (as bench_nosoftmax.py), per-token gates (``g[b, h, t]``) and
the lightning decay (``-slopes[h]``). Times each kernel of flexgen's chunked linear attention
alone (prefix, state, state REVERSE, output, grad) over chunk sizes, key / value slices, warps,
stages and the decay form (how G is had: "traced" scan, "head" closed form, "prefix" kernel),
each checked against the shipped configuration's result; then fla's ``chunk_simple_gla`` pieces
(its chunk-local cumsum, ``chunk_fwd_h``, ``chunk_fwd_o``, the backward's) and end to end
(flexgen with the shipped tiles and with the sweep's fastest, fla), all in this process.

Compiling ~80 flexgen variants and fla's autotuning (~150 configurations) would take minutes
one after another: ``--jobs`` worker processes compile them first at a short length (Triton's
disk cache then serves this process; fla's workers skip its timings and keep no autotune
result, so fla still tunes here, at the real length, on an idle GPU). Prints a table last;
writes JSON under ``$OUT`` (``--out``), else ``benchmarks/results/``.
"""
from __future__ import annotations

import os

os.environ.pop("FLEXGEN_POISON", None)

import argparse  # noqa: E402
import concurrent.futures as cf  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

B, H, D = 1, 16, 128
DTYPE = torch.bfloat16

# (part, kind, decay form, chunk, key slice, value slice, warps, stages). kind: "gates" or
# "lightning"; the first row of each (part, kind) is the shipped configuration (the baseline
# every other row is checked against).
STATE_64 = [(128, 16, 4, 3), (128, 32, 4, 3), (128, 16, 4, 4), (64, 16, 4, 3), (64, 32, 4, 3),
            (64, 32, 4, 4), (64, 64, 4, 3), (64, 64, 8, 3), (32, 32, 4, 3), (32, 64, 4, 3),
            (32, 32, 2, 3), (64, 32, 2, 3), (64, 16, 2, 3), (32, 16, 2, 3)]
STATE_128 = [(128, 16, 4, 3), (64, 32, 4, 3), (64, 16, 4, 3), (32, 32, 4, 3), (64, 64, 8, 3),
             (64, 32, 8, 3)]
OUTPUT_64 = [(128, 64, 4, 2), (128, 64, 8, 2), (128, 128, 8, 2), (128, 128, 4, 2), (128, 32, 4, 2),
             (64, 64, 4, 3), (64, 64, 4, 2), (64, 128, 8, 3), (64, 128, 4, 3), (32, 64, 4, 3),
             (32, 128, 4, 3)]
OUTPUT_128 = [(128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 8, 3), (64, 128, 8, 3), (128, 64, 4, 2),
              (128, 32, 4, 2)]
GRAD = [(64, 64, 8, 2), (64, 64, 4, 2), (64, 64, 8, 1), (64, 64, 8, 3), (64, 32, 8, 2), (64, 32, 4, 2),
        (64, 128, 8, 2), (64, 128, 8, 1), (64, 32, 8, 3), (32, 64, 4, 2), (32, 128, 4, 2), (32, 64, 8, 2),
        (128, 64, 8, 2)]


# Around the first sweep's fastest (benchmarks/NOTES.md): deeper pipelines, chunk 128.
REFINE_STATE = {64: [(64, 32, 4, 4), (64, 32, 4, 5), (128, 16, 4, 5), (64, 16, 4, 4), (32, 32, 4, 4),
                     (64, 64, 4, 4)],
                128: [(64, 32, 4, 4), (64, 32, 4, 3), (64, 32, 4, 5), (128, 16, 4, 4), (64, 16, 4, 4),
                      (32, 32, 4, 4), (64, 64, 4, 4), (64, 32, 8, 4), (64, 64, 8, 4)]}
REFINE_OUTPUT = {128: [(64, 128, 8, 3), (64, 128, 8, 4), (32, 128, 8, 3), (32, 128, 8, 4), (128, 128, 8, 3),
                       (64, 64, 4, 3), (32, 64, 4, 3), (64, 128, 4, 3)],
                 64: [(64, 128, 4, 3), (64, 128, 4, 4), (32, 128, 4, 4), (64, 128, 8, 4)]}
REFINE_GRAD = [(64, 64, 8, 3), (64, 64, 8, 4), (64, 32, 4, 3), (128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 8, 2),
               (128, 32, 4, 2), (128, 64, 4, 2), (128, 128, 8, 3)]
# The tiles before this sweep (and the decay traced in every kernel): the "before" row of e2e.
BEFORE = dict(state_dk=0, state_dv=16, state_warps=4, state_stages=3, output_dk=0, output_dv=64, output_warps=4,
              output_stages=2, grad_chunk=64, grad_dv=64, grad_warps=8, grad_stages=2), 64


def variants(mode: str) -> list:
    rows = []
    if mode == "refine":
        for chunk, tiles in REFINE_STATE.items():
            rows += [("state", "gates", "prefix", chunk, *c) for c in tiles]
        rows += [("state", "lightning", "head", c, 64, 32, 4, 4) for c in (128, 64)]
        rows += [("state", "lightning", "head", 128, 64, 16, 4, 4)]
        for kind, form in (("lightning", "head"), ("gates", "prefix")):
            rows += [("reverse", kind, form, 64, 64, 32, 4, 4)]
            rows += [("reverse", kind, form, 128, *c) for c in
                     ((64, 32, 4, 4), (64, 32, 4, 3), (64, 16, 4, 4), (128, 16, 4, 4))]
        for chunk, tiles in REFINE_OUTPUT.items():
            rows += [("output", "gates", "prefix", chunk, *c) for c in tiles]
        rows += [("output", "lightning", "head", 128, 64, 128, 8, 3)]
        rows += [("grad", "lightning", "head", c[0], 0, *c[1:]) for c in REFINE_GRAD]
        rows += [("grad", "gates", "prefix", c[0], 0, *c[1:]) for c in
                 ((64, 64, 8, 3), (64, 32, 8, 3), (128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 8, 2))]
        rows += [("prefix", "gates", "prefix", c, 0, 0, 4, 1) for c in (64, 128)]
        return rows
    if mode == "smoke":
        return [("state", "gates", "traced", 16, 32, 32, 4, 1), ("state", "gates", "prefix", 16, 16, 16, 4, 1),
                ("state", "lightning", "head", 16, 16, 32, 4, 1),
                ("reverse", "lightning", "head", 16, 32, 32, 4, 1),
                ("output", "gates", "traced", 16, 32, 32, 4, 1), ("output", "gates", "prefix", 16, 16, 16, 4, 1),
                ("grad", "lightning", "head", 16, 0, 32, 4, 1), ("grad", "gates", "prefix", 16, 0, 16, 4, 1),
                ("prefix", "gates", "prefix", 16, 0, 0, 4, 1)]
    rows.append(("state", "gates", "traced", 64, 128, 16, 4, 3))
    rows += [("state", "gates", "prefix", 64, *c) for c in STATE_64]
    rows += [("state", "gates", "prefix", 128, *c) for c in STATE_128]
    rows += [("state", "gates", "traced", 64, *c) for c in ((64, 32, 4, 3), (32, 32, 4, 3))]
    rows += [("state", "gates", "traced", 128, 64, 32, 4, 3)]
    rows.append(("state", "lightning", "traced", 64, 128, 16, 4, 3))
    rows += [("state", "lightning", "head", 64, *c) for c in
             ((128, 16, 4, 3), (64, 32, 4, 3), (64, 16, 4, 3), (32, 32, 4, 3), (64, 64, 4, 3))]
    rows += [("state", "lightning", "head", 128, *c) for c in ((64, 32, 4, 3), (64, 16, 4, 3))]
    rows.append(("reverse", "lightning", "traced", 64, 128, 16, 4, 3))
    rows += [("reverse", "lightning", "head", 64, *c) for c in
             ((128, 16, 4, 3), (64, 32, 4, 3), (64, 16, 4, 3), (32, 32, 4, 3))]
    rows += [("reverse", "gates", "prefix", 64, *c) for c in ((128, 16, 4, 3), (64, 32, 4, 3))]
    rows.append(("output", "gates", "traced", 64, 128, 64, 4, 2))
    rows += [("output", "gates", "prefix", 64, *c) for c in OUTPUT_64]
    rows += [("output", "gates", "prefix", 128, *c) for c in OUTPUT_128]
    rows.append(("output", "lightning", "traced", 64, 128, 64, 4, 2))
    rows += [("output", "lightning", "head", 64, *c) for c in ((128, 64, 4, 2), (128, 128, 8, 2), (64, 64, 4, 3))]
    rows.append(("grad", "lightning", "traced", 64, 0, 64, 8, 2))
    rows += [("grad", "lightning", "head", c[0], 0, *c[1:]) for c in GRAD]
    rows.append(("grad", "gates", "traced", 64, 0, 64, 8, 2))
    rows += [("grad", "gates", "prefix", c[0], 0, *c[1:]) for c in GRAD[:1] + [GRAD[4], GRAD[1]]]
    rows += [("prefix", "gates", "prefix", c, 0, 0, 4, 1) for c in (64, 128, 32)]
    return rows


# ---------------------------------------------------------------------------------- flexgen

class Setup:
    """Inputs at length T and the shipped plans of both decays (their specs are the templates
    the variants are made from)."""

    def __init__(self, T, device):
        import flexgen
        from flexgen.api import _linear_mods
        from flexgen.runtime.plan import plan_linear, plan_linear_backward
        from flexgen.kernels.backward import grad_slots
        self.T, self.device = T, device
        gen = torch.Generator(device=device).manual_seed(1)
        self.q, self.k = (F.normalize(torch.randn(B, H, T, D, generator=gen, device=device), dim=-1).to(DTYPE)
                          for _ in range(2))
        self.v = torch.randn(B, H, T, D, generator=gen, device=device, dtype=DTYPE)
        self.do = torch.randn(B, H, T, D, generator=gen, device=device, dtype=DTYPE)
        self.slopes = torch.tensor([2.0 ** (-8 * (i + 1) / H) for i in range(H)], device=device)
        self.gates = F.logsigmoid(torch.randn(B, H, T, generator=gen, device=device) + 4.0)
        self.scale = D ** -0.5
        self.plans, self.bws, self.buffers = {}, {}, {}
        for kind in ("gates", "lightning"):
            gates = self.gates.clone().requires_grad_(kind == "gates")
            decay = self.decay(kind, gates)
            text, bufs, ftext, fbufs = _linear_mods(decay, None)
            plan = plan_linear(self.q, self.k, self.v, None, text, bufs, ftext, fbufs, self.scale, False, "")
            self.plans[kind] = plan
            self.bws[kind] = plan_linear_backward(plan, grad_slots(bufs))
            self.buffers[kind] = [b.detach() for b in bufs]
        self.flexgen = flexgen

    def decay(self, kind, gates=None):
        gates = self.gates if gates is None else gates
        slopes = self.slopes
        if kind == "gates":
            return lambda b, h, t: gates[b, h, t]
        return lambda b, h, t: -slopes[h]

    def spec(self, part, kind, form, chunk, dk, dv, warps, stages):
        plan, bw = self.plans[kind], self.bws[kind]
        base = {"state": bw.state, "reverse": bw.state, "output": plan.output, "grad": bw.grad,
                "prefix": bw.prefix or plan.prefix}[part]
        if base is None:      # the shipped plan has no prefix kernel: make one from the state's fields
            base = dataclasses.replace(bw.state, part="prefix", block_n=0, block_k=0, feature=None)
        fields = dict(block_m=chunk, num_warps=warps, num_stages=stages, decay_form=form)
        if part != "prefix":
            fields.update(block_n=dv)
        if part in ("state", "reverse", "output"):
            fields.update(block_k=0 if dk >= D else dk)
        return dataclasses.replace(base, **fields)

    def gcum(self, kind, chunk):
        from flexgen.runtime import launch
        g = torch.empty(B, H, self.T, dtype=torch.float32, device=self.device)
        launch.run(self.spec("prefix", kind, "prefix", chunk, 0, 0, 4, 1), self.device,
                   dict(gcum=g, decay_buffers=self.buffers[kind]))
        return g

    def call(self, row, cache):
        """(a function launching the variant ``row``, what it writes: checked after a launch)."""
        from flexgen.runtime import launch
        part, kind, form, chunk = row[:4]
        spec = self.spec(*row)
        dev, T = self.device, self.T
        bufs = self.buffers[kind]
        chunks = -(-T // chunk)
        key = (kind, chunk, form)
        gcum = None
        if form == "prefix":
            gcum = cache.get(("gcum",) + key)
            if gcum is None:
                gcum = cache[("gcum",) + key] = self.gcum(kind, chunk)
        new = lambda *shape, dtype=DTYPE: torch.empty(*shape, dtype=dtype, device=dev)  # noqa: E731
        if part == "prefix":
            out = new(B, H, T, dtype=torch.float32)
            args = dict(gcum=out, decay_buffers=bufs)
            outs = (out,)
        elif part in ("state", "reverse"):
            states = new(B, H, chunks, D, D)
            final = new(B, H, D, D, dtype=torch.float32)
            x, y = (self.k, self.v) if part == "state" else (self.q, self.do)
            args = dict(x=x, y=y, states=states, init=None, final=final, gcum=gcum, decay_buffers=bufs,
                        feature_buffers=[], scale=self.scale, group=1, reverse=part == "reverse")
            outs = (states, final)
        else:
            # The states this chunk size needs, from the shipped-tile state kernel of the same form.
            st = cache.get(("states",) + key)
            if st is None:
                st = []
                for rev in (False, True):
                    srow = ("reverse" if rev else "state", kind, form, chunk, D, 16, 4, 3)
                    fn, (states, _) = self.call(srow, cache)
                    fn()
                    st.append(states)
                st = cache[("states",) + key] = tuple(st)
            if part == "output":
                out = new(B, H, T, D)
                args = dict(q=self.q, k=self.k, v=self.v, states=st[0], out=out, gcum=gcum, decay_buffers=bufs,
                            feature_buffers=[], scale=self.scale)
                outs = (out,)
            else:
                dq, dk, dv = new(B, H, T, D), new(B, H, T, D), new(B, H, T, D)
                dg = new(B, H, T, dtype=torch.float32) if kind == "gates" else None
                args = dict(q=self.q, k=self.k, v=self.v, do=self.do, states=st[0], dstates=st[1], dq=dq, dk=dk,
                            dv=dv, dg=dg, gcum=gcum, decay_buffers=bufs, feature_buffers=[], scale=self.scale)
                outs = (dq, dk, dv) + (() if dg is None else (dg,))
        return (lambda: launch.run(spec, dev, args)), outs


def warm_flexgen(rows, T):
    """Worker: compile ``rows`` (launch each once at length T); returns (row, error) pairs."""
    setup = Setup(T, torch.device("cuda"))
    done, cache = [], {}
    for row in rows:
        try:
            setup.call(row, cache)[0]()
            torch.cuda.synchronize()
            done.append((row, None))
        except Exception as exc:  # noqa: BLE001
            done.append((row, f"{type(exc).__name__}: {str(exc)[:300]}"))
    return done


# ---------------------------------------------------------------------------------- fla

def fla_inputs(setup, kind, grad=False):
    t = lambda x: x.transpose(1, 2).contiguous()  # noqa: E731  [B, H, T, ...] -> fla's [B, T, H, ...]
    q, k, v, do = (t(x) for x in (setup.q, setup.k, setup.v, setup.do))
    if grad:
        q, k, v = (x.requires_grad_() for x in (q, k, v))
    kw = dict(scale=setup.scale)
    if kind == "gates":
        kw["g"] = t(setup.gates)
    else:
        kw["g_gamma"] = -setup.slopes
    return q, k, v, do, kw


def fla_calls(setup, kind):
    """name -> callable: fla's forward, its pieces, and (lightning) its forward+backward and the
    backward's pieces, as ``chunk_simple_gla`` runs them."""
    from fla.ops.simple_gla import chunk_simple_gla
    from fla.ops.common.chunk_h import chunk_bwd_dh, chunk_fwd_h
    from fla.ops.common.chunk_o import chunk_bwd_dqkwg, chunk_bwd_dv, chunk_fwd_o
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2
    q, k, v, do, kw = fla_inputs(setup, kind)
    calls = {"fwd": lambda: chunk_simple_gla(q, k, v, **kw)}
    g = g_gamma = None
    if kind == "gates":
        calls["cumsum"] = lambda: chunk_local_cumsum(kw["g"], chunk_size=64, scale=RCP_LN2)
        g = calls["cumsum"]()
    else:
        g_gamma = kw["g_gamma"] * RCP_LN2
    calls["fwd_h"] = lambda: chunk_fwd_h(k=k, v=v, g=g, g_gamma=g_gamma, gk=None, gv=None, h0=None,
                                         output_final_state=False, chunk_size=64, states_in_fp32=False)
    h, _ = calls["fwd_h"]()
    calls["fwd_o"] = lambda: chunk_fwd_o(q=q, k=k, v=v, g=g, g_gamma=g_gamma, h=h, scale=setup.scale, chunk_size=64)
    if kind == "lightning":
        qg, kg, vg, _, kwg = fla_inputs(setup, kind, grad=True)

        def fb():
            for x in (qg, kg, vg):
                x.grad = None
            chunk_simple_gla(qg, kg, vg, **kwg)[0].backward(do)
        calls["fwd+bwd"] = fb
        calls["bwd_h32"] = lambda: chunk_fwd_h(k=k, v=v, g=None, g_gamma=g_gamma, gk=None, gv=None, h0=None,
                                               output_final_state=False, chunk_size=64, states_in_fp32=True)
        h32, _ = calls["bwd_h32"]()
        calls["bwd_dh"] = lambda: chunk_bwd_dh(q=q, k=k, v=v, do=do, h0=None, dht=None, scale=setup.scale, g=None,
                                               g_gamma=g_gamma, gk=None, gv=None, chunk_size=64,
                                               states_in_fp32=True)
        dh, _ = calls["bwd_dh"]()
        calls["bwd_dqk"] = lambda: chunk_bwd_dqkwg(q=q, k=k, v=v, do=do, h=h32, dh=dh, g=None, g_gamma=g_gamma,
                                                   scale=setup.scale, chunk_size=64)
        calls["bwd_dv"] = lambda: chunk_bwd_dv(q=q, k=k, do=do, dh=dh, g=None, g_gamma=g_gamma,
                                               scale=setup.scale, chunk_size=64)
    return calls


FLA_WARM = ("gates fwd", "lightning fwd", "lightning h32", "lightning dh", "lightning dqk+dv")


def warm_fla(job, T):
    """Worker: compile every configuration fla's autotuners try in ``job`` (one of FLA_WARM;
    the timings skipped, no result kept)."""
    os.environ["FLA_CACHE_RESULTS"] = "0"
    from triton.runtime import driver

    def once(fn, quantiles=None, **kw):
        fn()
        return [1.0, 1.0, 1.0] if quantiles else 1.0
    driver.active.get_benchmarker = lambda: once
    from fla.ops.simple_gla import chunk_simple_gla
    from fla.ops.common.chunk_h import chunk_bwd_dh, chunk_fwd_h
    from fla.ops.common.chunk_o import chunk_bwd_dqkwg, chunk_bwd_dv
    setup = Setup(T, torch.device("cuda"))
    kind, what = job.split(" ")
    q, k, v, do, kw = fla_inputs(setup, kind)
    gamma = kw.get("g_gamma")
    try:
        if what == "fwd":
            chunk_simple_gla(q, k, v, **kw)
        elif what == "h32":
            chunk_fwd_h(k=k, v=v, g=None, g_gamma=gamma, gk=None, gv=None, h0=None, output_final_state=False,
                        chunk_size=64, states_in_fp32=True)
        elif what == "dh":
            chunk_bwd_dh(q=q, k=k, v=v, do=do, h0=None, dht=None, scale=setup.scale, g=None, g_gamma=gamma,
                         gk=None, gv=None, chunk_size=64, states_in_fp32=True)
        else:
            h = torch.zeros(B, T // 64, H, D, D, dtype=torch.float32, device="cuda")
            chunk_bwd_dqkwg(q=q, k=k, v=v, do=do, h=h, dh=h, g=None, g_gamma=gamma, scale=setup.scale,
                            chunk_size=64)
            chunk_bwd_dv(q=q, k=k, do=do, dh=h, g=None, g_gamma=gamma, scale=setup.scale, chunk_size=64)
        torch.cuda.synchronize()
        return None
    except Exception as exc:  # noqa: BLE001
        return f"{job}: {type(exc).__name__}: {str(exc)[:300]}"


def fla_best_configs() -> dict:
    """The configurations fla's autotuners chose in this process."""
    out = {}
    try:
        from fla.ops.common import chunk_h, chunk_o
        for mod, name in ((chunk_h, "chunk_fwd_kernel_h"), (chunk_h, "chunk_bwd_kernel_dh"),
                          (chunk_o, "chunk_fwd_kernel_o"), (chunk_o, "chunk_bwd_kernel_dqkwg"),
                          (chunk_o, "chunk_bwd_kernel_dv")):
            kernel = getattr(mod, name, None)
            while kernel is not None and not isinstance(getattr(kernel, "cache", None), dict):
                kernel = getattr(kernel, "fn", None)      # heuristics -> autotuner -> jit
            cache = getattr(kernel, "cache", None) or {}
            out[name] = {str(k): str(v) for k, v in cache.items()}
    except Exception as exc:  # noqa: BLE001
        out["error"] = repr(exc)
    return out


# ---------------------------------------------------------------------------------- main

def rel(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--jobs", type=int, default=15, help="compile workers")
    ap.add_argument("--warm-length", type=int, default=1024)
    ap.add_argument("--budget", type=float, default=250.0, help="seconds: stop timing and print by then")
    ap.add_argument("--skip-fla", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--rows", default="wide", choices=("wide", "refine"),
                    help="wide: the first sweep; refine: around its fastest")
    ap.add_argument("--profile", action="store_true",
                    help="torch.profiler of the shipped forward+backward (kernel times, host time)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    global H, D
    if args.smoke:
        H, D, args.budget = 2, 32, 1e9
    start = time.monotonic()
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    T = 64 if args.smoke else args.length
    rows = variants("smoke" if args.smoke else args.rows)
    out_dir = args.out or os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "sweep_linear_smoke.json" if args.smoke else "sweep_linear.json")
    report = dict(T=T, B=B, H=H, D=D, rows=[], fla={}, e2e={}, notes=[])

    def left():
        return args.budget - (time.monotonic() - start)

    def save():
        with open(path, "w") as f:
            json.dump(report, f, indent=1, default=str)

    fla_ok = False
    if not args.skip_fla and cuda:
        try:
            import fla  # noqa: F401
            fla_ok = True
        except Exception as exc:  # noqa: BLE001
            report["notes"].append(f"no fla: {exc!r}")
    if cuda and args.jobs > 1:
        ctx = multiprocessing.get_context("spawn")
        pool = cf.ProcessPoolExecutor(args.jobs, mp_context=ctx)
        fla_warm = [pool.submit(warm_fla, job, args.warm_length) for job in FLA_WARM] if fla_ok else []
        n = args.jobs - len(fla_warm)
        flex_warm = [pool.submit(warm_flexgen, rows[i::n], args.warm_length) for i in range(n)]
        try:
            for fut in cf.as_completed(flex_warm, timeout=max(10, left() - 120)):
                for row, err in fut.result():
                    if err:
                        report["notes"].append(f"warm {row}: {err}")
        except cf.TimeoutError:
            report["notes"].append("flexgen warm-up not finished: the rest compiles here")
        print(f"flexgen variants compiled ({time.monotonic() - start:.0f} s)", flush=True)
        try:
            for fut in cf.as_completed(fla_warm, timeout=max(10, left() - 150)):
                if fut.result():
                    report["notes"].append(f"fla warm: {fut.result()}")
        except cf.TimeoutError:
            report["notes"].append("fla warm-up not finished: fla compiles here")
        print(f"fla compiled ({time.monotonic() - start:.0f} s)", flush=True)
        # Workers still compiling would share the GPU with the timings (and hold the exit).
        for proc in list((pool._processes or {}).values()):
            proc.kill()
        pool.shutdown(wait=False, cancel_futures=True)

    from triton.testing import do_bench
    timer = (lambda fn: float(do_bench(fn, warmup=10, rep=40, return_mode="median"))) if cuda else \
        (lambda fn: (fn(), 0.0)[1])
    setup = Setup(T, device)
    cache, base = {}, {}
    for row in rows:
        if left() < 90:
            report["notes"].append("flexgen rows cut short (budget)")
            break
        entry = dict(zip(("part", "kind", "form", "chunk", "dk", "dv", "warps", "stages"), row))
        try:
            fn, outs = setup.call(row, cache)
            entry["ms"] = timer(fn)
            fn()
            ref_key = (row[0], row[1]) if row[0] in ("output", "grad") else (row[0], row[1], row[3])
            if ref_key not in base:
                base[ref_key] = [o.clone() for o in outs]
            entry["rel_err"] = max(rel(o, r) for o, r in zip(outs, base[ref_key]))
        except Exception as exc:  # noqa: BLE001
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        report["rows"].append(entry)
        print(f"  {entry}", flush=True)
    cache.clear()
    save()

    if fla_ok:
        for kind in ("gates", "lightning"):
            if left() < 40:
                break
            try:
                calls = fla_calls(setup, kind)
                for name, fn in calls.items():
                    report["fla"][f"{kind} {name}"] = timer(fn)
                    print(f"  fla {kind} {name}: {report['fla'][f'{kind} {name}']:.3f} ms", flush=True)
            except Exception as exc:  # noqa: BLE001
                report["fla"][f"{kind} error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                traceback.print_exc(limit=3)
        report["fla_configs"] = fla_best_configs()
        save()

    e2e(setup, report, timer, left, args.profile)
    save()
    print(f"wrote {path}")
    text = table(report)
    with open(os.path.join(out_dir, "sweep_linear_table.txt"), "w") as f:
        f.write(text + "\n")
    print("\n" + text)
    return 0


def best(report, part, kind, chunk=None):
    rows = [r for r in report["rows"] if r["part"] == part and r["kind"] == kind and "ms" in r
            and (chunk is None or r["chunk"] == chunk) and r.get("rel_err", 1) < 2e-2]
    return min(rows, key=lambda r: r["ms"]) if rows else None


def picks(report, kind):
    """The fastest forward (prefix + state + output at one chunk size) and backward tiles."""
    choice = None
    for chunk in sorted({r["chunk"] for r in report["rows"]}):
        s, o = best(report, "state", kind, chunk), best(report, "output", kind, chunk)
        if s and o:
            p = best(report, "prefix", kind, chunk)
            total = s["ms"] + o["ms"] + (p["ms"] if p and s["form"] == "prefix" else 0)
            if choice is None or total < choice[0]:
                choice = (total, s, o)
    g = best(report, "grad", kind)
    return choice, g


def profiled(fn, n=5) -> list:
    """[(kernel or op, CUDA ms per call, host ms per call)], the 12 largest by CUDA time."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        cuda = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        rows.append((e.key[:60], cuda / 1e3 / n, e.self_cpu_time_total / 1e3 / n, e.count // n))
    rows.sort(key=lambda r: -r[1])
    top = rows[:12]
    top += sorted(rows, key=lambda r: -r[2])[:6]
    return top


def e2e(setup, report, timer, left, profile=False):
    """flexgen end to end: shipped tiles, then the sweep's fastest (both decays); fla's rows."""
    flexgen = setup.flexgen
    from flexgen.runtime import plan_linear
    from flexgen.runtime.plan import _LINEAR
    shipped = dict(plan_linear.LINEAR_GPU_TILES), plan_linear.LINEAR_CHUNK
    # "traced": the decay_mod evaluated and scanned in every kernel (before the "head" and
    # "prefix" forms), with the shipped tiles.
    configs = [("before", BEFORE), ("shipped", None)]
    for kind in ("gates", "lightning"):
        choice, g = picks(report, kind)
        if choice:
            _, s, o = choice
            tiles = dict(shipped[0], state_dk=s["dk"], state_dv=s["dv"], state_warps=s["warps"],
                         state_stages=s["stages"], output_dk=o["dk"], output_dv=o["dv"],
                         output_warps=o["warps"], output_stages=o["stages"])
            if g:
                tiles.update(grad_chunk=g["chunk"], grad_dv=g["dv"], grad_warps=g["warps"], grad_stages=g["stages"])
            configs.append((f"best for {kind}", (tiles, s["chunk"])))
    decay_form = plan_linear._decay_form
    for name, cfg in configs:
        plan_linear._decay_form = (lambda decay: "traced") if name == "before" else decay_form
        plan_linear.LINEAR_GPU_TILES.clear()
        plan_linear.LINEAR_GPU_TILES.update(shipped[0] if cfg is None else cfg[0])
        plan_linear.LINEAR_CHUNK = shipped[1] if cfg is None else cfg[1]
        _LINEAR.clear()
        res = report["e2e"][name] = dict(tiles=dict(plan_linear.LINEAR_GPU_TILES), chunk=plan_linear.LINEAR_CHUNK)
        for kind in ("gates", "lightning"):
            if left() < 15:
                break
            try:
                gates = setup.gates.clone()
                decay = setup.decay(kind, gates)
                q, k, v = setup.q, setup.k, setup.v
                out = flexgen.linear_attention(q, k, v, decay_mod=decay, scale=setup.scale)
                res[f"{kind} fwd"] = timer(lambda: flexgen.linear_attention(q, k, v, decay_mod=decay, scale=setup.scale))
                leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
                if kind == "gates":
                    gates.requires_grad_()
                    leaves.append(gates)

                def fb():
                    for x in leaves:
                        x.grad = None
                    flexgen.linear_attention(*leaves[:3], decay_mod=decay, scale=setup.scale).backward(setup.do)
                res[f"{kind} fwd+bwd"] = timer(fb)
                if setup.device.type == "cuda":
                    # Host time per call (no wait for the GPU) against the GPU's: a call the
                    # host cannot keep up with measures the host.
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(10):
                        fb()
                    t1 = time.perf_counter()
                    torch.cuda.synchronize()
                    res[f"{kind} fwd+bwd host"] = (t1 - t0) * 100
                    res[f"{kind} fwd+bwd wall"] = (time.perf_counter() - t0) * 100
                    if profile and name == "shipped":
                        res[f"{kind} profile"] = profiled(fb)
                try:
                    from fla.ops.simple_gla import chunk_simple_gla
                    fq, fk, fv, _, kw = fla_inputs(setup, kind)
                    theirs = chunk_simple_gla(fq, fk, fv, **kw)[0].transpose(1, 2)
                    res[f"{kind} vs fla err"] = rel(out, theirs)
                except Exception:  # noqa: BLE001
                    pass
            except Exception as exc:  # noqa: BLE001
                res[f"{kind} error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                traceback.print_exc(limit=3)
        print(f"  e2e {name}: {res}", flush=True)
    plan_linear.LINEAR_GPU_TILES.clear()
    plan_linear.LINEAR_GPU_TILES.update(shipped[0])
    plan_linear.LINEAR_CHUNK = shipped[1]
    plan_linear._decay_form = decay_form
    _LINEAR.clear()


def table(report) -> str:
    f = lambda x, spec=".3f": "-" if x is None else format(x, spec)  # noqa: E731
    lines = [f"linear attention kernels, B={report['B']} H={report['H']} T={report['T']} D={report['D']} bf16"]
    head = f"{'part':<8} {'kind':<9} {'form':<7} {'chunk':>5} {'dk':>4} {'dv':>4} {'w':>2} {'st':>2} | {'ms':>7} {'err':>7}"
    lines += ["", head, "-" * len(head)]
    for r in report["rows"]:
        lines.append(f"{r['part']:<8} {r['kind']:<9} {r['form']:<7} {r['chunk']:>5} {r['dk']:>4} {r['dv']:>4} "
                     f"{r['warps']:>2} {r['stages']:>2} | {f(r.get('ms')):>7} {f(r.get('rel_err'), '.1e'):>7} "
                     f"{r.get('error', '')}")
    if report["fla"]:
        lines += ["", "fla: " + ", ".join(f"{k} {f(v) if isinstance(v, float) else v}"
                                          for k, v in report["fla"].items())]
    for name, res in report["e2e"].items():
        fla = report["fla"]
        cells = []
        for kind in ("gates", "lightning"):
            for what, peer in (("fwd", "fwd"), ("fwd+bwd", "fwd+bwd")):
                ms, theirs = res.get(f"{kind} {what}"), fla.get(f"{kind} {peer}")
                ratio = f" ({theirs / ms:.2f}x fla)" if isinstance(ms, float) and isinstance(theirs, float) else ""
                cells.append(f"{kind} {what} {f(ms)}{ratio}")
        lines += ["", f"e2e {name} (chunk {res['chunk']}, {res['tiles']}):", "  " + "; ".join(cells)]
        for kind in ("gates", "lightning"):
            if f"{kind} fwd+bwd host" in res:
                lines.append(f"  {kind} fwd+bwd per call: host {res[f'{kind} fwd+bwd host']:.3f} ms, "
                             f"wall {res[f'{kind} fwd+bwd wall']:.3f} ms")
            for key, cuda, host, count in res.get(f"{kind} profile", []):
                lines.append(f"    {kind} profile: {key:<60} cuda {cuda:.3f} host {host:.3f} x{count}")
    for note in report["notes"]:
        lines.append(f"note: {note}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
