"""Time to first result: a new mask with cold caches, then a new process with warm caches.

    python benchmarks/compile_latency.py               # on a GPU machine
    python benchmarks/compile_latency.py --device cpu  # checks the script anywhere; interpreter times

Runs five child processes with fresh MASKC_CACHE_DIR and TRITON_CACHE_DIR:
  1. cold: maskc and Triton caches empty; the first call traces, analyses, renders, compiles,
     and Triton builds its launcher library with gcc (once per Triton cache);
  2. warm: a new process with both caches filled by (1);
  3. profile: (2) again with the first call under cProfile, to see where the time goes;
  4. new mask: another mask (prefix-LM) in a new process, with a fresh maskc cache and (1)'s
     Triton cache: the cost of a mask nobody compiled, on a machine that has run Triton;
  5. flex: torch.compile(flex_attention) with a new mask, for comparison; then the same
     mask with a different window, which FlexAttention recompiles and maskc does not.
Each child prints its own wall-clock times; imports are excluded, CUDA context creation is
done before timing.

Under each maskc time, a line splits it into the phases of a call, in order: trace,
kernel_for (the source from memory, disk or rendering), block map, load kernel file (importing
the generated module; before the first, maskc waits for its warm-up threads and hands Triton
its cache key), triton launch (Triton's first-call work: specialisation, cache lookup or
compile, cubin load, launch), and other (checks, allocation, the kernel itself until
synchronize). The next line names Triton's costly steps run by the call itself: triton_key
(Triton hashing its install, 0.3 s, once a process unless maskc's stored key is used), compile
or cache lookup, launcher build (gcc, once a Triton cache) and cubin load; and the garbage
collector's time, part of whichever phase it interrupted. On CUDA a third line names the steps
that ran in maskc's warm-up threads instead (triton_key and the build of Triton's driver
utilities, started by the first CUDA kernel_for so that they overlap rendering and the block
map) and how long the first load still waited for them.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import gc, sys, threading, time, torch
which, device = sys.argv[1], sys.argv[2]
if device == "cuda":
    torch.ones(1, device="cuda"); torch.cuda.synchronize()
    B, H, L, D, dtype = 1, 16, 4096, 128, torch.bfloat16
else:
    B, H, L, D, dtype = 1, 1, 128, 32, torch.float32
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
q, k, v = (torch.randn(B, H, L, D, device=device, dtype=dtype) for _ in range(3))
if which == "flex":
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    flex = torch.compile(flex_attention, dynamic=False)
    for window in (1000, 1100):
        def mask(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)
        t0 = time.perf_counter()
        bm = create_block_mask(mask, None, None, L, L, device=device)
        flex(q, k, v, block_mask=bm); sync()
        print(f"flex window={window}: first result {time.perf_counter() - t0:.3f} s")
    sys.exit()

import maskc, triton, triton.compiler, triton.runtime.build, triton.runtime.cache, triton.runtime.jit
import maskc.runtime.loader, maskc.runtime.plan, maskc.trace.mods

SPENT, WARM_UP, GC = {}, {}, {"s": 0.0, "full": 0}
PHASES = ("trace", "kernel_for", "block map", "load kernel file", "triton launch")
TRITON_STEPS = ("triton_key", "compile or cache lookup", "launcher build", "cubin load")


def timed(label, owner, name):
    inner = getattr(owner, name, None)
    if inner is None:
        return  # this Triton has no such step
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent = SPENT if threading.current_thread() is threading.main_thread() else WARM_UP
            spent[label] = spent.get(label, 0.0) + time.perf_counter() - t0
    setattr(owner, name, wrapper)


def on_gc(phase, info):
    if phase == "start":
        on_gc.t0 = time.perf_counter()
    else:
        GC["s"] += time.perf_counter() - on_gc.t0
        GC["full"] += info["generation"] == 2


def instrument():
    timed("trace", maskc.trace.mods, "trace")
    timed("kernel_for", maskc.runtime.plan, "kernel_for")
    timed("block map", maskc.runtime.plan, "cached_block_map")
    timed("load kernel file", maskc.runtime.loader, "load")
    if device == "cuda":
        timed("triton launch", triton.runtime.jit.JITFunction, "run")
    else:
        from triton.runtime.interpreter import InterpretedFunction
        timed("triton launch", InterpretedFunction, "run")
    # Older Tritons keep these in other modules: each is timed where this one has it.
    for owner in (triton.runtime.cache, triton.compiler.compiler):
        timed("triton_key", owner, "triton_key")
    timed("compile or cache lookup", triton.compiler, "compile")
    for owner in (triton.runtime.build, sys.modules.get("triton.backends.nvidia.driver")):
        timed("launcher build", owner, "_build")
    timed("cubin load", triton.compiler.compiler.CompiledKernel, "_init_handles")
    timed("warm-up wait", maskc.runtime.loader._WARM_UP, "join")
    gc.callbacks.append(on_gc)


def breakdown(total):
    ms = lambda label, spent=SPENT: f"{label} {1e3 * spent.get(label, 0.0):.0f}"
    other = total - sum(SPENT.get(p, 0.0) for p in PHASES)
    lines = [f"  phases (ms): {', '.join(map(ms, PHASES))}, other {1e3 * other:.0f}",
             f"  triton steps (ms): {', '.join(map(ms, TRITON_STEPS))}; "
             f"garbage collection {1e3 * GC['s']:.0f} ({GC['full']} full)"]
    if device == "cuda":
        lines.append(f"  in maskc's warm-up threads (ms): {ms('triton_key', WARM_UP)}, "
                     f"{ms('launcher build', WARM_UP)}; the load waited {1e3 * SPENT.get('warm-up wait', 0.0):.0f}")
    return "\n".join(lines)


def first_result(window):
    if which == "new mask":
        def mask(b, h, q_idx, kv_idx):  # prefix-LM: never compiled in this Triton cache
            return (q_idx >= kv_idx) | (kv_idx < window)
    else:
        def mask(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)
    SPENT.clear(); WARM_UP.clear(); GC.update(s=0.0, full=0)
    t0 = time.perf_counter()
    maskc.compiled_attention(q, k, v, mask_mod=mask); sync()
    return time.perf_counter() - t0


if which == "profile":
    import cProfile, pstats
    profiler = cProfile.Profile()
    total = profiler.runcall(first_result, 1000)
    print(f"maskc warm under cProfile: first result {total:.3f} s; top 20 by cumulative time "
          f"(profiling inflates Python-heavy steps):")
    pstats.Stats(profiler, stream=sys.stdout).strip_dirs().sort_stats("cumulative").print_stats(20)
    sys.exit()

instrument()
for window in (1000, 1100):
    total = first_result(window)
    print(f"maskc {which} window={window}: first result {total:.3f} s, {maskc.runtime.cache_info()}")
    print(breakdown(total))
"""


def child(which: str, env: dict, device: str) -> None:
    out = subprocess.run([sys.executable, "-c", CHILD, which, device], env=env, capture_output=True, text=True)
    print(out.stdout.strip())
    if out.returncode:
        print(out.stderr[-3000:])
        raise SystemExit(out.returncode)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    device = parser.parse_args().device
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, MASKC_CACHE_DIR=os.path.join(tmp, "maskc"), TRITON_CACHE_DIR=os.path.join(tmp, "triton"))
        for which in ("cold", "warm", "profile"):
            child(which, env, device)
        # A new mask on a machine that has run Triton before: its launcher library (gcc, once
        # per Triton cache) is built, but neither maskc nor Triton has seen this kernel.
        child("new mask", dict(env, MASKC_CACHE_DIR=os.path.join(tmp, "maskc_new")), device)
        if device == "cuda":
            env_flex = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"),
                            TRITON_CACHE_DIR=os.path.join(tmp, "triton_flex"))
            child("flex", env_flex, device)


if __name__ == "__main__":
    main()
