"""The flexgen demo: generate a kernel from two small mods, run it, check it.

Runs on a GPU when there is one, else on CPU through the Triton interpreter.
    python examples/demo.py
"""
import time

import torch

import flexgen
from flexgen.mods import and_masks, causal_mask, document_mask, tanh_softcap
from flexgen.reference import flex_attention_reference


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    B, Hq, Hkv, L, D = 2, 4, 2, 300, 64           # GQA, a length that is no multiple of the block
    q = torch.randn(B, Hq, L, D, device=device, dtype=torch.bfloat16)
    k = torch.randn(B, Hkv, L, D, device=device, dtype=torch.bfloat16)
    v = torch.randn(B, Hkv, L, D, device=device, dtype=torch.bfloat16)

    # Two packed documents per sequence, causal inside each, scores soft-capped at 30.
    doc_ids = (torch.arange(L, device=device) >= 170).int().expand(B, L).contiguous()
    mask_mod = and_masks(causal_mask, document_mask(doc_ids))
    score_mod = tanh_softcap(30.0)

    start = time.perf_counter()
    block_mask = flexgen.create_block_mask(mask_mod, B, None, L, L, device=device, BLOCK_SIZE=64)
    out, lse = flexgen.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                      enable_gqa=True, return_lse=True)
    elapsed = time.perf_counter() - start
    print(block_mask)
    print(f"generated, compiled and ran the kernel in {elapsed:.2f} s on {device}")

    ref, ref_lse = flex_attention_reference(q, k, v, score_mod, mask_mod, enable_gqa=True,
                                            return_lse=True, dtype=torch.float64)
    err = (out.double() - ref).abs().max().item()
    lse_err = (lse.double() - ref_lse).abs().max().item()
    print(f"max |out - float64 reference| = {err:.2e}, max |lse - reference| = {lse_err:.2e}")

    source = flexgen.kernel_source(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True)
    line = next(i for i, text in enumerate(source.splitlines()) if "score = qk * SM_SCALE" in text)
    print("the generated score_mod, as the kernel applies it:")
    print("\n".join(source.splitlines()[line:line + 3]))
    if err > 2e-2 or lse_err > 1e-2:
        raise SystemExit("FAILED: the kernel disagrees with the reference")
    print("OK")


if __name__ == "__main__":
    main()
