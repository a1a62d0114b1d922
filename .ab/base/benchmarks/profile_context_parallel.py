"""Where context parallelism's time goes on short shards: on 2 GPUs, causal, 8192 tokens (4096 a
rank), B=1 Hq=32 Hkv=8 D=128 bf16. Rank 0 prints the wall time of a synchronised forward and
training step, the host time of submitting them, and a cProfile of the training steps.

    bash benchmarks/run_gpu.sh benchmarks/profile_context_parallel.py      # on nvidia-h200-x2
"""
import cProfile
import os
import pstats
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import maskc
import maskc.distributed as md

L, Hq, Hkv, D, REPEATS = 8192, 32, 8, 128, 50


def run(rank: int, world_size: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    g = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(1, Hq, L, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, Hkv, L, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in "kv")
    plan = md.plan(maskc.masks.causal, L)
    qs, ks, vs = (plan.shard(t).requires_grad_() for t in (q, k, v))
    d_out = torch.randn_like(qs)

    def forward():
        with torch.no_grad():
            md.attention(qs, ks, vs, plan, enable_gqa=True)

    def step():
        md.attention(qs, ks, vs, plan, enable_gqa=True).backward(d_out)

    def single():
        maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal, enable_gqa=True)

    for name, fn in (("1-GPU forward (whole sequence)", single), ("CP forward", forward), ("CP step", step)):
        fn()
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(REPEATS):
            fn()
        host = time.perf_counter() - start
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        if rank == 0:
            print(f"{name}: {wall / REPEATS * 1e3:.2f} ms a call, {host / REPEATS * 1e3:.2f} ms of it to submit")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(REPEATS):
        step()
    torch.cuda.synchronize()
    profile.disable()
    if rank == 0:
        pstats.Stats(profile).sort_stats("tottime").print_stats(22)
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(2, port), nprocs=2)
