"""Correctness of flexgen on the GPU at realistic sizes, against the float32 reference.

    python benchmarks/gpu_check.py             # CUDA: B=2, H=8, L=2048, D=128, bf16
    python benchmarks/gpu_check.py --smoke     # tiny sizes on CPU (Triton interpreter)
    python benchmarks/gpu_check.py --cases causal,gqa_causal --budget 60

Every case draws fresh random inputs, runs ``flexgen.flex_attention`` with
``return_lse=True`` and outputs poisoned with NaN before the launch
(``FLEXGEN_POISON=1``, set here before flexgen is imported), and compares
with ``flexgen.reference.flex_attention_reference`` computed in float32 on
the same device (float32 matmuls, tf32 off). A case passes when nothing is
NaN (an unwritten element stays NaN), ``|out - ref| / |ref|`` (norms) and
``max |out - ref|`` are under the dtype's tolerance, the LSE agrees (same
-inf rows, finite entries within ``LSE_ATOL``), and a second launch on the same
inputs (``return_lse=False``) gives a bitwise-equal output (a moving result
is a race). Where torch can build the same mask, the block layout is also
compared with torch's ``create_block_mask`` (information, not pass/fail).

Prints one PASS / FAIL / ERROR / SKIP line per case and a table at the end;
writes ``gpu_check.json`` under ``--out`` (default: ``$OUT`` when set).
Exit status 1 if any case failed or errored.
"""
from __future__ import annotations

import os

# Before flexgen is imported: it reads this once, at import.
os.environ["FLEXGEN_POISON"] = "1"

import argparse  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import torch  # noqa: E402

import flexgen  # noqa: E402
from flexgen import mods  # noqa: E402
from flexgen.reference import flex_attention_reference  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import doc_ids, environment, report, write_json  # noqa: E402

# bf16 keeps 8 bits of mantissa, fp16 11: tolerances on the output in the
# storage dtype, against a float32 reference on the same (rounded) inputs.
REL_TOL = {torch.bfloat16: 1e-2, torch.float16: 3e-3, torch.float32: 1e-3}
ABS_TOL = {torch.bfloat16: 3e-2, torch.float16: 6e-3, torch.float32: 2e-3}
LSE_ATOL = 2e-3


class Timeout(Exception):
    """Raised by SIGTERM / the budget alarm so the summary is still written."""


STOP = []   # non-empty once SIGTERM arrived: a library may wrap the Timeout, this stays


def _on_signal(signum, frame):
    STOP.append(signum)
    raise Timeout(f"signal {signum}")


# ---------------------------------------------------------------------------
# sizes and cases

def sizes(smoke: bool) -> SimpleNamespace:
    if smoke:
        return SimpleNamespace(device="cpu", B=2, H=2, L=256, L_kv=300, L_odd=255, D=64,
                               Hq_gqa=4, Hkv_gqa=1, window=64, dead_rows=40, dims=(64, 80, 128, 256))
    return SimpleNamespace(device="cuda", B=2, H=8, L=2048, L_kv=3000, L_odd=2047, D=128,
                           Hq_gqa=8, Hkv_gqa=2, window=1024, dead_rows=100, dims=(64, 80, 128, 256))


def random_doc_ids(B, L, device, gen) -> torch.Tensor:
    """int32 [B, L]: each row cut into random-length documents (at least 3, about 256 long)."""
    return doc_ids(B, L, device, gen, mean_len=256, min_docs=3)


@dataclass
class Case:
    name: str
    Lq: int
    Lkv: int
    D: int
    Hq: int
    Hkv: int
    dtype: torch.dtype = torch.bfloat16
    # build(case, S, gen) -> (score_mod, mask_mod, mask_batch) ; mask_batch: B or None
    build: object = None
    note: str = ""
    sdpa: str | None = None      # "full" / "causal": the same attention through SDPA, as a peer



def _none(c, S, g):
    return None, None, None


def make_cases(S) -> list[Case]:
    L, B, H, D = S.L, S.B, S.H, S.D
    cases = []

    def add(name, build=_none, Lq=L, Lkv=L, D=D, Hq=H, Hkv=H, dtype=torch.bfloat16, note="", sdpa=None):
        cases.append(Case(name, Lq, Lkv, D, Hq, Hkv, dtype, build, note, sdpa))

    causal = lambda c, S, g: (None, mods.causal_mask, None)  # noqa: E731
    add("no_mod", note="no score_mod, no block_mask", sdpa="full")
    add("causal", causal, sdpa="causal")
    add("sliding_window", lambda c, S, g: (None, mods.sliding_window(S.window), None),
        note=f"causal window {S.window}")
    add("prefix_lm", lambda c, S, g: (None, mods.prefix_lm(L // 4), None), note=f"prefix {L // 4}")
    add("document", lambda c, S, g: (None, mods.document_mask(random_doc_ids(B, c.Lq, S.device, g)), B),
        note="random doc lengths per batch row")
    add("document_causal", lambda c, S, g: (
        None, mods.and_masks(mods.causal_mask, mods.document_mask(random_doc_ids(B, c.Lq, S.device, g))), B))
    add("alibi", lambda c, S, g: (mods.alibi(num_heads=c.Hq), None, None))
    add("softcap", lambda c, S, g: (mods.tanh_softcap(30.0), None, None), note="cap 30")

    def relbias(c, S, g):
        table = torch.randn(c.Hq, 2 * c.Lq - 1, generator=g).to(S.device)
        return mods.relative_position_bias(table, c.Lq), None, None
    add("relative_bias", relbias, note="table [H, 2L-1]")
    add("softcap_causal", lambda c, S, g: (mods.tanh_softcap(30.0), mods.causal_mask, None))
    add("alibi_causal", lambda c, S, g: (mods.alibi(num_heads=c.Hq), mods.causal_mask, None))
    add("gqa_causal", causal, Hq=S.Hq_gqa, Hkv=S.Hkv_gqa, note=f"Hq={S.Hq_gqa} Hkv={S.Hkv_gqa}",
        sdpa="causal")
    add("lq_ne_lkv_lower_right", lambda c, S, g: (None, mods.causal_lower_right(c.Lq, c.Lkv), None),
        Lkv=S.L_kv, note=f"Lq={L} Lkv={S.L_kv}")
    add("lq_ne_lkv_no_mask", Lkv=S.L_kv, note=f"Lq={L} Lkv={S.L_kv}", sdpa="full")

    def kvpad(c, S, g):
        lengths = torch.randint(c.Lkv // 2, c.Lkv + 1, (B,), generator=g, dtype=torch.int32)
        return None, mods.kv_padding(lengths.to(S.device)), B
    add("lq_ne_lkv_kv_padding", kvpad, Lkv=S.L_kv, note="random kv lengths per batch row")
    add("odd_len_no_mod", Lq=S.L_odd, Lkv=S.L_odd, note=f"L={S.L_odd}", sdpa="full")
    add("odd_len_causal", causal, Lq=S.L_odd, Lkv=S.L_odd, note=f"L={S.L_odd}", sdpa="causal")
    for d in S.dims:
        if d != D:
            add(f"d{d}_causal", causal, D=d, sdpa="causal")
    add("d80_softcap_sliding", lambda c, S, g: (mods.tanh_softcap(30.0), mods.sliding_window(S.window), None),
        D=80)
    add("fp16_causal", causal, dtype=torch.float16, sdpa="causal")
    add("fp16_no_mod", dtype=torch.float16, sdpa="full")
    add("dead_rows", lambda c, S, g: (None, mods.causal(-S.dead_rows), None),
        note=f"first {S.dead_rows} rows fully masked (zeros, lse -inf)")

    def qpad(c, S, g):
        lengths = torch.randint(c.Lq // 2, c.Lq + 1, (B,), generator=g, dtype=torch.int32)
        return None, mods.and_masks(mods.causal_mask, mods.q_padding(lengths.to(S.device))), B
    add("dead_rows_q_padding", qpad, note="padded query rows see nothing")
    return cases


# ---------------------------------------------------------------------------
# one case

def _torch_block_states(mask_mod, mB, Lq, Lkv, device):
    """Block states [B, H, NQ, NKV] of torch's own create_block_mask (None if unavailable)."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_cbm
    tbm = torch_cbm(mask_mod, mB, None, Lq, Lkv, device=device)
    as_flexgen = flexgen.BlockMask(tbm.kv_num_blocks, tbm.kv_indices, tbm.full_kv_num_blocks,
                                   tbm.full_kv_indices, tbm.kv_num_blocks, tbm.kv_indices,
                                   tbm.full_kv_num_blocks, tbm.full_kv_indices,
                                   (128, 128), mask_mod, (Lq, Lkv))
    return as_flexgen.block_states()


def run_case(case: Case, S, seed: int, compare_blocks: bool) -> dict:
    dev = S.device
    gen = torch.Generator().manual_seed(seed)
    B = S.B
    score_mod, mask_mod, mask_batch = case.build(case, S, gen)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device=dev, dtype=case.dtype)

    q = rnd(B, case.Hq, case.Lq, case.D)
    k = rnd(B, case.Hkv, case.Lkv, case.D)
    v = rnd(B, case.Hkv, case.Lkv, case.D)
    gqa = case.Hq != case.Hkv
    r = dict(name=case.name, note=case.note, dtype=str(case.dtype).replace("torch.", ""),
             B=B, Hq=case.Hq, Hkv=case.Hkv, Lq=case.Lq, Lkv=case.Lkv, D=case.D, seed=seed)

    t0 = time.perf_counter()
    block_mask = None
    if mask_mod is not None:
        block_mask = flexgen.create_block_mask(mask_mod, mask_batch, None, case.Lq, case.Lkv, device=dev)
        r["sparsity_pct"] = round(block_mask.sparsity(), 2)
    out, lse = flexgen.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                      enable_gqa=gqa, return_lse=True)
    if dev == "cuda":
        torch.cuda.synchronize()
    r["first_call_s"] = round(time.perf_counter() - t0, 3)  # includes generating + compiling
    out2 = flexgen.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                  enable_gqa=gqa, return_lse=False)

    ref, ref_lse = flex_attention_reference(q, k, v, score_mod, mask_mod, enable_gqa=gqa,
                                            return_lse=True, dtype=torch.float32)
    outf = out.float()
    nan_out = int(torch.isnan(outf).sum())
    nan_lse = int(torch.isnan(lse).sum())
    finite = torch.isfinite(outf)
    diff = (outf - ref).masked_fill(~finite, 0.0)
    r["nan_out"], r["nan_lse"] = nan_out, nan_lse
    r["max_abs"] = float(diff.abs().max())
    ref_norm = float(ref.norm())
    r["rel"] = float(diff.norm()) / ref_norm if ref_norm > 0 else float(diff.norm())
    ref_dead = torch.isneginf(ref_lse)
    r["dead_rows"] = int(ref_dead.sum())
    r["lse_dead_mismatch"] = int((torch.isneginf(lse) != ref_dead).sum())
    both = torch.isfinite(lse) & torch.isfinite(ref_lse)
    r["lse_max_abs"] = float((lse - ref_lse).masked_fill(~both, 0.0).abs().max()) if both.any() else 0.0
    if r["dead_rows"]:
        dead_out = out.float()[ref_dead]
        r["dead_rows_nonzero"] = int((dead_out != 0).sum())  # NaN counts as nonzero
    r["deterministic"] = bool(torch.equal(torch.nan_to_num(out, nan=12345.0),
                                          torch.nan_to_num(out2, nan=12345.0)))
    r["nan_out_second"] = int(torch.isnan(out2).sum())

    problems = []
    if nan_out or nan_lse or r["nan_out_second"]:
        problems.append(f"NaN (out {nan_out}, lse {nan_lse}, 2nd out {r['nan_out_second']}): unwritten or bad")
    if r["rel"] > REL_TOL[case.dtype]:
        problems.append(f"rel {r['rel']:.2e} > {REL_TOL[case.dtype]:.0e}")
    if r["max_abs"] > ABS_TOL[case.dtype]:
        problems.append(f"max_abs {r['max_abs']:.2e} > {ABS_TOL[case.dtype]:.0e}")
    if r["lse_dead_mismatch"]:
        problems.append(f"{r['lse_dead_mismatch']} rows disagree on lse=-inf")
    if r["lse_max_abs"] > LSE_ATOL:
        problems.append(f"lse err {r['lse_max_abs']:.2e} > {LSE_ATOL:.0e}")
    if r.get("dead_rows_nonzero"):
        problems.append(f"{r['dead_rows_nonzero']} nonzero outputs in fully masked rows")
    if not r["deterministic"]:
        problems.append("second launch differs (race?)")

    if case.sdpa:
        # The same attention through torch's own fused kernel, against the same
        # reference: the error a peer makes in this dtype (information only).
        try:
            peer = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=case.sdpa == "causal", enable_gqa=gqa).float()
            r["sdpa_max_abs"] = float((peer - ref).abs().max())
            r["sdpa_rel"] = float((peer - ref).norm()) / ref_norm if ref_norm > 0 else None
        except Exception as e:
            r["sdpa_error"] = f"{type(e).__name__}: {str(e)[:200]}"

    if compare_blocks and block_mask is not None:
        try:
            ours = block_mask.block_states()
            theirs = _torch_block_states(mask_mod, mask_batch, case.Lq, case.Lkv, dev)
            ours = ours.to(theirs.device).expand_as(theirs)
            # "yes": identical; "set": same blocks visited, full/partial split differs
            # (torch pads a ragged last block and calls it partial); "NO": other blocks visited.
            if torch.equal(ours, theirs):
                r["blocks_vs_torch"] = "yes"
            elif torch.equal(ours > 0, theirs > 0):
                r["blocks_vs_torch"] = "set"
            else:
                r["blocks_vs_torch"] = "NO"
            r["blocks_full_here_partial_torch"] = int(((ours == 2) & (theirs == 1)).sum())
            r["blocks_partial_here_full_torch"] = int(((ours == 1) & (theirs == 2)).sum())
            r["blocks_visited_here_not_torch"] = int(((ours > 0) & (theirs == 0)).sum())
            r["blocks_visited_torch_not_here"] = int(((ours == 0) & (theirs > 0)).sum())
        except Exception as e:  # torch may not support a mod / size here: information only
            r["blocks_vs_torch"] = "err"
            r["blocks_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    r["status"] = "FAIL" if problems else "PASS"
    r["problems"] = problems
    return r


# ---------------------------------------------------------------------------
# reporting

def fmt(x, spec):
    """``format(x, spec)``, or a dash padded to the same width."""
    width = int("".join(ch for ch in spec.split(".")[0] if ch.isdigit()) or 1)
    return "-".rjust(width) if x is None else format(x, spec)


def table(results) -> str:
    head = f"{'case':<24} {'status':<6} {'dtype':<8} {'shape (B,Hq/Hkv,Lq/Lkv,D)':<28} " \
           f"{'max_abs':>9} {'rel':>9} {'sdpa_rel':>9} {'lse_err':>9} {'dead':>5} {'det':>4} {'bm=torch':>8} " \
           f"{'1st s':>6}"
    lines = [head, "-" * len(head)]
    for r in results:
        if r["status"] == "SKIP":
            lines.append(f"{r['name']:<24} SKIP   ({r.get('note', '')})")
            continue
        if r["status"] == "ERROR":
            lines.append(f"{r['name']:<24} ERROR  {r.get('error', '')[:100]}")
            continue
        shape = f"{r.get('B')},{r.get('Hq')}/{r.get('Hkv')},{r.get('Lq')}/{r.get('Lkv')},{r.get('D')}"
        bm = r.get("blocks_vs_torch", "-")
        lines.append(f"{r['name']:<24} {r['status']:<6} {r.get('dtype', ''):<8} {shape:<28} "
                     f"{fmt(r.get('max_abs'), '9.2e')} {fmt(r.get('rel'), '9.2e')} {fmt(r.get('sdpa_rel'), '9.2e')} "
                     f"{fmt(r.get('lse_max_abs'), '9.2e')} {fmt(r.get('dead_rows'), '5d')} "
                     f"{('yes' if r.get('deterministic') else 'NO') if 'deterministic' in r else '-':>4} "
                     f"{bm:>8} {fmt(r.get('first_call_s'), '6.2f')}")
    counts = {s: sum(r["status"] == s for r in results) for s in ("PASS", "FAIL", "ERROR", "SKIP")}
    lines.append("gpu_check: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    for r in results:
        if r["status"] in ("FAIL", "ERROR"):
            lines.append(f"  {r['name']}: " + "; ".join(r.get("problems", [])) + r.get("error", ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU through the Triton interpreter")
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--budget", type=float, default=float(os.environ.get("GPU_CHECK_BUDGET_S", 150)),
                    help="seconds; cases not started by then are SKIPped (default 150)")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for gpu_check.json (default $OUT)")
    ap.add_argument("--no-torch-blocks", action="store_true", help="skip the block-layout comparison")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    args = ap.parse_args(argv)

    S = sizes(args.smoke)
    cases = make_cases(S)
    if args.list:
        print("\n".join(f"{c.name:<24} {c.note}" for c in cases))
        return 0
    if args.cases:
        wanted = [n.strip() for n in args.cases.split(",") if n.strip()]
        unknown = set(wanted) - {c.name for c in cases}
        if unknown:
            ap.error(f"unknown cases {sorted(unknown)}; --list shows them")
        cases = [c for c in cases if c.name in wanted]
    if S.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; use --smoke for the CPU run", file=sys.stderr)
        return 2
    # The reference must really be float32, not tf32.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    env = environment(S.device == "cuda", device=S.device, poison=os.environ.get("FLEXGEN_POISON"))
    print(f"gpu_check on {env['device_name']}: torch {env['torch']}, triton {env['triton']}, "
          f"budget {args.budget:.0f} s, {len(cases)} cases", flush=True)
    path = os.path.join(args.out, "gpu_check.json") if args.out else None
    if path:
        os.makedirs(args.out, exist_ok=True)
    signal.signal(signal.SIGTERM, _on_signal)

    t_start = time.monotonic()
    results = []
    try:
        for i, case in enumerate(cases):
            if time.monotonic() - t_start > args.budget:
                results.append(dict(name=case.name, status="SKIP", note="budget"))
                print(f"SKIP  {case.name} (budget)", flush=True)
                continue
            t0 = time.perf_counter()
            try:
                r = run_case(case, S, seed=1000 + i, compare_blocks=not args.no_torch_blocks)
            except Timeout:
                raise
            except Exception as e:
                if STOP:   # the signal arrived inside a library that wrapped it
                    raise Timeout(f"signal {STOP[0]}") from e
                r = dict(name=case.name, note=case.note, status="ERROR",
                         error=f"{type(e).__name__}: {str(e)[:300]}",
                         traceback=traceback.format_exc(limit=6))
            r["seconds"] = round(time.perf_counter() - t0, 2)
            results.append(r)
            if r["status"] == "ERROR":
                print(f"ERROR {case.name}: {r['error']}", flush=True)
            else:
                print(f"{r['status']:<5} {case.name:<24} max_abs {r['max_abs']:.2e} rel {r['rel']:.2e} "
                      f"lse {r['lse_max_abs']:.2e} ({r['seconds']:.1f} s)"
                      + ("" if r["status"] == "PASS" else "  <- " + "; ".join(r["problems"])), flush=True)
            if S.device == "cuda":
                torch.cuda.empty_cache()
            write_json(path, dict(env=env, tolerances=dict(rel=str(REL_TOL), abs=str(ABS_TOL), lse=LSE_ATOL),
                                  cases=results))
            if STOP:
                raise Timeout(f"signal {STOP[0]}")
    except (Timeout, KeyboardInterrupt) as e:
        print(f"gpu_check: stopped early ({e}); writing what was done", flush=True)
        done = {r["name"] for r in results}
        results += [dict(name=c.name, status="SKIP", note="stopped") for c in cases if c.name not in done]
    write_json(path, dict(env=env, tolerances=dict(rel=str(REL_TOL), abs=str(ABS_TOL), lse=LSE_ATOL),
                          cases=results, seconds=round(time.monotonic() - t_start, 1)))
    report(table(results), "GPU_CHECK_SUMMARY")
    return 1 if any(r["status"] in ("FAIL", "ERROR") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
