"""Train a small transformer with its sequence split over 2 processes (context parallelism).

Every process holds one shard of each sequence (``flexgen.distributed.shard``, the
load-balanced layout); attention is ``flexgen.distributed.context_parallel_attention``:
the key/value shards travel between the processes while the local kernels run, and
the backward pass sends the key/value gradients back to their owners. The model is
wrapped in ``DistributedDataParallel`` (or FSDP2's ``fully_shard`` with ``--wrap fsdp``),
which averages the parameter gradients over the processes; with every process holding
the same number of tokens that average is exactly the gradient of the loss over the
whole sequence.

The attention: packed documents (a document mask over global positions, document
borders falling inside shards) with a causal mask, grouped-query heads, and a
*learned* relative-position bias per head (a captured parameter: flexgen derives its
gradient; each process gets its queries' share and DDP sums it like any parameter).
Positions are global: ``shard_positions`` gives each token its place in the sequence.

The script checks that each step's loss equals, to float32 rounding, the loss of the
same model trained in ONE process on the whole sequence (``flexgen.flex_attention``).

    python examples/context_parallel_train.py          # spawns 2 processes (gloo on CPU)
    python examples/context_parallel_train.py --wrap both     # DDP, then FSDP2
    torchrun --nproc_per_node 2 examples/context_parallel_train.py   # NCCL on 2 GPUs

On CPU the kernels run through the Triton interpreter (a minute or so).
"""
from __future__ import annotations

import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import flexgen
from flexgen.distributed import context_parallel_attention, shard, shard_positions
from flexgen.mods import and_masks, causal_mask, doc_ids_from_lengths, document_mask

VOCAB, DIM, HEADS, KV_HEADS, LAYERS = 32, 32, 2, 1, 2
HEAD_DIM = DIM // HEADS
WORLD = 2
L = 2 * WORLD * 24                   # 96 tokens: 2 * world chunks of 24 (not a multiple of the block)
DOCS = [30, 41, 25]                  # document lengths: borders inside shards
STEPS = 3


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.kv = nn.Linear(DIM, 2 * KV_HEADS * HEAD_DIM, bias=False)
        self.out = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)
        self.rel = nn.Parameter(torch.zeros(HEADS, 2 * L - 1))    # bias per head and distance

    def forward(self, x, attend):
        B, n, _ = x.shape
        q = self.q(x).view(B, n, HEADS, HEAD_DIM).transpose(1, 2)
        k, v = self.kv(x).view(B, n, 2, KV_HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        rel = self.rel

        def relative_bias(score, b, h, q_idx, kv_idx):     # global positions, under CP too
            return score + rel[h, q_idx - kv_idx + L - 1]
        y = attend(q, k, v, relative_bias)
        return self.out(y.transpose(1, 2).reshape(B, n, DIM))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(L, DIM)
        self.attn = nn.ModuleList(Attention() for _ in range(LAYERS))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
                                 for _ in range(LAYERS))
        self.norms = nn.ModuleList(nn.LayerNorm(DIM) for _ in range(2 * LAYERS))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens, positions, attend):
        x = self.embed(tokens) + self.pos(positions.long())
        for i, (attn, mlp) in enumerate(zip(self.attn, self.mlp)):
            x = x + attn(self.norms[2 * i](x), attend)
            x = x + mlp(self.norms[2 * i + 1](x))
        return self.head(x)


def make_batch(device):
    """Tokens [1, L + 1]: each document repeats a random motif (learnable within a document)."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(1):
        parts = []
        for n in DOCS:
            motif = torch.randint(0, VOCAB, (5,), generator=g)
            parts.append(motif.repeat(-(-n // 5))[:n])
        rows.append(torch.cat(parts + [torch.randint(0, VOCAB, (1,), generator=g)]))
    return torch.stack(rows).to(device)


def mask_for(device):
    ids = doc_ids_from_lengths(DOCS, device=device)     # the whole sequence's ids, on every rank
    return and_masks(causal_mask, document_mask(ids))


def train(model, tokens, positions, labels, attend, loss_of, device):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(STEPS):
        logits = model(tokens, positions, attend)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss_of(loss.detach()))
    return losses


def context_parallel_run(rank: int, device, wrap: str = "ddp") -> list:
    torch.manual_seed(0)
    model = Model().to(device)
    if wrap == "ddp":
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    else:                        # FSDP2: parameters sharded over the same ranks, gathered per layer
        from torch.distributed.fsdp import fully_shard
        for layer in model.attn:
            fully_shard(layer)
        fully_shard(model)
    batch = make_batch(device)
    tokens, labels = shard(batch[:, :-1], dim=1), shard(batch[:, 1:], dim=1)
    positions = shard_positions(L // WORLD, device=device).expand(tokens.shape[0], -1)
    mask_mod = mask_for(device)

    def attend(q, k, v, score_mod):
        return context_parallel_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod,
                                          enable_gqa=True)

    def global_loss(local):          # every rank holds as many tokens: the mean of the means
        total = local.clone()
        dist.all_reduce(total)
        return float(total) / WORLD
    return train(model, tokens, positions, labels, attend, global_loss, device)


def single_process_run(device) -> list:
    torch.manual_seed(0)
    model = Model().to(device)
    batch = make_batch(device)
    tokens, labels = batch[:, :-1], batch[:, 1:]
    positions = torch.arange(L, device=device).expand(tokens.shape[0], -1)
    block_mask = flexgen.create_block_mask(mask_for(device), None, None, L, L, device=device)

    def attend(q, k, v, score_mod):
        return flexgen.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True)
    return train(model, tokens, positions, labels, attend, float, device)


def worker(rank: int, world: int, wraps=("ddp",)) -> None:
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if not cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))   # the processes share the cores
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    try:
        runs = {wrap: context_parallel_run(rank, device, wrap) for wrap in wraps}
        if rank == 0:
            alone = single_process_run(device)
            print(f"one process:                          " + " ".join(f"{x:.6f}" for x in alone))
            worst = 0.0
            for wrap, losses in runs.items():
                print(f"context parallel, {world} processes, {wrap:<4}: "
                      + " ".join(f"{x:.6f}" for x in losses), flush=True)
                worst = max([worst] + [abs(a - b) for a, b in zip(losses, alone)])
            if worst > 1e-4 or not alone[-1] < alone[0]:
                print(f"MISMATCH: largest loss difference {worst:.2e}")
                sys.exit(1)
            print(f"losses match (largest difference {worst:.1e}, {dist.get_backend()}); the loss falls "
                  f"{alone[0]:.3f} -> {alone[-1]:.3f}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawned(rank, world, port, wraps):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    worker(rank, world, wraps)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--wrap", default="ddp", choices=("ddp", "fsdp", "both"),
                   help="DistributedDataParallel, FSDP2 (fully_shard), or one run of each")
    wraps = ("ddp", "fsdp") if (w := p.parse_args().wrap) == "both" else (w,)
    if "RANK" in os.environ:                             # under torchrun
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), wraps)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_spawned, args=(WORLD, port, wraps), nprocs=WORLD)


if __name__ == "__main__":
    main()
