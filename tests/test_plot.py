"""BlockMask.plot: the picture's colours follow the mask and the block states."""
from __future__ import annotations

import builtins
import sys

import pytest
import torch

import flexgen
from flexgen import create_block_mask
from flexgen import mods as M
from flexgen.masks import plot as P

# Front-end checks (tracing, masks, mods and their kernels' numerics): CI runs them with the
# newest Triton; its second pass compiles their launches from the first pass's record.
pytestmark = pytest.mark.once

pytest.importorskip("matplotlib")


def causal_mask_64():
    return create_block_mask(M.causal_mask, 1, 1, 64, 64, device="cpu", BLOCK_SIZE=16)


def test_colours_follow_mask_and_blocks():
    block_mask = create_block_mask(M.sliding_window(40), 1, 1, 70, 50, device="cpu", BLOCK_SIZE=16)
    keep, colours, counts = P.element_picture(block_mask)
    assert keep.shape == (70, 50) and colours.shape == (70, 50, 3)
    assert counts["wrong"] == 0
    states = block_mask.block_states()[0, 0]
    assert counts == {"full": int((states == 2).sum()), "partial": int((states == 1).sum()),
                      "empty": int((states == 0).sum()), "wrong": 0}
    full, partial_kept = torch.tensor(P.FULL_KEPT), torch.tensor(P.PARTIAL_KEPT)
    assert torch.equal(colours[40, 30], full)          # q - kv = 10, block (2, 1) is full
    assert torch.equal(colours[17, 17], partial_kept)  # on the diagonal
    assert torch.equal(colours[17, 18], torch.tensor(P.PARTIAL_MASKED))
    assert torch.equal(colours[69, 0], torch.tensor(P.EMPTY))


def test_wrong_block_states_are_flagged():
    # The block lists of a sliding window, paired with the causal mask_mod: blocks
    # the window skips hold positions the causal mask keeps.
    window = create_block_mask(M.sliding_window(8), 1, 1, 64, 64, device="cpu", BLOCK_SIZE=16)
    lying = flexgen.BlockMask.from_states(window.block_states(), window.BLOCK_SIZE,
                                          M.causal_mask, window.seq_lengths)
    _, colours, counts = P.element_picture(lying)
    assert counts["wrong"] > 0
    assert torch.equal(colours[63, 0], torch.tensor(P.WRONG))
    fig = lying.plot()
    assert "disagree" in fig.axes[0].get_title()


def test_plot_returns_figure_and_writes_png(tmp_path):
    path = tmp_path / "causal.png"
    fig = causal_mask_64().plot(path)
    assert type(fig).__name__ == "Figure"
    title = fig.axes[0].get_title()
    assert "causal_mask" in title and "sparsity 37.5%" in title and "6 empty" in title
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    causal_mask_64().plot(str(tmp_path / "again.png"))
    assert (tmp_path / "again.png").stat().st_size > 1000


def test_plot_refuses_long_sequences():
    block_mask = create_block_mask(M.causal_mask, 1, 1, 300, 100, device="cpu")
    with pytest.raises(flexgen.InputError, match="build a smaller mask for the picture"):
        block_mask.plot()
    assert block_mask.plot(max_len=300) is not None
    with pytest.raises(flexgen.InputError, match="max_len"):
        causal_mask_64().plot(max_len=0)
    with pytest.raises(flexgen.InputError, match="path"):
        causal_mask_64().plot(path=3)


def test_missing_matplotlib_is_a_clear_error(monkeypatch):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(flexgen.FlexgenError, match=r"pip install matplotlib"):
        causal_mask_64().plot()
