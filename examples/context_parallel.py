"""Context parallelism: one causal attention over a sequence sharded across processes.

Each rank holds a shard of the positions (for a causal mask, the zigzag split: of 2N equal
chunks, rank r holds chunks r and 2N-1-r, a cheap head and an expensive tail, so every rank
keeps as many tiles as the others); key shards travel between ranks while each computes, and
the mask sees global positions. The example checks the gathered output and gradients against
single-process maskc, then prints the plan (layout=zigzag).

Run:  torchrun --nproc-per-node 2 examples/context_parallel.py
(CPU: gloo, small float32 inputs through Triton's interpreter; with one CUDA GPU per rank:
NCCL, bf16, 32768 tokens.)
"""
import os

import torch
import torch.distributed as dist

import maskc
import maskc.distributed

# (tokens, heads, head dim, tile) on GPUs and on CPU. Each length cuts into 4 chunks of whole,
# equal numbers of tiles (2N for N = 2 ranks): a length that does not (200 tokens: 13 tiles)
# balances finer with more chunks than zigzag's, and the plan takes that split instead.
SHAPES = {"cuda": (32768, 16, 128, 128), "cpu": (192, 2, 16, 16)}


def main() -> None:
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    device, dtype = (torch.device("cuda", rank), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    L, H, D, block = SHAPES["cuda" if cuda else "cpu"]

    torch.manual_seed(0)  # every rank draws the same full tensors; each keeps its shard
    q, k, v = (torch.randn(1, H, L, D, device=device, dtype=dtype) for _ in range(3))
    plan = maskc.distributed.plan(maskc.masks.causal, L, block_size=block)
    q_local, k_local, v_local = (plan.shard(t).requires_grad_() for t in (q, k, v))

    out = maskc.distributed.attention(q_local, k_local, v_local, plan)
    out.sum().backward()

    full_out = plan.unshard(out.detach())
    full_dq = plan.unshard(q_local.grad)
    q1 = q.clone().requires_grad_()
    want = maskc.compiled_attention(q1, k, v, mask_mod=maskc.masks.causal)
    want.sum().backward()
    if rank == 0:
        out_error = (full_out.float() - want.float()).abs().max().item()
        dq_error = (full_dq.float() - q1.grad.float()).abs().max().item()
        print(plan)
        print(f"rank 0 holds positions {plan.positions().tolist()[:3]}... ({plan.local_len} of {L})")
        print(f"max |out - single process| = {out_error:.2e}, max |dq - single process| = {dq_error:.2e}")
        print("ok" if max(out_error, dq_error) < (5e-2 if cuda else 1e-4) else "MISMATCH")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
