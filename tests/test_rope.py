"""RoPE fused into PagedKVCache.append: the cached keys and the returned query against a plain
torch rotation (flexgen.kernels.rope.rotate, checked itself against the textbook formulas),
for NeoX and GPT-J layouts, partial rotary dims, linear and Llama-3 scaling, positions
continuing from the cached lengths across page boundaries."""
from __future__ import annotations

import math

import pytest
import torch

import flexgen
from flexgen import InputError, PagedKVCache, RoPE
from flexgen.kernels.rope import rotate

# Front-end checks (tracing, masks, mods and their kernels' numerics): CI runs them with the
# newest Triton; its second pass compiles their launches from the first pass's record.
pytestmark = pytest.mark.once

LLAMA3 = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def test_rotate_matches_the_formulas():
    x = torch.randn(3, 32, dtype=torch.float64)
    pos = torch.tensor([0, 5, 77])
    freq = 1.0 / 500.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    ang = pos[:, None] * freq
    # GPT-J, rotary_dim 16 of 32: pairs (2j, 2j + 1)
    got = rotate(x, pos, RoPE(theta=500.0, rotary_dim=16, interleaved=True))
    a, b = x[:, 0:16:2], x[:, 1:16:2]
    assert torch.allclose(got[:, 0:16:2], a * ang.cos() - b * ang.sin(), atol=1e-5)
    assert torch.allclose(got[:, 1:16:2], b * ang.cos() + a * ang.sin(), atol=1e-5)
    assert torch.equal(got[:, 16:], x[:, 16:])
    # NeoX, linear scaling 2: the angle halves
    got = rotate(x, pos, RoPE(theta=500.0, rotary_dim=16, scaling={"type": "linear", "factor": 2.0}))
    a, b = x[:, :8], x[:, 8:16]
    half = ang / 2
    assert torch.allclose(got[:, :8], a * half.cos() - b * half.sin(), atol=1e-5)
    # Llama 3: high frequencies kept, low ones divided by the factor
    f = RoPE(theta=10000.0, scaling=LLAMA3).inv_freq(32, "cpu").double()
    plain = RoPE(theta=10000.0).inv_freq(32, "cpu").double()
    wavelen = 2 * math.pi / plain
    assert torch.allclose(f[wavelen < 16], plain[wavelen < 16])
    assert torch.allclose(f[wavelen > 64], plain[wavelen > 64] / 8)


@pytest.mark.parametrize("rope", [
    RoPE(theta=10000.0),
    RoPE(theta=1000.0, rotary_dim=16, interleaved=True, scaling={"type": "linear", "factor": 4.0}),
    RoPE(theta=500000.0, rotary_dim=24, scaling=LLAMA3),
], ids=["neox", "gptj-partial-linear", "neox-partial-llama3"])
def test_append_rotates_keys_and_query_across_pages(rope):
    Hkv, Hq, D, page = 2, 4, 32, 8
    cache = PagedKVCache(num_pages=16, page_size=page, num_kv_heads=Hkv, head_dim=D, max_batch=3,
                         max_pages_per_seq=8, dtype=torch.float32, device="cpu")
    slots = [cache.add_sequence() for _ in range(2)]
    keys = {s: [] for s in slots}
    # A prefill of 11 and 5 tokens (row 1 padded), then two decode steps: positions cross pages.
    for L, counts in ((11, [11, 5]), (1, [1, 1]), (1, [1, 1])):
        start = [cache.length(s) for s in slots]
        k, v = torch.randn(2, Hkv, L, D), torch.randn(2, Hkv, L, D)
        q = torch.randn(2, Hq, L, D)
        q_rot = cache.append(slots, k, v, counts=counts, rope=rope, query=q)
        pos = torch.tensor(start)[:, None] + torch.arange(L)
        torch.testing.assert_close(q_rot, rotate(q, pos[:, None, :], rope), atol=1e-5, rtol=1e-5)
        want = rotate(k, pos[:, None, :], rope)
        for b, s in enumerate(slots):
            keys[s].append(want[b, :, :counts[b]])
    for s in slots:
        k_cached, _ = cache.gather(s)
        torch.testing.assert_close(k_cached, torch.cat(keys[s], dim=1), atol=1e-5, rtol=1e-5)


def test_rope_errors():
    cache = PagedKVCache(num_pages=4, page_size=8, num_kv_heads=1, head_dim=16, max_batch=1,
                         max_pages_per_seq=4, dtype=torch.float32, device="cpu")
    s = cache.add_sequence()
    k = torch.randn(1, 1, 2, 16)
    with pytest.raises(InputError, match="RoPE.rotary_dim"):
        cache.append([s], k, k, rope=RoPE(rotary_dim=7))
    with pytest.raises(InputError, match="query"):
        cache.append([s], k, k, rope=RoPE(), query=torch.randn(1, 3, 2, 16).transpose(1, 3))
    with pytest.raises(InputError, match="query.*None without rope"):
        cache.append([s], k, k, query=torch.randn(1, 1, 2, 16))
    with pytest.raises(InputError, match="RoPE.scaling"):
        cache.append([s], k, k, rope=RoPE(scaling={"type": "yarn", "factor": 2.0}))
    assert cache.length(s) == 0
    assert flexgen.RoPE is RoPE
