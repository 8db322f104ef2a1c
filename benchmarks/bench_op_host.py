"""Host time per call of the attention ops: as flexgen defines them (flexgen/runtime/ops/define.py,
torch.library.Library) against the same implementations as torch.library.custom_ops, and the
implementations alone, interleaved round by round in one process (a host's speed drifts).

    python benchmarks/bench_op_host.py          # CUDA: the small model's attention (B=2, 8 heads,
                                                # 4k, D=128, document mask + relative bias);
                                                # CPU: a smaller call with the launches stubbed
    ROUNDS=25 OUT=dir python benchmarks/bench_op_host.py

Each round times 20 calls of each variant without synchronizing (the GPU runs behind), under
no_grad, as a compiled graph calls the ops. Prints medians and the per-round difference.
"""
import os
import statistics
import time

import torch
from torch import Tensor
import flexgen
from flexgen.runtime import ops
dev = "cuda" if torch.cuda.is_available() else "cpu"
dt = torch.bfloat16 if dev == "cuda" else torch.float32
B, H, L, D = (2, 8, 4096, 128) if dev == "cuda" else (2, 8, 512, 64)
docs = torch.cumsum((torch.rand(B, L) < 4.0 / 1024).int(), 1).int().to(dev)
q, k, v = (torch.randn(B, H, L, D, device=dev, dtype=dt) for _ in range(3))
rel = torch.randn(H, 2 * L - 1, device=dev, dtype=dt) * 0.1
def mask_mod(b, h, q_idx, kv_idx): return (docs[b, q_idx] == docs[b, kv_idx]) & (q_idx >= kv_idx)
def score_mod(score, b, h, q_idx, kv_idx): return score + rel[h, q_idx - kv_idx + L - 1]
bm = flexgen.create_block_mask(mask_mod, B, None, L, L, device=dev)
from flexgen.api import _mods
graph, sbuf, mgraph, mbuf, lists, bsize, lengths = _mods(score_mod, bm)
args = (q, k, v, list(sbuf), list(mbuf), list(lists), graph, mgraph, list(bsize), list(lengths), D ** -0.5, False, "", False)
with torch.no_grad():
    out, lse, _ = torch.ops.flexgen.attention(*args)
g = torch.randn_like(out)
bargs = (q, k, v, out, lse, g, None, list(sbuf), list(mbuf), list(lists), graph, mgraph, list(bsize), list(lengths), D ** -0.5, False, "", [0], True)

@torch.library.custom_op("flexgen_old::attention", mutates_args=())
def old_fwd(query: Tensor, key: Tensor, value: Tensor, score_buffers: list[Tensor],
            mask_buffers: list[Tensor], block_lists: list[Tensor], score_mod: str, mask_mod: str,
            block_size: list[int], mask_lengths: list[int], scale: float, enable_gqa: bool,
            options: str, want_max: bool) -> tuple[Tensor, Tensor, Tensor]:
    return ops._attention(query, key, value, score_buffers, mask_buffers, block_lists, score_mod,
                          mask_mod, block_size, mask_lengths, scale, enable_gqa, options, want_max)
old_fwd.register_autograd(lambda ctx, *g: None, setup_context=lambda ctx, inputs, output: None)

@torch.library.custom_op("flexgen_old::attention_backward", mutates_args=())
def old_bwd(query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor,
            grad_out: Tensor | None, grad_lse: Tensor | None, score_buffers: list[Tensor],
            mask_buffers: list[Tensor], block_lists: list[Tensor], score_mod: str,
            mask_mod: str, block_size: list[int], mask_lengths: list[int], scale: float,
            enable_gqa: bool, options: str, grad_slots: list[int],
            needs_kv: bool) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    return ops._attention_backward(query, key, value, out, lse, grad_out, grad_lse, score_buffers,
                                   mask_buffers, block_lists, score_mod, mask_mod, block_size,
                                   mask_lengths, scale, enable_gqa, options, grad_slots, needs_kv)

if dev == "cpu":
    from flexgen.runtime import launch
    launch.run = lambda *a, **kw: None     # the host path alone (the interpreter would dominate)
def sync():
    if dev == "cuda": torch.cuda.synchronize()
def host(fn, n=20):
    sync(); t = time.perf_counter()
    for _ in range(n): fn()
    dt_ = (time.perf_counter() - t) / n * 1e6
    sync()
    return dt_
cases = {"fwd impl": lambda: ops._attention(*args), "fwd old op": lambda: torch.ops.flexgen_old.attention.default(*args),
         "fwd new op": lambda: torch.ops.flexgen.attention.default(*args),
         "bwd impl": lambda: ops._attention_backward(*bargs), "bwd old op": lambda: torch.ops.flexgen_old.attention_backward.default(*bargs),
         "bwd new op": lambda: torch.ops.flexgen.attention_backward.default(*bargs)}
times = {k: [] for k in cases}
with torch.no_grad():
    for fn in cases.values(): fn()
    for _ in range(int(os.environ.get("ROUNDS", 15))):
        for name, fn in cases.items():
            times[name].append(host(fn))
lines = []
for name, ts in times.items():
    lines.append(f"{name:12s} median {statistics.median(ts):7.1f} us, min {min(ts):7.1f}")
for part in ("fwd", "bwd"):
    d = [o - n for o, n in zip(times[f"{part} old op"], times[f"{part} new op"])]
    lines.append(f"{part}: old - new per round: median {statistics.median(d):.1f} us")
print("\n".join(lines))
if os.environ.get("OUT"):
    open(os.path.join(os.environ["OUT"], "op_interleave.txt"), "w").write("\n".join(lines))
