"""Lowered forms: a value mod's float constants are parameters of its lowered form, and the
forms of everyday mods ship with flexgen (flexgen.frontend.seeds, mods/lowered.json)."""
from __future__ import annotations

import json

import pytest
import torch

import flexgen
from flexgen import create_block_mask
from flexgen.frontend import lowering, seeds
from flexgen.frontend.program import lowered_form
from flexgen.frontend.trace import trace
from flexgen.mods import alibi, causal_mask, tanh_softcap
from conftest import run_and_check

# Front-end checks (tracing, masks, mods and their kernels' numerics): CI runs them with the
# newest Triton; its second pass compiles their launches from the first pass's record.
pytestmark = pytest.mark.once


def _form(mod, kind="score_mod"):
    return lowered_form(trace(mod, kind).graph, parameters=kind != "mask_mod")


def test_float_constants_met_by_traced_values_are_parameters():
    form, values = _form(lambda score, b, h, q_idx, kv_idx: 37.3 * torch.tanh(score / 37.3))
    assert values == (37.3,)
    assert "37.3" not in form and "param f 0" in form and "program score_mod mod;" in form
    # The name is not part of the form; neither is the cap.
    assert _form(tanh_softcap(2.1))[0] == form


@pytest.mark.parametrize("mod", [
    lambda score, b, h, q_idx, kv_idx: score + torch.exp(torch.tensor(0.5)),    # feeds exp
    lambda score, b, h, q_idx, kv_idx: score * 0.0 + score * 1.0,              # zero, one
    lambda score, b, h, q_idx, kv_idx: score + float("inf") * (q_idx < 0),      # infinite
    lambda score, b, h, q_idx, kv_idx: score ** 1.5,                            # an exponent
])
def test_constants_whose_value_shapes_the_form_stay_values(mod):
    assert _form(mod)[1] == ()


def test_constants_written_as_structure_stay_values():
    # Integers and fractions over powers of two: sympy simplifies and merges with them.
    assert _form(lambda score, b, h, q_idx, kv_idx: score * 2.0 / 2.0 + 0.0)[1] == ()
    assert _form(lambda score, b, h, q_idx, kv_idx: score - 0.03125 * kv_idx + q_idx / 32.0)[1] == ()
    assert _form(tanh_softcap(50.0))[1] == ()
    assert _form(lambda score, b, h, q_idx, kv_idx: score * 0.1)[1] == (0.1,)


def test_mask_mods_keep_their_constants():
    form, values = _form(lambda b, h, q_idx, kv_idx: (q_idx - kv_idx) * 0.5 < 3.0, "mask_mod")
    assert values == () and "0.5" in form and "3.0" in form


def test_a_new_constant_is_lowered_without_sympy(monkeypatch):
    def softcap(cap):
        return lambda score, b, h, q_idx, kv_idx: cap * torch.tanh(score / cap + torch.sin(score))
    first = lowering.lower(trace(softcap(3.3), "score_mod"))
    calls = []
    monkeypatch.setattr(lowering, "_lower", lambda *a: calls.append(a))
    second = lowering.lower(trace(softcap(-0.13), "score_mod"))
    assert calls == []
    assert "(-0.13)" in second.snippet.result and "3.3" in first.snippet.result
    assert second.snippet.result.replace("(-0.13)", "3.3") == first.snippet.result


@pytest.mark.parametrize("cap", [0.37, 50.0, -3.0, 1e-3, 1e4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parameters_keep_the_forward_exact(cap, dtype):
    g = torch.Generator().manual_seed(int(abs(cap) * 100))
    q, k, v = (torch.randn(1, 2, 70, 32, generator=g).to(dtype) for _ in range(3))
    bm = create_block_mask(causal_mask, None, None, 70, 70, device="cpu", BLOCK_SIZE=32)
    run_and_check(q, k, v, score_mod=lambda score, b, h, q_idx, kv_idx: cap * torch.tanh(score / cap),
                  block_mask=bm, kernel_options={"BLOCK_M": 32, "BLOCK_N": 32})
    run_and_check(q, k, v, score_mod=alibi(6), kernel_options={"BLOCK_M": 32, "BLOCK_N": 32})


def test_parameters_keep_the_backward_exact():
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=g, dtype=torch.float64).float().requires_grad_()
               for _ in range(3))

    def mod(score, b, h, q_idx, kv_idx):
        return 7.5 * torch.tanh(score / 7.5) - 0.25 * (q_idx - kv_idx)
    out = flexgen.flex_attention(q, k, v, score_mod=mod)
    out.square().sum().backward()
    grads = [t.grad for t in (q, k, v)]
    from flexgen.reference import flex_attention_reference
    q2, k2, v2 = (t.detach().double().requires_grad_() for t in (q, k, v))
    flex_attention_reference(q2, k2, v2, score_mod=mod, dtype=torch.float64).square().sum().backward()
    for got, want in zip(grads, (q2.grad, k2.grad, v2.grad)):
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


def test_shipped_forms_are_current():
    import sympy
    shipped = json.loads((seeds.Path(str(seeds.importlib.resources.files("flexgen.mods"))) / seeds.FILE)
                         .read_text())
    if shipped["sympy"] != sympy.__version__:
        pytest.skip(f"forms shipped from sympy {shipped['sympy']}, this is {sympy.__version__}")
    assert shipped == json.loads(json.dumps(seeds.build())), "regenerate them: python -m flexgen.frontend.seeds"


def test_shipped_forms_are_found_first(monkeypatch):
    calls = []
    monkeypatch.setattr(lowering, "_lower", lambda *a: calls.append(a))
    monkeypatch.setattr(lowering, "_FORMS", {})
    monkeypatch.setattr(lowering, "_LOWERED", {})
    monkeypatch.setenv("FLEXGEN_RESTART_INDEX", "0")
    for mod, kind in seeds.examples():
        lowering.lower(trace(mod, kind))
    lowering.lower(trace(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, "mask_mod"))
    lowering.lower(trace(tanh_softcap(12.3), "score_mod"))
    assert calls == []
    assert len(seeds.table()) == len({lowered_form(trace(m, k).graph, k != "mask_mod")[0]
                                      for m, k in seeds.examples()})


def test_a_damaged_shipped_file_falls_back_to_sympy(monkeypatch):
    monkeypatch.setattr(seeds, "table", lambda: {f"s\n{_form(tanh_softcap(3.3))[0]}": {"lines": 7}})
    monkeypatch.setattr(lowering, "_FORMS", {})
    monkeypatch.setattr(lowering, "_LOWERED", {})
    monkeypatch.setenv("FLEXGEN_RESTART_INDEX", "0")
    lowered = lowering.lower(trace(tanh_softcap(3.3), "score_mod"))
    assert "_tanh" in lowered.snippet.result and "3.3" in lowered.snippet.result


def test_a_parameter_that_meets_only_constants_is_lowered_with_its_value(monkeypatch):
    # q * 0 - 1.3: sympy cancels q * 0, so the constant meets only 0; log of it folds to NaN
    # in torch's arithmetic, which the lowering can do with the value only.
    mod = lambda score, b, h, q_idx, kv_idx: torch.maximum(score, torch.log(q_idx * 0 - 1.3))  # noqa: E731
    assert _form(mod)[1] == (1.3,)
    lowered = lowering.lower(trace(mod, "score_mod"))
    assert "_flexgen_param" not in lowered.snippet.result and "nan" in lowered.snippet.result
    # The form is remembered as one that needs its values.
    form = f"s\n{_form(mod)[0]}"
    assert lowering._FORMS[form] is lowering.VALUE_DEPENDENT
