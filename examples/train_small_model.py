"""Train a tiny transformer whose attention is a flexgen kernel, forward and backward.

The attention variant: causal (a block mask), grouped-query (2 query heads
sharing 1 key/value head), scores soft-capped at 20 and a *learned* relative
position bias per head (``table[h, q_idx - kv_idx + L - 1]``). flexgen derives
the backward of that score_mod with sympy: the soft-cap's derivative scales
the score gradients, and the bias table's gradient is scattered by the dQ
kernel (every score on one diagonal adds to one entry). No backward is written
here.

The task: sequences of random tokens that repeat with period 7, so token t
equals token t - 7 once the first period is seen; the learned bias finds the
distance. The script

1. checks that the first step's gradients (every parameter, the bias table
   included) match those of the same model with attention computed by the
   plain-torch reference (``flexgen.reference``, float64), and
2. trains for a few steps and checks that the loss falls.

Runs on a GPU when there is one, else on CPU through the Triton interpreter
(well under a minute).
    python examples/train_small_model.py
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

import flexgen
from flexgen.mods import causal_mask
from flexgen.reference import flex_attention_reference

VOCAB, PERIOD = 16, 7
L, DIM, HEADS, KV_HEADS = 48, 64, 2, 1
HEAD_DIM = DIM // HEADS
SOFTCAP = 20.0


def flexgen_attention(q, k, v, score_mod, block_mask):
    return flexgen.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                  enable_gqa=True)


def reference_attention(q, k, v, score_mod, block_mask):
    out = flex_attention_reference(q, k, v, score_mod, block_mask, enable_gqa=True)
    return out.to(q.dtype)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.kv = nn.Linear(DIM, 2 * KV_HEADS * HEAD_DIM, bias=False)
        self.out = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)
        # One learned bias per head and relative distance (2L - 1 of them).
        self.rel = nn.Parameter(torch.zeros(HEADS, 2 * L - 1))
        rel = self.rel

        def softcap_relative_bias(score, b, h, q_idx, kv_idx):
            return SOFTCAP * torch.tanh(score / SOFTCAP) + rel[h, q_idx - kv_idx + L - 1]

        self.score_mod = softcap_relative_bias

    def forward(self, x, block_mask, attention):
        B, T, _ = x.shape
        q = self.q(x).view(B, T, HEADS, HEAD_DIM).transpose(1, 2)
        k, v = self.kv(x).view(B, T, 2, KV_HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        y = attention(q, k, v, self.score_mod, block_mask)          # [B, HEADS, T, HEAD_DIM]
        return self.out(y.transpose(1, 2).reshape(B, T, HEADS * HEAD_DIM))


class TinyLM(nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Attention() for _ in range(layers))
        self.mlps = nn.ModuleList(nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, 2 * DIM), nn.GELU(),
                                                nn.Linear(2 * DIM, DIM)) for _ in range(layers))
        self.norms = nn.ModuleList(nn.LayerNorm(DIM) for _ in range(layers))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens, block_mask, attention):
        x = self.embed(tokens)
        for norm, attn, mlp in zip(self.norms, self.blocks, self.mlps):
            x = x + attn(norm(x), block_mask, attention)
            x = x + mlp(x)
        return self.head(x)


def batch(generator, size, device):
    """Random tokens repeating with period PERIOD: inputs and next-token targets."""
    start = torch.randint(0, VOCAB, (size, PERIOD), generator=generator)
    seq = start.repeat(1, (L + 1) // PERIOD + 1)[:, :L + 1].to(device)
    return seq[:, :-1], seq[:, 1:]


def loss_fn(model, tokens, targets, block_mask, attention):
    logits = model(tokens, block_mask, attention)
    # Only positions past the first period are predictable.
    return F.cross_entropy(logits[:, PERIOD:].reshape(-1, VOCAB), targets[:, PERIOD:].reshape(-1))


def main(steps=20, batch_size=4):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    block_mask = flexgen.create_block_mask(causal_mask, None, None, L, L, device=device,
                                           BLOCK_SIZE=64 if device == "cpu" else 128)
    model = TinyLM().to(device)
    with torch.no_grad():   # start the biases off zero: their gradients then differ more
        for blk in model.blocks:
            blk.rel.normal_(0.0, 0.1)
    # A second copy (its score_mods capture its own tables) for the reference attention.
    reference = TinyLM().to(device)
    reference.load_state_dict(model.state_dict())

    # 1. The first step's gradients against the reference attention.
    tokens, targets = batch(gen, batch_size, device)
    loss_fn(model, tokens, targets, block_mask, flexgen_attention).backward()
    loss_fn(reference, tokens, targets, block_mask, reference_attention).backward()
    worst = 0.0
    for (name, p), p_ref in zip(model.named_parameters(), reference.parameters()):
        scale = p_ref.grad.abs().max().clamp_min(1e-6)
        worst = max(worst, float((p.grad - p_ref.grad).abs().max() / scale))
    print(f"first-step gradients vs reference: max relative difference {worst:.2e} "
          f"(rel-bias grad norm {model.blocks[0].rel.grad.norm():.3e})")
    assert worst < 1e-3, "flexgen's gradients differ from the reference's"

    # 2. Train.
    model.zero_grad()
    # The bias tables learn fastest with a larger step: they pick the distance to copy from.
    tables = [p for name, p in model.named_parameters() if name.endswith(".rel")]
    others = [p for name, p in model.named_parameters() if not name.endswith(".rel")]
    optimizer = torch.optim.AdamW([{"params": others, "lr": 1e-2},
                                   {"params": tables, "lr": 0.1, "weight_decay": 0.0}])
    losses, start = [], time.perf_counter()
    for step in range(steps):
        tokens, targets = batch(gen, batch_size, device)
        loss = loss_fn(model, tokens, targets, block_mask, flexgen_attention)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step % 5 == 0 or step == steps - 1:
            print(f"step {step:3d}  loss {loss.item():.4f}")
    print(f"{steps} steps in {time.perf_counter() - start:.1f} s on {device}")
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.5 * first, f"the loss did not fall: {first:.3f} -> {last:.3f}"
    print(f"loss fell from {first:.3f} to {last:.3f}")


if __name__ == "__main__":
    main()
