"""``attn_implementation="flexgen"`` in Hugging Face transformers
(``flexgen.integrations.transformers``).

Tiny models with random weights (no downloads), float32 on CPU, compared with transformers'
own attention: "eager" (plain matmul + softmax, which also applies Gemma 2's soft-cap and
GPT-OSS's sinks, where transformers' "sdpa" path does not) or "sdpa". All models share one
head dim and dtype, so their calls share the few kernels the suite compiles for sm_90.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5")

import flexgen  # noqa: E402
from flexgen.integrations import transformers as flexgen_hf  # noqa: E402

# torch / Hugging Face / distributed plumbing: CI's second pass compiles its kernels from the
# first pass's record instead of running it (conftest, FLEXGEN_TEST_RECORD_ONCE).
pytestmark = pytest.mark.once

flexgen_hf.register()

VOCAB = 128
# Weights far larger than transformers' default init (0.02): attention rows are peaked
# rather than uniform, so a mask or soft-cap mistake moves the logits well past tolerance.
INIT = 0.25
COMMON = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=128,
              initializer_range=INIT, tie_word_embeddings=False)
WINDOW = 5
# Longer than 16 queries: prefills take the forward kernel (up to 16, the decode kernel).
PROMPT = 19


def _config(family, **overrides):
    if family == "llama":
        return transformers.LlamaConfig(**COMMON, **overrides)
    if family == "mistral":
        return transformers.MistralConfig(**COMMON, sliding_window=WINDOW, **overrides)
    if family == "qwen2":
        # Layer 0 full attention, layer 1 a sliding window.
        return transformers.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=WINDOW,
                                        max_window_layers=1, **overrides)
    if family == "gemma2":
        # Alternating sliding / full layers; a soft-cap small enough to bend most scores.
        return transformers.Gemma2Config(**COMMON, sliding_window=WINDOW,
                                         attn_logit_softcapping=4.0, final_logit_softcapping=None,
                                         query_pre_attn_scalar=16, **overrides)
    if family == "gpt_oss":
        # Attention sinks (s_aux), alternating sliding / full layers, a small MoE.
        return transformers.GptOssConfig(**COMMON, sliding_window=WINDOW, num_local_experts=2,
                                         num_experts_per_tok=1, **overrides)
    if family == "llama4":
        # Layer 0 chunked attention (6 positions a chunk, counted from each row's first real
        # token), layer 1 full attention without RoPE; one expert.
        return transformers.Llama4TextConfig(**COMMON, attention_chunk_size=6, no_rope_layers=[1, 0],
                                             num_local_experts=1, interleave_moe_layer_step=1,
                                             intermediate_size_mlp=96, **overrides)
    raise ValueError(family)


def _pair(family, reference="eager", **overrides):
    """(flexgen model, reference model) with the same random weights, in eval mode."""
    # Two configs: from_config writes the attention implementation into the config it gets.
    ref = transformers.AutoModelForCausalLM.from_config(_config(family, **overrides),
                                                        attn_implementation=reference)
    model = transformers.AutoModelForCausalLM.from_config(_config(family, **overrides),
                                                          attn_implementation="flexgen")
    model.load_state_dict(ref.state_dict())
    assert model.config._attn_implementation == "flexgen"
    assert ref.config._attn_implementation == reference
    return model.eval(), ref.eval()


def _padded_batch(length=PROMPT):
    """Token ids [3, length] and their 2-D mask: row 0 left-padded, row 1 right-padded,
    row 2 unpadded."""
    ids = torch.randint(0, VOCAB, (3, length))
    mask = torch.ones(3, length, dtype=torch.long)
    mask[0, :4] = 0
    mask[1, -3:] = 0
    return ids, mask


def _close(got, want, atol=2e-4, rtol=2e-4):
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gemma2", "gpt_oss", "llama4"])
def test_logits_match_eager_with_left_and_right_padding(family):
    """Prefill logits of every real token equal eager's: GQA, the padding mask on either
    side, sliding windows (per layer type), Gemma 2's soft-cap, GPT-OSS's sinks, Llama 4's
    chunks (whose floor divisions of a padded position once rounded in float)."""
    model, ref = _pair(family)
    ids, mask = _padded_batch()
    with torch.no_grad():
        got = model(ids, attention_mask=mask).logits
        want = ref(ids, attention_mask=mask).logits
    real = mask.bool()
    _close(got[real], want[real])


def test_packed_sequences_match_sdpa():
    """Packed training batches (several sequences per row, told apart by position_ids that
    restart, no 2-D mask): transformers' mask function remaps q_idx and kv_idx through the
    position ids, and flexgen traces that too (sliding window included)."""
    model, ref = _pair("mistral", "sdpa")
    ids = torch.randint(0, VOCAB, (2, PROMPT))
    positions = torch.stack([torch.cat([torch.arange(8), torch.arange(PROMPT - 8)]),
                             torch.cat([torch.arange(3), torch.arange(PROMPT - 3)])])
    with torch.no_grad():
        got = model(ids, position_ids=positions).logits
        want = ref(ids, position_ids=positions).logits
    _close(got, want)


@pytest.mark.parametrize("family,cache,padded", [("mistral", "dynamic", True),
                                                ("gemma2", "static", True),
                                                ("llama", "static", False),
                                                ("llama4", "dynamic", True)])
def test_generate_matches(family, cache, padded):
    """Greedy generate() gives the reference's tokens and scores: prefill, then decode steps
    (one query against the cache, the cache's offsets in the mask). Padded: a left-padded
    batch. Static cache: the unused cache slots stay hidden, by the padded 2-D mask or, with
    no mask, by the causal mask at the right offset (the cache bumps its length counter in
    place before attention runs: the mask must hold the value it was built with). The
    windows (5) are shorter than the prompt: sliding layers keep only the window's keys, so
    the mask's key positions start past 0 (Mistral's dynamic cache) or roll (Gemma 2's
    static one)."""
    model, ref = _pair(family, "eager" if family == "gemma2" else "sdpa")
    ids, mask = _padded_batch(PROMPT)
    mask[1] = 1                                    # generate() expects left padding
    kwargs = dict(max_new_tokens=3, do_sample=False, output_scores=True,
                  return_dict_in_generate=True, pad_token_id=0)
    if padded:
        kwargs["attention_mask"] = mask
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    with torch.no_grad():
        got = model.generate(ids, **kwargs)
        want = ref.generate(ids, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    for g, w in zip(got.scores, want.scores):
        _close(g, w)


@pytest.mark.parametrize("family,layer", [("gemma2", "sliding_attention"),
                                          ("gpt_oss", "full_attention")])
def test_training_gradients_match_eager(family, layer):
    """One training step with padding and GQA: the loss and every parameter's gradient equal
    eager's. Gemma 2: the soft-cap's derivative in the backward kernels, through a sliding
    window. GPT-OSS: the sinks' gradient, which reaches q, k and v through the LSE (and
    the sinks themselves). One layer type each: the other mask is the logits tests' job."""
    model, ref = _pair(family, layer_types=[layer] * COMMON["num_hidden_layers"])
    ids, mask = _padded_batch()
    # Position j is scored on token j + 1: only where both are real. (A padded query sees no
    # key: flexgen gives it a zero output, eager the mean of all values; neither is used.)
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, 1:].masked_fill_(mask[:, :-1] == 0, -100)
    grads = []
    for m in (model, ref):
        m.train()
        loss = m(ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        grads.append((loss.detach(), {n: p.grad for n, p in m.named_parameters()}))
    (loss, got), (want_loss, want) = grads
    _close(loss, want_loss)
    assert got.keys() == want.keys()
    for name in want:
        _close(got[name], want[name], atol=1e-4, rtol=1e-3)


def test_compiled_fullgraph_prefill_and_decode_step():
    """torch.compile(model, fullgraph=True) with a static cache (transformers' setup for
    compiled decoding): a padded prefill and one decode step match eager. The block masks,
    the padding, the cache's offset (a tensor the cache bumps in place) and the unused cache
    slots are all handled inside the graph with no host sync (a graph break would raise).
    The aot_eager backend runs dynamo, the custom ops' fake implementations and AOTAutograd
    as the default backend does, without inductor's C++ builds of the rest of the model
    (over a minute more on CPU; the default backend passes this test too)."""
    model, ref = _pair("llama", "sdpa")
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    ids, mask = _padded_batch()
    mask[1] = 1
    caches = [transformers.StaticCache(config=m.config, max_cache_len=PROMPT + 3)
              for m in (model, ref)]
    step = torch.randint(0, VOCAB, (3, 1))
    longer = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], dim=1)
    with torch.no_grad():
        got = compiled(ids, attention_mask=mask, past_key_values=caches[0]).logits
        want = ref(ids, attention_mask=mask, past_key_values=caches[1]).logits
        real = mask.bool()
        _close(got[real], want[real])
        got = compiled(step, attention_mask=longer, past_key_values=caches[0]).logits
        want = ref(step, attention_mask=longer, past_key_values=caches[1]).logits
    _close(got, want)


@pytest.mark.parametrize("q_length,kv_length,q_offset,kv_offset", [
    (7, 7, 0, 0),                         # prefill
    (1, 10, "tensor 8", 0),               # decode step, static cache: a 0-d tensor offset
    (1, 5, 8, 4),                         # decode step, a sliding-window cache dropped 4 keys
])
@pytest.mark.parametrize("sliding", [False, True])
def test_block_mask_equals_transformers_mask(q_length, kv_length, q_offset, kv_offset, sliding):
    """flexgen_mask keeps exactly the positions transformers' own sdpa_mask keeps: causal or
    sliding window, padding on either side, the cache's offsets. A tensor offset is copied:
    the cache bumps its counter in place after the mask is built, before attention reads it."""
    from transformers import masking_utils as hf
    if q_offset == "tensor 8":
        q_offset = torch.tensor(8)
    function = hf.sliding_window_causal_mask_function(3) if sliding else hf.causal_mask_function
    padding = torch.ones(3, kv_length + kv_offset, dtype=torch.bool)
    padding[0, :2] = False
    padding[1, -1] = False
    args = dict(batch_size=3, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                kv_offset=kv_offset, mask_function=function, attention_mask=padding)
    want = hf.sdpa_mask(**args, allow_is_causal_skip=False)
    block_mask = flexgen_hf.flexgen_mask(**args, device="cpu")
    if isinstance(q_offset, torch.Tensor):
        q_offset.add_(q_length)
    assert block_mask.shape == (3, 1, q_length, kv_length)
    got = flexgen.create_mask(block_mask.mask_mod, 3, 1, q_length, kv_length, device="cpu")
    assert torch.equal(got, want.expand_as(got))


def test_masks_without_cache_offsets_are_built_once():
    """Training and a first prefill pass offsets of 0 (ints): the mask is transformers' own
    function, reading no offset tensor, so every step's mask comes back with the same lists
    (at the same addresses, which the kernels' launch replays key on)."""
    from flexgen.frontend.trace import trace
    from transformers import masking_utils as hf
    args = dict(batch_size=2, q_length=300, kv_length=300, q_offset=0, kv_offset=0,
                mask_function=hf.sliding_window_causal_mask_function(50))
    first, second = (flexgen_hf.flexgen_mask(**args, device="cpu") for _ in range(2))
    assert trace(first.mask_mod, "mask_mod").buffers == ()
    assert first.kv_indices.data_ptr() == second.kv_indices.data_ptr()
    got = flexgen.create_mask(second.mask_mod, 2, 1, 300, 300, device="cpu")
    assert torch.equal(got, hf.sdpa_mask(**args, attention_mask=None, allow_is_causal_skip=False).expand_as(got))


# The float mask's finfo.min (what transformers' eager masks hold) times log2(e) overflows
# to -inf in the interpreter's numpy, which says so; on a GPU it is -inf silently.
@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")
@pytest.mark.parametrize("mask", ["bool 4-D", "float 4-D + position_bias", "none (causal)"])
def test_attention_function_with_masks_a_caller_prepared(mask):
    """The attention function alone, with what a caller may pass instead of flexgen's block
    mask: a 4-D bool mask (True keeps; a BlockMask is built from it), a 4-D float mask and a
    T5-style position_bias (both added to the scores), or no mask (causal, as SDPA's
    is_causal). Compared with softmax(q k^T * scale + bias) v computed in float64."""
    module = transformers.models.llama.modeling_llama.LlamaAttention(_config("llama"), 0)
    B, Hq, Hkv, L, D = 2, 4, 2, PROMPT, 16
    q = torch.randn(B, Hq, L, D)
    k, v = torch.randn(B, Hkv, L, D), torch.randn(B, Hkv, L, D)
    keep = torch.rand(B, 1, L, L) < 0.6
    keep |= torch.eye(L, dtype=torch.bool)              # every query keeps a key
    bias = torch.zeros(B, Hq, L, L, dtype=torch.float64)
    kwargs = {}
    if mask == "bool 4-D":
        given = keep
        bias.masked_fill_(~keep, -torch.inf)
    elif mask.startswith("float"):
        given = torch.randn(B, 1, L, L).masked_fill(~keep, torch.finfo(torch.float32).min)
        kwargs["position_bias"] = torch.randn(1, Hq, L, L)
        bias += given.double() + kwargs["position_bias"].double()
    else:
        given = None
        bias.masked_fill_(~torch.ones(L, L, dtype=torch.bool).tril(), -torch.inf)
    out, weights = flexgen_hf.flexgen_attention_forward(module, q, k, v, given, scaling=0.3,
                                                        **kwargs)
    scores = q.double() @ k.double().repeat_interleave(2, dim=1).transpose(-1, -2) * 0.3 + bias
    want = torch.softmax(scores, dim=-1) @ v.double().repeat_interleave(2, dim=1)
    assert weights is None
    _close(out, want.transpose(1, 2).float())


# ------------------------------------------------------------------------------ what is refused

def test_unsupported_features_raise_flexgen_errors():
    """Attention dropout while training, output_attentions, head_mask and the paged cache of
    continuous batching raise a FlexgenError that names the feature and the fix, before any
    kernel runs."""
    config = _config("llama")
    config.attention_dropout = 0.1
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="flexgen")
    ids = torch.randint(0, VOCAB, (1, 5))
    with pytest.raises(flexgen.FlexgenError, match="dropout.*attention_dropout = 0.0"):
        model.train()(ids)
    with pytest.raises(flexgen.FlexgenError, match="output_attentions.*eager"):
        model.eval()(ids, output_attentions=True)
    q = torch.randn(1, 4, 5, 16)
    attention = model.model.layers[0].self_attn
    with pytest.raises(flexgen.FlexgenError, match="head_mask"):
        flexgen_hf.flexgen_attention_forward(attention, q, q, q, None, head_mask=torch.ones(4))
    with pytest.raises(flexgen.FlexgenError, match="cache.*continuous batching"):
        flexgen_hf.flexgen_attention_forward(attention, q, q, q, None, cache=object())


def test_register_needs_transformers_and_import_does_not_load_it(monkeypatch):
    """``import flexgen`` leaves transformers unimported; register() without it raises a
    FlexgenError saying what to install."""
    code = ("import sys, flexgen, flexgen.integrations.transformers; "
            "print('transformers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(flexgen.FlexgenError, match=r"pip install 'flexgen\[hf\]'"):
        flexgen_hf.register()
