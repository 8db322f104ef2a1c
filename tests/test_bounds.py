"""Captured tensors indexed out of bounds: an error like torch's, on the host where it can be.

``flexgen.frontend.bounds_check`` checks every index that depends on positions
only, before launch, over the call's ranges; indices that depend on loaded data
are checked on the device in debug mode (``FLEXGEN_DEBUG=1``, in a subprocess
here: the flag is read at import) and otherwise read 0 past the end.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import flexgen
from flexgen import create_block_mask, flex_attention
from flexgen.frontend import bounds_check
from flexgen.frontend.bounds_check import IndexBoundsError, check_indices
from flexgen.frontend.lowering import lower
from flexgen.frontend.trace import trace
from flexgen import decode_attention
from flexgen.reference import flex_attention_reference
from conftest import run_and_check

OPTIONS = {"BLOCK_M": 32, "BLOCK_N": 32}


def _qkv(L, Lkv=None, B=1, H=2):
    return (torch.randn(B, H, n, 16) for n in (L, Lkv or L, Lkv or L))


def test_reads_past_a_short_tensor_raise_like_torch():
    """bias[q_idx] with a bias shorter than the queries read 0 past its end; torch raises."""
    bias = torch.randn(30)

    def query_bias(score, b, h, q_idx, kv_idx):
        return score + bias[q_idx]

    q, k, v = _qkv(40)
    with pytest.raises(IndexError):
        flex_attention_reference(q, k, v, query_bias)
    with pytest.raises(IndexBoundsError) as info:
        flex_attention(q, k, v, score_mod=query_bias)
    message = str(info.value)
    for words in ("score_mod 'query_bias'", "captured tensor 0 (shape [30])", "dim 0", "`q_idx`",
                  "from 0 to 39", "q_idx in [0, 40)", "-30..29", "Fix:"):
        assert words in message, (words, message)
    assert isinstance(info.value, flexgen.FlexgenError)
    q, k, v = _qkv(30)
    run_and_check(q, k, v, query_bias, kernel_options=OPTIONS)      # long enough: runs


def test_negative_indices_wrap_like_torch():
    bias = torch.randn(40)

    def from_the_end(score, b, h, q_idx, kv_idx):
        return score + bias[-1 - kv_idx]

    q, k, v = _qkv(40)
    run_and_check(q, k, v, from_the_end, kernel_options=OPTIONS)    # -40 .. -1: valid
    q, k, v = _qkv(20, 41)
    with pytest.raises(IndexError):
        flex_attention_reference(q, k, v, from_the_end)
    with pytest.raises(IndexBoundsError, match="from -41 to -1"):
        flex_attention(q, k, v, score_mod=from_the_end)


def test_every_dimension_and_position_is_checked():
    table = torch.randn(2, 50)

    def per_head(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + 20]

    q, k, v = _qkv(30, H=2)
    run_and_check(q, k, v, per_head, kernel_options=OPTIONS)         # -9 .. 49
    q, k, v = _qkv(30, H=3)
    with pytest.raises(IndexBoundsError, match="along dim 0: the index `h` takes values from 0 to 2"):
        flex_attention(q, k, v, score_mod=per_head)
    q, k, v = _qkv(31, H=2)
    with pytest.raises(IndexBoundsError, match="along dim 1"):
        flex_attention(q, k, v, score_mod=per_head)


def test_loose_interval_bounds_raise_nothing_torch_accepts():
    """q * kv // (kv + 1) <= q - 1: its interval bound reaches (Q-1)(KV-1), a real position never does."""
    bias = torch.randn(39)

    def ratio(score, b, h, q_idx, kv_idx):
        return score + bias[(q_idx * kv_idx) // (kv_idx + 1)]

    q, k, v = _qkv(40)
    run_and_check(q, k, v, ratio, kernel_options=OPTIONS)


def test_an_index_through_log_of_zero_is_checked_in_ieee_arithmetic():
    """bias[log(q_idx).long() + 3] reads at log(0) = -inf (sympy's exact value there is zoo, which
    once made the check pass silently): in IEEE arithmetic the index is -2**31 + 3, out of
    bounds, as torch finds. An index that takes log(0) only in a branch torch.where drops
    (T5's buckets, test_torch_compat) is in bounds."""
    bias = torch.randn(40)

    def log_position(score, b, h, q_idx, kv_idx):
        return score + bias[torch.log(q_idx.float()).long() + 3]

    q, k, v = _qkv(40)
    with pytest.raises(IndexError):
        flex_attention_reference(q, k, v, log_position)
    with pytest.raises(IndexBoundsError, match="from -2147483645 to 6"):
        flex_attention(q, k, v, score_mod=log_position)


def test_an_index_out_of_bounds_between_the_corners_is_found():
    """20 - |q_idx - 20| is 0 and 1 at the first and last query and 20 in between: checking the
    corners alone let it read masked zeros past a tensor of 10. So is a relative index, checked
    at every distance kv_idx - q_idx (|d| // 2 + 10 + d % 3 reaches 31 at d = 38)."""
    bias, table = torch.randn(10), torch.randn(31)

    def peak(score, b, h, q_idx, kv_idx):
        return score + bias[20 - (q_idx - 20).abs()]

    def relative(score, b, h, q_idx, kv_idx):
        d = kv_idx - q_idx
        return score + table[d.abs() // 2 + 10 + d % 3]

    q, k, v = _qkv(40)
    for mod, words in ((peak, "from 0 to 20"), (relative, "to 31")):
        with pytest.raises(IndexError):
            flex_attention_reference(q, k, v, mod)
        with pytest.raises(IndexBoundsError, match=words):
            flex_attention(q, k, v, score_mod=mod)
    q, k, v = _qkv(37)
    run_and_check(q, k, v, relative, kernel_options=OPTIONS)        # up to 29: runs


def test_mask_mods_are_checked_in_create_block_mask_and_the_call():
    doc = torch.zeros(40, dtype=torch.int32)

    def same_doc(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    mask = create_block_mask(same_doc, 1, 1, 40, 40, device="cpu", BLOCK_SIZE=32)
    with pytest.raises(IndexBoundsError, match="mask_mod 'same_doc'.*shape \\[40\\]"):
        create_block_mask(same_doc, 1, 1, 41, 41, device="cpu", BLOCK_SIZE=32)
    q, k, v = _qkv(40)
    run_and_check(q, k, v, block_mask=mask, kernel_options=OPTIONS)


def test_decode_checks_the_positions_of_its_longest_sequence():
    bias = torch.randn(30)

    def query_bias(score, b, h, q_idx, kv_idx):
        return score + bias[q_idx]

    q, k = torch.randn(2, 2, 4, 16), torch.randn(2, 2, 40, 16)
    decode_attention(q, k, k, score_mod=query_bias, kv_lengths=[30, 20])      # queries at 26..29
    with pytest.raises(IndexBoundsError, match="from 36 to 39"):
        decode_attention(q, k, k, score_mod=query_bias, kv_lengths=[30, 40])  # 36..39
    decode_attention(q, k, k, score_mod=query_bias, q_offsets=0)
    with pytest.raises(IndexBoundsError):
        decode_attention(q, k, k, score_mod=query_bias, q_offsets=[0, 27])
    with pytest.raises(IndexBoundsError):   # flex_attention's decode path: queries 0..3 of 40 keys
        flex_attention(q, k, k, score_mod=lambda s, b, h, q_idx, kv_idx: s + bias[kv_idx])


def test_decode_steps_with_tensors_sized_to_the_cache_repeat_one_memoized_check():
    """Every decode step has new lengths; a check over the whole cache does not change with them."""
    doc = torch.zeros(2, 64, dtype=torch.int32)

    def same_doc(b, h, q_idx, kv_idx):
        return doc[b, kv_idx] == doc[b, q_idx]

    q, k = torch.randn(2, 2, 1, 16), torch.randn(2, 2, 64, 16)
    decode_attention(q, k, k, mask_mod=same_doc, kv_lengths=[10, 20])
    entries = len(bounds_check._CHECKED)
    for step in range(3):
        decode_attention(q, k, k, mask_mod=same_doc, kv_lengths=[11 + step, 21 + step])
    assert len(bounds_check._CHECKED) == entries


def test_check_indices_is_a_pure_memoized_function_of_shapes_and_ranges():
    bias = torch.randn(30)
    lowered = lower(trace(lambda s, b, h, q_idx, kv_idx: s + bias[q_idx + kv_idx], "score_mod"))
    check_indices(lowered, "score_mod", "m", ((30,),), 1, 1, 15, 16)
    with pytest.raises(IndexBoundsError):
        check_indices(lowered, "score_mod", "m", ((30,),), 1, 1, 16, 16)
    check_indices(lowered, "score_mod", "m", ((30,),), 1, 1, (10, 20), 10)   # 10 .. 28
    check_indices(lowered, "score_mod", "m", ((30,),), 1, 1, None, 100)      # unknown q: not checked
    check_indices(lowered, "score_mod", "m", ((30,),), 1, 1, 0, 100)         # no positions
    entries = len(bounds_check._CHECKED)
    check_indices(lowered, "score_mod", "m", ((30,),), 2, 4, 15, 16)      # b, h unread: a memo hit
    assert len(bounds_check._CHECKED) == entries
    assert bounds_check.decode_ranges((2, 4, 3), None, None, [10, 50], 50) == [((1, 2), 4, (47, 50), 50),
                                                                                ((0, 1), 4, (7, 10), 10)]


def test_reads_that_depend_on_data_give_zero_past_the_end_without_debug_mode():
    """Not checkable on the host without reading the tensors: documented (README), pinned here."""
    bias = torch.randn(30)
    doc = torch.arange(40, dtype=torch.int32)        # 30..39 index past bias's end

    def doc_bias(score, b, h, q_idx, kv_idx):
        return score + bias[doc[q_idx]]

    padded = torch.cat([bias, torch.zeros(10)])

    def padded_bias(score, b, h, q_idx, kv_idx):
        return score + padded[doc[q_idx]]

    q, k, v = _qkv(40)
    out = flex_attention(q, k, v, score_mod=doc_bias, kernel_options=OPTIONS)
    torch.testing.assert_close(out.double(), flex_attention_reference(q, k, v, padded_bias),
                               atol=1e-4, rtol=1e-4)


_DEBUG_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch, triton
    import flexgen
    from flexgen.reference import flex_attention_reference
    from flexgen.runtime import aot

    bias = torch.randn(30)
    doc = torch.randint(0, 30, (40,), dtype=torch.int32)

    def doc_bias(score, b, h, q_idx, kv_idx):
        return score + bias[doc[q_idx]]

    def doc_mask(b, h, q_idx, kv_idx):
        return bias[doc[kv_idx]] > -1.0

    q = torch.randn(1, 2, 40, 16)
    report = {}
    with aot.recording() as launches:
        out = flexgen.flex_attention(q, q, q, score_mod=doc_bias)
    report["in_range_error"] = (out.double() - flex_attention_reference(q, q, q, doc_bias)).abs().max().item()
    spec, args, constexprs = launches[0]
    report["key"] = spec.key
    source = flexgen.kernel_source(q, q, q, score_mod=doc_bias)
    report["asserts"] = source.count("tl.device_assert(")
    report["jit_debug"] = "debug=True)" in source
    # The sm_90 compile keeps the asserts when Triton compiles in debug mode, as on the GPU.
    compile = triton.compile
    aot.triton.compile = lambda src, target, options: compile(src, target=target,
                                                              options=dict(options, debug=True))
    compiled = aot.compile_launch(spec, args, constexprs)
    report["ptx_asserts"] = compiled.asm["ptx"].count("__assertfail")
    doc[7] = 35                  # past bias's end, known only on the device
    for name, call in (("score_mod", lambda: flexgen.flex_attention(q, q, q, score_mod=doc_bias)),
                       ("mask_mod", lambda: flexgen.create_block_mask(doc_mask, 1, 1, 40, 40, device="cpu"))):
        try:
            call()
            report[name] = None
        except Exception as exc:
            report[name] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(report))
""")


def test_debug_mode_catches_reads_past_a_tensor_on_the_device(tmp_path):
    env = dict(os.environ, FLEXGEN_DEBUG="1", FLEXGEN_CACHE_DIR=str(tmp_path / "kernels"))
    done = subprocess.run([sys.executable, "-c", _DEBUG_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["in_range_error"] < 1e-4
    assert report["asserts"] == 2 and report["jit_debug"]         # one per load: doc, then bias
    assert report["ptx_asserts"] >= 1
    for kind in ("score_mod", "mask_mod"):
        assert report[kind] and "AssertionError" in report[kind], report[kind]
        assert f"the {kind} reads its captured tensor 1 out of bounds" in report[kind]

    # Debug and normal kernels never share a key.
    bias, doc = torch.randn(30), torch.randint(0, 30, (40,), dtype=torch.int32)
    q = torch.randn(1, 2, 40, 16)

    def doc_bias(score, b, h, q_idx, kv_idx):
        return score + bias[doc[q_idx]]

    from flexgen.runtime import aot
    with aot.recording() as launches:
        flex_attention(q, q, q, score_mod=doc_bias)
    assert not launches[0][0].debug and launches[0][0].key != report["key"]


# The index table (plain data, no sympy) and the sympy path agree on every affine index.
_TABLE = torch.zeros(40)
_GRID = torch.zeros(3, 50, dtype=torch.int64)
AFFINE_MODS = {
    "document": (lambda b, h, q_idx, kv_idx: _GRID[b, q_idx] == _GRID[b, kv_idx], "mask_mod"),
    "padding": (lambda b, h, q_idx, kv_idx: kv_idx < _GRID[0, b + 1], "mask_mod"),
    "relative": (lambda s, b, h, q_idx, kv_idx: s + _TABLE[q_idx - kv_idx + 19], "score_mod"),
    "reversed": (lambda s, b, h, q_idx, kv_idx: s + _TABLE[39 - 2 * kv_idx], "score_mod"),
    "negative": (lambda s, b, h, q_idx, kv_idx: s + _TABLE[kv_idx - q_idx - 1], "score_mod"),
    "constant": (lambda s, b, h, q_idx, kv_idx: s + _GRID[2, kv_idx], "score_mod"),
    "chained": (lambda s, b, h, q_idx, kv_idx: s + _TABLE[_GRID[b, q_idx]] * _TABLE[h], "score_mod"),
}


@pytest.mark.parametrize("name", sorted(AFFINE_MODS))
def test_the_index_table_agrees_with_sympy(name):
    import dataclasses
    mod, kind = AFFINE_MODS[name]
    traced = trace(mod, kind)
    lowered = lower(traced)
    assert lowered.index_table is not None
    slow = dataclasses.replace(lowered, index_table=None)
    shapes = tuple(tuple(t.shape) for t in traced.buffers)
    for ranges in [(1, 2, 20, 20), (3, 2, 40, 40), (2, 1, 50, 50), ((1, 2), 2, (5, 25), 30), (3, 2, None, 7)]:
        outcomes = []
        for m in (lowered, slow):
            try:
                check_indices(m, kind, "mod", shapes, *ranges)
                outcomes.append(None)
            except IndexBoundsError as err:
                outcomes.append(str(err))
        assert outcomes[0] == outcomes[1], (ranges, outcomes)
        if None not in ranges:
            plain = tuple(r if isinstance(r, int) else r for r in ranges)
            layout = [(tuple(t.shape), tuple(t.stride())) for t in traced.buffers]
            assert bounds_check._prove(lowered, layout, dict(zip(bounds_check._NAMES, map(bounds_check._half_open, plain)))) \
                == bounds_check._prove(slow, layout, dict(zip(bounds_check._NAMES, map(bounds_check._half_open, plain))))


def test_non_affine_indices_take_the_sympy_path():
    lowered = lower(trace(lambda s, b, h, q_idx, kv_idx: s + _TABLE[q_idx // 2], "score_mod"))
    assert lowered.index_table is None
    with pytest.raises(IndexBoundsError, match="q_idx // 2|floor"):
        check_indices(lowered, "score_mod", "mod", ((40,),), 1, 1, 100, 100)
