"""Kernel families beyond the forward: the backward pass, split-K decode, the paged KV cache."""
