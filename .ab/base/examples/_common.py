"""Shared plumbing of the workload examples (causal.py, sliding_window.py, ...).

Each example builds its own mask_mod and score_mod, then hands them to `run_example`, which

1. picks the sizes: small float32 inputs on CPU (Triton's interpreter: slow but exact),
   bf16 and bigger ones when CUDA is available;
2. runs `maskc.compiled_attention` and checks it against the float64 reference
   `maskc.testing.attention_reference`, printing the relative error and 'ok';
3. prints the block map the kernel ran with (FULL tiles █ run without mask code,
   PARTIAL ░ evaluate the mask, EMPTY · are never loaded);
4. prints the part of the generated Triton kernel that is specialised to this workload.

>>> from _common import Problem, run_example
>>> p = Problem.pick()
>>> sys.exit(run_example(p, maskc.masks.sliding_window(p.L // 4)))

This module is a helper for the examples, not part of maskc.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

import maskc
from maskc.runtime.tiles import choose
from maskc.testing import assert_close_to_reference, attention_reference


@dataclass(frozen=True)
class Problem:
    """Where and how big: q, k and v are [B, H, L, D] of `dtype` on `device`."""

    device: torch.device
    dtype: torch.dtype
    B: int
    H: int
    L: int
    D: int

    @classmethod
    def pick(cls, cpu_len: int = 256, cuda_len: int = 4096) -> "Problem":
        """Small float32 on CPU (the interpreter runs each tile op in numpy); bf16 on CUDA."""
        if torch.cuda.is_available():
            return cls(torch.device("cuda"), torch.bfloat16, B=2, H=8, L=cuda_len, D=128)
        return cls(torch.device("cpu"), torch.float32, B=1, H=2, L=cpu_len, D=32)

    def inputs(self, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Standard normal q, k, v (fixed seed, so every run checks the same numbers)."""
        gen = torch.Generator().manual_seed(seed)
        shape = (self.B, self.H, self.L, self.D)
        return tuple(torch.randn(shape, generator=gen).to(self.device, self.dtype) for _ in range(3))

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"B={self.B} H={self.H} L={self.L} D={self.D} {dtype} on {self.device}"


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64: the measure assert_close_to_reference bounds."""
    out64, ref64 = out.double().cpu(), ref.double().cpu()
    return float((out64 - ref64).norm() / ref64.norm().clamp(min=1e-30))


def check(out: torch.Tensor, ref: torch.Tensor, what: str) -> bool:
    """Print the relative error and 'ok', or what went wrong; True when within the dtype's tolerance."""
    err = relative_error(out, ref)
    try:
        assert_close_to_reference(out, ref, what=what)
    except AssertionError as e:
        print(f"{what}: relative error {err:.2e} vs the float64 reference  FAILED: {e}")
        return False
    print(f"{what}: relative error {err:.2e} vs the float64 reference  ok")
    return True


def specialised_lines(source: str) -> list[str]:
    """From generated kernel source: the '# mask_mod:' / '# score_mod:' header comments and,
    in the tile function both loops call (`_fwd_tile`), the mask line (`keep = ...`) and the
    score line (`s = (...) * LOG2E`)."""
    lines = source.splitlines()
    header = [line for line in lines if line.startswith(("# mask_mod:", "# score_mod:"))]
    starts = [i for i, line in enumerate(lines) if line.startswith("def _fwd_tile(")]
    if not header or not starts:
        raise RuntimeError("the generated kernel no longer has the '# mask_mod:' header or the "
                           "'def _fwd_tile(' function this example looks for")
    ends = [i for i, line in enumerate(lines) if i > starts[0] and line.startswith("@triton.jit")]
    body = [line.strip() for line in lines[starts[0]:ends[0] if ends else None]]
    picked = [line for line in body if line.startswith("keep = ")
              or (line.startswith("s = (") and line.endswith("* LOG2E"))]
    if not any(line.startswith("s = (") for line in picked):
        picked.append("(no score_mod: the tile uses the scaled scores qk * qk_scale as they are)")
    return header + ["...", *picked]


def run_example(p: Problem, mask_mod, score_mod=None) -> int:
    """Run, check, and show one workload; returns the exit status (0 when the check passed)."""
    name = mask_mod.__name__ + (f" + {score_mod.__name__}" if score_mod is not None else "")
    print(f"== {name}: {p}")
    kernel = maskc.compile(mask_mod=mask_mod, score_mod=score_mod, dtype=p.dtype, head_dim=p.D, device=p.device)
    # the tiles compiled_attention would choose for the map (maskc/runtime/tiles.py owns them)
    tiles = choose(p.D, p.device.type, torch.empty((), dtype=p.dtype).element_size())
    bm = maskc.block_map(mask_mod, p.L, p.L, block_size=tiles.sparse, B=p.B, H=p.H, device=p.device)

    q, k, v = p.inputs()
    start = time.perf_counter()
    out = maskc.compiled_attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod, block_map=bm)
    if p.device.type == "cuda":
        torch.cuda.synchronize()
    work = "Triton's compile" if p.device.type == "cuda" else "loading the kernel into Triton's interpreter"
    print(f"compiled_attention: {1e3 * (time.perf_counter() - start):.0f} ms (first call, so this includes {work})")
    ref, _ = attention_reference(q, k, v, mask_mod=mask_mod, score_mod=score_mod)
    ok = check(out, ref, name)

    print()
    print(bm)
    print()
    print(f"generated kernel (full source: {kernel.path}), the lines specialised to {name}:")
    for line in specialised_lines(kernel.source):
        print("    " + line)
    return 0 if ok else 1
