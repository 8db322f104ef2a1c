"""Rotary position embeddings (RoPE), fused into the paged cache's append.

``RoPE`` describes the rotation; ``PagedKVCache.append(..., rope=RoPE(...), query=q)``
rotates the new keys at their logical positions while the paged_write kernel
writes them into their pages (and the query, returned rotated), so a decode step
needs no position tensor and no separate rotation kernel. ``rotate`` is the same
rotation in plain torch (the unfused path, and the tests' oracle).

Frequencies: ``inv_freq[j] = theta ** (-2j / rotary_dim)``, then the scaling:
``{"type": "linear", "factor": f}`` divides them by f (positions / f);
``{"type": "llama3", "factor": f, "low_freq_factor": lo, "high_freq_factor": hi,
"original_max_position_embeddings": n}`` divides the low frequencies by f, keeps the
high ones and blends in between (Llama 3.1's rule).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import expected

SCALINGS = ("linear", "llama3")


@dataclass(frozen=True)
class RoPE:
    """A rotary embedding: ``theta`` (base), ``rotary_dim`` (the leading dims rotated; None:
    all), ``interleaved`` (GPT-J's pairs (2j, 2j + 1); False: NeoX / Llama's halves
    (j, j + rotary_dim / 2)), ``scaling`` (None or a dict, see the module docstring)."""
    theta: float = 10000.0
    rotary_dim: int | None = None
    interleaved: bool = False
    scaling: dict | None = None

    def __hash__(self):
        return hash((self.theta, self.rotary_dim, self.interleaved,
                     None if self.scaling is None else tuple(sorted(self.scaling.items()))))

    def dims(self, head_dim: int) -> int:
        """The rotated dims for ``head_dim`` (checked: even, at most the head dim)."""
        r = head_dim if self.rotary_dim is None else self.rotary_dim
        if not isinstance(r, int) or isinstance(r, bool) or r < 2 or r % 2 or r > head_dim:
            raise expected("RoPE.rotary_dim", f"an even int from 2 to the head dim {head_dim}, or None",
                           repr(r), "rotate all dims (None) or an even leading part")
        return r

    def inv_freq(self, head_dim: int, device) -> torch.Tensor:
        """The rotation frequencies ``[rotary_dim / 2]`` float32 on ``device``, scaling applied."""
        r = self.dims(head_dim)
        if not isinstance(self.theta, (int, float)) or isinstance(self.theta, bool) or self.theta <= 1:
            raise expected("RoPE.theta", "a number > 1 (the base, e.g. 10000.0)", repr(self.theta),
                           "pass the model's rope_theta")
        freq = 1.0 / (float(self.theta) ** (torch.arange(0, r, 2, dtype=torch.float64) / r))
        s = self.scaling
        if s is not None:
            kind = s.get("type", s.get("rope_type")) if isinstance(s, dict) else None
            if kind not in SCALINGS:
                raise expected("RoPE.scaling", f"None or a dict with type in {list(SCALINGS)}", repr(s),
                               "e.g. {'type': 'linear', 'factor': 2.0}")
            factor = float(s["factor"])
            if kind == "linear":
                freq = freq / factor
            else:
                lo, hi = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
                n = float(s.get("original_max_position_embeddings", 8192))
                wavelen = 2 * math.pi / freq
                smooth = ((n / wavelen - lo) / (hi - lo)).clamp(0.0, 1.0)
                blended = (1 - smooth) * freq / factor + smooth * freq
                freq = torch.where(wavelen < n / hi, freq, torch.where(wavelen > n / lo, freq / factor,
                                                                       blended))
        return freq.to(torch.float32).to(device)


def rotate(x: torch.Tensor, positions: torch.Tensor, rope: RoPE) -> torch.Tensor:
    """``x [..., L, D]`` rotated at ``positions [..., L]`` (broadcast): the rotated dims computed in
    float32 and returned in x's dtype, the others unchanged."""
    D = x.shape[-1]
    r = rope.dims(D)
    angle = positions.to(torch.float32)[..., None] * rope.inv_freq(D, x.device)
    cos, sin = angle.cos(), angle.sin()
    rot, rest = x[..., :r].to(torch.float32), x[..., r:]
    if rope.interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    else:
        a, b = rot[..., : r // 2], rot[..., r // 2:]
        out = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
    return torch.cat((out.to(x.dtype), rest), dim=-1)


__all__ = ["RoPE", "rotate"]
