"""Render benchmarks/results/*.json (benchmarks/_results.py's files) into docs/benchmarks.md and its charts.

    python benchmarks/render_results.py            # docs/benchmarks.md, docs/assets/benchmarks/*.png
    python benchmarks/render_results.py --no-charts

The page has one section a result: its provenance (GPU, versions, commit, date, command, source),
its setup and a table of its figures, with each time's ratio to maskc's. The charts come from the
results named in CHARTS: TFLOP/s (the result's `work` ÷ time) by workload for the forward and the
forward + backward at D=128, and µs by workload for decoding. A new run written over one of those
files (`--json benchmarks/results/forward-d128.json`) redraws its chart. The output depends only on
the results: no timestamps, a fixed figure size, PNGs without a software tag.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ORDER = ["forward", "forward-ratios", "forward+backward", "decode", "decode-step", "hopper", "model"]
# result file (stem) -> chart file and what its bars show
CHARTS = {"forward-d128": ("forward.png", "tflops"), "forward-backward-d128": ("backward.png", "tflops"),
          "decode": ("decode.png", "time")}
BARS = ["maskc", "FlexAttention", "SDPA"]  # an implementation named "SDPA (cuDNN)" is drawn as SDPA
COLOURS = {"maskc": "#1f77b4", "FlexAttention": "#ff7f0e", "SDPA": "#7f7f7f"}
PROVENANCE = ["gpu", "torch", "triton", "commit", "date", "command", "source"]


def load(results: Path) -> list[tuple[str, dict]]:
    """(file stem, result) for every JSON file in `results`, in ORDER of benchmark, then by file name."""
    found = [(p.stem, json.loads(p.read_text(encoding="utf-8"))) for p in sorted(results.glob("*.json"))]
    rank = {name: i for i, name in enumerate(ORDER)}
    return sorted(found, key=lambda r: (rank.get(r[1]["benchmark"], len(ORDER)), r[0]))


def number(value: float, unit: str) -> str:
    return f"{value:.2f}" if unit == "×" else f"{value:.5g}"


def columns(result: dict) -> list[tuple[str, str, str]]:
    """(implementation, metric, unit) in the order the figures first name them."""
    seen = {}
    for f in result["figures"]:
        seen.setdefault((f["implementation"], f["metric"], f["unit"]), None)
    return list(seen)


def table(result: dict) -> list[str]:
    """The figures as a markdown table: a row a workload, a column an (implementation, metric), then
    each other library's time ÷ maskc's where both are times in the same unit."""
    cols = columns(result)
    rows: dict[str, dict] = {}
    for f in result["figures"]:
        rows.setdefault(f["workload"], {})[f["implementation"], f["metric"], f["unit"]] = f["value"]
    ratios = [c for c in cols if c[1] == "time" and not c[0].startswith("maskc") and ("maskc", "time", c[2]) in cols]
    head = [f"{impl} {metric} ({unit})" if metric != "time" else f"{impl} ({unit})" for impl, metric, unit in cols]
    head += [f"{impl} ÷ maskc" for impl, _, _ in ratios]
    lines = ["| workload | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    for workload, cells in rows.items():
        text = [number(cells[c], c[2]) if c in cells else "—" for c in cols]
        for c in ratios:
            mine = cells.get(("maskc", "time", c[2]))
            text.append(f"{cells[c] / mine:.2f}" if c in cells and mine else "—")
        lines.append(f"| {workload} | " + " | ".join(text) + " |")
    return lines


def section(stem: str, result: dict, page_dir: Path, assets: Path, charts: bool) -> list[str]:
    out = [f"## {result['title']}", ""]
    out += [f"- **{key}:** " + (f"`{result[key]}`" if key == "command" else str(result.get(key, "—")))
            for key in PROVENANCE]
    out += [f"- **setup:** {result['setup']}"]
    if result.get("note"):
        out += [f"- **note:** {result['note']}"]
    out += ["", *table(result), ""]
    if charts and stem in CHARTS:
        link = Path(os.path.relpath(assets / CHARTS[stem][0], page_dir)).as_posix()
        out += [f"![{result['title']}]({link})", ""]
    return out


def page(loaded: list[tuple[str, dict]], page_dir: Path, assets: Path, charts: bool) -> str:
    out = ["# Benchmarks", "",
           "Each section is one result file of `benchmarks/results/`, rendered by "
           "`python benchmarks/render_results.py`. \"÷ maskc\" is the other's time over maskc's: above 1, "
           "maskc is faster. A result's commit is the one whose tree was measured or whose text recorded "
           "the figures (its source).", ""]
    for stem, result in loaded:
        out += section(stem, result, page_dir, assets, charts)
    return "\n".join(out).rstrip("\n") + "\n"


def bars(result: dict, kind: str) -> tuple[list[str], dict[str, list[float | None]], str]:
    """Workloads timed for maskc and another library, each implementation's heights (None where not
    measured; keyed by the name the result gives it) and the axis label."""
    times: dict[str, dict[str, float]] = {}
    names = {}
    unit = ""
    for f in result["figures"]:
        bar = "SDPA" if f["implementation"].startswith("SDPA") else f["implementation"]
        if f["metric"] != "time" or bar not in BARS:
            continue
        names.setdefault(bar, f["implementation"])
        unit = f["unit"]
        value = f["value"]
        if kind == "tflops":
            value = result["work"][f["workload"]] / (value * {"ms": 1e-3, "µs": 1e-6, "s": 1.0}[unit]) / 1e12
        times.setdefault(f["workload"], {})[bar] = value
    workloads = [w for w, t in times.items() if "maskc" in t and len(t) > 1]
    heights = {names[bar]: [times[w].get(bar) for w in workloads] for bar in BARS if bar in names}
    label = "TFLOP/s (higher is better)" if kind == "tflops" else f"{unit} a call (lower is better, log scale)"
    return workloads, heights, label


def chart(result: dict, kind: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads, heights, label = bars(result, kind)
    fig, ax = plt.subplots(figsize=(10, 4.8), dpi=100)
    width = 0.8 / len(heights)
    for i, (name, values) in enumerate(heights.items()):
        xs = [x + (i - (len(heights) - 1) / 2) * width for x, v in enumerate(values) if v is not None]
        colour = COLOURS["SDPA" if name.startswith("SDPA") else name]
        ax.bar(xs, [v for v in values if v is not None], width, label=name, color=colour)
    if kind == "time":
        ax.set_yscale("log")
    ax.set_xticks(range(len(workloads)), workloads, rotation=20, ha="right", fontsize=9)
    ax.set_ylabel(label)
    ax.set_title(f"{result['title']} · {result['gpu']} · {result['commit']} ({result['date']})", fontsize=10)
    ax.legend(fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)


def render(results: Path, page_path: Path, assets: Path, charts: bool = True) -> list[Path]:
    """Write the page (and the charts); returns the paths written."""
    loaded = load(results)
    page_path.parent.mkdir(parents=True, exist_ok=True)
    page_path.write_text(page(loaded, page_path.parent, assets, charts), encoding="utf-8")
    written = [page_path]
    if charts:
        for stem, result in loaded:
            if stem in CHARTS:
                name, kind = CHARTS[stem]
                chart(result, kind, assets / name)
                written.append(assets / name)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--page", type=Path, default=REPO / "docs" / "benchmarks.md")
    parser.add_argument("--assets", type=Path, default=REPO / "docs" / "assets" / "benchmarks")
    parser.add_argument("--no-charts", action="store_true", help="write the page only (no matplotlib)")
    args = parser.parse_args()
    for path in render(args.results, args.page, args.assets, charts=not args.no_charts):
        print(path)


if __name__ == "__main__":
    main()
