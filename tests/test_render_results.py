"""benchmarks/render_results.py: the docs' benchmark page names every result's provenance, and
its output depends only on the results."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
RESULTS = BENCHMARKS / "results"
FIELDS = ["gpu", "torch", "triton", "commit", "date", "command", "source"]


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


render_results = _module("render_results")


def _results() -> list[tuple[str, dict]]:
    return [(p.name, json.loads(p.read_text(encoding="utf-8"))) for p in sorted(RESULTS.glob("*.json"))]


def test_the_repository_keeps_results_with_every_provenance_field():
    results = _results()
    assert results, f"no result files in {RESULTS}"
    for name, result in results:
        missing = [f for f in FIELDS + ["schema", "benchmark", "title", "setup", "figures"] if not result.get(f)]
        assert not missing, f"{name} lacks {missing}"
        for figure in result["figures"]:
            assert set(figure) == {"workload", "implementation", "metric", "value", "unit"}, (name, figure)
            assert isinstance(figure["value"], (int, float)), (name, figure)


def test_the_page_lists_every_results_provenance_and_figures(tmp_path):
    page = tmp_path / "docs" / "benchmarks.md"
    render_results.render(RESULTS, page, tmp_path / "docs" / "assets" / "benchmarks", charts=False)
    text = page.read_text(encoding="utf-8")
    sections = text.split("\n## ")[1:]
    results = _results()
    assert len(sections) == len(results)
    for name, result in results:
        section = next((s for s in sections if s.startswith(result["title"] + "\n")), None)
        assert section is not None, f"{name}: no section titled {result['title']!r}"
        for field in FIELDS:
            assert str(result[field]) in section, f"{name}: the page does not show its {field} {result[field]!r}"
        for figure in result["figures"]:
            assert figure["workload"] in section, (name, figure)


def test_the_page_is_the_same_on_every_render(tmp_path):
    pages = []
    for run in ("a", "b"):
        page = tmp_path / run / "benchmarks.md"
        render_results.render(RESULTS, page, tmp_path / run / "assets", charts=False)
        pages.append(page.read_bytes())
    assert pages[0] == pages[1]


def test_a_result_written_by_a_benchmark_renders_with_its_provenance(tmp_path, monkeypatch):
    results = _module("_results")
    monkeypatch.setattr(sys, "argv", ["benchmarks/bench_attention.py", "--json", "x.json"])
    folder = tmp_path / "results"
    folder.mkdir()
    figures = [results.Figure("causal", "maskc", "time", 1.8, "ms"),
               results.Figure("causal", "FlexAttention", "time", 2.7, "ms")]
    results.write(str(folder / "forward-d128.json"), "forward", "Forward, D=128", "bf16, B=4 H=16 L=8192 D=128",
                  figures, work={"causal": 1.1e12})
    written = json.loads((folder / "forward-d128.json").read_text(encoding="utf-8"))
    assert written["command"] == "python benchmarks/bench_attention.py --json x.json"
    assert written["source"] == "measured"
    page = tmp_path / "benchmarks.md"
    render_results.render(folder, page, tmp_path / "assets", charts=False)
    text = page.read_text(encoding="utf-8")
    for field in FIELDS:
        assert str(written[field]) in text, field
    assert "| causal | 1.8 | 2.7 | 1.50 |" in text


def test_the_charts_are_the_same_on_every_render(tmp_path):
    pytest.importorskip("matplotlib")
    images = []
    for run in ("a", "b"):
        written = render_results.render(RESULTS, tmp_path / run / "benchmarks.md", tmp_path / run / "assets")
        names = sorted(p.name for p in written if p.suffix == ".png")
        assert names == ["backward.png", "decode.png", "forward.png"]
        images.append([(tmp_path / run / "assets" / n).read_bytes() for n in names])
    assert images[0] == images[1]
    assert b"Software" not in images[0][0]
