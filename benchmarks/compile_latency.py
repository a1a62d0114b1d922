"""Time to first result: a new mask with cold caches, then a new process with warm caches.

    python benchmarks/compile_latency.py          # on a GPU machine

Runs three child processes with fresh MASKC_CACHE_DIR and TRITON_CACHE_DIR:
  1. cold: maskc and Triton caches empty; the first call traces, analyses, renders, compiles;
  2. warm: a new process with both caches filled by (1);
  3. flex: torch.compile(flex_attention) with a new mask, for comparison; then the same
     mask with a different window, which FlexAttention recompiles and maskc does not.
Each child prints its own wall-clock times; imports are excluded, CUDA context creation is
done before timing.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

CHILD = r"""
import time, torch
torch.ones(1, device="cuda"); torch.cuda.synchronize()
B, H, L, D = 1, 16, 4096, 128
q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
which = "{which}"
if which == "flex":
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    flex = torch.compile(flex_attention, dynamic=False)
    for window in (1000, 1100):
        def mask(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)
        t0 = time.perf_counter()
        bm = create_block_mask(mask, None, None, L, L, device="cuda")
        flex(q, k, v, block_mask=bm); torch.cuda.synchronize()
        print(f"flex window={{window}}: first result {{time.perf_counter() - t0:.3f}} s")
else:
    import maskc
    for window in (1000, 1100):
        def mask(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)
        t0 = time.perf_counter()
        maskc.compiled_attention(q, k, v, mask_mod=mask); torch.cuda.synchronize()
        print(f"maskc {{which}} window={{window}}: first result {{time.perf_counter() - t0:.3f}} s, "
              f"{{maskc.cache_info()}}")
"""


def child(which: str, env: dict) -> None:
    out = subprocess.run([sys.executable, "-c", CHILD.format(which=which)], env=env, capture_output=True, text=True)
    print(out.stdout.strip())
    if out.returncode:
        print(out.stderr[-3000:])
        raise SystemExit(out.returncode)


def main():
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, MASKC_CACHE_DIR=os.path.join(tmp, "maskc"), TRITON_CACHE_DIR=os.path.join(tmp, "triton"))
        child("cold", env)
        child("warm", env)
        env_flex = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"),
                        TRITON_CACHE_DIR=os.path.join(tmp, "triton_flex"))
        child("flex", env_flex)


if __name__ == "__main__":
    main()
