"""2-D neighborhood attention (NATTEN, Hassani et al., 2023) over an image.

Tokens are the pixels of a ``height x width`` image in row-major order
(token ``t`` is pixel ``(t // width, t % width)``). A pixel sees a
``kernel_h x kernel_w`` window around it. By default the window is clamped
at the borders like NATTEN's: it slides inward so it always holds
``kernel_h * kernel_w`` pixels (a corner pixel sees the corner window, not
a quarter of one). With ``clamp_at_border=False`` the window is simply
centred and cut off by the borders. The picture is a band of blocks, one
block row per image row::

    neighborhood_2d(4, 4, 3, 3)        neighborhood_2d(4, 4, 3, 3,
                                       clamp_at_border=False)

    █ █ █ · █ █ █ · █ █ █ · · · · ·    █ █ · · █ █ · · · · · · · · · ·
    █ █ █ · █ █ █ · █ █ █ · · · · ·    █ █ █ · █ █ █ · · · · · · · · ·
    · █ █ █ · █ █ █ · █ █ █ · · · ·    · █ █ █ · █ █ █ · · · · · · · ·
    · █ █ █ · █ █ █ · █ █ █ · · · ·    · · █ █ · · █ █ · · · · · · · ·
    █ █ █ · █ █ █ · █ █ █ · · · · ·    █ █ · · █ █ · · █ █ · · · · · ·
    █ █ █ · █ █ █ · █ █ █ · · · · ·    █ █ █ · █ █ █ · █ █ █ · · · · ·
    · █ █ █ · █ █ █ · █ █ █ · · · ·    · █ █ █ · █ █ █ · █ █ █ · · · ·
    · █ █ █ · █ █ █ · █ █ █ · · · ·    · · █ █ · · █ █ · · █ █ · · · ·
    · · · · █ █ █ · █ █ █ · █ █ █ ·    · · · · █ █ · · █ █ · · █ █ · ·
    · · · · █ █ █ · █ █ █ · █ █ █ ·    · · · · █ █ █ · █ █ █ · █ █ █ ·
    · · · · · █ █ █ · █ █ █ · █ █ █    · · · · · █ █ █ · █ █ █ · █ █ █
    · · · · · █ █ █ · █ █ █ · █ █ █    · · · · · · █ █ · · █ █ · · █ █
    · · · · █ █ █ · █ █ █ · █ █ █ ·    · · · · · · · · █ █ · · █ █ · ·
    · · · · █ █ █ · █ █ █ · █ █ █ ·    · · · · · · · · █ █ █ · █ █ █ ·
    · · · · · █ █ █ · █ █ █ · █ █ █    · · · · · · · · · █ █ █ · █ █ █
    · · · · · █ █ █ · █ █ █ · █ █ █    · · · · · · · · · · █ █ · · █ █
"""
from __future__ import annotations

import torch

from flexgen.errors import expected

from ._check import positive_int


def neighborhood_2d(height, width, kernel_h, kernel_w, clamp_at_border=True):
    """mask_mod of a ``kernel_h x kernel_w`` window around each pixel.

    Kernel sizes are odd (the query pixel is the centre) and at most the
    image size. The sequence length must be ``height * width``.
    Clamped (default): pixel ``(i, j)`` sees rows
    ``s .. s + kernel_h - 1`` with ``s = clamp(i - kernel_h // 2, 0, height - kernel_h)``,
    and likewise for columns. Unclamped: ``|Δrow| <= kernel_h // 2`` and
    ``|Δcol| <= kernel_w // 2``.
    """
    height = positive_int("height", height, "pass the image height in pixels")
    width = positive_int("width", width, "pass the image width in pixels")
    for name, k, size in (("kernel_h", kernel_h, height), ("kernel_w", kernel_w, width)):
        positive_int(name, k, "pass an odd kernel size, e.g. 7")
        if k % 2 == 0 or k > size:
            raise expected(name, f"an odd size <= {size} (the image side)", k,
                           "pass an odd kernel size no larger than the image")
    half_h, half_w = kernel_h // 2, kernel_w // 2

    if not clamp_at_border:
        def neighborhood_mask(b, h, q_idx, kv_idx):
            near_row = abs(q_idx // width - kv_idx // width) <= half_h
            near_col = abs(q_idx % width - kv_idx % width) <= half_w
            return near_row & near_col
        return neighborhood_mask

    def clamped_neighborhood_mask(b, h, q_idx, kv_idx):
        kv_row, kv_col = kv_idx // width, kv_idx % width
        row0 = torch.clamp(q_idx // width - half_h, 0, height - kernel_h)
        col0 = torch.clamp(q_idx % width - half_w, 0, width - kernel_w)
        in_rows = (kv_row >= row0) & (kv_row < row0 + kernel_h)
        in_cols = (kv_col >= col0) & (kv_col < col0 + kernel_w)
        return in_rows & in_cols

    return clamped_neighborhood_mask
