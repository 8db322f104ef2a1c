"""Continuous batching with a paged KV cache: requests arrive and finish at different steps,
prefill chunks and decode tokens share each step, RoPE is fused into the cache append; every
logit is checked against a run without any cache.

    python examples/continuous_batching.py            # CPU (Triton interpreter), about a minute
    python examples/continuous_batching.py --device cuda

The model is ``paged_generation.py``'s (2 layers, 4 query heads over 2 KV heads, head dim 16,
random weights). Each step takes, for every active request, either its next prompt chunk (at
most ``--chunk`` tokens: chunked prefill) or its last generated token, and runs the layers on
all of them at once: per layer one ``PagedKVCache.append(..., rope=RoPE(), query=q)`` (keys
rotated at their positions while written into their pages, the query rotated in the same
kernel) and one packed ``PagedKVCache.attention`` (a query ``[total, Hq, D]`` with per-slot
``q_lengths``: prefill chunks see their cached prefix, decode tokens their whole sequence). A
request whose prompt is done samples greedily; one that has its tokens leaves and frees its
pages and slot for the next arrival.

On CUDA, decode steps (every active request feeds one token) run in CUDA graphs, one per
set of slots (``DecodeGraphs``): the first such step of a set runs its body eagerly (kernels
compile, the cache makes its small index tensors), the second is captured, later ones
replay. Pages are reserved before a replay and the host's lengths brought along after it
(``PagedKVCache.advance``); inside, the append reads the positions from the cache's device
lengths and the attention takes the device lengths and a fixed bound (``max_kv_len`` = the
cache's capacity), so nothing in a step reads a length back to the host.
``--graphs off`` turns them off; ``--graphs eager`` runs the graph body without capturing
(what the CPU test checks).

The check: for each request, the model run without a cache on its final tokens (plain torch
attention, the same rotary embedding): the logits of every generated position must agree.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from paged_generation import (HEAD_DIM, HKV, HQ, LAYERS, VOCAB, build_model, finish_layer,  # noqa: E402
                              logits_of, logits_without_cache, rms_norm, to_device)

import flexgen  # noqa: E402
from flexgen.mods import causal_mask  # noqa: E402

# paged_generation.rotary is NeoX's rotate-half with base 10000 over the whole head dim.
ROPE = flexgen.RoPE(theta=10000.0)


class Request:
    def __init__(self, rid, arrival, prompt, new_tokens):
        self.rid, self.arrival, self.prompt, self.new_tokens = rid, arrival, prompt, new_tokens
        self.tokens = list(prompt)
        self.fed = 0                  # tokens already in the cache
        self.logits = []              # the logits that chose each generated token
        self.slot = None

    @property
    def done(self):
        return len(self.tokens) - len(self.prompt) >= self.new_tokens


def projections(layer, h):
    """q [B, Hq, L, Dh], k, v [B, Hkv, L, Dh] of h [B, L, d], not rotated (the append rotates)."""
    B, L, _ = h.shape
    x = rms_norm(h, layer["norm1"])
    return ((x @ layer["wq"]).view(B, L, HQ, HEAD_DIM).transpose(1, 2),
            (x @ layer["wk"]).view(B, L, HKV, HEAD_DIM).transpose(1, 2),
            (x @ layer["wv"]).view(B, L, HKV, HEAD_DIM).transpose(1, 2))


def step(model, caches, batch, chunk, device, decode=None):
    """One forward step over ``batch`` (requests with tokens to feed); records their logits.
    With ``decode`` (a DecodeGraphs), a step in which every request decodes goes through it."""
    if decode is not None and all(r.fed >= len(r.prompt) for r in batch):
        logits = decode.step(batch)
        for b, r in enumerate(batch):
            r.fed += 1
            r.logits.append(logits[b].cpu())
            r.tokens.append(int(logits[b].argmax()))
        return
    feeds = []
    for r in batch:
        if r.fed < len(r.prompt):
            feeds.append(r.prompt[r.fed:r.fed + chunk])        # the next prompt chunk
        else:
            feeds.append([r.tokens[-1]])                       # the last generated token
    counts = [len(f) for f in feeds]
    B, L = len(batch), max(counts)
    tokens = torch.zeros(B, L, dtype=torch.long)
    for b, f in enumerate(feeds):
        tokens[b, :len(f)] = torch.tensor(f)
    slots = [r.slot for r in batch]
    h = model["embed"][tokens.to(device)]
    for layer, cache in zip(model["layers"], caches):
        q, k, v = projections(layer, h)
        q = cache.append(slots, k, v, counts=counts, rope=ROPE, query=q)
        packed = torch.cat([q[b, :, :c].transpose(0, 1) for b, c in enumerate(counts)])
        attn = cache.attention(packed, slots, mask_mod=causal_mask, q_lengths=counts)
        padded = attn.new_zeros(B, L, HQ, HEAD_DIM)
        start = 0
        for b, c in enumerate(counts):
            padded[b, :c] = attn[start:start + c]
            start += c
        h = finish_layer(layer, h, padded.transpose(1, 2))
    last = torch.tensor(counts, device=device) - 1
    logits = logits_of(model, h[torch.arange(B, device=device), last])
    for b, r in enumerate(batch):
        r.fed += counts[b]
        if r.fed >= len(r.prompt):                             # prompt done: this row samples
            r.logits.append(logits[b].cpu())
            r.tokens.append(int(logits[b].argmax()))


class DecodeGraphs:
    """Decode steps in CUDA graphs, one graph per tuple of slots (``capture=False``: the same
    body, run eagerly every time). A graph reads the cache's tensors and the slots' rows of its
    page table and lengths, never a request: it serves whichever requests hold those slots."""

    def __init__(self, model, caches, device, capture=True):
        self.model, self.caches, self.device, self.capture = model, caches, device, capture
        self.graphs = {}            # slots -> (graph, token buffer, logits, rows)
        self.warm = set()           # slots whose body ran eagerly once
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.replays = 0

    def body(self, slots, tokens, rows):
        """The step on device tensors only: tokens [B, 1], rows [B] (int64 slots)."""
        h = self.model["embed"][tokens]
        for layer, cache in zip(self.model["layers"], self.caches):
            q, k, v = projections(layer, h)
            q = cache.append(slots, k, v, rope=ROPE, query=q)
            # The device lengths and a fixed bound: the launch does not depend on this step's lengths.
            attn = flexgen.decode_attention(q, cache.k_cache, cache.v_cache, enable_gqa=True,
                                            kv_lengths=cache.lengths[rows], page_table=cache.page_table[rows],
                                            mask_mod=causal_mask, max_kv_len=cache.max_seq_len)
            h = finish_layer(layer, h, attn)
        return logits_of(self.model, h[:, 0])

    def step(self, batch):
        """Logits [B, VOCAB] of one decode step of ``batch``; the caches advance by one token each."""
        slots = tuple(r.slot for r in batch)
        for cache in self.caches:       # pages first: a replay cannot allocate
            cache.reserve(slots, [cache.length(s) + 1 for s in slots])
        tokens = torch.tensor([[r.tokens[-1]] for r in batch], device=self.device)
        hit = self.graphs.get(slots)
        if hit is not None:
            graph, static_tokens, logits, _ = hit
            static_tokens.copy_(tokens)
            graph.replay()
            self.replays += 1
            for cache in self.caches:   # the replay ran no Python: the host lengths follow
                cache.advance(slots, [1] * len(slots))
            return logits
        rows = torch.tensor(slots, dtype=torch.long, device=self.device)
        if not self.capture or slots not in self.warm:
            self.warm.add(slots)
            return self.body(list(slots), tokens, rows)
        # Captured, then replayed at once: the capture ran the host part (the appends' host
        # lengths), the replay the kernels.
        graph = torch.cuda.CUDAGraph()
        static_tokens = tokens.clone()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.body(list(slots), static_tokens, rows)
        self.graphs[slots] = (graph, static_tokens, logits, rows)      # (rows: the graph reads it)
        graph.replay()
        self.replays += 1
        return logits


def serve(model, requests, device, chunk, max_batch, page_size=16, graphs="auto"):
    """Serve ``requests`` to the end: (steps, steps mixing prefill and decode, the DecodeGraphs or None)."""
    longest = max(len(r.prompt) + r.new_tokens for r in requests)
    pages = -(-longest // page_size)
    caches = [flexgen.PagedKVCache(num_pages=max_batch * pages, page_size=page_size, num_kv_heads=HKV,
                                   head_dim=HEAD_DIM, max_batch=max_batch, max_pages_per_seq=pages,
                                   dtype=torch.float32, device=device) for _ in range(LAYERS)]
    decode = None
    if graphs == "eager" or (graphs == "auto" and device.type == "cuda"):
        decode = DecodeGraphs(model, caches, device, capture=graphs == "auto")
    waiting = sorted(requests, key=lambda r: r.arrival)
    active, steps, mixed = [], 0, 0
    while waiting or active:
        while waiting and waiting[0].arrival <= steps and len(active) < max_batch:
            r = waiting.pop(0)
            r.slot = caches[0].add_sequence()
            assert all(c.add_sequence() == r.slot for c in caches[1:])
            active.append(r)
        if active:
            prefill = sum(r.fed < len(r.prompt) for r in active)
            mixed += 0 < prefill < len(active)
            step(model, caches, active, chunk, device, decode)
        for r in [r for r in active if r.done]:
            for c in caches:
                c.free(r.slot)
            active.remove(r)
            print(f"  step {steps:>2}: request {r.rid} done ({len(r.prompt)} prompt + {r.new_tokens} new tokens)")
        steps += 1
    return steps, mixed, decode


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--chunk", type=int, default=16, help="prompt tokens per request per step")
    ap.add_argument("--max-batch", type=int, default=3, help="requests served at once")
    ap.add_argument("--requests", type=int, default=6, help="how many of the six requests to serve")
    ap.add_argument("--graphs", default="auto", choices=("auto", "off", "eager"),
                    help="decode steps in CUDA graphs (auto: on CUDA only), or not, or their body eagerly")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    model = build_model()
    rng = random.Random(3)
    # (arrival step, prompt length, tokens to generate)
    plan = [(0, 23, 6), (0, 5, 9), (3, 12, 7), (1, 40, 4), (4, 1, 5), (6, 30, 3)][:args.requests]
    requests = [Request(i, a, [rng.randrange(VOCAB) for _ in range(n)], g) for i, (a, n, g) in enumerate(plan)]
    t0 = time.perf_counter()
    with torch.no_grad():
        steps, mixed, decode = serve(to_device(model, device), requests, device, args.chunk, args.max_batch,
                             graphs=args.graphs)
    seconds = time.perf_counter() - t0
    worst = 0.0
    for r in requests:
        want = logits_without_cache(model, r.tokens)[len(r.prompt) - 1:len(r.prompt) - 1 + r.new_tokens]
        got = torch.stack(r.logits)
        worst = max(worst, (got - want).abs().max().item())
    ok = worst < 1e-3
    graphed = "" if decode is None else (f", {decode.replays} decode steps replayed from {len(decode.graphs)} "
                                         "CUDA graphs" if decode.capture else ", decode steps through the graph body")
    print(f"{len(requests)} requests in {steps} steps ({mixed} mixing prefill and decode{graphed}) on {device}: "
          f"{seconds:.1f} s; max |logit difference| vs no cache: {worst:.2e} -> {'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
