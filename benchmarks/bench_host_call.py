"""Host work of a cached compiled_attention call, on the CPU: what is timed is maskc's Python
between the call and the launch (the mod's guards, the plan lookup, the checks). The tiny-call
overhead on the GPU (bench_overhead.py, bench_decode_step.py) is this plus Triton's launcher;
this one runs anywhere, so a change can be compared before a GPU session:

    python benchmarks/bench_host_call.py [--decode] [--flex]
    PYTHONPATH=/path/to/other/tree python benchmarks/bench_host_call.py   # another version

Prefill (the default): B=1, H=1, L=128, D=64, float32, causal, no gradients; the forward's
launch (launch.forward) is replaced by a function returning ready outputs.

--decode: issue #41's decoding step, B=1, Hq=32, Hkv=8, D=128, 4096 keys, one query, causal,
kv_lens, with the H100's decoding tiles (16×64) and 32 splits forced (what the H100 chooses),
so that the call launches the split kernel and the combine as it does there; float32, since
the interpreter's path would copy bf16 inputs to float32 on every call. The launches run
launch.py's direct path, checks included: every LaunchPlan is made as on CUDA (`_direct` False:
no direct runner yet) with Triton's `fn[grid]` replaced by a stand-in compiled kernel whose grid
launcher does nothing. The first call then builds the direct runner as on the GPU, and later
calls pass its checks; torch.cuda.current_device and Triton's current stream (this machine has
no CUDA) return 0. Left out: Triton's own launcher (its grid runner and the driver's launch).

--flex: the same call as maskc.flex_attention with a BlockMask from maskc.create_block_mask (causal,
BLOCK_SIZE 128), through torch.compile(fullgraph=True, backend="aot_eager"): Dynamo's guards,
AOTAutograd's wrapper and the `maskc::attention` operator, which converts the BlockMask's tile
tensors to a BlockMap (or finds the conversion again) before it plans. With --decode the query
rows are few and no gradient is wanted, so the operator asks the decoding kernel, whose choice
checks the converted map against its mask (BlockMap.agrees_with_mask).

--hf: the decoding step as transformers' eager generate() makes it, one token over a 512-token
dynamic cache, through a 16-layer LlamaForCausalLM with Llama 3.2 1B's heads (32/8 of dim 64)
and a small hidden size (256), launches as --decode (9 splits, the H100's choice at this length):
the time is maskc's attention function
alone, timed around each layer's call between the model's other work (whose CPU cache
pollution a loop of calls alone does not have), µs a layer. SDPA's figure on the GPU comes
from benchmarks/profile_generate_host.py.

Best and median of 7 rounds of 2000 calls (200 with --flex, 100 steps of 16 layers with --hf),
µs a call.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from types import SimpleNamespace

import torch

import maskc
from maskc.runtime import api, launch, tiles


class _Compiled:
    """Stands for the kernel Triton's `fn[grid](...)` returns: its grid launcher does nothing."""

    def __getitem__(self, grid):
        return lambda *args, stream=None: None


def _launches_as_on_cuda() -> None:
    made = launch.LaunchPlan.__init__

    def on_cuda(self, *args, **kwargs):
        made(self, *args, **kwargs)
        self.fn, self._direct = (lambda *args, **options: _Compiled()), False

    launch.LaunchPlan.__init__ = on_cuda
    torch.cuda.current_device = lambda: 0
    launch.driver = SimpleNamespace(active=SimpleNamespace(get_current_stream=lambda device: 0))


def prefill():
    q, k, v = (torch.randn(1, 1, 128, 64) for _ in range(3))
    out, lse = torch.empty_like(q), torch.empty(1, 1, 128)
    api.launch.forward = lambda q, k, v, problem: (out, lse)  # the launch, and nothing else, left out
    return lambda: maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal)


def decode():
    _launches_as_on_cuda()
    q = torch.randn(1, 32, 1, 128)
    k, v = (torch.randn(1, 8, 4096, 128) for _ in range(2))
    lens = torch.full((1,), 4096, dtype=torch.int32)
    return lambda: maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal, enable_gqa=True, kv_lens=lens)


def flex(decoding: bool):
    """The prefill call or the decoding step (no kv_lens: one query at position 0 of a mask made
    for it) as compiled maskc.flex_attention with a BlockMask."""
    if decoding:
        _launches_as_on_cuda()
        q = torch.randn(1, 32, 1, 128)
        k, v = (torch.randn(1, 8, 4096, 128) for _ in range(2))
    else:
        q, k, v = (torch.randn(1, 1, 128, 64) for _ in range(3))
        out, lse = torch.empty_like(q), torch.empty(1, 1, 128)
        api.launch.forward = lambda q, k, v, problem: (out, lse)
    block_mask = maskc.create_block_mask(maskc.masks.causal, None, None, q.shape[2], k.shape[2], device="cpu")
    compiled = torch.compile(lambda q, k, v, block_mask: maskc.flex_attention(q, k, v, block_mask=block_mask,
                                                                             enable_gqa=True),
                             backend="aot_eager", fullgraph=True)
    return lambda: compiled(q, k, v, block_mask)


def hf_rounds() -> list[float]:
    """--hf: seven rounds of 100 decoding steps; µs of maskc's attention function a layer."""
    import transformers
    from transformers import AttentionInterface

    import maskc.integrations.transformers as hf
    _launches_as_on_cuda()
    hf.register()
    spent = [0.0]

    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = hf.attention_forward(*args, **kwargs)
        spent[0] += time.perf_counter() - start
        return out

    AttentionInterface.register("maskc", timed)
    config = transformers.LlamaConfig(hidden_size=256, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                                      intermediate_size=512, num_hidden_layers=16, vocab_size=1000,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    cache = transformers.DynamicCache(config=config)
    model.config._attn_implementation = "sdpa"  # the prompt's prefill, which is not timed
    model(torch.randint(0, 1000, (1, 512)), past_key_values=cache, use_cache=True)
    model.config._attn_implementation = "maskc"
    token = torch.randint(0, 1000, (1, 1))

    def step():
        model(token, past_key_values=cache, use_cache=True)
        cache.crop(-1)  # the same length every step

    for _ in range(10):
        step()
    rounds = []
    for _ in range(7):
        spent[0] = 0.0
        for _ in range(100):
            step()
        rounds.append(spent[0] / (100 * config.num_hidden_layers) * 1e6)
    return rounds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--decode", action="store_true", help="time the decoding step instead of the prefill call")
    parser.add_argument("--flex", action="store_true", help="as maskc.flex_attention with a BlockMask, compiled")
    parser.add_argument("--hf", action="store_true", help="transformers' eager decoding step, layer by layer")
    args = parser.parse_args()
    if args.hf:
        # 9 splits: the H100's choice for a row of 513 keys (decode.choose_splits with 132 multiprocessors)
        with torch.no_grad(), tiles.use_config(decode=tiles.TileConfig(16, 64, 4, 3), splits=9):
            rounds = hf_rounds()
        print(f"host work of maskc's attention function in an eager generate() step: best {min(rounds):.1f} µs, "
              f"median {statistics.median(rounds):.1f} µs a layer")
        return
    call = flex(args.decode) if args.flex else decode() if args.decode else prefill()
    calls = 200 if args.flex else 2000
    tiles_of_h100 = tiles.use_config(decode=tiles.TileConfig(16, 64, 4, 3), splits=32)
    with torch.no_grad(), tiles_of_h100 if args.decode else contextlib.nullcontext():
        call()  # traces and plans once
        rounds = []
        for _ in range(7):
            start = time.perf_counter()
            for _ in range(calls):
                call()
            rounds.append((time.perf_counter() - start) / calls * 1e6)
    what = ("decoding step" if args.decode else "prefill call") + (" (compiled flex_attention)" if args.flex else "")
    print(f"host work of a cached {what}: best {min(rounds):.1f} µs, median {statistics.median(rounds):.1f} µs")


if __name__ == "__main__":
    main()
