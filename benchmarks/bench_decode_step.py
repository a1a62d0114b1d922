"""One decoding step as a model's attention layer calls it: maskc beside SDPA and FlexAttention,
per call with the host included (do_bench) and replayed from a CUDA graph, then where maskc's
host time goes (cProfile). The shape is issue #41's: bf16, B=1, Hq=32, Hkv=8, D=128, 4096 keys,
one query, causal, `kv_lens`.

    bash benchmarks/run_gpu.sh benchmarks/bench_decode_step.py [--profile]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import maskc
from _results import JSON_HELP, Figure, write

B, HQ, HKV, D, L = 1, 32, 8, 128, 4096


def graphed(fn):
    """fn replayed from a CUDA graph (captured after two warm-up calls on a side stream)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", action="store_true", help="print maskc's cProfile top 25")
    parser.add_argument("--json", metavar="PATH", help=JSON_HELP)
    args = parser.parse_args()
    cuda = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(B, HQ, 1, D, **cuda)
    k, v = (torch.randn(B, HKV, L, D, **cuda) for _ in range(2))
    lens = torch.full((B,), L, dtype=torch.int32, device="cuda")

    def causal_last(b, h, q_idx, kv_idx):
        return q_idx + L - 1 >= kv_idx

    flex_mask = create_block_mask(causal_last, B, None, 1, L, device="cuda")
    flex = torch.compile(flex_attention)
    calls = {
        "maskc": lambda: maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal, enable_gqa=True,
                                                  kv_lens=lens),
        "SDPA": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        "FlexAttention": lambda: flex(q, k, v, block_mask=flex_mask, enable_gqa=True),
    }
    with torch.no_grad():
        want = calls["SDPA"]().float()
        for name, fn in calls.items():
            torch.testing.assert_close(fn().float(), want, atol=2e-2, rtol=2e-2, msg=name)
        rows = {}
        for name, fn in calls.items():
            eager = triton.testing.do_bench(fn, warmup=200, rep=1000) * 1e3
            replay = triton.testing.do_bench(graphed(fn), warmup=200, rep=1000) * 1e3
            rows[name] = (eager, replay)
    print(f"{torch.cuda.get_device_name()}, bf16 B={B} Hq={HQ} Hkv={HKV} D={D} keys={L}, one query")
    print(f"{'':14} {'per call µs':>12} {'graph µs':>10} {'÷ SDPA':>7}")
    for name, (eager, replay) in rows.items():
        print(f"{name:14} {eager:12.1f} {replay:10.1f} {eager / rows['SDPA'][0]:7.2f}")
    workload = f"causal, {L} keys, one query"
    write(args.json, "decode-step", "One decoding step", f"bf16, B={B} Hq={HQ} Hkv={HKV} D={D}, kv_lens",
          [Figure(workload, name, metric, t, "µs") for name, (eager, replay) in rows.items()
           for metric, t in (("per call", eager), ("graph replay", replay))])
    if args.profile:
        with torch.no_grad():
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(2000):
                calls["maskc"]()
            profile.disable()
        torch.cuda.synchronize()
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
