"""Pictures of block masks: the element mask with the block grid laid over it.

``BlockMask.plot`` (which calls ``plot_block_mask``) evaluates the mask_mod
on every position of the first batch and head (``flexgen.reference.dense_mask``,
O(Q_LEN * KV_LEN) memory, hence the ``max_len`` limit) and colours each
position by whether it is kept and by the state of its block:

- full block (kernel skips mask_mod): dark blue;
- partial block (kernel applies mask_mod): orange where kept, pale orange where masked;
- empty block (kernel skips the block): light grey;
- a kept position in an empty block, or a masked one in a full block: magenta.
  That never happens for a correct ``BlockMask``; the title counts them.

matplotlib is imported only when a picture is drawn (``pip install matplotlib``,
or ``pip install 'flexgen[plot]'``); flexgen itself does not need it.
"""
from __future__ import annotations

import os

import torch

from ..errors import FlexgenError, expected

# RGB colours (colour-blind safe: blue / orange / grey, magenta for errors).
FULL_KEPT = (0.13, 0.40, 0.67)        # '#2166ac'
PARTIAL_KEPT = (0.90, 0.38, 0.00)     # '#e66101'
PARTIAL_MASKED = (0.99, 0.86, 0.70)   # '#fddbb3'
EMPTY = (0.94, 0.94, 0.94)            # '#f0f0f0'
WRONG = (0.81, 0.00, 0.55)            # '#ce008c'
GRID = (0.25, 0.25, 0.25)

EMPTY_STATE, PARTIAL_STATE, FULL_STATE = 0, 1, 2   # BlockMask.block_states() values


def _matplotlib():
    """(Figure, Patch) from matplotlib, imported on first use; FlexgenError when it is missing."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise FlexgenError(
            "BlockMask.plot: expected matplotlib to be installed, got ImportError "
            f"({exc}). Fix: pip install matplotlib (or pip install 'flexgen[plot]')") from exc
    return Figure, Patch


def _mod_name(mask_mod) -> str:
    if mask_mod is None:
        return "no mask_mod"
    return getattr(mask_mod, "__name__", type(mask_mod).__name__)


def element_picture(block_mask, max_len: int = 256):
    """(keep, colours, counts) for the first batch and head of ``block_mask``.

    ``keep`` is the bool ``[Q_LEN, KV_LEN]`` mask, ``colours`` a float
    ``[Q_LEN, KV_LEN, 3]`` RGB image in the colours of this module, and
    ``counts`` a dict with the number of ``full``, ``partial`` and ``empty``
    blocks and of ``wrong`` positions (kept in an empty block or masked in a
    full one). Raises InputError when a length exceeds ``max_len``.
    """
    from ..reference import dense_mask

    if not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 1:
        raise expected("max_len", "a positive int", repr(max_len), "pass e.g. max_len=256")
    Q_LEN, KV_LEN = block_mask.seq_lengths
    if Q_LEN > max_len or KV_LEN > max_len:
        raise expected(
            "block_mask", f"Q_LEN and KV_LEN <= max_len={max_len} for a picture (one cell per position)",
            f"Q_LEN={Q_LEN}, KV_LEN={KV_LEN}",
            f"build a smaller mask for the picture, e.g. create_block_mask(mask_mod, 1, 1, "
            f"{min(Q_LEN, max_len)}, {min(KV_LEN, max_len)}, BLOCK_SIZE=16), or pass a larger max_len")
    q_block, kv_block = block_mask.BLOCK_SIZE
    states = block_mask.block_states()[0, 0].cpu()
    keep = dense_mask(block_mask.mask_mod, 1, 1, Q_LEN, KV_LEN, block_mask.device)[0, 0].cpu()

    # The state of the block each position falls in, [Q_LEN, KV_LEN].
    rows = torch.arange(Q_LEN) // q_block
    cols = torch.arange(KV_LEN) // kv_block
    state = states[rows[:, None], cols[None, :]]

    palette = torch.tensor([EMPTY, PARTIAL_MASKED, PARTIAL_KEPT, FULL_KEPT, WRONG])
    index = torch.full((Q_LEN, KV_LEN), 0, dtype=torch.long)
    index[(state == PARTIAL_STATE) & ~keep] = 1
    index[(state == PARTIAL_STATE) & keep] = 2
    index[(state == FULL_STATE) & keep] = 3
    wrong = ((state == EMPTY_STATE) & keep) | ((state == FULL_STATE) & ~keep)
    index[wrong] = 4
    counts = {
        "full": int((states == FULL_STATE).sum()),
        "partial": int((states == PARTIAL_STATE).sum()),
        "empty": int((states == EMPTY_STATE).sum()),
        "wrong": int(wrong.sum()),
    }
    return keep, palette[index], counts


def title(block_mask, counts: dict) -> str:
    """The figure title: the mod, the sizes and the block counts behind the sparsity."""
    Q_LEN, KV_LEN = block_mask.seq_lengths
    q_block, kv_block = block_mask.BLOCK_SIZE
    total = counts["full"] + counts["partial"] + counts["empty"]
    lines = [
        _mod_name(block_mask.mask_mod),
        f"Q_LEN={Q_LEN}, KV_LEN={KV_LEN}, BLOCK_SIZE=({q_block}, {kv_block}); batch 0, head 0",
        f"{counts['full']} full, {counts['partial']} partial, {counts['empty']} empty of {total} "
        f"blocks; sparsity {100.0 * counts['empty'] / total if total else 0.0:.1f}%",
    ]
    if counts["wrong"]:
        lines.append(f"{counts['wrong']} positions disagree with their block's state (magenta)")
    return "\n".join(lines)


def plot_block_mask(block_mask, path=None, max_len: int = 256):
    """A matplotlib ``Figure`` of ``block_mask``'s element mask with the block grid overlaid.

    Only the first batch and head are drawn. Positions are coloured by their
    block's state (full, partial, empty; see the module docstring), grid lines
    mark the ``BLOCK_SIZE`` blocks, and the title gives the block counts and
    the sparsity (percentage of blocks skipped). With ``path`` (str or
    path-like) the figure is also written there, as PNG unless the suffix
    names another format matplotlib knows. Raises InputError when Q_LEN or
    KV_LEN exceeds ``max_len``: the picture has one cell per position.

    The figure is not registered with pyplot: a notebook shows it when it is
    a cell's value (after ``%matplotlib inline``), and nothing needs closing.
    """
    Figure, Patch = _matplotlib()
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise expected("path", "a file path (str or os.PathLike) or None", type(path).__name__,
                       "pass e.g. path='mask.png'")
    keep, colours, counts = element_picture(block_mask, max_len)
    Q_LEN, KV_LEN = keep.shape
    q_block, kv_block = block_mask.BLOCK_SIZE

    width = 6.0
    # The axes take about 5 of the 6 inches of width; title and legend about 1.8 of height.
    height = min(max(5.0 * Q_LEN / KV_LEN, 0.6), 10.0) + 1.8
    # Not registered with pyplot: no global state, nothing to close.
    fig = Figure(figsize=(width, height), layout="constrained")
    ax = fig.add_subplot()
    ax.imshow(colours.numpy(), interpolation="nearest", aspect="equal",
              extent=(-0.5, KV_LEN - 0.5, Q_LEN - 0.5, -0.5))
    for x in range(kv_block, KV_LEN, kv_block):
        ax.axvline(x - 0.5, color=GRID, linewidth=1.0)
    for y in range(q_block, Q_LEN, q_block):
        ax.axhline(y - 0.5, color=GRID, linewidth=1.0)
    ax.set_xlim(-0.5, KV_LEN - 0.5)
    ax.set_ylim(Q_LEN - 0.5, -0.5)
    ax.set_xlabel("kv_idx")
    ax.set_ylabel("q_idx")
    ax.xaxis.set_label_position("top")
    ax.xaxis.tick_top()
    ax.set_title(title(block_mask, counts), fontsize=9)

    legend = [Patch(facecolor=FULL_KEPT, label="full block"),
              Patch(facecolor=PARTIAL_KEPT, label="partial: kept"),
              Patch(facecolor=PARTIAL_MASKED, label="partial: masked"),
              Patch(facecolor=EMPTY, edgecolor=GRID, linewidth=0.5, label="empty block")]
    if counts["wrong"]:
        legend.append(Patch(facecolor=WRONG, label="wrong block state"))
    fig.legend(handles=legend, loc="outside lower center", ncols=len(legend), fontsize=8,
               frameon=False, handlelength=1.2, columnspacing=1.0)
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig
