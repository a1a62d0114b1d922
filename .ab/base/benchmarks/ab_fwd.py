"""A/B the forward kernel: maskc's templates beside edited copies of them, in one process.

    python benchmarks/ab_fwd.py --variant base= --variant pipe=.exp/pipe --variant big=@128,128,8,2 \
        --dims 128,64 --only "no mask|causal"

A variant is NAME=[FOLDER][@BLOCK_M,BLOCK_N,WARPS,STAGES]: FOLDER holds the forward template and
its prelude (left empty: maskc's own), the numbers a tile config (left out: maskc's default).
Every variant runs the same launch as maskc.compiled_attention (same block map, arguments and
tensor descriptors) with only the kernel source or config changed. Each output is checked
against FlexAttention on the whole problem and the float64 reference on one (b, h) slice.
Variants and FlexAttention are timed in turn, three rounds, medians reported; after each
timing the SM clock and board power are read (NVML), since a kernel near the power limit
runs at a lower clock. Prints registers, spills and shared memory of each compiled variant,
and writes its PTX under --asm when given. Levers measured with it: benchmarks/NOTES.md.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

sys.path.insert(0, str(Path(__file__).parent))
from maskc import masks  # noqa: E402
from maskc.codegen.render import render  # noqa: E402
from maskc.codegen.render import parameters  # noqa: E402
from maskc.runtime import launch, loader, plan  # noqa: E402
from maskc.runtime.kernel import CompiledKernel  # noqa: E402
from maskc.runtime.tiles import TileConfig, use_config  # noqa: E402
from maskc.testing import attention_reference, dense_mask  # noqa: E402
from maskc.trace.mods import as_mask_mod, as_score_mod  # noqa: E402
from workloads import workloads  # noqa: E402

try:
    import pynvml

    pynvml.nvmlInit()
    _GPU = pynvml.nvmlDeviceGetHandleByIndex(0)
except Exception:  # no NVML: clocks are not reported
    _GPU = None

flex = torch.compile(flex_attention, dynamic=False)


def gpu_state() -> str:
    if _GPU is None:
        return ""
    clock = pynvml.nvmlDeviceGetClockInfo(_GPU, pynvml.NVML_CLOCK_SM)
    watts = pynvml.nvmlDeviceGetPowerUsage(_GPU) / 1000
    return f"{clock}MHz/{watts:.0f}W"


class Recorder:
    """Stands in for a @triton.jit function and keeps the compiled kernel of its last launch."""

    def __init__(self, fn):
        self.fn, self.compiled = fn, None

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.compiled = self.fn[grid](*args, **kwargs)
            return self.compiled
        return launch


def parse_variant(text: str):
    name, _, rest = text.partition("=")
    folder, _, config = rest.partition("@")
    tiles = TileConfig(*(int(x) for x in config.split(","))) if config else None
    return name, folder or None, tiles


def variant_run(q, k, v, mask, score, folder, tiles, workdir: Path):
    """A callable running maskc's forward with the kernel rendered from `folder`."""
    with use_config(forward=tiles) if tiles else use_config():
        mm, sm = as_mask_mod(mask), as_score_mod(score)
        traces = (mm.traced if mm else None, sm.traced if sm else None)
        problem = plan.problem_of(q, k, v, mm, sm, None, traces)
        source = problem.forward_kernel.kernel_source
        text = render(source, templates=folder).text
        path = workdir / f"fwd_{abs(hash((folder, tiles, problem.forward_kernel.signature)))}.py"
        path.write_text(text)
        module = loader.load(path, interpret=False)
        recorder = Recorder(module.attention_fwd)
        module.attention_fwd = recorder  # the launch plan takes the function from the module
        kernel = CompiledKernel(source, problem.forward_kernel.signature, text, path, parameters(text))
        kernel._functions[False] = module
        problem.forward_kernel = kernel
    return (lambda: launch.forward(q, k, v, problem)[0]), recorder


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", action="append", required=True)
    ap.add_argument("--dims", default="128")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--only", default="no mask|causal")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--asm", default="", help="folder for each variant's PTX (first workload of each dim)")
    args = ap.parse_args()
    variants = [parse_variant(t) for t in args.variant]
    workdir = Path(tempfile.mkdtemp(prefix="maskc_ab_"))
    B, H, L = 4, 16, args.length
    rows = []
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"B={B} H={H} L={L} bf16 forward")
    for D in (int(d) for d in args.dims.split(",")):
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        chosen = [w for w in workloads(L, H, "cuda") if w[0] in args.only.split("|")]
        for index, (name, mask, score) in enumerate(chosen):
            pairs = int(dense_mask(mask, L, L, device="cuda")[0, 0].sum()) if mask is not None else L * L
            tflops = lambda ms: 4 * B * H * D * pairs / (ms * 1e-3) / 1e12  # noqa: E731
            bm = create_block_mask(mask.fn, None, None, L, L, device="cuda") if mask is not None else None
            runs = {"flex": lambda bm=bm: flex(q, k, v, score_mod=score.fn if score else None, block_mask=bm)}
            expected = runs["flex"]().float()
            if score is None and (mask is None or mask is masks.causal):  # cuDNN's own masks
                runs["sdpa"] = lambda causal=mask is not None: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            ref, _ = attention_reference(*(t[:1, :1].double() for t in (q, k, v)), mask, score)
            for vname, folder, tiles in variants:
                try:
                    run, recorder = variant_run(q, k, v, mask, score, folder, tiles, workdir)
                    out = run().float()
                except Exception as e:  # a variant that does not compile is reported, not fatal
                    print(f"D={D} {name} {vname}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                    continue
                err_flex = float((out - expected).norm() / expected.norm())
                err_ref = float((out[:1, :1].double() - ref).norm() / ref.norm())
                ck = recorder.compiled
                print(f"D={D} {name} {vname}: regs {ck.n_regs} spills {ck.n_spills} shared {ck.metadata.shared} "
                      f"err vs flex {err_flex:.1e} vs f64 {err_ref:.1e}", flush=True)
                if err_flex > 2e-2 or err_ref > 2e-2 or out.isnan().any():
                    print(f"  WRONG: {vname} dropped", flush=True)
                    continue
                if args.asm and index == 0:
                    Path(args.asm).mkdir(parents=True, exist_ok=True)
                    (Path(args.asm) / f"{vname}_d{D}.ptx").write_text(ck.asm["ptx"])
                    try:
                        (Path(args.asm) / f"{vname}_d{D}.sass").write_text(ck.asm["sass"])
                    except Exception as e:  # SASS needs cuobjdump; PTX alone still answers most questions
                        print(f"  no SASS: {e}")
                runs[vname] = run
            times = {n: [] for n in runs}
            for _ in range(args.rounds):
                for n, run in runs.items():
                    ms = triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")
                    times[n].append((ms, gpu_state()))
            for n, ts in times.items():
                ms, state = sorted(ts)[len(ts) // 2]
                rows.append((D, name, n, tflops(ms), [round(tflops(t)) for t, _ in ts], state))
                print(f"D={D} {name:22s} {n:10s} {tflops(ms):6.1f} TFLOP/s  rounds {rows[-1][4]}  {state}",
                      flush=True)
    print("\n| D | workload | variant | TFLOP/s | /flex | rounds | clock/power after |")
    print("|---|---|---|---|---|---|---|")
    flex_of = {(D, w): t for D, w, n, t, _, _ in rows if n == "flex"}
    for D, w, n, t, each, state in rows:
        print(f"| {D} | {w} | {n} | {t:.0f} | {t / flex_of[(D, w)]:.2f} | {each} | {state} |")


if __name__ == "__main__":
    main()
