"""maskc quickstart: block maps of the standard masks, then two checked attention calls.

Part 1 analyses each standard mask at L=1024 with 128×128 tiles and prints its block map:
FULL tiles (█) run with no mask code, PARTIAL tiles (░) evaluate the mask, EMPTY tiles (·)
are never loaded. Each map is checked tile by tile against dense evaluation of the mask.
The analysis never looks at the L×L pairs one by one, so it stays fast at L=131072, where a
dense boolean mask would need 16 GiB: part 1 ends by timing that.

Part 2 runs maskc.compiled_attention for a causal mask and for a sliding window with tanh
soft-capping, and checks both against the float64 reference in maskc.testing. On CPU the
generated Triton kernel runs through Triton's interpreter (slow, exact), so the inputs are
small; with CUDA they are bf16 and bigger.

Run:  python examples/quickstart.py
Then: the per-workload scripts, e.g. python examples/sliding_window.py, which also print
the generated kernel's specialised lines.
"""
import sys
import time

import torch

import maskc
from maskc.testing import assert_block_map_exact, assert_close_to_reference, attention_reference

L = 1024
TILE = (128, 128)


@maskc.mask_mod
def attention_sink(b, h, q_idx, kv_idx):
    """Your own masks are plain FlexAttention-style functions: every query may see the first 64 keys."""
    return kv_idx < 64


def standard_masks() -> list:
    m = maskc.masks
    # Four packed documents of 300, 200, 400 and 124 tokens: doc_ids[i] is token i's document.
    doc_ids = torch.repeat_interleave(torch.arange(4), torch.tensor([300, 200, 400, 124]))
    return [
        m.causal,
        m.sliding_window(256),
        m.prefix_lm(320),
        m.document(doc_ids, causal=True),
        m.chunked_causal(256),
        m.dilated_sliding_window(256, 2),
        # StreamingLLM-style: a sliding window plus attention sinks, kept causal.
        m.or_masks(m.sliding_window(256), m.and_masks(m.causal, attention_sink)),
    ]


def show_block_maps() -> None:
    print(f"== part 1: block maps at L={L}, tiles {TILE[0]}×{TILE[1]}\n")
    summary = []
    for mask in standard_masks():
        bm = maskc.block_map(mask, q_len=L, kv_len=L, block_size=TILE)
        print(bm)
        assert_block_map_exact(mask, L, L, TILE)  # raises if any tile differs from dense evaluation
        print("(same verdicts as dense evaluation, tile by tile)\n")
        summary.append((mask.__name__, bm.num_full, bm.num_partial, bm.num_empty, bm.sparsity))

    width = max(len(row[0]) for row in summary)
    print(f"{'mask':<{width}}  full  partial  empty  sparsity (tiles skipped)")
    for name, full, partial, empty, sparsity in summary:
        print(f"{name:<{width}}  {full:4d}  {partial:7d}  {empty:5d}  {sparsity:8.1%}")

    big = 131072
    print(f"\nblock map build time at L={big} ({big // TILE[0]}×{big // TILE[1]} tiles; a dense mask would be "
          f"{big * big / 1e9:.1f} billion booleans;\n"
          f"measured after the maps above, so one-time warm-up of torch is not counted):")
    for mask in (maskc.masks.causal, maskc.masks.sliding_window(1024)):
        start = time.perf_counter()
        bm = maskc.block_map(mask, q_len=big, kv_len=big, block_size=TILE)
        ms = 1e3 * (time.perf_counter() - start)
        print(f"  {mask.__name__:<20} {ms:7.1f} ms  (full={bm.num_full} partial={bm.num_partial} "
              f"empty={bm.num_empty}, sparsity {bm.sparsity:.1%})")


def check_attention() -> bool:
    if torch.cuda.is_available():
        device, dtype, (B, H, n, D) = "cuda", torch.bfloat16, (2, 8, 2048, 128)
    else:
        device, dtype, (B, H, n, D) = "cpu", torch.float32, (1, 2, 96, 32)
    print(f"\n== part 2: maskc.compiled_attention vs the float64 reference, "
          f"q/k/v [{B}, {H}, {n}, {D}] {str(dtype).removeprefix('torch.')} on {device}\n")
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, n, D, device=device, dtype=dtype) for _ in range(3))

    all_ok = True
    for mask, score in ((maskc.masks.causal, None),
                        (maskc.masks.sliding_window(n // 3), maskc.scores.softcap(30.0))):
        start = time.perf_counter()
        out = maskc.compiled_attention(q, k, v, mask_mod=mask, score_mod=score)
        seconds = time.perf_counter() - start
        ref, _ = attention_reference(q, k, v, mask_mod=mask, score_mod=score)
        err = float((out.double() - ref).norm() / ref.norm())
        name = mask.__name__ + (f" + {score.__name__}" if score is not None else "")
        try:
            assert_close_to_reference(out, ref)
            verdict = "ok"
        except AssertionError as e:
            verdict, all_ok = f"FAILED: {e}", False
        print(f"{name:<32} relative error {err:.2e}  ({seconds:.1f} s, first call)  {verdict}")
    return all_ok


if __name__ == "__main__":
    show_block_maps()
    sys.exit(0 if check_attention() else 1)
