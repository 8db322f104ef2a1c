"""Block-sparse masks: which (query block, kv block) tiles a kernel visits.

A ``BlockMask`` holds, per (batch, head, query block), the kv blocks that are
partially masked (mask_mod applied) and those fully kept (mask_mod skipped), and
the transposed lists for the backward pass: torch's BlockMask layout and fields,
so masks move between the two libraries (``mask_inputs`` reads torch's too).
``create_block_mask`` traces the mask_mod and runs the ``flexgen::block_mask`` op
(``flexgen.masks.builder``), which never builds the dense ``[Q_LEN, KV_LEN]`` mask:
memory is O(number of blocks). Both run inside torch.compile.
"""
from __future__ import annotations

import torch

from ..errors import expected, reported
from ..frontend.trace import trace_cached
from . import bounds
from .builder import fill_lists, hits_of_states, layout

LIST_NAMES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
              "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")
# torch's marker for "no block mask" (its _create_empty_block_mask): BLOCK_SIZE of 2**30.
LARGE_SPARSE_BLOCK = 1 << 30


class BlockMask:
    """Which blocks of the ``[Q_LEN, KV_LEN]`` score matrix are partial, full or skipped.

    Same fields as ``torch.nn.attention.flex_attention.BlockMask``:
    ``kv_num_blocks`` ``[B, H, NQ]`` and ``kv_indices`` ``[B, H, NQ, NKV]`` list
    the partially masked kv blocks of each query block (mask_mod applied),
    ``full_kv_*`` the fully unmasked ones (mask_mod skipped); ``q_*`` and
    ``full_q_*`` are the transposed lists (per kv block, its query blocks).
    ``B`` or ``H`` of size 1 broadcasts over the batch or heads. ``mask_mod`` is
    the mod the kernels apply to partial blocks: assigning another one (torch's
    decode pattern: a sliced mask with an offset mod) makes that one run.
    """

    def __init__(self, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
                 q_num_blocks, q_indices, full_q_num_blocks, full_q_indices,
                 BLOCK_SIZE, mask_mod, seq_lengths):
        self.kv_num_blocks, self.kv_indices = kv_num_blocks, kv_indices
        self.full_kv_num_blocks, self.full_kv_indices = full_kv_num_blocks, full_kv_indices
        self.q_num_blocks, self.q_indices = q_num_blocks, q_indices
        self.full_q_num_blocks, self.full_q_indices = full_q_num_blocks, full_q_indices
        self.BLOCK_SIZE = tuple(BLOCK_SIZE)
        self.mask_mod = mask_mod
        self.seq_lengths = tuple(seq_lengths)

    @classmethod
    def from_states(cls, states: torch.Tensor, BLOCK_SIZE, mask_mod, seq_lengths) -> "BlockMask":
        """Build the index lists from an int8 ``[B, H, NQ, NKV]`` of EMPTY / PARTIAL / FULL."""
        buf = fill_lists(hits_of_states(states))
        return cls(*layout(*states.shape).views(buf), BLOCK_SIZE, mask_mod, seq_lengths)

    def traced(self):
        """The traced mask_mod: the one assigned now (``trace_cached`` makes a repeat cheap)."""
        return trace_cached(self.mask_mod, "mask_mod")

    def as_tuple(self) -> tuple:
        """torch's flattened form: (Q_LEN, KV_LEN, the eight lists, Q_BLOCK, KV_BLOCK, mask_mod)."""
        return (*self.seq_lengths, *(getattr(self, n) for n in LIST_NAMES), *self.BLOCK_SIZE,
                self.mask_mod)

    @property
    def shape(self) -> tuple:
        """(B, H, Q_LEN, KV_LEN); B or H is 1 where the mask broadcasts."""
        B, H = self.kv_num_blocks.shape[:2]
        return (B, H) + self.seq_lengths

    def numel(self) -> int:
        """Elements of the mask's shape (not accounting for sparsity), as torch counts them."""
        B, H, Q, KV = self.shape
        return B * H * Q * KV

    @property
    def device(self) -> torch.device:
        return self.kv_num_blocks.device

    def to_dense(self) -> torch.Tensor:
        """int32 ``[B, H, NQ, NKV]``: 1 where a block is computed (partial or full), else 0."""
        B, H, nq = self.kv_num_blocks.shape
        nkv = self.kv_indices.shape[-1]
        dense = torch.zeros(B, H, nq, nkv, dtype=torch.int32, device=self.device)
        for num, idx in ((self.kv_num_blocks, self.kv_indices),
                         (self.full_kv_num_blocks, self.full_kv_indices)):
            valid = torch.arange(nkv, device=self.device) < num[..., None]
            dense.scatter_add_(-1, idx.long(), valid.to(torch.int32))
        return dense

    def block_states(self) -> torch.Tensor:
        """int8 ``[B, H, NQ, NKV]``: 0 skipped, 1 partial, 2 full."""
        B, H, nq = self.kv_num_blocks.shape
        nkv = self.kv_indices.shape[-1]
        states = torch.zeros(B, H, nq, nkv, dtype=torch.int8, device=self.device)
        for num, idx, value in ((self.kv_num_blocks, self.kv_indices, bounds.PARTIAL),
                                (self.full_kv_num_blocks, self.full_kv_indices, bounds.FULL)):
            valid = torch.arange(nkv, device=self.device) < num[..., None]
            states.scatter_add_(-1, idx.long(), (valid * value).to(torch.int8))
        return states

    def sparsity(self) -> float:
        """Percentage of blocks skipped (neither partial nor full)."""
        total = self.kv_indices.numel()
        computed = int(self.kv_num_blocks.sum()) + int(self.full_kv_num_blocks.sum())
        return 100.0 * (1 - computed / total) if total else 0.0

    def to(self, device) -> "BlockMask":
        moved = [getattr(self, n).to(device) for n in LIST_NAMES]
        return BlockMask(*moved, self.BLOCK_SIZE, self.mask_mod, self.seq_lengths)

    def to_string(self, max_blocks: int = 32) -> str:
        """A picture of the block layout: '█' full, '░' partial, ' ' skipped (first batch and head)."""
        states = self.block_states()[0, 0]
        rows = []
        for row in states[:max_blocks].tolist():
            rows.append("".join(" ░█"[v] for v in row[:max_blocks]) + ("…" if len(row) > max_blocks else ""))
        if states.shape[0] > max_blocks:
            rows.append("…")
        return "\n".join(rows)

    def plot(self, path=None, max_len: int = 256):
        """A matplotlib Figure of the element mask (first batch and head) with the block grid.

        Full, partial and empty blocks are shaded in distinct colours and the
        title gives the block counts and sparsity; with ``path`` a PNG is
        written too. Evaluates mask_mod densely, so Q_LEN and KV_LEN must be
        <= ``max_len`` (else InputError). Needs matplotlib; see ``flexgen.masks.plot``.
        """
        from ..masks.plot import plot_block_mask
        return plot_block_mask(self, path=path, max_len=max_len)

    def __repr__(self) -> str:
        B, H, Q_LEN, KV_LEN = self.shape
        name = getattr(self.mask_mod, "__name__", type(self.mask_mod).__name__)
        head = (f"BlockMask(shape=(B={B}, H={H}, Q_LEN={Q_LEN}, KV_LEN={KV_LEN}), "
                f"BLOCK_SIZE={self.BLOCK_SIZE}, sparsity={self.sparsity():.2f}%, mask_mod={name})")
        nq, nkv = self.kv_indices.shape[-2:]
        if nq <= 32 and nkv <= 32:
            return head + "\n" + self.to_string()
        return head


def _check_block_size(BLOCK_SIZE) -> tuple:
    sizes = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else tuple(BLOCK_SIZE)
    if len(sizes) != 2 or any(not isinstance(s, int) or s < 16 or s & (s - 1) for s in sizes):
        raise reported(expected("BLOCK_SIZE", "a power of two >= 16, or a (Q_BLOCK, KV_BLOCK) pair of "
                                "them", BLOCK_SIZE, "use 128 (the default) or 64"))
    return sizes


def _check_length(name, value, allow_none=False):
    if value is None and allow_none:
        return 1
    if not isinstance(value, (int, torch.SymInt)) or isinstance(value, bool) or value < 1:
        raise reported(expected(name, "a positive int" + (" or None (broadcast)" if allow_none else ""),
                                repr(value), f"pass the {name} of your inputs"))
    return value


def default_device():
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=None, BLOCK_SIZE=128,
                      _compile=False) -> BlockMask:
    """The ``BlockMask`` of ``mask_mod(b, h, q_idx, kv_idx)`` over ``[B, H, Q_LEN, KV_LEN]``.

    ``B`` / ``H`` = None build one mask shared by every batch / head (the mod
    then sees b = 0 / h = 0). ``device`` defaults to CUDA when available, else
    CPU. ``BLOCK_SIZE`` is the sparse block size (an int or a (Q, KV) pair).
    ``_compile`` is accepted for torch compatibility (flexgen's builder is always
    compiled). Memory is O(B * H * NQ * NKV), never O(Q_LEN * KV_LEN). Works inside
    torch.compile (one ``flexgen::block_mask`` op).
    """
    from ..runtime.ops import call_block_mask
    Bn, Hn = _check_length("B", B, True), _check_length("H", H, True)
    Q_LEN, KV_LEN = _check_length("Q_LEN", Q_LEN), _check_length("KV_LEN", KV_LEN)
    q_block, kv_block = _check_block_size(BLOCK_SIZE)
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    traced = trace_cached(mask_mod, "mask_mod")
    buf = call_block_mask(traced.buffers, traced.graph, Bn, Hn, Q_LEN, KV_LEN, q_block, kv_block, device)
    lists = layout(Bn, Hn, -(-Q_LEN // q_block), -(-KV_LEN // kv_block)).views(buf)
    return BlockMask(*lists, (q_block, kv_block), mask_mod, (Q_LEN, KV_LEN))


def mask_inputs(block_mask) -> tuple:
    """What the ops take of a block mask: (mask program text, its captured tensors, the eight
    lists, (Q_BLOCK, KV_BLOCK), (Q_LEN, KV_LEN)); a flexgen or a torch BlockMask, or None.

    torch's masks may lack the full-block lists (``separate_full_blocks=False``): empty
    ones stand in. torch's "no mask" marker (BLOCK_SIZE 2**30) counts as no mask.
    """
    if block_mask is None:
        return "", (), (), (), ()
    if isinstance(block_mask, BlockMask):
        traced = block_mask.traced()
        lists = tuple(getattr(block_mask, n) for n in LIST_NAMES)
    elif _is_torch_block_mask(block_mask):
        if tuple(block_mask.BLOCK_SIZE) == (LARGE_SPARSE_BLOCK, LARGE_SPARSE_BLOCK):
            return "", (), (), (), ()
        if block_mask.q_indices is None:
            raise reported(expected("block_mask", "a torch BlockMask with its q lists (for the backward "
                                    "pass too)", "one built with compute_q_blocks=False",
                                    "build it with create_block_mask or BlockMask.from_kv_blocks"))
        traced = trace_cached(block_mask.mask_mod, "mask_mod")
        lists = tuple(getattr(block_mask, n) for n in LIST_NAMES)
        if lists[2] is None:
            lists = (lists[0], lists[1], torch.zeros_like(lists[0]), torch.zeros_like(lists[1]),
                     *lists[4:6], torch.zeros_like(lists[4]), torch.zeros_like(lists[5]))
    else:
        raise reported(expected("block_mask", "a BlockMask (flexgen's or torch's) or None",
                                type(block_mask).__name__, "build it with create_block_mask"))
    return traced.graph, traced.buffers, lists, tuple(block_mask.BLOCK_SIZE), tuple(block_mask.seq_lengths)


def _is_torch_block_mask(obj) -> bool:
    flex = getattr(torch.nn.attention, "flex_attention", None)
    return flex is not None and isinstance(obj, flex.BlockMask)


def create_mask(mod, B, H, Q_LEN, KV_LEN, device=None) -> torch.Tensor:
    """The dense bool mask ``[B, H, Q_LEN, KV_LEN]`` of a mask_mod (or ``score_mod != -inf``).

    This materializes O(Q_LEN * KV_LEN) memory: for inspection and tests.
    """
    from ..reference import dense_mask, index_grids
    device = torch.device(device) if device is not None else default_device()
    Bn, Hn = B or 1, H or 1
    names = getattr(getattr(mod, "__code__", None), "co_argcount", 4)
    if names == 5:
        b, h, q, kv = index_grids(Bn, Hn, Q_LEN, KV_LEN, device)
        scores = torch.zeros(Bn, Hn, Q_LEN, KV_LEN, device=device)
        return mod(scores, b, h, q, kv) != float("-inf")
    return dense_mask(mod, Bn, Hn, Q_LEN, KV_LEN, device)
