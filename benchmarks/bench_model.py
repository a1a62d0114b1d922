"""A Llama-shaped model (about 1.2B parameters, randomly initialised, bf16) with maskc, SDPA and
FlexAttention as its attention, side by side in one process: a training step (forward and
backward) under torch.compile, and generate() tokens per second.

    bash benchmarks/run_gpu.sh benchmarks/bench_model.py                      # steps at 4096 and 8192
    bash benchmarks/run_gpu.sh benchmarks/bench_model.py --generate           # 256 tokens, eager
    bash benchmarks/run_gpu.sh benchmarks/bench_model.py --lengths 4096 --impls maskc,sdpa

The model is transformers' LlamaForCausalLM with Llama 3.2 1B's shapes (hidden 2048, 16 layers,
32 query heads, 8 kv heads, head dim 64, MLP 8192, vocabulary 128256), one sequence per batch,
causal. Each implementation gets the same weights; before timing, its logits are compared with
SDPA's on the same tokens.
"""
from __future__ import annotations

import argparse
import gc
import time

import torch
import transformers

import maskc.integrations.transformers
from _results import JSON_HELP, Figure, write

CONFIG = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
              num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=16384,
              rope_theta=500000.0, tie_word_embeddings=True, attention_dropout=0.0)
NAMES = {"maskc": "maskc", "sdpa": "SDPA", "flex_attention": "FlexAttention"}
FIGURES: list[Figure] = []  # every printed figure, for --json


def model_for(impl: str, state=None):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**CONFIG)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl,
                                                              dtype=torch.bfloat16)
    if state is not None:
        model.load_state_dict(state)
    return model


def timed(fn, repeats: int) -> float:
    """Median seconds of fn() over `repeats` runs, each synchronised, after one run (which compiles
    the kernels)."""
    fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def training(impls, lengths, repeats: int) -> None:
    state = model_for("sdpa").state_dict()
    rows = {}
    for length in lengths:
        ids = torch.randint(0, CONFIG["vocab_size"], (1, length), device="cuda",
                            generator=torch.Generator("cuda").manual_seed(length))
        reference = None
        for impl in impls:
            model = model_for(impl, state)
            with torch.no_grad():
                logits = model(input_ids=ids).logits.float()
            if reference is None:
                reference = logits
            error = (logits - reference).abs().max().item()
            del logits
            compiled = torch.compile(model)

            def step():
                compiled(input_ids=ids, labels=ids).loss.backward()
                model.zero_grad(set_to_none=True)

            start = time.perf_counter()
            step()
            step()
            warm = time.perf_counter() - start
            seconds = timed(step, repeats)
            rows[impl, length] = seconds
            FIGURES.append(Figure(f"training step, L={length}", NAMES[impl], "time", seconds * 1e3, "ms"))
            print(f"  {NAMES[impl]:<14} L={length:<6} step {seconds * 1e3:8.1f} ms  {length / seconds:9.0f} tok/s  "
                  f"first two steps {warm:6.1f} s  max |logits - {NAMES[impls[0]]}| {error:.3g}", flush=True)
            del model, compiled
            gc.collect()
            torch.cuda.empty_cache()
            torch._dynamo.reset()
    print("\nforward+backward step under torch.compile, ms (ratio: other ÷ maskc, higher is better for maskc)")
    print(f"{'length':>8} " + " ".join(f"{NAMES[i]:>14}" for i in impls))
    for length in lengths:
        base = rows.get(("maskc", length))
        cells = []
        for impl in impls:
            ms = rows[impl, length] * 1e3
            cells.append(f"{ms:8.1f}" + (f" ×{rows[impl, length] / base:4.2f}" if base and impl != "maskc" else "      "))
        print(f"{length:>8} " + " ".join(f"{c:>14}" for c in cells))


def generation(impls, prompt: int, new: int, batch: int) -> None:
    state = model_for("sdpa").state_dict()
    ids = torch.randint(0, CONFIG["vocab_size"], (batch, prompt), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(1))
    outputs = {}
    print(f"\ngenerate: batch {batch}, prompt {prompt}, {new} new tokens, greedy, eager, dynamic cache")
    for impl in impls:
        model = model_for(impl, state).eval()

        def run():
            return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                  min_new_tokens=new, do_sample=False)

        with torch.no_grad():
            run()
            seconds = timed(lambda: outputs.__setitem__(impl, run()), 3)
        same = torch.equal(outputs[impl], outputs[impls[0]])
        FIGURES.append(Figure(f"generate(), batch {batch}, prompt {prompt}, {new} new tokens", NAMES[impl],
                              "throughput", batch * new / seconds, "tok/s"))
        print(f"  {NAMES[impl]:<14} {seconds:6.2f} s  {batch * new / seconds:8.1f} tok/s  "
              f"tokens equal to {NAMES[impls[0]]}'s: {same}", flush=True)
        del model
        gc.collect()
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="4096,8192")
    parser.add_argument("--impls", default="maskc,sdpa,flex_attention")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--generate", action="store_true", help="time generate() instead of training steps")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--json", metavar="PATH", help=JSON_HELP)
    args = parser.parse_args()
    maskc.integrations.transformers.register()
    torch._dynamo.config.cache_size_limit = 64
    impls = args.impls.split(",")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {transformers.__version__}")
    if args.generate:
        generation(impls, args.prompt, args.new_tokens, args.batch)
    else:
        training(impls, [int(n) for n in args.lengths.split(",")], args.repeats)
    write(args.json, "model", "A 1B Llama: generate()" if args.generate else "A 1B Llama: compiled training step",
          f"Llama 3.2 1B's shapes, random weights, bf16, transformers {transformers.__version__}", FIGURES)


if __name__ == "__main__":
    main()
