"""``flexgen.masks.mask_eval``: undecided mask blocks classified with torch ops.

The torch path runs the mask's printed Triton snippet on torch tensors; the
generated block-mask kernel runs the same snippet under the interpreter. Both
classify every block of small grids here (not only the ones bounds leave
undecided) and must give identical states, which must also match the dense
mask where plain torch can compute it. Then: chunking, the threshold that
picks a path, and the fallback to the kernel for what the torch path refuses.
"""
from __future__ import annotations

import pytest
import torch
import torch.utils._python_dispatch

from flexgen import create_block_mask

from flexgen.masks import block_mask, builder

from flexgen.masks import bounds

from flexgen.runtime import launch

from flexgen.masks import mask_eval
from flexgen import mods as M
from flexgen.codegen.printer import Snippet
from flexgen.frontend.lowering import buffer_map, lower
from flexgen.reference import dense_mask
from flexgen.frontend.trace import trace

# Front-end checks (tracing, masks, mods and their kernels' numerics): CI runs them with the
# newest Triton; its second pass compiles their launches from the first pass's record.
pytestmark = pytest.mark.once

G = torch.Generator().manual_seed(1234)


def random_doc_ids(n, most=60):
    lengths = []
    while sum(lengths) < n:
        lengths.append(int(torch.randint(1, most, (), generator=G)))
    lengths[-1] -= sum(lengths) - n
    return M.doc_ids_from_lengths(lengths)


DOC = random_doc_ids(200)
DOC_2D = torch.stack([random_doc_ids(200), random_doc_ids(200, most=120)])   # [b, q_idx]
PREFIX_B = torch.tensor([5, 90], dtype=torch.int32)
BIAS_2D = torch.randn(2, 200, generator=G)                                  # float [b, q_idx]
KEEP = torch.rand(2, 3, 200, generator=G) > 0.4                             # bool [b, h, kv_idx]
ODD = torch.randint(0, 3, (131,), generator=G, dtype=torch.int32)            # shorter than the lengths
ODD_PADDED = torch.cat([ODD, torch.zeros(200 - 131, dtype=torch.int32)])     # what a masked load reads
REL = torch.randint(0, 2, (63,), generator=G, dtype=torch.int32)             # indexed by kv_idx - q_idx
LIMIT = torch.tensor(77)                                                    # a 0-d runtime scalar


def rel_reference(b, h, q_idx, kv_idx):
    # REL[kv_idx - q_idx] as the kernel reads it: negative indices wrap once, the rest reads 0.
    d = kv_idx - q_idx
    inside = (d >= -63) & (d < 63)
    return torch.where(inside, REL[d.clamp(-63, 62).long()], 0) > 0


def neg_floordiv_mod(b, h, q_idx, kv_idx):     # Python's rounding of negatives, not C's
    return ((q_idx - kv_idx - 7) // 5) % 3 == (kv_idx - 2 * q_idx) % 4


def neg_floordiv_window(b, h, q_idx, kv_idx):
    return (kv_idx - q_idx) // 16 >= -2


def per_batch_and_head(b, h, q_idx, kv_idx):
    return abs(q_idx - kv_idx) <= 8 + 40 * h - 10 * b


def dilated_per_head(b, h, q_idx, kv_idx):
    return ((q_idx - kv_idx) % (h + 2) == 0) & (kv_idx <= q_idx)


def min_max(b, h, q_idx, kv_idx):
    return torch.minimum(q_idx, kv_idx + 3) >= torch.maximum(kv_idx, q_idx // 2)


MODS = {   # name: (mask_mod, B, H[, dense oracle: plain torch with the kernel's semantics])
    "causal": (M.causal_mask, 1, 1),
    "sliding_window": (M.sliding_window(23), 1, 1),
    "two_sided_window": (M.sliding_window(30, causal=False), 1, 1),
    "prefix_lm": (M.prefix_lm(41), 1, 1),
    "prefix_lm_per_batch": (M.prefix_lm(PREFIX_B), 2, 1),
    "document": (M.document_mask(DOC), 1, 1),
    "document_2d": (M.document_mask(DOC_2D), 2, 1),
    "per_batch_and_head": (per_batch_and_head, 2, 3),
    "dilated_per_head": (dilated_per_head, 1, 3),
    "negative_floordiv_mod": (neg_floordiv_mod, 1, 1),
    "negative_floordiv_window": (neg_floordiv_window, 1, 1),
    "buffer_shorter_than_lengths": (lambda b, h, q_idx, kv_idx: ODD[q_idx] == ODD[kv_idx], 1, 1,
                                    lambda b, h, q_idx, kv_idx: ODD_PADDED[q_idx] == ODD_PADDED[kv_idx]),
    "negative_index_wraps": (lambda b, h, q_idx, kv_idx: REL[kv_idx - q_idx] > 0, 1, 1, rel_reference),
    "float_2d_buffer": (lambda b, h, q_idx, kv_idx: BIAS_2D[b, q_idx] * 10.0 < (kv_idx - q_idx) * 0.5, 2, 1),
    "bool_3d_buffer": (lambda b, h, q_idx, kv_idx: KEEP[b, h, kv_idx] | (q_idx == kv_idx), 2, 3),
    "scalar_tensor": (lambda b, h, q_idx, kv_idx: q_idx < LIMIT + kv_idx // 3, 1, 1),
    "float_math": (lambda b, h, q_idx, kv_idx: torch.exp(-abs(q_idx - kv_idx) / 7.0) > 0.1, 1, 1),
    "float_scale": (lambda b, h, q_idx, kv_idx: q_idx * 0.37 >= kv_idx - 3.5, 1, 1),
    "where": (lambda b, h, q_idx, kv_idx: torch.where(q_idx > 100, kv_idx < 50, kv_idx >= q_idx), 1, 1),
    "min_max": (min_max, 1, 1),
    "bitwise": (lambda b, h, q_idx, kv_idx: ((q_idx ^ kv_idx) & 7) == 0, 1, 1),
    "cast_to_int": (lambda b, h, q_idx, kv_idx: (q_idx / 3.0).to(torch.int32) >= kv_idx // 3, 1, 1),
    "nothing": (lambda b, h, q_idx, kv_idx: q_idx < 0, 1, 1),
}

SHAPES = [(200, 97, (64, 128)), (130, 200, (64, 16)), (67, 67, (128, 64))]


def all_blocks(B, H, Q_LEN, KV_LEN, q_block, kv_block):
    nq, nkv = -(-Q_LEN // q_block), -(-KV_LEN // kv_block)
    return torch.ones(B, H, nq, nkv).nonzero()


def dense_states(mask_mod, B, H, Q_LEN, KV_LEN, q_block, kv_block):
    """int8 [B * H * NQ * NKV] block states from the dense mask (positions past the lengths ignored)."""
    dense = dense_mask(mask_mod, B, H, Q_LEN, KV_LEN)
    nq, nkv = -(-Q_LEN // q_block), -(-KV_LEN // kv_block)
    padded = torch.zeros(B, H, nq * q_block, nkv * kv_block, dtype=torch.int32)
    padded[..., :Q_LEN, :KV_LEN] = dense.to(torch.int32)
    valid = torch.zeros(nq * q_block, nkv * kv_block, dtype=torch.int32)
    valid[:Q_LEN, :KV_LEN] = 1
    kept = padded.view(B, H, nq, q_block, nkv, kv_block).sum((3, 5))
    total = valid.view(nq, q_block, nkv, kv_block).sum((1, 3))
    states = torch.full(kept.shape, bounds.PARTIAL, dtype=torch.int8)
    states[kept == 0] = bounds.EMPTY
    states[kept == total] = bounds.FULL
    return states.flatten()


def by_kernel(monkeypatch, lowered, traced, blocks, *sizes):
    """create_block_mask's kernel path, forced, as int8 states (its [partial, full] rows combined)."""
    monkeypatch.setattr(mask_eval, "TORCH_MAX_ELEMENTS", -1)
    partial, full = builder._classify_undecided(lowered, traced, blocks, *sizes)
    assert bool(((partial == 0) | (full == 0)).all()), "a block both partial and full"
    return (partial + 2 * full).to(torch.int8)


@pytest.mark.parametrize("name", list(MODS))
def test_torch_path_and_kernel_agree(monkeypatch, name):
    """Every block of a few grids: the same state from torch ops, the kernel and the dense mask."""
    mask_mod, B, H, *oracle = MODS[name]
    oracle = oracle[0] if oracle else mask_mod
    traced = trace(mask_mod, "mask_mod")
    lowered = lower(traced)
    for Q_LEN, KV_LEN, (q_block, kv_block) in SHAPES:
        blocks = all_blocks(B, H, Q_LEN, KV_LEN, q_block, kv_block)
        sizes = (Q_LEN, KV_LEN, q_block, kv_block)
        states = mask_eval.classify_blocks(lowered, traced.buffers, blocks, *sizes)
        assert states.dtype == torch.int8 and states.shape == (blocks.shape[0],)
        assert torch.equal(states, by_kernel(monkeypatch, lowered, traced, blocks, *sizes)), (Q_LEN, KV_LEN)
        assert torch.equal(states, dense_states(oracle, B, H, *sizes)), (Q_LEN, KV_LEN)


@pytest.mark.parametrize("name", [n for n, (_, B, H, *_) in MODS.items() if B == 1 or H == 1])
def test_folded_batch_and_head_give_the_same_states(name):
    """With B (H) of 1, b (h) is a host constant and the ops on it fold: the same states."""
    mask_mod, B, H, *_ = MODS[name]
    traced = trace(mask_mod, "mask_mod")
    lowered = lower(traced)
    for Q_LEN, KV_LEN, (q_block, kv_block) in SHAPES:
        blocks = all_blocks(B, H, Q_LEN, KV_LEN, q_block, kv_block)
        sizes = (Q_LEN, KV_LEN, q_block, kv_block)
        plain = mask_eval.classify_blocks(lowered, traced.buffers, blocks, *sizes)
        folded = mask_eval.classify_blocks(lowered, traced.buffers, blocks, *sizes, B=B, H=H)
        hits = mask_eval.classify_blocks(lowered, traced.buffers, blocks, *sizes, hits=True, B=B, H=H)
        assert torch.equal(plain, folded), (Q_LEN, KV_LEN)
        assert hits.dtype == torch.int32 and hits.shape == (2, blocks.shape[0])
        assert torch.equal(hits[0] + 2 * hits[1], plain.to(torch.int32)), (Q_LEN, KV_LEN)


def test_folding_leaves_only_the_gathers():
    """A document mask of one batch: its loads need no bounds checks (Q_LEN and KV_LEN fit the
    buffer) and b is 0, so each load is a cast and a gather, and the mask one comparison."""
    traced = trace(M.document_mask(DOC), "mask_mod")
    lowered = lower(traced)
    blocks = all_blocks(1, 1, 200, 200, 64, 64)

    class Count(torch.utils._python_dispatch.TorchDispatchMode):
        ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    mask_eval.classify_blocks(lowered, traced.buffers, blocks, 200, 200, 64, 64, hits=True, B=1, H=1)
    with Count() as counted:
        mask_eval.classify_blocks(lowered, traced.buffers, blocks, 200, 200, 64, 64, hits=True, B=1, H=1)
    launched = [op for op in counted.ops if op in ("_to_copy", "index", "eq", "lt", "where", "mul",
                                                   "bitwise_and", "add", "full")]
    assert sorted(launched) == ["_to_copy", "_to_copy", "add", "eq", "index", "index"], counted.ops


def test_ragged_tail_blocks_ignore_positions_past_the_lengths():
    """A block cut by Q_LEN / KV_LEN is full when all its positions inside the lengths are kept."""
    def inside(b, h, q_idx, kv_idx):       # false only past the lengths (130, 70)
        return (q_idx < 130) & (kv_idx < 70)

    traced = trace(inside, "mask_mod")
    blocks = all_blocks(1, 1, 130, 70, 64, 64)
    states = mask_eval.classify_blocks(lower(traced), traced.buffers, blocks, 130, 70, 64, 64)
    assert states.tolist() == [bounds.FULL] * 6


def test_chunks_give_the_same_states(monkeypatch):
    mask_mod = M.document_mask(DOC_2D)
    traced = trace(mask_mod, "mask_mod")
    lowered = lower(traced)
    blocks = all_blocks(2, 1, 200, 200, 32, 16)          # 7 * 13 blocks per batch
    whole = mask_eval.classify_blocks(lowered, traced.buffers, blocks, 200, 200, 32, 16)
    monkeypatch.setattr(mask_eval, "CHUNK_ELEMENTS", 3 * 32 * 16 + 5)    # chunks of 3 blocks
    calls = []
    original = mask_eval._Lang.load
    monkeypatch.setattr(mask_eval._Lang, "load", lambda *a, **k: calls.append(1) or original(*a, **k))
    chunked = mask_eval.classify_blocks(lowered, traced.buffers, blocks, 200, 200, 32, 16)
    assert len(calls) == 2 * -(-blocks.shape[0] // 3)     # two loads per chunk
    assert torch.equal(whole, chunked)
    assert torch.equal(whole, dense_states(mask_mod, 2, 1, 200, 200, 32, 16))


# --- which path create_block_mask takes ----------------------------------------------

def _forbid(monkeypatch, module, name):
    def refuse(*args, **kwargs):
        raise AssertionError(f"{module.__name__}.{name} must not be called on this path")
    monkeypatch.setattr(module, name, refuse)


def _check_states(mask, mask_mod, B, H, Q_LEN, KV_LEN, q_block, kv_block):
    expected = dense_states(mask_mod, B, H, Q_LEN, KV_LEN, q_block, kv_block)
    assert torch.equal(mask.block_states().flatten(), expected)


@pytest.mark.parametrize("mask_mod", [M.causal_mask, M.sliding_window(300), M.prefix_lm(333),
                                      M.document_mask(random_doc_ids(2048, most=700))],
                         ids=["causal", "sliding_window", "prefix_lm", "document"])
def test_common_masks_take_the_torch_path(monkeypatch, mask_mod):
    """Common masks leave a few blocks per row undecided: no kernel is compiled for them."""
    traced = trace(mask_mod, "mask_mod")
    states = bounds.classify(lower(traced).expr, 1, 1, 2048, 2048, 128, 128, buffer_map(traced),
                             torch.device("cpu"))
    undecided = int((states == bounds.UNDECIDED).sum())
    assert 0 < undecided <= 256 // 4, undecided          # the diagonal, the edges: a few per row
    _forbid(monkeypatch, launch, "run")
    mask = create_block_mask(mask_mod, None, None, 2048, 2048, device="cpu")
    _check_states(mask, mask_mod, 1, 1, 2048, 2048, 128, 128)


def test_threshold_forces_the_kernel_path(monkeypatch):
    mask_mod = MODS["negative_floordiv_mod"][0]
    monkeypatch.setattr(mask_eval, "TORCH_MAX_ELEMENTS", 0)
    _forbid(monkeypatch, mask_eval, "classify_blocks")
    launched = []
    original = launch.run
    monkeypatch.setattr(launch, "run", lambda spec, *a, **k: launched.append(spec.template) or
                        original(spec, *a, **k))
    mask = create_block_mask(mask_mod, None, 2, 130, 200, device="cpu", BLOCK_SIZE=(64, 16))
    assert launched == ["block_mask"]
    _check_states(mask, mask_mod, 1, 2, 130, 200, 64, 16)


def test_threshold_counts_elements(monkeypatch):
    """At the threshold: torch ops; one element fewer allowed: the kernel."""
    mask_mod = M.causal_mask
    states = bounds.classify(lower(trace(mask_mod, "mask_mod")).expr, 1, 1, 256, 128, 64, 32, {},
                             torch.device("cpu"))
    elements = int((states == bounds.UNDECIDED).sum()) * 64 * 32
    assert elements > 0
    monkeypatch.setattr(mask_eval, "TORCH_MAX_ELEMENTS", elements)
    # (every build a build: a mask capturing no tensor is otherwise built once per size)
    monkeypatch.setattr(block_mask, "tensor_free_lists", lambda key, build: build())
    _forbid(monkeypatch, launch, "run")
    create_block_mask(mask_mod, None, None, 256, 128, device="cpu", BLOCK_SIZE=(64, 32))
    monkeypatch.setattr(mask_eval, "TORCH_MAX_ELEMENTS", elements - 1)
    with pytest.raises(AssertionError, match="launch.run must not be called"):
        create_block_mask(mask_mod, None, None, 256, 128, device="cpu", BLOCK_SIZE=(64, 32))


def test_unsupported_falls_back_to_the_kernel(monkeypatch):
    def refuse(*args, **kwargs):
        raise mask_eval.Unsupported("test")

    monkeypatch.setattr(mask_eval, "classify_blocks", refuse)
    launched = []
    original = launch.run
    monkeypatch.setattr(launch, "run", lambda spec, *a, **k: launched.append(spec.template) or
                        original(spec, *a, **k))
    mask_mod = MODS["dilated_per_head"][0]
    mask = create_block_mask(mask_mod, None, 3, 130, 200, device="cpu", BLOCK_SIZE=(64, 16))
    assert launched == ["block_mask"]
    _check_states(mask, mask_mod, 1, 3, 130, 200, 64, 16)


# --- a mask's first build on a sync-free device (the GPU's path, here on the CPU) ----------

class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """The ops of a call that read a device tensor on the host (a sync on a GPU). (Under a
    dispatch mode the mask is built inside the flexgen::block_mask op, whose ops a mode does
    not see: the tests that use this one call the builder directly, ``ops._eager``.)"""

    READS = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "tolist", "equal"}

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.READS:
            self.reads.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def sync_free(monkeypatch):
    """The CPU treated as a GPU (``builder.SYNC_FREE_DEVICES``), no mask built yet in the process
    and every build a build (a mask capturing no tensor is otherwise built once per size); yields
    the list of block-mask launches (dense or not: True or False; "lists" for the lists kernel's)."""
    monkeypatch.setattr(builder, "SYNC_FREE_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(builder, "_BUILT", set())
    monkeypatch.setattr(block_mask, "tensor_free_lists", lambda key, build: build())
    launched, original = [], launch.run
    monkeypatch.setattr(launch, "run", lambda spec, *a, **k: launched.append(getattr(spec, "dense", "lists"))
                        or original(spec, *a, **k))
    return launched


def _lists(mask):
    return [t for t in mask.as_tuple() if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("name,Q_LEN,KV_LEN,BLOCK", [
    ("causal", 256, 256, (64, 64)),
    ("document_2d", 200, 200, (32, 16)),           # a captured tensor, b in the mask, B = 2
    ("per_batch_and_head", 130, 200, (64, 16)),    # ragged q blocks, b and h, B = 2, H = 3
    ("bool_3d_buffer", 67, 131, (32, 64)),         # ragged both ways, a captured [b, h, kv] tensor
    ("float_2d_buffer", 200, 97, (64, 128)),          # a float [b, q] tensor, kv blocks past KV_LEN
])
def test_first_build_uses_torch_ops_then_the_kernel(sync_free, monkeypatch, name, Q_LEN, KV_LEN, BLOCK):
    """The first build of a mask classifies every block and fills the lists with torch ops (no
    kernel launched, no host read); the second launches the dense kernel and the lists kernel:
    both give the dense mask's lists."""
    mask_mod, B, H, *oracle = MODS[name]
    from flexgen.runtime import ops
    monkeypatch.setattr(ops, "_eager", lambda *tensors: True)
    with _HostReads() as host:
        first = create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device="cpu", BLOCK_SIZE=BLOCK)
    assert sync_free == [] and host.reads == []
    _check_states(first, oracle[0] if oracle else mask_mod, B, H, Q_LEN, KV_LEN, *BLOCK)
    second = create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device="cpu", BLOCK_SIZE=BLOCK)
    assert sync_free == [True, "lists"]
    for a, b in zip(_lists(first), _lists(second)):
        assert torch.equal(a, b)


def test_first_build_falls_back_to_the_kernel(sync_free, monkeypatch):
    """A mask the torch path refuses, or a grid above mask_eval.TORCH_MAX_ELEMENTS: the first
    build launches the kernel."""
    mask_mod = MODS["dilated_per_head"][0]
    with monkeypatch.context() as m:
        m.setattr(mask_eval, "classify_blocks", lambda *a, **k: (_ for _ in ()).throw(mask_eval.Unsupported("test")))
        mask = create_block_mask(mask_mod, None, 3, 130, 200, device="cpu", BLOCK_SIZE=(64, 16))
    assert sync_free == [True]
    _check_states(mask, mask_mod, 1, 3, 130, 200, 64, 16)
    monkeypatch.setattr(mask_eval, "TORCH_MAX_ELEMENTS", 128 * 128 - 1)
    create_block_mask(M.causal_mask, None, None, 100, 128, device="cpu", BLOCK_SIZE=64)  # 4 whole blocks
    assert sync_free == [True, True, "lists"]       # the process's second lists: the lists kernel


def test_warmup_compiles_the_mask_kernel(sync_free):
    """flexgen.precompile builds each mask once: it launches (compiles) the dense kernel and the
    lists kernel, which the first build outside it then launches too; clear_caches forgets the
    built masks."""
    import flexgen
    mask_mod = MODS["sliding_window"][0]

    def build():
        return create_block_mask(mask_mod, None, None, 130, 130, device="cpu", BLOCK_SIZE=32)

    summary = flexgen.precompile([build], progress=False)
    assert sync_free == [True, "lists"] and summary["kernels"] == 2
    build()
    assert sync_free == [True, "lists"] * 2
    flexgen.clear_caches()
    build()
    assert sync_free == [True, "lists"] * 2   # forgotten: torch ops again


def test_a_first_build_launches_kernels_a_previous_process_compiled(sync_free, monkeypatch):
    """A first build whose kernels need no compile (``launch.ready``: loaded, or recorded in
    the restart index by a previous process) launches them instead of the torch ops."""
    asked = []
    monkeypatch.setattr(launch, "ready", lambda spec, device, inputs: asked.append(spec.template) or True)
    mask_mod = MODS["sliding_window"][0]
    mask = create_block_mask(mask_mod, None, None, 130, 130, device="cpu", BLOCK_SIZE=32)
    assert sync_free == [True, "lists"] and asked == ["block_mask", "block_lists"]
    _check_states(mask, mask_mod, 1, 1, 130, 130, 32, 32)


def test_launch_ready_is_false_where_no_compiled_kernel_runs():
    """The interpreter compiles nothing, but nothing compiled runs there either: the torch
    ops stay the first build's path on the CPU."""
    spec = builder.lists_spec()
    assert not launch.ready(spec, torch.device("cpu"), {})


@pytest.mark.parametrize("lines,result,kind,what", [
    (("m_0 = q_idx // 3",), "m_0 >= kv_idx", "bool", "FloorDiv"),      # C rounding in Triton
    (("m_0 = q_idx % 3",), "m_0 >= kv_idx", "bool", "Mod"),
    ((), "tl.dot(q_idx, kv_idx) > 0", "bool", "dot"),
    ((), "undefined_name > kv_idx", "bool", "undefined_name"),
    ((), "q_idx.item() > kv_idx", "bool", "item"),
    ((), "(0 < q_idx < kv_idx)", "bool", "chained"),
    ((), "(q_idx > 0) and (kv_idx > 0)", "bool", "BoolOp"),
    ((), "q_idx - kv_idx", "int", "kind int"),
    (("m_0, m_1 = q_idx, kv_idx",), "m_0 >= m_1", "bool", "statement"),
])
def test_snippets_outside_the_stand_in_are_refused(lines, result, kind, what):
    snippet = Snippet(tuple(lines), result, kind)
    with pytest.raises(mask_eval.Unsupported, match=what.split()[0]):
        mask_eval._compile(snippet, ())


def test_printed_masks_are_supported():
    for name, (mask_mod, *_) in MODS.items():
        assert mask_eval.supports(lower(trace(mask_mod, "mask_mod"))), name


def test_integer_division_by_zero_is_refused():
    """torch raises on an integer division by zero (on the CPU): the caller then uses the kernel."""
    def divides(b, h, q_idx, kv_idx):
        return q_idx // (kv_idx - 40) >= 1

    traced = trace(divides, "mask_mod")
    blocks = all_blocks(1, 1, 64, 64, 32, 32)
    with pytest.raises(mask_eval.Unsupported, match="RuntimeError"):
        mask_eval.classify_blocks(lower(traced), traced.buffers, blocks, 64, 64, 32, 32)


def test_constant_masks():
    """A mask that folds to a constant prints as True / False, not as a tensor."""
    def everything(b, h, q_idx, kv_idx):
        return q_idx >= 0

    def nothing(b, h, q_idx, kv_idx):
        return q_idx < 0

    blocks = all_blocks(1, 1, 100, 100, 64, 64)
    for mask_mod, state in ((everything, bounds.FULL), (nothing, bounds.EMPTY)):
        lowered = lower(trace(mask_mod, "mask_mod"))
        assert lowered.snippet.result in ("True", "False")
        states = mask_eval.classify_blocks(lowered, (), blocks, 100, 100, 64, 64)
        assert states.tolist() == [state] * 4
