"""Attention without softmax: sigmoid attention and decayed linear attention, against their peers.

    python benchmarks/bench_nosoftmax.py            # the H100 grid (~2 min; --budget 150 s)
    python benchmarks/bench_nosoftmax.py --smoke    # tiny sizes on CPU (interpreter): checks the script only

bf16, H = 16 heads, D = 128, 16k tokens (``--length``), batch 1. Three parts, each case
checked for correctness before it is timed:

1. **sigmoid vs softmax** (``flexgen.sigmoid_attention`` against flexgen's own softmax
   kernel, ``flexgen.flex_attention``, on the same inputs and the same block mask), causal and
   full, forward and forward+backward. ``speedup`` = softmax ms / sigmoid ms (target >= 1.05:
   the sigmoid kernel drops the online softmax's max, row sum and rescale). Checked against
   ``sigmoid_attention_reference`` (float32) at 1k tokens.
2. **linear attention vs flash-linear-attention** (``fla``, when importable: its
   ``chunk_simple_gla``; the peer is skipped cleanly otherwise) on the same inputs: the
   lightning decay (a constant ``-slopes[h]`` per head; fla's ``g_gamma``) and per-token gates
   (``logsigmoid`` gates ``[B, H, T]``; fla's ``g``), forward and forward+backward.
   ``vs fla`` = fla ms / flexgen ms (target >= 1.0). flexgen is checked against fla's output
   and against ``linear_attention_reference`` at 1k tokens.
3. **linear decode**: ``flexgen.linear_attention_decode`` — one token per sequence updating a
   cache of states ``[B, H, 128, 128]`` float32 in place, B in {1, 64}, lightning decay —
   replayed from a CUDA graph (kernel time; as a serving loop runs it: one step per replay, and
   ``x10``: ten steps in one graph, per step, the graph's launch shared as a model's layers
   share it) and called from Python.
   ``tok/s`` = B / time; ``GB/s`` counts the state read and written once plus q, k, v, out;
   ``%copy`` is that over the device-to-device copy bandwidth measured in the same run
   (target >= 80% at B = 64).

Cases run in order of importance (sigmoid causal, linear lightning and gates, sigmoid full,
decode B=64 then 1, then fla's forward and forward+backward, since fla autotunes for minutes on
its first calls; ``--fla-cases`` picks which, by default all but the gated forward+backward where
fla refuses it), each printed as soon as it is measured; a case not started within ``--budget``
seconds (150) is listed as skipped. Times are ``triton.testing.do_bench`` medians of ~50 ms. A case that fails is printed with its error and
the run goes on; SIGTERM still writes the JSON and the table. Writes JSON (device, versions,
every case) under ``$OUT`` when set (``--out`` overrides), else ``benchmarks/results/``.
Prints a table last.
"""
from __future__ import annotations

import os

# Timings must not include flexgen's NaN poisoning of outputs (an extra fill kernel).
os.environ.pop("FLEXGEN_POISON", None)

import argparse  # noqa: E402
import gc  # noqa: E402
import inspect  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import flexgen  # noqa: E402
from flexgen import mods as M  # noqa: E402
from flexgen.reference import linear_attention_reference, sigmoid_attention_reference  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Timer, copy_gbps, environment, graph_ms, write_json  # noqa: E402

DTYPE = torch.bfloat16


class Stop(BaseException):
    """SIGTERM: stop timing, still write the results (not an Exception: peers' handlers let it pass)."""


def _stop(signum, frame):
    raise Stop(f"signal {signum}")


def _err(exc) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def _cleanup(cuda):
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def _rel(a, b) -> float:
    """max |a - b| / max |b|."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


def _fwd_bwd(fn, leaves, d_out):
    """A callable running ``fn`` forward then backward into ``leaves`` (their grads reset)."""
    def run():
        for t in leaves:
            t.grad = None
        out = fn()
        out = out[0] if isinstance(out, tuple) else out
        out.backward(d_out)
    return run


# ---------------------------------------------------------------------------------- sigmoid

def sigmoid_cases(args, timer, cuda, device, variants=("causal", "full")) -> list:
    B, H, L, D = 1, args.heads, args.length, args.dim
    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, generator=gen, device=device, dtype=DTYPE) for _ in range(3))
    d_out = torch.randn(B, H, L, D, generator=gen, device=device, dtype=DTYPE)
    for variant in variants:
        row = dict(part="sigmoid", variant=variant, B=B, H=H, L=L, D=D)
        rows.append(row)
        try:
            mask = None if variant == "full" else flexgen.create_block_mask(
                M.causal_mask, None, None, L, L, device=device)
            # Correctness first, at a size the dense float32 reference can hold.
            Ls = min(L, 1024)
            qs, ks, vs = q[:, :, :Ls], k[:, :, :Ls], v[:, :, :Ls]
            mask_s = None if variant == "full" else flexgen.create_block_mask(
                M.causal_mask, None, None, Ls, Ls, device=device)
            got = flexgen.sigmoid_attention(qs, ks, vs, block_mask=mask_s)
            ref = sigmoid_attention_reference(qs, ks, vs, mask_mod=mask_s, dtype=torch.float32)
            row["check_rel_err"] = _rel(got, ref)
            flops = 4 * B * H * L * L * D * (0.5 if variant == "causal" else 1.0)
            sig = lambda: flexgen.sigmoid_attention(q, k, v, block_mask=mask)  # noqa: E731
            soft = lambda: flexgen.flex_attention(q, k, v, block_mask=mask)  # noqa: E731
            row["sigmoid_ms"] = timer(sig)
            row["softmax_ms"] = timer(soft)
            row["speedup"] = row["softmax_ms"] / row["sigmoid_ms"]
            row["sigmoid_tflops"] = flops / row["sigmoid_ms"] / 1e9
            row["softmax_tflops"] = flops / row["softmax_ms"] / 1e9
            leaves = [t.requires_grad_() for t in (q, k, v)]
            row["sigmoid_fb_ms"] = timer(_fwd_bwd(
                lambda: flexgen.sigmoid_attention(*leaves, block_mask=mask), leaves, d_out))
            row["softmax_fb_ms"] = timer(_fwd_bwd(
                lambda: flexgen.flex_attention(*leaves, block_mask=mask), leaves, d_out))
            row["speedup_fb"] = row["softmax_fb_ms"] / row["sigmoid_fb_ms"]
        except Exception as exc:  # noqa: BLE001 - one case failing must not stop the run
            row["error"] = _err(exc)
            traceback.print_exc(limit=3)
        finally:
            for t in (q, k, v):
                t.requires_grad_(False)
                t.grad = None
            _cleanup(cuda)
        print(f"  {row}", flush=True)
    return rows


# ---------------------------------------------------------------------------------- linear

def fla_peer():
    """(chunk_simple_gla, its keyword names) or (None, why)."""
    try:
        from fla.ops.simple_gla import chunk_simple_gla
    except Exception as exc:  # noqa: BLE001 - any import failure: no peer
        return None, _err(exc)
    return chunk_simple_gla, set(inspect.signature(chunk_simple_gla).parameters)


def _fla_kwargs(params, *, B, T, H, gates=None, slopes=None, scale):
    """chunk_simple_gla's keyword arguments for a lightning decay (``slopes`` [H]) or per-token
    gates ([B, T, H], fla's layout), whatever fla version is installed."""
    kwargs = dict(scale=scale)
    if "head_first" in params:
        kwargs["head_first"] = False          # fla's [B, T, H, D] layout
    if slopes is not None and "g_gamma" in params:
        kwargs["g_gamma"] = -slopes
    elif slopes is not None:
        kwargs["g"] = (-slopes).view(1, 1, H).expand(B, T, H).contiguous()
    if gates is not None:
        kwargs["g"] = gates
    return kwargs


def _fla_layout(t):
    """[B, H, T, ...] -> fla's [B, T, H, ...], contiguous (made once, outside the timings)."""
    return t.transpose(1, 2).contiguous()


def _linear_inputs(args, device):
    """The linear cases' inputs (the same on every call: a seeded generator)."""
    B, H, T, D = 1, args.heads, args.length, args.dim
    gen = torch.Generator(device=device).manual_seed(1)
    # Unit-norm rows keep the unnormalized states O(1) over 16k tokens, as a model's would.
    q, k = (F.normalize(torch.randn(B, H, T, D, generator=gen, device=device), dim=-1).to(DTYPE)
            for _ in range(2))
    v = torch.randn(B, H, T, D, generator=gen, device=device, dtype=DTYPE)
    d_out = torch.randn(B, H, T, D, generator=gen, device=device, dtype=DTYPE)
    slopes = torch.tensor([2.0 ** (-8 * (i + 1) / H) for i in range(H)], device=device)
    gates = F.logsigmoid(torch.randn(B, H, T, generator=gen, device=device) + 4.0)
    return q, k, v, d_out, slopes, gates


def _linear_call(variant, slopes, g, scale):
    """flexgen.linear_attention of one variant, as a function of (q, k, v)."""
    def decay(b, h, t):
        return -slopes[h] if variant == "lightning" else g[b, h, t]

    def ours(q, k, v):
        return flexgen.linear_attention(q, k, v, decay_mod=decay, scale=scale)
    return decay, ours


def linear_cases(args, timer, cuda, device, variants=("lightning", "gates")) -> list:
    """flexgen's rows; the peer's numbers are added later by ``fla_cases`` (its first calls
    autotune for minutes, so it runs after every flexgen case)."""
    B, H, T, D = 1, args.heads, args.length, args.dim
    scale = D ** -0.5
    q, k, v, d_out, slopes, gates = _linear_inputs(args, device)
    rows = []
    for variant in variants:
        row = dict(part="linear", variant=variant, B=B, H=H, T=T, D=D)
        rows.append(row)
        try:
            g = gates.clone()
            decay, ours = _linear_call(variant, slopes, g, scale)
            out = ours(q, k, v)
            Ts = min(T, 1024)
            ref = linear_attention_reference(q[:, :, :Ts], k[:, :, :Ts], v[:, :, :Ts], decay, scale=scale,
                                             dtype=torch.float32)
            row["check_rel_err"] = _rel(out[:, :, :Ts], ref)
            row["flexgen_ms"] = timer(lambda: ours(q, k, v))
            leaves = [t.requires_grad_() for t in (q, k, v)] + ([g.requires_grad_()] if variant == "gates" else [])
            row["flexgen_fb_ms"] = timer(_fwd_bwd(lambda: ours(*leaves[:3]), leaves, d_out))
        except Exception as exc:  # noqa: BLE001
            row["error"] = _err(exc)
            traceback.print_exc(limit=3)
        finally:
            for t in (q, k, v):
                t.requires_grad_(False)
                t.grad = None
            _cleanup(cuda)
        print(f"  {row}", flush=True)
    return rows


def fla_cases(args, timer, cuda, device, row, backward: bool) -> None:
    """fla's chunk_simple_gla on ``row``'s inputs: its forward (and the flexgen/fla difference),
    or with ``backward`` its forward+backward; results go into ``row``."""
    fla, params = (None, "skipped (--skip-fla)") if args.skip_fla else fla_peer()
    if fla is None:
        row.setdefault("peer", f"fla not available: {params}")
        return
    B, H, T, D, variant = row["B"], row["H"], row["T"], row["D"], row["variant"]
    scale = D ** -0.5
    q, k, v, d_out, slopes, gates = _linear_inputs(args, device)
    try:
        qf, kf, vf, do_f = (_fla_layout(t) for t in (q, k, v, d_out))
        g_f = _fla_layout(gates) if variant == "gates" else None
        kw = lambda g_f=g_f: _fla_kwargs(  # noqa: E731
            params, B=B, T=T, H=H, scale=scale, gates=g_f,
            slopes=slopes if variant == "lightning" else None)
        if not backward:
            theirs = fla(qf, kf, vf, **kw())
            theirs = theirs[0] if isinstance(theirs, tuple) else theirs
            row["vs_fla_rel_err"] = _rel(_fla_layout(_linear_call(variant, slopes, gates, scale)[1](q, k, v)),
                                         theirs)
            row["fla_ms"] = timer(lambda: fla(qf, kf, vf, **kw()))
            row["vs_fla"] = row["fla_ms"] / row["flexgen_ms"] if row.get("flexgen_ms") else None
        else:
            peer = [t.requires_grad_() for t in (qf, kf, vf)] + ([g_f.requires_grad_()] if g_f is not None else [])
            row["fla_fb_ms"] = timer(_fwd_bwd(lambda: fla(*peer[:3], **kw(*peer[3:])), peer, do_f))
            row["vs_fla_fb"] = row["fla_fb_ms"] / row["flexgen_fb_ms"] if row.get("flexgen_fb_ms") else None
    except Exception as exc:  # noqa: BLE001
        row["peer_error"] = _err(exc)
        traceback.print_exc(limit=3)
    finally:
        _cleanup(cuda)
    print(f"  {row}", flush=True)


def fla_case_names(text: str, cuda: bool) -> set:
    """The fla cases ``--fla-cases`` asks for (see its help)."""
    names = {"lightning", "gates", "lightning-fb", "gates-fb"}
    if text != "auto":
        wanted = set(filter(None, text.split(",")))
        if wanted - names:
            raise SystemExit(f"--fla-cases: unknown {sorted(wanted - names)}; pick among {sorted(names)}")
        return wanted
    import triton
    version = tuple(int(p) for p in triton.__version__.split(".")[:3] if p.isdigit())
    if cuda and torch.cuda.get_device_capability() == (9, 0) and (3, 4, 0) <= version < (3, 7, 1):
        names.discard("gates-fb")
    return names


# ---------------------------------------------------------------------------------- decode

def decode_cases(args, timer, cuda, device, bw, batches) -> list:
    H, D = args.heads, args.dim
    slopes = torch.tensor([2.0 ** (-8 * (i + 1) / H) for i in range(H)], device=device)

    def decay(b, h, t):
        return -slopes[h]

    rows = []
    for B in batches:
        row = dict(part="decode", B=B, H=H, D=D)
        rows.append(row)
        try:
            gen = torch.Generator(device=device).manual_seed(2)
            q, k, v = (torch.randn(B, H, 1, D, generator=gen, device=device, dtype=DTYPE) * 0.1
                       for _ in range(3))
            cache = torch.randn(B + 3, H, D, D, generator=gen, device=device) * 0.1
            slots = torch.randperm(B + 3, generator=torch.Generator().manual_seed(3))[:B].to(
                device=device, dtype=torch.int32)
            start = cache[slots.long()].clone()
            out = flexgen.linear_attention_decode(q, k, v, cache, slots, decay)
            ref, ref_state = linear_attention_reference(q, k, v, decay, initial_state=start,
                                                        output_final_state=True, dtype=torch.float32)
            row["check_rel_err"] = max(_rel(out, ref), _rel(cache[slots.long()], ref_state))
            step = lambda: flexgen.linear_attention_decode(q, k, v, cache, slots, decay)  # noqa: E731
            moved = 2 * B * H * D * D * 4 + 4 * B * H * D * 2
            row["eager_ms"] = timer(step)
            ms = graph_ms(step, timer, cuda)
            row["graph10_ms"] = graph_ms(step, timer, cuda, repeat=10)
            for name, t in (("eager", row["eager_ms"]), ("graph", ms), ("graph10", row["graph10_ms"])):
                if t is None:
                    continue
                row[f"{name}_tok_s"] = B / (t * 1e-3)
                row[f"{name}_gbps"] = moved / (t * 1e-3) / 1e9
                if bw:
                    row[f"{name}_pct_copy"] = 100 * row[f"{name}_gbps"] / bw
            row["graph_ms"] = ms
        except Exception as exc:  # noqa: BLE001
            row["error"] = _err(exc)
            traceback.print_exc(limit=3)
        finally:
            _cleanup(cuda)
        print(f"  {row}", flush=True)
    return rows


# ---------------------------------------------------------------------------------- report

def _f(x, spec, missing="-"):
    import re
    width = re.match(r"\d*", spec).group()
    return missing.rjust(int(width or 0)) if x is None else format(x, spec)


def table(payload) -> str:
    env, cases = payload["env"], payload["cases"]
    lines = [f"attention without softmax, bf16, H={payload['heads']}, D={payload['dim']}: "
             f"{env.get('device_name')}, copy {_f(payload.get('copy_gbps'), '.0f')} GB/s"]
    head = (f"{'sigmoid':<10} {'L':>6} | {'sigmoid ms':>10} {'softmax ms':>10} {'speedup':>7} | "
            f"{'fwd+bwd ms':>10} {'softmax':>8} {'speedup':>7} | {'rel err':>7}  note")
    lines += ["", head, "-" * len(head)]
    for r in (c for c in cases if c["part"] == "sigmoid"):
        lines.append(f"{r['variant']:<10} {r['L']:>6} | {_f(r.get('sigmoid_ms'), '10.3f')} "
                     f"{_f(r.get('softmax_ms'), '10.3f')} {_f(r.get('speedup'), '7.2f')} | "
                     f"{_f(r.get('sigmoid_fb_ms'), '10.3f')} {_f(r.get('softmax_fb_ms'), '8.3f')} "
                     f"{_f(r.get('speedup_fb'), '7.2f')} | {_f(r.get('check_rel_err'), '7.1e')}  "
                     f"{r.get('error', '')}")
    head = (f"{'linear':<10} {'T':>6} | {'flexgen ms':>10} {'fla ms':>8} {'vs fla':>6} | "
            f"{'fwd+bwd ms':>10} {'fla':>8} {'vs fla':>6} | {'vs fla err':>10} {'ref err':>7}  note")
    lines += ["", head, "-" * len(head)]
    for r in (c for c in cases if c["part"] == "linear"):
        lines.append(f"{r['variant']:<10} {r['T']:>6} | {_f(r.get('flexgen_ms'), '10.3f')} "
                     f"{_f(r.get('fla_ms'), '8.3f')} {_f(r.get('vs_fla'), '6.2f')} | "
                     f"{_f(r.get('flexgen_fb_ms'), '10.3f')} {_f(r.get('fla_fb_ms'), '8.3f')} "
                     f"{_f(r.get('vs_fla_fb'), '6.2f')} | {_f(r.get('vs_fla_rel_err'), '10.1e')} "
                     f"{_f(r.get('check_rel_err'), '7.1e')}  "
                     f"{r.get('error') or r.get('peer_error') or r.get('peer') or payload.get('fla', '')}")
    head = (f"{'decode':<10} {'B':>6} | {'graph us':>9} {'tok/s':>10} {'GB/s':>6} {'%copy':>5} | "
            f"{'x10 us':>7} {'%copy':>5} | {'eager us':>9} {'tok/s':>10} | {'rel err':>7}  note")
    lines += ["", head, "-" * len(head)]
    for r in (c for c in cases if c["part"] == "decode"):
        us = lambda key: None if r.get(key) is None else r[key] * 1e3  # noqa: E731
        lines.append(f"{'state':<10} {r['B']:>6} | {_f(us('graph_ms'), '9.1f')} {_f(r.get('graph_tok_s'), '10.0f')} "
                     f"{_f(r.get('graph_gbps'), '6.0f')} {_f(r.get('graph_pct_copy'), '5.0f')} | "
                     f"{_f(us('graph10_ms'), '7.1f')} {_f(r.get('graph10_pct_copy'), '5.0f')} | "
                     f"{_f(us('eager_ms'), '9.1f')} {_f(r.get('eager_tok_s'), '10.0f')} | "
                     f"{_f(r.get('check_rel_err'), '7.1e')}  {r.get('error', '')}")
    lines += ["", "targets: sigmoid speedup >= 1.05; linear vs fla >= 1.0 (forward and fwd+bwd); "
              "decode %copy >= 80 at B=64"]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--length", type=int, default=16384, help="tokens (sigmoid L and linear T)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batches", default="1,64", help="decode batch sizes")
    ap.add_argument("--parts", default="sigmoid,linear,decode")
    ap.add_argument("--skip-fla", action="store_true")
    ap.add_argument("--fla-cases", default="auto",
                    help="fla's cases, comma-separated among lightning, gates, lightning-fb, gates-fb; "
                         "auto: all but gates-fb where fla refuses it (Hopper with Triton >= 3.4 and "
                         "< 3.7.1, its issue #640), after minutes of autotuning its other kernels")
    ap.add_argument("--budget", type=float, default=150.0,
                    help="seconds: cases not started by then are listed as skipped")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (interpreter): tests the script")
    ap.add_argument("--out", default=None, help="output folder (default $OUT, else benchmarks/results)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    if args.smoke:
        args.length, args.heads, args.dim = 64, 2, 32
    args.batches = [int(b) for b in args.batches.split(",") if b]
    if args.smoke:
        args.batches = [1, 4]
    device = torch.device("cuda" if cuda else "cpu")
    # Short timings (medians of ~50 ms of calls): compiling dominates the run, not timing.
    timer = Timer(cuda, warmup_ms=10, rep_ms=50)
    signal.signal(signal.SIGTERM, _stop)
    out_dir = args.out or os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(out_dir, exist_ok=True)
    name = "bench_nosoftmax_smoke.json" if args.smoke else "bench_nosoftmax.json"
    json_path = os.path.join(out_dir, name)
    payload = dict(env=environment(cuda), heads=args.heads, dim=args.dim, length=args.length, cases=[])
    fla, why = fla_peer()
    payload["fla"] = "fla " + getattr(sys.modules.get("fla"), "__version__", "?") if fla else f"no fla ({why})"
    parts = set(args.parts.split(","))
    # The cases in order of importance, each printed as soon as it is measured, so that a run
    # cut short still has the ones that matter most.
    cases = [("sigmoid", "causal"), ("linear", "lightning"), ("linear", "gates"), ("sigmoid", "full")]
    cases += [("decode", B) for B in sorted(args.batches, reverse=True)]
    # The peer last: fla autotunes on its first calls (minutes on a fresh machine).
    cases += [("fla", ("lightning", False)), ("fla", ("gates", False)),
              ("fla", ("lightning", True)), ("fla", ("gates", True))]

    fla_wanted = fla_case_names(args.fla_cases, cuda)

    def peer(variant, backward):
        rows = [c for c in payload["cases"] if c["part"] == "linear" and c["variant"] == variant]
        name = variant + ("-fb" if backward else "")
        if rows and name not in fla_wanted:
            rows[0].setdefault("peer", f"fla {name} not run (--fla-cases {args.fla_cases})")
        elif rows and "error" not in rows[0]:
            fla_cases(args, timer, cuda, device, rows[0], backward)
        return []

    run = dict(
        sigmoid=lambda v: sigmoid_cases(args, timer, cuda, device, (v,)),
        linear=lambda v: linear_cases(args, timer, cuda, device, (v,)),
        decode=lambda B: decode_cases(args, timer, cuda, device, payload.get("copy_gbps"), (B,)),
        fla=lambda v: peer(*v))
    start = time.monotonic()
    try:
        payload["copy_gbps"] = copy_gbps(timer, cuda)
        for part, variant in cases:
            if (part if part != "fla" else "linear") not in parts:
                continue
            if time.monotonic() - start > args.budget:
                print(f"{part} {variant}: skipped (past --budget {args.budget:.0f} s)", flush=True)
                if part == "fla":
                    continue
                payload["cases"].append(dict(part=part, variant=variant, B=variant if part == "decode" else 1,
                                             H=args.heads, D=args.dim, L=args.length, T=args.length,
                                             error="skipped: past the time budget"))
                continue
            print(f"{part} {variant} ({time.monotonic() - start:.0f} s)", flush=True)
            payload["cases"] += run[part](variant)
            write_json(json_path, payload)
    except Stop as exc:
        print(f"  stopped: {exc}", flush=True)
    write_json(json_path, payload)
    print(f"wrote {json_path}")
    print("\n" + table(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
