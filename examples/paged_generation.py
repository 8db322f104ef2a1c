"""Generate text with a paged KV cache, and check every logit against a run without one.

    python examples/paged_generation.py            # CPU (Triton interpreter), under a minute
    python examples/paged_generation.py --device cuda

A small decoder-only transformer with random weights (2 layers, 4 query heads
over 2 KV heads, head dim 16, rotary positions, RMSNorm, SwiGLU) is built
locally. A batch of three prompts of different lengths is prefilled in one
padded call per layer (``PagedKVCache.append`` with per-row ``counts``, then
``PagedKVCache.attention`` with a causal mask and per-row ``q_lengths``), and
32 tokens are generated greedily, one ``append`` + ``attention`` (q_len = 1)
per layer per step. The cache's pages are handed out in a shuffled order, so
no sequence is contiguous in memory.

The check: the same model run without any cache, recomputing each sequence
in full with plain torch attention (``F.scaled_dot_product_attention``,
causal) on the tokens the paged run produced; the logits of every generated
position must agree.
"""
from __future__ import annotations

import argparse
import math
import random
import sys
import time

import torch
import torch.nn.functional as F

from flexgen.mods import causal_mask
from flexgen.kernels.paged import PagedKVCache

VOCAB, D_MODEL, LAYERS, HQ, HKV, HEAD_DIM, FFN = 256, 64, 2, 4, 2, 16, 128


def build_model(seed=0):
    """Random weights (float32) as a dict of tensors."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape, scale=None):
        return torch.randn(*shape, generator=g) * (scale or 1 / math.sqrt(shape[0]))

    layers = [dict(norm1=torch.ones(D_MODEL), wq=w(D_MODEL, HQ * HEAD_DIM), wk=w(D_MODEL, HKV * HEAD_DIM),
                   wv=w(D_MODEL, HKV * HEAD_DIM), wo=w(HQ * HEAD_DIM, D_MODEL), norm2=torch.ones(D_MODEL),
                   w_gate=w(D_MODEL, FFN), w_up=w(D_MODEL, FFN), w_down=w(FFN, D_MODEL))
              for _ in range(LAYERS)]
    return dict(embed=w(VOCAB, D_MODEL, scale=1.0), layers=layers, norm=torch.ones(D_MODEL),
                head=w(D_MODEL, VOCAB))


def to_device(model, device):
    return {k: ([{n: t.to(device) for n, t in layer.items()} for layer in v] if k == "layers" else v.to(device))
            for k, v in model.items()}


def rms_norm(x, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


def rotary(x, positions):
    """Rotate-half rotary embedding. x [B, H, L, Dh], positions [B, L] (int)."""
    half = HEAD_DIM // 2
    freq = 10000.0 ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angle = positions[:, None, :, None].float() * freq          # [B, 1, L, half]
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


def qkv(layer, h, positions):
    B, L, _ = h.shape
    x = rms_norm(h, layer["norm1"])
    q = (x @ layer["wq"]).view(B, L, HQ, HEAD_DIM).transpose(1, 2)
    k = (x @ layer["wk"]).view(B, L, HKV, HEAD_DIM).transpose(1, 2)
    v = (x @ layer["wv"]).view(B, L, HKV, HEAD_DIM).transpose(1, 2)
    return rotary(q, positions), rotary(k, positions), v


def finish_layer(layer, h, attn):
    B, _, L, _ = attn.shape
    h = h + attn.transpose(1, 2).reshape(B, L, HQ * HEAD_DIM) @ layer["wo"]
    x = rms_norm(h, layer["norm2"])
    return h + (F.silu(x @ layer["w_gate"]) * (x @ layer["w_up"])) @ layer["w_down"]


def logits_of(model, h):
    return rms_norm(h, model["norm"]) @ model["head"]


# --- with the paged cache ----------------------------------------------------------------
def generate_paged(model, prompts, new_tokens, device, page_size=16):
    """Greedy generation; returns (tokens per sequence, logits [B, new_tokens, VOCAB]) of each step."""
    B = len(prompts)
    longest = max(len(p) for p in prompts) + new_tokens
    pages_per_seq = -(-longest // page_size)
    caches = []
    for layer in range(LAYERS):
        cache = PagedKVCache(num_pages=B * pages_per_seq + 2, page_size=page_size, num_kv_heads=HKV,
                             head_dim=HEAD_DIM, max_batch=B, max_pages_per_seq=pages_per_seq,
                             dtype=torch.float32, device=device)
        random.Random(layer).shuffle(cache._free_pages)         # scattered pages, on purpose
        caches.append(cache)
    slots = [caches[0].add_sequence() for _ in range(B)]
    for cache in caches[1:]:
        assert [cache.add_sequence() for _ in range(B)] == slots

    # Prefill: one padded batch, per-row lengths.
    lengths = [len(p) for p in prompts]
    L = max(lengths)
    tokens = torch.zeros(B, L, dtype=torch.long)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = torch.tensor(p)
    tokens = tokens.to(device)
    positions = torch.arange(L, device=device).expand(B, L)
    h = model["embed"][tokens]
    for layer, cache in zip(model["layers"], caches):
        q, k, v = qkv(layer, h, positions)
        cache.append(slots, k, v, counts=lengths)
        attn = cache.attention(q, slots, mask_mod=causal_mask, q_lengths=lengths)
        h = finish_layer(layer, h, attn)
    last = torch.tensor(lengths, device=device) - 1
    step_logits = [logits_of(model, h[torch.arange(B, device=device), last])]
    out_tokens = [list(p) for p in prompts]

    # Decode: one token per sequence per step; the queries sit at the end of each sequence.
    for step in range(new_tokens):
        nxt = step_logits[-1].argmax(-1)
        for b in range(B):
            out_tokens[b].append(int(nxt[b]))
        if step == new_tokens - 1:
            break
        pos = torch.tensor([caches[0].length(s) for s in slots], device=device)[:, None]
        h = model["embed"][nxt][:, None, :]
        for layer, cache in zip(model["layers"], caches):
            q, k, v = qkv(layer, h, pos)
            cache.append(slots, k, v)
            h = finish_layer(layer, h, cache.attention(q, slots))
        step_logits.append(logits_of(model, h[:, 0]))
    return out_tokens, torch.stack(step_logits, 1)


# --- without any cache: full recompute per sequence ----------------------------------------
def logits_without_cache(model, tokens):
    """Logits [L, VOCAB] at every position of one sequence, plain torch attention."""
    t = torch.tensor(tokens)[None]
    L = t.shape[1]
    h = model["embed"][t]
    positions = torch.arange(L)[None]
    for layer in model["layers"]:
        q, k, v = qkv(layer, h, positions)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        h = finish_layer(layer, h, attn)
    return logits_of(model, h)[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False

    model = build_model()
    rng = random.Random(1)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (7, 19, 33)]
    t0 = time.perf_counter()
    with torch.no_grad():
        tokens, logits = generate_paged(to_device(model, device), prompts, args.new_tokens, device)
    t_paged = time.perf_counter() - t0

    worst = 0.0
    for b, p in enumerate(prompts):
        want = logits_without_cache(model, tokens[b])             # every position of the full sequence
        got = logits[b].cpu()                                      # the steps that produced new tokens
        ref = want[len(p) - 1:len(p) - 1 + args.new_tokens]
        worst = max(worst, (got - ref).abs().max().item())
        same = bool((ref.argmax(-1) == got.argmax(-1)).all())
        print(f"sequence {b}: prompt {len(p):>2} tokens + {args.new_tokens} generated; "
              f"greedy choices agree: {same}; first new tokens {tokens[b][len(p):len(p) + 8]}")
    ok = worst < 1e-3
    print(f"paged generation on {device}: {t_paged:.1f} s; max |logit difference| vs no cache: "
          f"{worst:.2e} -> {'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
