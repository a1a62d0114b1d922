"""Training with a learnable bias: forward+backward with the score mod's captured tensor
requiring grad, maskc beside compiled FlexAttention (its learnable-bias path) in one process.

    bash benchmarks/run_gpu.sh benchmarks/bench_bias_grads.py [--length 4096] [--dim 128]

bf16, B=4, H=16, causal. Biases: a per-head relative-position table [H, 2L-1] (T5/Swin-style,
every (q, kv) pair reads its own element), ALiBi slopes [H], a per-head softcap [H]. Each step
computes the gradients of q, k, v and the bias. Before timing, both libraries' bias gradients
are compared with each other.
"""
from __future__ import annotations

import argparse

import torch
import triton
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import maskc


def biases(H: int, L: int):
    """name -> (captured tensor, score_mod over it): written once, run by both libraries."""
    table = torch.randn(H, 2 * L - 1, device="cuda") * 0.1
    slopes = torch.rand(H, device="cuda")
    cap = 20 + 10 * torch.rand(H, device="cuda")
    return {
        "relative table": (table, lambda t: lambda s, b, h, q, kv: s + t[h, q - kv + L - 1]),
        "ALiBi slopes": (slopes, lambda t: lambda s, b, h, q, kv: s + t[h] * (kv - q)),
        "softcap": (cap, lambda t: lambda s, b, h, q, kv: t[h] * torch.tanh(s / t[h])),
    }


# Flex's forward (BLOCK_M/N) and backward (BLOCK_M1/N1: dK/dV, BLOCK_M2/N2: dQ) tiles, smaller than
# its defaults for D=128 on an H100, which asked for 233 KB of shared memory with a learnable table
SMALL_FLEX_TILES = {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=128)
    args = parser.parse_args()
    B, H, L, D = 4, 16, args.length, args.dim
    torch.manual_seed(0)
    flex = torch.compile(flex_attention)
    causal_flex = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, L, L, device="cuda")
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"bf16 B={B} H={H} L={L} D={D} causal, forward+backward incl. the bias gradient")
    print(f"{'bias':<16} {'maskc ms':>9} {'Flex ms':>9} {'Flex÷maskc':>10} {'frozen maskc ms':>16} "
          f"{'grad difference':>16}")
    for name, (tensor, mod) in biases(H, L).items():
        bias = tensor.clone().requires_grad_()
        ours = maskc.score_mod(mod(bias))
        theirs = mod(bias)

        def maskc_step(score=ours, inputs=(q, k, v, bias)):
            out = maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal, score_mod=score)
            return torch.autograd.grad(out, inputs, out)

        def flex_step(options=None):
            out = flex(q, k, v, score_mod=theirs, block_mask=causal_flex, kernel_options=options)
            return torch.autograd.grad(out, (q, k, v, bias), out)

        flex_grads, flex_ms = None, float("nan")
        # Flex's default tiles, then the smaller ones a Flex user would pass when those ask for
        # more shared memory than the GPU has
        for options in (None, SMALL_FLEX_TILES):
            try:
                flex_grads = flex_step(options)
            except Exception as error:  # said in the table: a path Flex does not take
                print(f"  FlexAttention refused {name} with kernel_options={options}: {type(error).__name__}: "
                      f"{str(error)[:200]}")
                continue
            if options:
                print(f"  FlexAttention ran {name} with kernel_options={options}")
            step_options = options
            break
        ours_grads = maskc_step()
        if flex_grads is not None:
            flex_ms = triton.testing.do_bench(lambda: flex_step(step_options), rep=300)
            scale = flex_grads[3].abs().max().clamp(min=1e-6)
            difference = ((ours_grads[3] - flex_grads[3]).abs().max() / scale).item()
        else:
            difference = float("nan")
        maskc_ms = triton.testing.do_bench(maskc_step, rep=300)
        frozen = maskc.score_mod(mod(tensor))
        maskc_step(frozen, (q, k, v))
        frozen_ms = triton.testing.do_bench(lambda: maskc_step(frozen, (q, k, v)), rep=300)
        print(f"{name:<16} {maskc_ms:9.2f} {flex_ms:9.2f} {flex_ms / maskc_ms:10.2f} {frozen_ms:16.2f} "
              f"{difference:16.2e}", flush=True)


if __name__ == "__main__":
    main()
