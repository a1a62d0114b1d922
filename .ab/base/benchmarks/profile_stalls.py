"""Where a Gluon kernel's warps wait: Nsight Compute's stall sampling, instruction by instruction.

    bash benchmarks/profile_stalls.sh            # on the GPU machine; CSVs under $OUT (or /tmp/stalls)

profile_stalls.sh runs this file twice a case and once at the end. Under `ncu`, `run` launches one workload's maskc
forward (+ backward) a few times, and ncu profiles one launch of the kernel it is told to
(--launch-skip past the warm-up). Then `report` reads the reports ncu exported as CSV and prints,
per kernel: the issue rate, the pipes' utilisation (tensor, transcendental XU, FMA, ALU), the warps'
stall reasons summed over the kernel, and the SASS instructions with the most stall samples, each
with its leading reasons (`line`: the instruction's row in the source CSV). This is the profile benchmarks/NOTES.md asks for before the next lever.
"""
from __future__ import annotations

import argparse
import csv
import re
import sys
from collections import Counter
from pathlib import Path


def run(args) -> None:
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    import maskc
    from workloads import workloads

    B, H, L, D = args.batch, args.heads, args.length, args.dim
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=args.backward)
               for _ in range(3))
    d_out = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)
    (name, mask, score), = [w for w in workloads(L, H, "cuda") if w[0] == args.workload]
    for _ in range(args.steps):
        out = maskc.compiled_attention(q, k, v, mask_mod=mask, score_mod=score)
        if args.backward:
            out.backward(d_out)
    torch.cuda.synchronize()


def rows(path: Path, first: str) -> list[dict]:
    # ncu's CSV pages open with other lines ("==PROF==", the kernel's name): the table starts at
    # the line whose first cell is `first`
    lines = path.read_text().splitlines()
    start = next((n for n, line in enumerate(lines) if line.startswith(f'"{first}"')), len(lines))
    return list(csv.DictReader(lines[start:]))


def number(text: str | None) -> float:
    try:
        return float(text.replace(",", ""))
    except (ValueError, AttributeError):
        return 0.0


KERNEL = {  # label: metric (the unit is ncu's, from the units row)
    "duration": "gpu__time_duration.sum",
    "SM clock": "gpc__cycles_elapsed.avg.per_second",
    "issue active": "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "tensor pipe": "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
    "XU (exp2)": "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active",
    "FMA": "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active",
    "ALU": "sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active",
    "registers/thread": "launch__registers_per_thread",
}


def report(args) -> None:
    for raw_path in sorted(Path(args.folder).glob("*.raw.csv")):
        label = raw_path.name[:-len(".raw.csv")]
        print(f"\n## {label}")
        table = rows(raw_path, "ID")
        if not table:
            print("(no rows)")
            continue
        units, row = table[0], table[-1]  # the first row under the header gives units
        print("; ".join(f"{name} {row.get(metric, '-')} {units.get(metric, '')}".rstrip()
                        for name, metric in KERNEL.items()))
        source = raw_path.with_name(f"{label}.source.csv")
        if source.exists():
            stalls(rows(source, "Address"), args.top)


def stalls(table: list[dict], top: int) -> None:
    """Stall samples by reason, by opcode, and the instructions with the most."""
    if not table:
        print("(no source rows)")
        return
    reasons = [c for c in table[0] if c.startswith("stall_") and "Not Issued" not in c]
    total = sum(number(r["Warp Stall Sampling (All Samples)"]) for r in table) or 1.0
    by_reason, by_opcode = Counter(), {}
    for r in table:
        # "@!P3 BRA 0x..." -> BRA: the opcode without its predicate
        opcode = re.sub(r"^@!?U?P\w+\s+", "", (r["Source"] or "").strip()).split(" ")[0]
        for c in reasons:
            by_reason[c[6:]] += number(r[c])
            by_opcode.setdefault(opcode, Counter())[c[6:]] += number(r[c])

    def shares(counter, n=3):
        return ", ".join(f"{k} {v / total:.1%}" for k, v in counter.most_common(n) if v)

    print(f"stall samples by reason: {shares(by_reason, 8)}")
    print("\n| opcode | share | leading reasons |\n|---|---|---|")
    for opcode in sorted(by_opcode, key=lambda o: -sum(by_opcode[o].values()))[:top]:
        print(f"| {opcode} | {sum(by_opcode[opcode].values()) / total:.1%} | {shares(by_opcode[opcode])} |")
    print("\n| share | line | instruction | leading reasons |\n|---|---|---|---|")
    ranked = sorted(range(len(table)), key=lambda n: -number(table[n]["Warp Stall Sampling (All Samples)"]))
    for n in ranked[:top]:
        r = table[n]
        lead = Counter({c[6:]: number(r[c]) for c in reasons})
        print(f"| {number(r['Warp Stall Sampling (All Samples)']) / total:.1%} | {n} | {(r['Source'] or '').strip()[:60]} "
              f"| {shares(lead)} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    target = sub.add_parser("run")
    target.add_argument("--workload", default="no mask")
    target.add_argument("--dim", type=int, default=128)
    target.add_argument("--batch", type=int, default=4)
    target.add_argument("--heads", type=int, default=16)
    target.add_argument("--length", type=int, default=8192)
    target.add_argument("--backward", action="store_true")
    target.add_argument("--steps", type=int, default=3)
    tables = sub.add_parser("report")
    tables.add_argument("folder")
    tables.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    run(args) if args.command == "run" else report(args)


if __name__ == "__main__":
    main()
