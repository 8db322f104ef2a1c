"""A learned relative-position bias: forward + backward with the bias's gradient, on a GPU.

    python benchmarks/bench_bias_grad.py        # H100: ~1 min

``score + bias[q_idx - kv_idx + L - 1]`` under a causal (optionally document) mask, bf16,
D=64, the bias float32 ``[2L - 1]`` with ``requires_grad``. Times flexgen's forward +
backward (``torch.autograd.grad`` of q, k, v and the bias) with and without
``torch.use_deterministic_algorithms(True)`` (fixed-point sums of the bias gradient:
``det cost`` = its time over the default's; ``bitwise`` = two deterministic runs equal),
the same call under ``kernel_options={"BACKEND": "gluon"}`` (the Gluon dQ kernel adding the
bias's gradient; ``gluon err``: its largest difference from AUTO's gradients, relative to
their largest entry), and torch's compiled ``flex_attention`` on the same mods where it
compiles (on the H100 with torch 2.11 its forward template asks for more shared memory than
the GPU has for this mod; the row then reads nan). Prints a table last; JSON to
``$OUT/bias_grad.json`` when set. ``--cases L:H:D:doc,...`` picks the cases.
"""
import json
import os
import sys

import torch
import triton

os.environ.pop("FLEXGEN_POISON", None)
import flexgen  # noqa: E402
from torch.nn.attention.flex_attention import create_block_mask as torch_cbm  # noqa: E402
from torch.nn.attention.flex_attention import flex_attention as torch_flex  # noqa: E402

CASES = "4096:8:64:0,4096:8:64:1,16384:16:64:0"   # L:H:D:documents


def bench(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=60)


def main() -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=CASES, help="comma list of L:H:D:documents (0 or 1)")
    cases = [tuple(int(x) for x in c.split(":")) for c in ap.parse_args().cases.split(",")]
    if not torch.cuda.is_available():
        print("bench_bias_grad: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = "cuda"
    rows = []
    for L, H, D, with_doc in cases:
        with_doc = bool(with_doc)
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, H, L, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        bias = torch.zeros(2 * L - 1, device=dev).normal_(0, 0.1).requires_grad_(True)
        docs = torch.arange(L, device=dev) // 1024

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + bias[q_idx - kv_idx + L - 1]

        def mask_mod(b, h, q_idx, kv_idx):
            keep = q_idx >= kv_idx
            return keep & (docs[q_idx] == docs[kv_idx]) if with_doc else keep

        go = torch.randn(1, H, L, D, device=dev, dtype=torch.bfloat16)
        fbm = flexgen.create_block_mask(mask_mod, 1, 1, L, L, device=dev)

        def run_flexgen(options=None):
            out = flexgen.flex_attention(q, k, v, score_mod=score_mod, block_mask=fbm, kernel_options=options)
            return torch.autograd.grad(out, (q, k, v, bias), go)

        def run_gluon():
            return run_flexgen({"BACKEND": "gluon"})

        got = run_flexgen()
        row = dict(L=L, H=H, D=D, doc=with_doc, flexgen_ms=bench(run_flexgen), torch_ms=float("nan"),
                   rel_err=[], gluon_ms=float("nan"), gluon_err=[])
        try:
            row["gluon_err"] = [round(float((a.float() - b.float()).abs().max() / b.float().abs().max()), 4)
                                for a, b in zip(run_gluon(), got)]
            row["gluon_ms"] = bench(run_gluon)
        except Exception as e:      # noqa: BLE001 - a row, not the end
            row["gluon_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        try:
            torch._dynamo.reset()
            compiled = torch.compile(torch_flex)
            tbm = torch_cbm(mask_mod, 1, 1, L, L, device=dev)

            def run_torch():
                out = compiled(q, k, v, score_mod=score_mod, block_mask=tbm)
                return torch.autograd.grad(out, (q, k, v, bias), go)

            want = run_torch()
            row["torch_ms"] = bench(run_torch)
            row["rel_err"] = [round(float((a.float() - b.float()).abs().max() / b.float().abs().max()), 4)
                              for a, b in zip(got, want)]
        except Exception as e:      # noqa: BLE001 - the peer's failure is a row, not the end
            row["torch_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        torch.use_deterministic_algorithms(True)
        try:
            first, second = run_flexgen(), run_flexgen()
            row["det_bitwise"] = all(torch.equal(a, b) for a, b in zip(first, second))
            row["det_ms"] = bench(run_flexgen)
        finally:
            torch.use_deterministic_algorithms(False)
        row["vs_torch"] = row["torch_ms"] / row["flexgen_ms"]
        row["det_cost"] = row["det_ms"] / row["flexgen_ms"]
        rows.append(row)
        print(row, flush=True)
    print("\n| L | H | D | doc | flexgen ms | gluon ms | gluon err | torch ms | vs torch | deterministic ms | det cost "
          "| bitwise | rel err q,k,v,bias |")
    for r in rows:
        print(f"| {r['L']} | {r['H']} | {r['D']} | {r['doc']} | {r['flexgen_ms']:.3f} | {r['gluon_ms']:.3f} | "
              f"{r['gluon_err']} | {r['torch_ms']:.3f} | {r['vs_torch']:.2f} | {r['det_ms']:.3f} | "
              f"{r['det_cost']:.2f} | {r['det_bitwise']} | {r['rel_err']} |")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bias_grad.json"), "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
