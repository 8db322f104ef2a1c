"""flexgen.distributed: context-parallel attention against the float64 oracle on the whole sequence.

Multi-process cases run in spawned gloo workers through the Triton interpreter
(``tests/context_parallel_cases.py``: one spawn per world size for all its cases,
so the import cost of torch + flexgen is paid once per world size). Each case
compares every rank's output, LSE, dQ, dK, dV (and a learned bias's gradient
summed over the ranks) with autograd through ``flex_attention_reference`` in
float64, and checks which shard pairs were skipped and what was sent.

In this process: the plan's block classification against flexgen's own builder on
the shifted mask (no process group needed), and a one-rank group (gloo, world 1)
for the argument errors and for the kernels the shifted mods generate, so the
suite's sm_90 ahead-of-time compile covers them (spawned workers skip conftest).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import context_parallel_cases as cases
import flexgen
from flexgen import InputError, mods
from flexgen.distributed import context_parallel_attention, positions, schedule
from flexgen.reference import flex_attention_reference

# torch / Hugging Face / distributed plumbing: CI's second pass compiles its kernels from the
# first pass's record instead of running it (conftest, FLEXGEN_TEST_RECORD_ONCE).
pytestmark = pytest.mark.once

ROOT = Path(__file__).resolve().parents[1]


def _assert_rows(rows):
    failures = [f"rank {r}:\n{row.get('error')}" for r, row in enumerate(rows) if not row.get("ok")]
    assert not failures, "\n".join(failures)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return cases.run_cases(2, cases.WORLD_CASES[2], str(tmp_path_factory.mktemp("cp2")))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return cases.run_cases(4, cases.WORLD_CASES[4], str(tmp_path_factory.mktemp("cp4")))


@pytest.mark.parametrize("name", cases.WORLD_CASES[2])
def test_two_ranks(two_ranks, name):
    _assert_rows(two_ranks[name])


@pytest.mark.parametrize("name", cases.WORLD_CASES[4])
def test_four_ranks(four_ranks, name):
    _assert_rows(four_ranks[name])


# --- the plan: which blocks of a shard pair the mask keeps ------------------------------------

def _doc_mask(L):
    sizes, n = [], 0
    while n < L:
        sizes.append(min(13 + 7 * (len(sizes) % 3), L - n))
        n += sizes[-1]
    return mods.and_masks(mods.causal_mask, mods.document_mask(mods.doc_ids_from_lengths(sizes)))


def _batched_doc_mask(L):
    ids = torch.stack([mods.doc_ids_from_lengths([L // 3, L - L // 3]),
                       mods.doc_ids_from_lengths([5, L - 5])])
    return mods.document_mask(ids)


@pytest.mark.parametrize("layout", ["load_balanced", "contiguous"])
@pytest.mark.parametrize("world,chunk", [(2, 24), (3, 16), (4, 11)])
@pytest.mark.parametrize("mask", ["causal", "window", "documents", "batched-documents", "prefix"])
def test_pair_blocks_match_the_builder(layout, world, chunk, mask):
    """The plan's blocks (bounds on the mask rewritten to global positions, elements where the
    bounds leave a block open) equal create_block_mask's on the shifted mask_mod, for every
    pair of every rank; a pair is planned iff it has a block."""
    local = 2 * chunk
    L = world * local
    mask_mod = {"causal": lambda L: mods.causal_mask, "window": lambda L: mods.sliding_window(9),
                "documents": _doc_mask, "batched-documents": _batched_doc_mask,
                "prefix": lambda L: mods.prefix_lm(L // 3 + 1)}[mask](L)
    B = 2 if mask == "batched-documents" else 1
    pos = [positions(r, world, local, layout) for r in range(world)]
    for r in range(world):
        plan = schedule.plan_for(mask_mod, B, 2, local, world, r, layout, 16, torch.device("cpu"))
        for t in range(world):
            s = (r - t) % world
            shifted = schedule.shifted_mask(mask_mod, pos[r], pos[s])
            want = flexgen.create_block_mask(shifted, B, None, local, local, device="cpu", BLOCK_SIZE=16)
            any_block = bool(want.to_dense().any())
            assert plan.recv[t] == any_block, (r, s)
            if any_block:
                got = plan.masks[s].block_states().expand(B, 1, -1, -1)
                assert torch.equal(got, want.block_states()), (r, s)
            # the sender's view of the same pair agrees with the receiver's
            sender = schedule.plan_for(mask_mod, B, 2, local, world, s, layout, 16, torch.device("cpu"))
            assert sender.send[t] == plan.recv[t]


def test_bounds_decide_causal_blocks_without_elements(monkeypatch):
    """Causal, load-balanced, chunks a multiple of the block: the bounds of the rewritten mask
    decide every block but the diagonal ones; no element is evaluated off the diagonal."""
    seen = []
    real = schedule._classify_undecided

    def counting(lowered, traced, blocks, *args, **kwargs):
        seen.append(blocks.shape[0])
        return real(lowered, traced, blocks, *args, **kwargs)
    monkeypatch.setattr(schedule, "_classify_undecided", counting)
    world, local = 4, 64
    for r in range(world):
        schedule.plan_for(mods.causal_mask, 1, 1, local, world, r, "load_balanced", 16,
                          torch.device("cpu"))
    # rank r's own pair holds two chunks of 2 blocks each: 4 diagonal blocks, nothing else open
    assert seen[:1] == [4] and sum(seen) == world * 4, seen


# --- one rank: argument errors, and the kernels of the shifted mods -------------------------

@pytest.fixture
def one_rank(tmp_path):
    assert not dist.is_initialized()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_not_initialized():
    assert not dist.is_initialized()
    q = torch.randn(1, 1, 8, 16)
    with pytest.raises(flexgen.FlexgenError, match="init_process_group"):
        context_parallel_attention(q, q, q)
    with pytest.raises(flexgen.FlexgenError, match="init_process_group"):
        flexgen.distributed.shard(q)


def test_argument_errors(one_rank):
    q = torch.randn(1, 2, 10, 16)
    cases_ = [
        (dict(layout="zigzag"), "layout"),
        (dict(comm="ring"), "comm"),
        (dict(block_size=48), "block_size"),
        (dict(mask_mod=flexgen.create_block_mask(mods.causal_mask, 1, 1, 10, 10, device="cpu",
                                                 BLOCK_SIZE=16)), "mask_mod"),
    ]
    for kwargs, arg in cases_:
        with pytest.raises(InputError, match=f"^{arg}:"):
            context_parallel_attention(q, q, q, **kwargs)
    with pytest.raises(InputError, match="even local length"):
        context_parallel_attention(q[:, :, :9], q[:, :, :9], q[:, :, :9])
    with pytest.raises(InputError, match="^key:"):
        context_parallel_attention(q, q[:, :, :8], q[:, :, :8])
    with pytest.raises(InputError, match="^query:"):
        context_parallel_attention(q[0], q, q)
    with pytest.raises(InputError, match="multiple of 2"):
        flexgen.distributed.shard(torch.randn(1, 1, 7, 4))


def test_one_rank_matches_the_oracle(one_rank):
    """A group of one: the shifted mods (positions through captured maps, nested loads of
    document ids, a learned bias) forward and backward; the suite compiles these kernels for
    sm_90 ahead of time."""
    L = 38
    ids = mods.doc_ids_from_lengths([11, 20, 7])
    mask_mod = mods.and_masks(mods.causal_mask, mods.document_mask(ids))
    table = (torch.randn(2, 2 * L - 1) * 0.3).requires_grad_()

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + L - 1]
    q, k, v = (torch.randn(1, 2, L, 32, requires_grad=True) for _ in range(3))
    out, lse = context_parallel_attention(q, k, v, score_mod=rel_bias, mask_mod=mask_mod,
                                          return_lse=True, block_size=16)
    ref, ref_lse = flex_attention_reference(q, k, v, score_mod=rel_bias, mask_mod=mask_mod,
                                            return_lse=True)
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, table), dout)
    want = torch.autograd.grad(ref, (q, k, v, table), dout.double())
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w.double(), atol=2e-4, rtol=1e-4)


def test_gradient_error_before_the_forward(one_rank):
    """A score_mod with no derivative fails when called with gradients, not in backward."""
    def rounded(score, b, h, q_idx, kv_idx):
        return torch.floor(score)
    q = torch.randn(1, 1, 8, 16, requires_grad=True)
    with pytest.raises(flexgen.GradientError):
        context_parallel_attention(q, q, q, score_mod=rounded, block_size=16)


# --- the example and the benchmark's smoke run ------------------------------------------------

@pytest.mark.slow
def test_example_trains_like_one_process():
    """examples/context_parallel_train.py: 2 gloo processes under DDP and under FSDP2, losses equal
    to one process's."""
    script = ROOT / "examples" / "context_parallel_train.py"
    done = subprocess.run([sys.executable, str(script), "--wrap", "both"],
                          capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "losses match" in done.stdout, done.stdout[-3000:]


@pytest.mark.slow
def test_benchmark_smoke(tmp_path):
    """benchmarks/bench_context_parallel.py --smoke under torchrun with 2 CPU processes."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_port", str(cases.free_port())]
    done = subprocess.run(torchrun + [str(ROOT / "benchmarks" / "bench_context_parallel.py"), "--smoke",
                                      "--out", str(tmp_path / "bench.json")],
                          capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "bench.json").exists()
