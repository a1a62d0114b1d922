"""Where forward + backward spends its time, kernel by kernel: maskc beside FlexAttention.

    bash benchmarks/run_gpu.sh benchmarks/profile_backward.py --dim 128 --only "no mask|causal"

B=4 H=16 L=8192 bf16 by default. `--only "relative table"` profiles a learnable relative-position
table instead (causal, the table's gradient too; FlexAttention with bench_bias_grads.py's
smaller tiles, which it needs for this at D=128). Each implementation's fwd+bwd runs 10 times under
torch.profiler after warm-up (and, for maskc, after its Gluon kernels have compiled); the
table gives each CUDA kernel's mean milliseconds per step and its share of the step. The
matrix products each kernel runs are counted from its name to give TFLOP/s over the kept
pairs: maskc's forward 2 (Q·Kᵀ, P·V), dQ 3 (Q·Kᵀ, dO·Vᵀ, dS·K), dK/dV 4 (the two again, Pᵀ·dO,
dSᵀ·Q), 5 where no dQ kernel ran (the Gluon dK/dV kernel computed dQ too); a kernel with
another name gets no rate.
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
import maskc  # noqa: E402
from maskc.testing import dense_mask  # noqa: E402
from bench_bias_grads import SMALL_FLEX_TILES  # noqa: E402
from workloads import workloads  # noqa: E402

flex = torch.compile(flex_attention, dynamic=False)
STEPS = 10
# matrix products of B·H·pairs·D multiply-adds each, by kernel name
PRODUCTS = {"attention_fwd_hopper": 2, "attention_fwd": 2, "attention_bwd_dq": 3, "attention_bwd_dkdv_hopper": 4,
            "attention_bwd_dkdv": 4}


def kernel_times(step) -> dict[str, float]:
    """Mean CUDA milliseconds per step of each kernel `step()` launches."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            step()
        torch.cuda.synchronize()
    totals = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time / 1e3 / STEPS
    return dict(totals)


def short(name: str) -> str:
    for known in sorted(PRODUCTS, key=len, reverse=True):
        if name.startswith(known):
            return known
    return name[:48]


def cases(names, q, k, v, d_out):
    """(name, {implementation: one step}, kept pairs a head) for the workloads named."""
    L, H = q.shape[2], q.shape[1]
    for name, mask, score in workloads(L, H, "cuda"):
        if name not in names:
            continue
        pairs = int(dense_mask(mask, L, L, device="cuda")[0, 0].sum()) if mask is not None else L * L
        flex_bm = create_block_mask(mask.fn, None, None, L, L, device="cuda") if mask is not None else None
        yield name, {
            "maskc": lambda: maskc.compiled_attention(q, k, v, mask_mod=mask, score_mod=score).backward(d_out),
            "flex": lambda: flex(q, k, v, score_mod=score.fn if score else None,
                                 block_mask=flex_bm).backward(d_out),
        }, pairs
    if "relative table" in names:
        table = (torch.randn(H, 2 * L - 1, device="cuda") * 0.1).requires_grad_()

        def relative(score, b, h, q_idx, kv_idx):
            return score + table[h, q_idx - kv_idx + L - 1]
        ours = maskc.score_mod(relative)
        causal = create_block_mask(maskc.masks.causal.fn, None, None, L, L, device="cuda")
        yield "relative table (learnable), causal", {
            "maskc": lambda: maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal,
                                                      score_mod=ours).backward(d_out),
            "flex": lambda: flex(q, k, v, score_mod=relative, block_mask=causal,
                                 kernel_options=SMALL_FLEX_TILES).backward(d_out),
        }, L * (L + 1) // 2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--only", default="no mask|causal|document (12), causal")
    args = ap.parse_args()
    B, H, L, D = args.batch, args.heads, args.length, args.dim
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    d_out = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)
    print(f"# {torch.cuda.get_device_name()}, B={B} H={H} L={L} D={D} bf16, fwd+bwd, {STEPS} steps profiled")
    for name, steps, pairs in cases(args.only.split("|"), q, k, v, d_out):
        print(f"\n## {name}")
        print("| impl | kernel | ms/step | share | TFLOP/s |")
        print("|---|---|---|---|---|")
        for impl, step in steps.items():
            times = kernel_times(step)
            total = sum(times.values())
            fused_dq = not any(short(kernel) == "attention_bwd_dq" for kernel in times)
            for kernel, ms in sorted(times.items(), key=lambda kv: -kv[1]):
                if ms < 0.01 * total:
                    continue
                products = PRODUCTS.get(short(kernel))
                if short(kernel) == "attention_bwd_dkdv_hopper" and fused_dq:
                    products = 5
                rate = f"{products * 2 * B * H * pairs * D / (ms * 1e-3) / 1e12:.0f}" if products else "—"
                print(f"| {impl} | {short(kernel)} | {ms:.3f} | {ms / total:.0%} | {rate} |")
            print(f"| {impl} | **all** | {total:.3f} | | |")


if __name__ == "__main__":
    main()
