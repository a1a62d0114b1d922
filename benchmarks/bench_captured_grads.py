"""Forward + backward with a score mod's captured tensor learnable (requiring grad) against the
same tensor frozen: learnable ALiBi slopes, a per-head relative-position table and a per-head
softcap, bf16, B=4, H=16, L=4096, D=128, causal, do_bench medians.

    bash benchmarks/run_gpu.sh benchmarks/bench_captured_grads.py

The gradients' correctness is tests/gpu/test_captured_grads.py's; bench_bias_grads.py times the
learnable case beside FlexAttention's.
"""
from __future__ import annotations

import torch
import triton

import maskc


def mods(H, L):
    """name -> (tensor, mod of it): the score mod built over a given tensor."""
    slopes = torch.rand(H, device="cuda")
    table = torch.randn(H, 2 * L - 1, device="cuda") * 0.1
    cap = 20 + 10 * torch.rand(H, device="cuda")
    return {
        "alibi": (slopes, lambda t: lambda s, b, h, q, kv: s + t[h] * (kv - q)),
        "relative": (table, lambda t: lambda s, b, h, q, kv: s + t[h, q - kv + L - 1]),
        "softcap": (cap, lambda t: lambda s, b, h, q, kv: t[h] * torch.tanh(s / t[h])),
    }


def main():
    torch.manual_seed(0)
    B, H, L, D = 4, 16, 4096, 128
    for name, (tensor, mod) in mods(H, L).items():
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        times = {}
        for learn in (False, True):
            t = tensor.clone().requires_grad_(learn)
            score = maskc.score_mod(mod(t))
            inputs = (q, k, v, t) if learn else (q, k, v)

            def step():
                out = maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal, score_mod=score)
                torch.autograd.grad(out, inputs, out)
            step()
            times[learn] = triton.testing.do_bench(step, rep=200)
        print(f"{name}: fwd+bwd {times[False]:.2f} ms frozen, {times[True]:.2f} ms learnable "
              f"(×{times[True] / times[False]:.2f})", flush=True)


if __name__ == "__main__":
    main()
