"""Gradients of captured tensors on CUDA: learnable ALiBi slopes (also driven negative), a
per-head relative-position table and a per-head softcap, against float64 autograd on a small
problem, determinism of two runs, then forward+backward time with the bias learnable vs frozen
(bf16, B=4, H=16, L=4096, D=128).

    bash benchmarks/run_gpu.sh benchmarks/check_gpu_captured_grads.py
"""
import sys

import torch
import triton

import maskc
from maskc.testing import attention_reference


def mods(H, L, dev):
    slopes = torch.rand(H, device=dev)
    table = torch.randn(H, 2 * L - 1, device=dev) * 0.1
    cap = 20 + 10 * torch.rand(H, device=dev)
    bf16 = torch.bfloat16
    return {
        "alibi": ((slopes,), lambda t: lambda s, b, h, q, kv: s + t[0][h] * (kv - q), bf16),
        # scores growing with q - kv: past Lq (300 of a 320-row tile) p overflowed to a NaN gradient.
        # float32: rows this peaked make dS = P (dP - Delta) a difference of near-equal terms, where
        # bfloat16's rounding of O (in Delta) exceeds the check's tolerance, as in any FlashAttention
        # backward
        "alibi, negative slopes": ((-1 - slopes,), lambda t: lambda s, b, h, q, kv: s + t[0][h] * (kv - q),
                                   torch.float32),
        "relative": ((table,), lambda t: lambda s, b, h, q, kv: s + t[0][h, q - kv + L - 1], bf16),
        "softcap": ((cap,), lambda t: lambda s, b, h, q, kv: t[0][h] * torch.tanh(s / t[0][h]), bf16),
    }


def main() -> int:
    torch.manual_seed(0)
    failures = 0
    B, H, L, D = 2, 4, 300, 64
    for name, (tensors, mod, dtype) in mods(H, L, "cuda").items():
        tensors = tuple(t.clone().requires_grad_() for t in tensors)
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
        d_out = torch.randn(B, H, L, D, device="cuda", dtype=dtype)
        runs = []
        for _ in range(2):
            out = maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal, score_mod=maskc.score_mod(mod(tensors)))
            runs.append(torch.autograd.grad(out, tensors, d_out))
        exact = tuple(t.detach().double().requires_grad_() for t in (q, k, v, *tensors))
        ref, _ = attention_reference(*exact[:3], maskc.masks.causal, mod(exact[3:]))
        want = torch.autograd.grad(ref, exact[3:], d_out.double())
        for got, w in zip(runs[0], want):
            error = ((got.double() - w).abs().max() / w.abs().max().clamp(min=1)).item()
            same = all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))
            ok = error < 3e-2 and same
            failures += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {name}: relative error {error:.2e}, deterministic {same}", flush=True)

    B, H, L, D = 4, 16, 4096, 128
    for name, (tensors, mod, _) in mods(H, L, "cuda").items():
        if name == "alibi, negative slopes":
            continue  # alibi's time
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        times = {}
        for learn in (False, True):
            ts = tuple(t.clone().requires_grad_(learn) for t in tensors)
            score = maskc.score_mod(mod(ts))
            inputs = (q, k, v, *ts) if learn else (q, k, v)

            def step():
                out = maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal, score_mod=score)
                torch.autograd.grad(out, inputs, out)
            step()
            times[learn] = triton.testing.do_bench(step, rep=200)
        print(f"{name}: fwd+bwd {times[False]:.2f} ms frozen, {times[True]:.2f} ms learnable "
              f"(×{times[True] / times[False]:.2f})", flush=True)
    print(f"failures: {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
