"""A benchmark's figures as a JSON file with their provenance, for benchmarks/results/ and the docs.

The benchmark scripts' `--json PATH` option writes one:

    {"schema": 1, "benchmark": "forward", "title": "Forward, D=128", "setup": "bf16, B=4 H=16 L=8192 D=128",
     "gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "triton": "3.6.0",
     "commit": "2949733", "date": "2026-12-07", "command": "python benchmarks/bench_attention.py --json f.json",
     "source": "measured", "work": {"causal": 1.1e12},
     "figures": [{"workload": "causal", "implementation": "maskc", "metric": "time", "value": 1.8, "unit": "ms"}]}

`source` is "measured" for a file a script wrote, or the document a file was transcribed from.
`work` (optional) is each workload's floating-point operations, so that a time becomes TFLOP/s;
`note` (optional, in transcribed files) says how a figure was obtained where the command does not.
benchmarks/render_results.py turns the files into docs/benchmarks.md and its charts.
"""
from __future__ import annotations

import datetime
import json
import shlex
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

SCHEMA = 1
JSON_HELP = ("also write the figures to PATH as JSON (benchmarks/_results.py); run_gpu.sh runs a script from /tmp, "
             "so give an absolute path")
REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Figure:
    """One measured number: `value` `unit` of `metric` for `implementation` on `workload`."""

    workload: str
    implementation: str
    metric: str
    value: float
    unit: str


def commit() -> str:
    """The repository's commit (short hash), or "unknown" outside a git checkout (the GPU machine
    runs an installed copy)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False,
                             timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def environment() -> dict:
    """GPU name and torch and triton versions; imported here so that a script that never writes a
    result does not pay for it."""
    import torch
    import triton
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)"
    return {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__}


def result(benchmark: str, title: str, setup: str, figures: list[Figure], work: dict | None = None) -> dict:
    """The JSON object for `figures`, with this machine's GPU, versions, commit, date (UTC) and command line."""
    out = {"schema": SCHEMA, "benchmark": benchmark, "title": title, "setup": setup, **environment(),
           "commit": commit(), "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
           "command": shlex.join(["python", *sys.argv]), "source": "measured"}
    if work:
        out["work"] = work
    out["figures"] = [asdict(f) for f in figures]
    return out


def write(path: str | None, benchmark: str, title: str, setup: str, figures: list[Figure],
          work: dict | None = None) -> None:
    """Write the result to `path` (nothing when `path` is None: `--json` not given)."""
    if path is None:
        return
    data = result(benchmark, title, setup, figures, work)
    Path(path).write_text(dumps(data), encoding="utf-8")
    print(f"# wrote {path}", flush=True)


def dumps(data: dict) -> str:
    """JSON with one figure a line, so that a diff of two results reads row by row."""
    head = {k: v for k, v in data.items() if k != "figures"}
    lines = [f" {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}," for k, v in head.items()]
    rows = ",\n".join(f"  {json.dumps(f, ensure_ascii=False)}" for f in data.get("figures", []))
    return "{\n" + "\n".join(lines) + '\n "figures": [\n' + rows + "\n ]\n}\n"
