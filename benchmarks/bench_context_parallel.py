"""Context parallelism on the GPUs of one host: maskc.distributed.attention beside single-GPU
maskc and torch's context_parallel (causal SDPA), in one run.

    bash benchmarks/run_gpu.sh benchmarks/bench_context_parallel.py            # on nvidia-h200-x2
    python benchmarks/bench_context_parallel.py --smoke                        # CPU, gloo, tiny: the script's logic

Launched with plain python it spawns one process per GPU (torchrun works too). Every rank
times the single-GPU maskc call on the whole sequence on its own GPU at the same time; the
ideal is that time ÷ ranks, and the efficiency is ideal ÷ the context-parallel time (forward
and backward, median of the repeats, each ended by a barrier). bf16, B=1, Hq=32, Hkv=8, D=128.
Each context-parallel output and gradient is compared with the single-GPU one.
"""
from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import maskc
import maskc.distributed as md


def timed(fn, repeats: int, device) -> float:
    """Median seconds of fn() on every rank, each repeat started and ended together, after one run
    (which compiles the kernels)."""
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        fn()
        _sync(device)
        dist.barrier()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def documents(L: int, device) -> torch.Tensor:
    """Document ids of a packed batch: lengths drawn from 1k to 32k tokens, a fixed seed."""
    g = torch.Generator().manual_seed(7)
    lengths, total = [], 0
    while total < L:
        n = min(int(torch.randint(L // 128, L // 4, (1,), generator=g)), L - total)
        lengths.append(n)
        total += n
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(device)


def workloads(args, device):
    L = args.length
    yield "causal", L, maskc.masks.causal
    yield "causal (short shards)", L // 16, maskc.masks.causal
    yield "document (causal)", L, maskc.masks.document(documents(L, device), causal=True)
    yield f"sliding window {args.window}", L // 2, maskc.masks.sliding_window(args.window)
    yield f"sliding window {args.window}", L, maskc.masks.sliding_window(args.window)


def run(rank: int, world_size: int, args) -> None:
    device = torch.device("cuda", rank) if not args.smoke else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world_size)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = [measure(name, L, mask, args, device, dtype) for name, L, mask in workloads(args, device)]
    if rank == 0:
        report(rows, world_size, args)
    bandwidth = p2p_bandwidth(device, world_size, rank, 256 << 20 if device.type == "cuda" else 1 << 20)
    if rank == 0:
        print(f"\npoint-to-point, both directions at once: {bandwidth:.0f} GB/s each way", flush=True)
    if device.type == "cuda":
        single_s, parallel_s, how = torch_context_parallel(args, device, world_size)
        if rank == 0:
            print(f"\ntorch context_parallel, causal SDPA (flash; {how}), length {args.length}: 1 GPU "
                  f"{single_s * 1e3:.1f} ms, context parallel {parallel_s * 1e3:.1f} ms, efficiency "
                  f"{single_s / world_size / parallel_s:.0%}; maskc context parallel ÷ torch's: "
                  f"{parallel_s / rows[0][-1]:.2f}x", flush=True)
    dist.destroy_process_group()


def measure(name, L, mask, args, device, dtype):
    """(name, L, plan, max error, 1-GPU forward, CP forward, 1-GPU step, CP step) of one workload."""
    g = torch.Generator(device).manual_seed(0)
    q = torch.randn(1, args.heads, L, args.dim, device=device, dtype=dtype, generator=g)
    k, v = (torch.randn(1, args.kv_heads, L, args.dim, device=device, dtype=dtype, generator=g) for _ in "kv")
    d_out = torch.randn(q.shape, device=device, dtype=dtype, generator=g)  # the same on every rank
    plan = md.plan(mask, L, block_size=args.block)
    qs, ks, vs, dos = (plan.shard(t).requires_grad_(t is not d_out) for t in (q, k, v, d_out))
    qf, kf, vf = (t.detach().requires_grad_() for t in (q, k, v))

    def single():
        maskc.compiled_attention(qf, kf, vf, mask_mod=mask, enable_gqa=True).backward(d_out)

    def parallel():
        md.attention(qs, ks, vs, plan, enable_gqa=True).backward(dos)

    with torch.no_grad():
        want = maskc.compiled_attention(q, k, v, mask_mod=mask, enable_gqa=True)
        got = plan.unshard(md.attention(qs, ks, vs, plan, enable_gqa=True))
        error = (got.float() - want.float()).abs().max().item()
        single_fwd = timed(lambda: maskc.compiled_attention(q, k, v, mask_mod=mask, enable_gqa=True),
                           args.repeats, device)
        parallel_fwd = timed(lambda: md.attention(qs, ks, vs, plan, enable_gqa=True), args.repeats, device)
    single_step = timed(single, args.repeats, device)
    parallel_step = timed(parallel, args.repeats, device)
    # the gradients of one step each, gathered: the backward's dK/dV exchange checked too
    for t in (qs, ks, vs, qf, kf, vf):
        t.grad = None
    single()
    parallel()
    grad_error = max(((plan.unshard(a.grad).float() - b.grad.float()).abs().max() / b.grad.float().abs().max()).item()
                     for a, b in zip((qs, ks, vs), (qf, kf, vf)))
    return name, L, plan, error, grad_error, single_fwd, parallel_fwd, single_step, parallel_step


def torch_context_parallel(args, device, world_size):
    """torch's context_parallel on causal SDPA (its head-tail load balancing, flash backend):
    (single-GPU SDPA seconds, context-parallel seconds, how GQA was run), forward and backward."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = init_device_mesh("cuda", (world_size,), mesh_dim_names=("cp",))
    L = args.length
    g = torch.Generator(device).manual_seed(0)
    q = torch.randn(1, args.heads, L, args.dim, device=device, dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, args.kv_heads, L, args.dim, device=device, dtype=torch.bfloat16, generator=g)
            for _ in "kv")
    # the flash backend takes no enable_gqa: k and v are repeated to Hq heads (4x the bytes its ring moves)
    k, v = (t.repeat_interleave(args.heads // args.kv_heads, dim=1) for t in (k, v))
    how = f"k, v repeated to {args.heads} heads"

    def single():
        qf, kf, vf = (t.detach().requires_grad_() for t in (q, k, v))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(qf, kf, vf, is_causal=True).sum().backward()

    # context_parallel shards these in place (resize_), which a tensor requiring grad refuses:
    # the timed leaves are taken from the shards inside the context
    buffers = [t.detach().clone() for t in (q, k, v)]

    single_s = timed(single, args.repeats, device)
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2]):
        def parallel():
            shards = [t.detach().requires_grad_() for t in buffers]
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                F.scaled_dot_product_attention(*shards, is_causal=True).sum().backward()

        parallel_s = timed(parallel, args.repeats, device)
    return single_s, parallel_s, how


def p2p_bandwidth(device, world_size: int, rank: int, nbytes: int) -> float:
    """GB/s each way between ranks 0 and 1, both sending at once (what a ring step does)."""
    if world_size < 2 or rank > 1:
        return float("nan")
    send = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    recv = torch.empty_like(send)
    peer = 1 - rank

    def exchange():
        for r in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]):
            r.wait()

    exchange()
    times = []
    for _ in range(5):
        _sync(device)
        start = time.perf_counter()
        exchange()
        _sync(device)
        times.append(time.perf_counter() - start)
    return nbytes / sorted(times)[2] / 1e9


def report(rows, world_size, args) -> None:
    print(f"\n{world_size} ranks, B=1 Hq={args.heads} Hkv={args.kv_heads} D={args.dim}; times in ms (median of "
          f"{args.repeats}); efficiency = (1 GPU ÷ {world_size}) ÷ context parallel, forward+backward")
    print("| workload | length | layout | ring steps | 1 GPU fwd | CP fwd | 1 GPU fwd+bwd | CP fwd+bwd | efficiency | "
          "max abs(out − 1 GPU) | max grad diff ÷ max grad |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, L, plan, error, grad_error, sf, pf, ss, ps in rows:
        print(f"| {name} | {L} | {plan.layout} | {len(plan.steps)} of {world_size} | {sf * 1e3:.1f} | "
              f"{pf * 1e3:.1f} | {ss * 1e3:.1f} | {ps * 1e3:.1f} | {ss / world_size / ps:.0%} | {error:.1e} | "
              f"{grad_error:.1e} |")
    print(flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned(rank, world_size, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    run(rank, world_size, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=131072)
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--block", type=int, default=128, help="the plan's tile")
    parser.add_argument("--smoke", action="store_true", help="CPU and gloo at a tiny size, 2 processes")
    args = parser.parse_args()
    if args.smoke:
        args.length, args.window, args.heads, args.kv_heads, args.dim, args.repeats, args.block = 96, 16, 2, 1, 16, 1, 16
    if "RANK" in os.environ:  # torchrun
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
    else:
        world_size = 2 if args.smoke else torch.cuda.device_count()
        mp.spawn(_spawned, args=(world_size, _free_port(), args), nprocs=world_size)


if __name__ == "__main__":
    main()
