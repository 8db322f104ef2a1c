"""flexgen inside Hugging Face transformers: attn_implementation="flexgen".

Builds a tiny Llama (GQA) and a tiny Gemma 2 (soft-capped scores, alternating sliding-window
and full layers) with random weights (nothing is downloaded), checks flexgen's logits on a
padded batch against transformers' own attention, and generates a few tokens greedily with
both. Runs on a GPU when there is one, else on CPU through the Triton interpreter.
    pip install "flexgen[hf]"
    python examples/hf_flexgen.py
"""
import copy
import time

import torch
import transformers

import flexgen.integrations.transformers as flexgen_hf

MODELS = {
    "llama": transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, vocab_size=128, initializer_range=0.25),
    "gemma2": transformers.Gemma2Config(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_hidden_layers=2, vocab_size=128, initializer_range=0.25,
        sliding_window=8, attn_logit_softcapping=5.0, query_pre_attn_scalar=16),
}
# transformers' SDPA path has no soft-cap: Gemma 2 is checked against its eager attention.
REFERENCE = {"llama": "sdpa", "gemma2": "eager"}


def main():
    flexgen_hf.register()                      # attn_implementation="flexgen" from here on
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (2, 24), device=device)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0                            # the first prompt is 5 tokens shorter (left padding)
    failed = False
    for name, config in MODELS.items():
        ref = transformers.AutoModelForCausalLM.from_config(
            copy.deepcopy(config), attn_implementation=REFERENCE[name]).to(device).eval()
        model = transformers.AutoModelForCausalLM.from_config(
            copy.deepcopy(config), attn_implementation="flexgen").to(device).eval()
        model.load_state_dict(ref.state_dict())

        with torch.no_grad():
            start = time.perf_counter()
            logits = model(ids, attention_mask=mask).logits
            elapsed = time.perf_counter() - start
            want = ref(ids, attention_mask=mask).logits
            real = mask.bool()                 # padded positions have no meaningful logits
            err = (logits[real] - want[real]).abs().max().item()

            tokens = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                    pad_token_id=0)[:, ids.shape[1]:]
            want_tokens = ref.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                       pad_token_id=0)[:, ids.shape[1]:]
        same = torch.equal(tokens, want_tokens)
        print(f"{name}: first forward {elapsed:.2f} s on {device}, "
              f"max |logits - {REFERENCE[name]}| = {err:.1e}; generated {tokens.tolist()} "
              f"({'same as' if same else 'DIFFERENT from'} {REFERENCE[name]})")
        failed |= err > 1e-3 or not same
    if failed:
        raise SystemExit("FAILED: flexgen disagrees with transformers' attention")
    print("OK")


if __name__ == "__main__":
    main()
