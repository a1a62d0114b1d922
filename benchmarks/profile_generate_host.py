"""Where an eager generate() step's time goes, maskc beside SDPA (and FlexAttention): transformers'
LlamaForCausalLM with bench_generate.py's model (Llama 3.2 1B's shapes, bf16, random weights, the
same weights for each implementation), a 512-token prompt in a dynamic cache, then decoding
steps of one token at batch 1 (the cache cut back after each, so every step has the same length).

    bash benchmarks/run_gpu.sh benchmarks/profile_generate_host.py [--impls maskc,sdpa] [--batch 1]
    python benchmarks/profile_generate_host.py --smoke      # CPU, a tiny model: the script end to end

For each implementation: a step's time (synchronised, median of 5 rounds of 50 steps), and the
host time of one attention call (the attention function transformers calls for each layer,
timed around the call without synchronising: Python and the launches' enqueueing, which is what
a host-bound step waits for), and the rest of the step divided by layers. With --profile, maskc's
cProfile top 25 (by own time) over 50 steps.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch
import transformers
from transformers import AttentionInterface

import maskc.integrations.transformers
from bench_generate import FULL, SMOKE, model_for, sync


def timed_attention(impl: str, spent: list) -> None:
    """Register `impl`'s attention function again, wrapped to add its host seconds to spent[0]."""
    inner = AttentionInterface._global_mapping[impl] if impl != "maskc" else maskc.integrations.transformers.attention_forward

    def attention(*args, **kwargs):
        start = time.perf_counter()
        out = inner(*args, **kwargs)
        spent[0] += time.perf_counter() - start
        return out

    AttentionInterface.register(impl, attention)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impls", default="maskc,sdpa,flex_attention")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="print maskc's cProfile top 25")
    parser.add_argument("--smoke", action="store_true", help="a tiny float32 model on the CPU: checks the script")
    args = parser.parse_args()
    setup = SMOKE if args.smoke else FULL
    prompt, steps, rounds = (16, 3, 2) if args.smoke else (512, 50, 5)
    maskc.integrations.transformers.register()
    layers = setup["config"]["num_hidden_layers"]
    ids = torch.randint(0, setup["config"]["vocab_size"], (args.batch, prompt), device=setup["device"],
                        generator=torch.Generator(setup["device"]).manual_seed(1))
    token = ids[:, -1:]
    state = None
    print(f"eager decoding step, batch {args.batch}, {prompt} keys, {layers} layers, {setup['device']}")
    for impl in args.impls.split(","):
        spent = [0.0]
        timed_attention(impl, spent)
        model = model_for(impl, setup, state)
        state = state or model.state_dict()
        with torch.no_grad():
            cache = transformers.DynamicCache(config=model.config)
            model(ids, past_key_values=cache, use_cache=True)

            def step():
                model(token, past_key_values=cache, use_cache=True)
                cache.crop(-1)

            for _ in range(steps):  # plans, kernels and the allocator's blocks for this length
                step()
            step_ms, call_us = [], []
            for _ in range(rounds):
                spent[0] = 0.0
                sync(setup["device"])
                start = time.perf_counter()
                for _ in range(steps):
                    step()
                sync(setup["device"])
                step_ms.append((time.perf_counter() - start) / steps * 1e3)
                call_us.append(spent[0] / (steps * layers) * 1e6)
            ms, us = statistics.median(step_ms), statistics.median(call_us)
            rest = (ms * 1e3 - us * layers) / layers
            print(f"  {impl:<15} step {ms:7.2f} ms ({args.batch * 1e3 / ms:7.1f} tok/s)   attention call {us:6.1f} µs "
                  f"host   rest of the step {rest:6.1f} µs a layer")
            if args.profile and impl == "maskc":
                profile = cProfile.Profile()
                profile.enable()
                for _ in range(steps):
                    step()
                sync(setup["device"])
                profile.disable()
                pstats.Stats(profile).sort_stats("tottime").print_stats(25)
        del model, cache
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
