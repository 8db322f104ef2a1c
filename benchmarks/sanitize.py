"""Run flexgen's kernel families on a GPU, small, for compute-sanitizer.

    compute-sanitizer --tool memcheck --error-exitcode 9 python benchmarks/sanitize.py [--only forward,...]
    compute-sanitizer --tool racecheck python benchmarks/sanitize.py --only race

Each case runs once on fresh random inputs and is checked against the float64 oracle
(a sanitizer finds bad accesses; the check finds wrong answers that stay in bounds). The
grid covers what the CPU suite covers, at sizes a sanitizer gets through in minutes: odd
and block-multiple lengths, GQA, head dims 64 / 80 / 128, no mask, causal, sliding window,
documents, fully masked rows, learned biases (backward), decode (contiguous and paged),
sigmoid and linear attention, the block-mask kernel and the paged write. The fuzzer's
stored and seeded examples run under memcheck as their own pytest run on the GPU
(``FLEXGEN_FUZZ_DEVICE=cuda pytest tests/test_fuzz.py``; ``benchmarks/run_all.sh``, step
sanitize). ``--only race`` runs one forward and one backward kernel (racecheck is slow).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

os.environ.setdefault("FLEXGEN_POISON", "1")

import torch  # noqa: E402

import flexgen  # noqa: E402
from flexgen import mods as M  # noqa: E402
from flexgen.reference import flex_attention_reference  # noqa: E402

DEV = torch.device("cuda")
RESULTS = []


def case(name, fn):
    t0 = time.perf_counter()
    try:
        err = fn()
        torch.cuda.synchronize()
        RESULTS.append((name, "PASS" if err is None or err < 3e-2 else "FAIL", err, time.perf_counter() - t0))
    except Exception as e:      # noqa: BLE001 - reported, the grid goes on
        traceback.print_exc()
        RESULTS.append((name, f"ERROR {type(e).__name__}: {str(e)[:120]}", None, time.perf_counter() - t0))


def rel(got, want):
    got, want = got.double().cpu(), want.double().cpu()
    if torch.isnan(got).any():
        return float("inf")
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))


def qkv(B, Hq, Hkv, Lq, Lkv, D, grad=False, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(Lq * 131 + Lkv + D)
    out = [torch.randn(B, h, L, D, generator=g).to(DEV, dtype) for h, L in ((Hq, Lq), (Hkv, Lkv), (Hkv, Lkv))]
    return [t.requires_grad_() for t in out] if grad else out


def forward_cases():
    docs = torch.randint(0, 3, (2, 256)).sort(-1).values.to(DEV)
    for L, D in ((129, 64), (256, 128), (200, 80)):
        for mname, mask in (("none", None), ("causal", M.causal_mask), ("window", M.sliding_window(50)),
                            ("document", M.document_mask(docs[:, :L])),
                            ("dead rows", lambda b, h, q, kv: (q >= kv) & (q % 7 != 3))):
            for sname, score in (("none", None), ("softcap", M.tanh_softcap(20.0)), ("alibi", M.alibi(4))):
                def run(L=L, D=D, mask=mask, score=score):
                    q, k, v = qkv(2, 4, 2, L, L, D)
                    bm = None if mask is None else flexgen.create_block_mask(mask, 2, None, L, L, device=DEV)
                    out = flexgen.flex_attention(q, k, v, score_mod=score, block_mask=bm, enable_gqa=True)
                    return rel(out, flex_attention_reference(q, k, v, score, mask, enable_gqa=True))
                case(f"forward L={L} D={D} {mname} {sname}", run)


def backward_cases():
    for L, D in ((129, 64), (256, 128)):
        for mname, mask in (("none", None), ("causal", M.causal_mask)):
            def run(L=L, D=D, mask=mask):
                q, k, v = qkv(1, 4, 2, L, L, D, grad=True)
                table = torch.randn(4, 2 * L - 1, device=DEV, requires_grad=True)
                score = M.relative_position_bias(table, L)
                bm = None if mask is None else flexgen.create_block_mask(mask, None, None, L, L, device=DEV)
                out = flexgen.flex_attention(q, k, v, score_mod=score, block_mask=bm, enable_gqa=True)
                got = torch.autograd.grad(out.float().square().sum(), (q, k, v, table))
                ref = flex_attention_reference(q, k, v, score, mask, enable_gqa=True)
                want = torch.autograd.grad(ref.square().sum(), (q, k, v, table))
                return max(rel(a, b) for a, b in zip(got, want))
            case(f"backward L={L} D={D} {mname} learned table", run)


def decode_cases():
    for L in (130, 1000):
        def run(L=L):
            q, k, v = qkv(3, 8, 2, 1, L, 128)
            lengths = torch.tensor([L, L // 2, 1], device=DEV, dtype=torch.int32)
            out = flexgen.decode_attention(q, k, v, score_mod=M.tanh_softcap(9.0), enable_gqa=True,
                                           kv_lengths=lengths)
            errs = []
            for b, n in enumerate(lengths.tolist()):
                want = flex_attention_reference(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n],
                                                M.tanh_softcap(9.0), enable_gqa=True)
                errs.append(rel(out[b:b + 1], want))
            return max(errs)
        case(f"decode contiguous L={L}", run)

    def paged():
        cache = flexgen.PagedKVCache(num_pages=32, page_size=16, num_kv_heads=2, head_dim=64, max_batch=3,
                                     max_pages_per_seq=12, dtype=torch.bfloat16, device=DEV)
        slots = [cache.add_sequence() for _ in range(3)]
        k, v = qkv(3, 2, 2, 150, 150, 64)[1:]
        cache.append(slots, k, v, counts=[150, 70, 5])
        q = qkv(3, 8, 2, 1, 1, 64)[0]
        out = cache.attention(q, slots, mask_mod=M.causal_mask)
        errs = []
        for b, n in enumerate((150, 70, 5)):
            want = flex_attention_reference(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], enable_gqa=True)
            errs.append(rel(out[b:b + 1], want))
        return max(errs)
    case("decode paged (write + attention)", paged)


def other_cases():
    def block_mask_kernel():
        from flexgen.masks import mask_eval
        old, mask_eval.TORCH_MAX_ELEMENTS = mask_eval.TORCH_MAX_ELEMENTS, -1      # force the kernel
        try:
            ids = torch.randint(0, 5, (777,), device=DEV).sort().values
            bm = flexgen.create_block_mask(M.document_mask(ids), None, None, 777, 777, device=DEV)
            dense = flexgen.create_mask(M.document_mask(ids), 1, 1, 777, 777, device=DEV)
            q, k, v = qkv(1, 2, 2, 777, 777, 64)
            out = flexgen.flex_attention(q, k, v, block_mask=bm)
            return rel(out, flex_attention_reference(q, k, v, mask_mod=lambda b, h, qi, kv: dense[0, 0][qi, kv]))
        finally:
            mask_eval.TORCH_MAX_ELEMENTS = old
    case("block-mask kernel (documents)", block_mask_kernel)

    def sigmoid():
        q, k, v = qkv(1, 4, 4, 200, 200, 64, grad=True)
        bm = flexgen.create_block_mask(M.causal_mask, None, None, 200, 200, device=DEV)
        out = flexgen.sigmoid_attention(q, k, v, block_mask=bm)
        got = torch.autograd.grad(out.float().sum(), (q, k, v))
        from flexgen.reference import sigmoid_attention_reference
        ref = sigmoid_attention_reference(q, k, v, mask_mod=M.causal_mask)
        want = torch.autograd.grad(ref.sum(), (q, k, v))
        return max([rel(out, ref)] + [rel(a, b) for a, b in zip(got, want)])
    case("sigmoid forward + backward", sigmoid)

    def linear():
        q, k, v = (t.detach().float().requires_grad_() for t in qkv(1, 4, 4, 300, 300, 64))
        slopes = torch.linspace(0.01, 0.2, 4, device=DEV)
        decay = lambda b, h, t: -slopes[h]            # noqa: E731
        out = flexgen.linear_attention(q, k, v, decay_mod=decay)
        got = torch.autograd.grad(out.sum(), (q, k, v))
        from flexgen.reference import linear_attention_reference
        ref = linear_attention_reference(q, k, v, decay_mod=decay)
        want = torch.autograd.grad(ref.sum(), (q, k, v))
        return max([rel(out, ref)] + [rel(a, b) for a, b in zip(got, want)])
    case("linear forward + backward", linear)


def race_cases():
    q, k, v = qkv(1, 2, 2, 256, 256, 64, grad=True)
    bm = flexgen.create_block_mask(M.causal_mask, None, None, 256, 256, device=DEV)
    table = torch.randn(2, 511, device=DEV, requires_grad=True)
    score = M.relative_position_bias(table, 256)

    def fwd():
        out = flexgen.flex_attention(q, k, v, score_mod=score, block_mask=bm)
        return rel(out, flex_attention_reference(q, k, v, score, M.causal_mask))

    def bwd():
        out = flexgen.flex_attention(q, k, v, score_mod=score, block_mask=bm)
        got = torch.autograd.grad(out.float().square().sum(), (q, k, v, table))
        ref = flex_attention_reference(q, k, v, score, M.causal_mask)
        want = torch.autograd.grad(ref.square().sum(), (q, k, v, table))
        return max(rel(a, b) for a, b in zip(got, want))
    case("race: forward", fwd)
    case("race: backward", bwd)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="forward,backward,decode,other")
    args = parser.parse_args()
    parts = dict(forward=forward_cases, backward=backward_cases, decode=decode_cases, other=other_cases,
                 race=race_cases)
    for part in args.only.split(","):
        parts[part]()
    bad = [r for r in RESULTS if r[1] != "PASS" and not r[1].startswith("SKIP")]
    print(f"\nsanitize: {len(RESULTS)} cases, {len(bad)} not passing")
    for name, status, err, secs in RESULTS:
        print(f"  {status:<10} {name:<48} {'' if err is None else f'{err:.2e}':>9} {secs:6.1f} s")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
