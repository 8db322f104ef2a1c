"""The cases of tests/test_context_parallel.py, run inside spawned gloo workers.

Spawning a process costs an import of torch and flexgen (5-10 s on the test
machine), so each world size is ONE spawn (``run_cases``): every worker runs
every case in order, compares its shards with the float64 oracle on the whole
sequence, and writes one JSON row per case; the test file turns each row into a
test. A case that fails on a rank is reported, and the workers go on with the next
case. The process group has a short timeout so a deadlock fails instead of hanging.

Each case: random full-sequence Q, K, V (every rank draws the same ones from one
seed), each rank takes its shard (``flexgen.distributed.shard``), runs
``context_parallel_attention`` forward and backward with a random upstream gradient,
and compares its output / LSE / dQ / dK / dV shards with autograd through
``flexgen.reference.flex_attention_reference`` in float64 on the whole sequence
(and, for a learned bias, the gradient summed over the ranks).
"""
from __future__ import annotations

import json
import os
import socket
import time
import traceback
import zlib
from dataclasses import dataclass, field
from datetime import timedelta

import torch

# Small head dim and block: the interpreter's cost grows with both.
D = 16
BLOCK = 16


@dataclass
class Case:
    name: str
    mask: object = None           # (L, device) -> mask_mod over global positions, or None
    score: object = None          # (L, learned) -> score_mod, or None
    learned: dict = field(default_factory=dict)   # name -> shape of a tensor that gets a gradient
    layout: str = "load_balanced"
    chunk: int = 21               # tokens per chunk: L = 2 * world * chunk (not a multiple of BLOCK)
    B: int = 1
    Hq: int = 2
    Hkv: int = 2
    dtype: torch.dtype = torch.float32
    comm: str = "auto"
    with_lse: bool = False        # the loss also uses the returned LSE
    expect_skipped: dict | None = None   # world -> pairs each rank's row skips (list by rank)
    expect_no_bytes: bool = False  # the mask needs no shard of any other rank
    grad: bool = True


# --- mods over global positions --------------------------------------------------------

def causal(L, device):
    from flexgen.mods import causal_mask
    return causal_mask


def window(L, device):
    from flexgen.mods import sliding_window
    return sliding_window(12)


def documents(L, device):
    """Causal documents whose borders fall inside shards (lengths prime to the chunks)."""
    from flexgen.mods import and_masks, causal_mask, doc_ids_from_lengths, document_mask
    sizes, n, i = [], 0, 0
    while n < L:
        sizes.append(min((17, 29, 11, 37)[i % 4], L - n))
        n, i = n + sizes[-1], i + 1
    return and_masks(causal_mask, document_mask(doc_ids_from_lengths(sizes, device=device)))


def aligned_documents(L, device):
    """Bidirectional documents that each lie inside one contiguous shard: no shard pair
    across ranks has a block, so nothing is sent."""
    from flexgen.mods import doc_ids_from_lengths, document_mask
    import torch.distributed as dist
    world = dist.get_world_size()
    shard = L // world
    half = shard // 2
    sizes = [half, shard - half] * world
    return document_mask(doc_ids_from_lengths(sizes, device=device))


def padded_documents(L, device):
    """Documents with padding (id -1) that sees nothing: fully masked query rows."""
    ids = torch.arange(L, device=device) // 19
    ids = torch.where(ids == 1, torch.full_like(ids, -1), ids).to(torch.int32)

    def padded_document_mask(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[kv_idx]) & (ids[q_idx] >= 0) & (q_idx >= kv_idx)
    return padded_document_mask


def alibi(L, learned):
    from flexgen.mods import alibi as make
    return make(num_heads=4)


def softcap(L, learned):
    from flexgen.mods import tanh_softcap
    return tanh_softcap(5.0)


def learned_bias(L, learned):
    table = learned["rel"]

    def relative_bias(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + L - 1]
    return relative_bias


CASES = [
    Case("causal-balanced", causal, expect_skipped={2: [0, 0]}),
    Case("causal-contiguous", causal, layout="contiguous", expect_skipped={2: [1, 0]}),
    Case("window-contiguous", window, layout="contiguous", expect_skipped={2: [1, 0]}),
    Case("window-balanced-gqa", window, Hq=4, Hkv=2),
    Case("documents-balanced", documents, B=2),
    Case("documents-aligned-contiguous", aligned_documents, layout="contiguous",
         expect_skipped={2: [1, 1], 4: [3, 3, 3, 3]}, expect_no_bytes=True),
    Case("padded-documents-lse", padded_documents, layout="contiguous", with_lse=True),
    Case("alibi-causal-balanced", causal, alibi, Hq=4, Hkv=4),
    Case("softcap-causal-gqa", causal, softcap, Hq=4, Hkv=2, layout="contiguous"),
    Case("learned-bias-causal", causal, learned_bias, learned={"rel": lambda L: (2, 2 * L - 1)}),
    Case("no-mask-softcap", None, softcap, comm="auto"),
    Case("causal-all-gather", causal, comm="all_gather"),
    Case("causal-bf16-forward", causal, dtype=torch.bfloat16, grad=False),
]

# Cases that check something else than attention values (a function of (world, rank)).
SPECIAL = ("shard-unshard", "shapes-differ")

WORLD_CASES = {
    2: [c.name for c in CASES] + list(SPECIAL),
    4: ["causal-balanced", "documents-aligned-contiguous", "window-balanced-gqa",
        "causal-all-gather", "shard-unshard"],
}
CHUNK = {2: 21, 4: 7}           # L = 84 (world 2), 56 (world 4)


def case(name: str) -> Case:
    return next(c for c in CASES if c.name == name)


# --- one case on one rank ----------------------------------------------------------------

def _errors(mine, full, name, shard_fn):
    """Max |difference| of a shard against the shard of the float64 full tensor."""
    want = shard_fn(full)
    got = mine.detach().double()
    both_inf = torch.isinf(want) & torch.isinf(got) & (torch.sign(want) == torch.sign(got))
    if (torch.isinf(want) != torch.isinf(got)).any():
        raise AssertionError(f"{name}: -inf rows differ from the reference")
    diff = (got - want).masked_fill(both_inf, 0).abs()
    scale = want.masked_fill(torch.isinf(want), 0).abs().max().clamp(min=1.0)
    return float(diff.max() / scale) if diff.numel() else 0.0


def run_case(c: Case, world: int, rank: int) -> dict:
    import torch.distributed as dist
    from flexgen.distributed import context_parallel_attention, shard
    from flexgen.distributed import ring
    from flexgen.reference import flex_attention_reference

    L = 2 * world * CHUNK[world]
    g = torch.Generator().manual_seed(zlib.crc32(c.name.encode()))
    q = torch.randn(c.B, c.Hq, L, D, generator=g)
    k = torch.randn(c.B, c.Hkv, L, D, generator=g)
    v = torch.randn(c.B, c.Hkv, L, D, generator=g)
    dout = torch.randn(c.B, c.Hq, L, D, generator=g)
    dlse = torch.randn(c.B, c.Hq, L, generator=g)
    learned = {n: (torch.randn(shape(L), generator=g) * 0.5).requires_grad_()
               for n, shape in c.learned.items()}
    mask_mod = None if c.mask is None else c.mask(L, "cpu")
    score_mod = None if c.score is None else c.score(L, learned)
    gqa = c.Hq != c.Hkv

    # The oracle on the whole sequence, float64, with autograd.
    full = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = flex_attention_reference(*full, score_mod=score_mod, mask_mod=mask_mod,
                                                enable_gqa=gqa, return_lse=True)
    if c.grad:
        loss = (ref_out * dout.double()).sum()
        if c.with_lse:
            live = torch.isfinite(ref_lse)
            loss = loss + (ref_lse.masked_fill(~live, 0) * dlse.double()).sum()
        ref_grads = torch.autograd.grad(loss, full + list(learned.values()))
    sh = lambda t: shard(t, layout=c.layout)  # noqa: E731

    # The context-parallel run on this rank's shards.
    mine = [sh(t).to(c.dtype).requires_grad_(c.grad) for t in (q, k, v)]
    ring.reset_stats()
    out, lse = context_parallel_attention(*mine, score_mod=score_mod, mask_mod=mask_mod,
                                          layout=c.layout, enable_gqa=gqa, return_lse=True,
                                          block_size=BLOCK, comm=c.comm)
    stats = dict(ring.STATS)
    row = {"out": _errors(out, ref_out.detach(), "out", sh), "lse": _errors(lse, ref_lse.detach(), "lse", sh)}
    if torch.isnan(out).any() or torch.isnan(lse).any():
        raise AssertionError("NaN in the output or LSE")
    if c.grad:
        loss = (out * sh(dout)).sum()
        if c.with_lse:
            loss = loss + (lse.masked_fill(torch.isinf(lse), 0) * sh(dlse)).sum()
        loss.backward()
        for name, t, want in zip("qkv", mine, ref_grads[:3]):
            row["d" + name] = _errors(t.grad, want, "d" + name, sh)
        for (name, t), want in zip(learned.items(), ref_grads[3:]):
            total = t.grad.clone()
            dist.all_reduce(total)           # each rank holds its queries' share
            row["d" + name] = _errors(total, want, "d" + name, lambda x: x)
    row["stats"] = stats
    row["dtype"] = str(c.dtype)
    return row


def _check_row(c: Case, world: int, rank: int, row: dict) -> None:
    tol = 2e-2 if c.dtype == torch.bfloat16 else 2e-4
    bad = {k: v for k, v in row.items() if isinstance(v, float) and not v <= tol}
    if bad:
        raise AssertionError(f"relative errors over {tol}: {bad}")
    if c.expect_skipped and world in c.expect_skipped:
        want = c.expect_skipped[world][rank]
        if row["stats"]["pairs_skipped"] != want:
            raise AssertionError(f"rank {rank} skipped {row['stats']['pairs_skipped']} shard pairs, "
                                 f"expected {want}")
    if c.expect_no_bytes and row["stats"]["bytes_sent"]:
        raise AssertionError(f"rank {rank} sent {row['stats']['bytes_sent']} bytes; the mask needs none")


def shard_unshard(world: int, rank: int) -> dict:
    """shard / unshard are inverse, and a shard holds the positions ``positions`` names."""
    from flexgen.distributed import positions, shard, shard_positions, unshard
    L = 2 * world * 5
    x = torch.randn(2, 3, L, 4, generator=torch.Generator().manual_seed(0))
    ids = torch.arange(L).expand(2, L)
    for layout in ("load_balanced", "contiguous"):
        part = shard(x, layout=layout)
        assert part.shape == (2, 3, L // world, 4) and part.is_contiguous()
        assert torch.equal(unshard(part, layout=layout), x), layout
        assert torch.equal(shard(ids, layout=layout, dim=1)[0].to(torch.int32),
                           positions(rank, world, L // world, layout)), layout
        assert torch.equal(shard_positions(L // world, layout=layout),
                           positions(rank, world, L // world, layout))
    return {}


def shapes_differ(world: int, rank: int) -> dict:
    """Shards of different lengths across ranks: an InputError on every rank, naming both."""
    from flexgen import InputError
    from flexgen.distributed import context_parallel_attention
    Ls = 8 if rank == 0 else 6
    q = torch.randn(1, 2, Ls, D)
    try:
        context_parallel_attention(q, q, q, layout="contiguous", block_size=BLOCK)
    except InputError as err:
        message = str(err)
        assert "rank 0 (1, 2, 8, 16)" in message and "rank 1 (1, 2, 6, 16)" in message, message
        return {"message": message}
    raise AssertionError("no error for shards of different lengths")


# --- the spawned workers ------------------------------------------------------------------

def worker(rank: int, world: int, port: int, outdir: str, names: list) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=90))
    rows = {}
    try:
        for name in names:
            start = time.perf_counter()
            try:
                if name in SPECIAL:
                    row = globals()[name.replace("-", "_")](world, rank)
                else:
                    c = case(name)
                    row = run_case(c, world, rank)
                    _check_row(c, world, rank, row)
                row["ok"] = True
            except Exception:
                row = {"ok": False, "error": traceback.format_exc()[-4000:]}
            row["seconds"] = round(time.perf_counter() - start, 2)
            rows[name] = row
            with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
                json.dump(rows, f)
            dist.barrier()      # the next case starts together (a failure on one rank stays in its case)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cases(world: int, names: list, outdir: str, timeout: float = 600.0) -> dict:
    """Spawn ``world`` gloo workers that run ``names``; {name: [row of rank 0, row of rank 1, ...]}.
    A rank that died or hung reports its missing cases as errors."""
    import torch.multiprocessing as mp
    ctx = mp.start_processes(worker, args=(world, free_port(), outdir, names), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    crashed = None
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                crashed = f"timed out after {timeout:.0f} s"
                break
    except Exception as err:           # a worker exited with an error
        crashed = f"{type(err).__name__}: {err}"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    results = {}
    for rank in range(world):
        path = os.path.join(outdir, f"rank{rank}.json")
        rows = json.load(open(path)) if os.path.exists(path) else {}
        for name in names:
            results.setdefault(name, []).append(
                rows.get(name, {"ok": False, "error": f"rank {rank} never reported ({crashed})"}))
    return results
