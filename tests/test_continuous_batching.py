"""examples/continuous_batching.py: a short run (three requests, arriving at different steps,
chunked prefill mixed with decode tokens, RoPE fused into the append) matches the model run
without a cache, logit for logit."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

# torch / Hugging Face / distributed plumbing: CI's second pass compiles its kernels from the
# first pass's record instead of running it (conftest, FLEXGEN_TEST_RECORD_ONCE).
pytestmark = pytest.mark.once

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_continuous_batching_example_matches_the_uncached_model(capsys):
    sys.path.insert(0, str(EXAMPLES))
    try:
        import continuous_batching
        assert continuous_batching.main(["--requests", "3", "--chunk", "8", "--max-batch", "2"]) == 0
    finally:
        sys.path.remove(str(EXAMPLES))
    out = capsys.readouterr().out
    assert "-> OK" in out and "mixing prefill and decode" in out and "(0 mixing" not in out


def test_the_decode_graph_body_matches_too(capsys):
    """--graphs eager: pure decode steps go through DecodeGraphs' body (the part captured in a
    CUDA graph on the GPU: device lengths, a fixed max_kv_len) run eagerly; same check."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        import continuous_batching
        assert continuous_batching.main(["--requests", "3", "--chunk", "8", "--max-batch", "2",
                                         "--graphs", "eager"]) == 0
    finally:
        sys.path.remove(str(EXAMPLES))
    out = capsys.readouterr().out
    assert "-> OK" in out and "through the graph body" in out
