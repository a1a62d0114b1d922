"""What users install: the wheel carries the kernel templates; the public surface is pinned."""
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import maskc

REPO = Path(__file__).resolve().parent.parent

PUBLIC = ["BlockMap", "BlockMask", "CacheInfo", "CompiledKernel", "MaskMod", "MaskTraceError", "MaskcError",
          "PagedKVCache", "ScoreMod", "__version__", "and_masks", "block_map", "cache_info", "clear_caches",
          "compile", "compiled_attention", "create_block_mask", "create_mask", "flex_attention", "invalidate",
          "mask_mod", "masks", "noop_mask", "or_masks", "paged_attention", "plot", "score_mod", "scores",
          "warmup"]


def test_public_surface_is_pinned():
    assert sorted(maskc.__all__) == sorted(PUBLIC)
    assert len(maskc.__all__) == len(set(maskc.__all__))
    for name in PUBLIC:
        assert hasattr(maskc, name), name


def test_wheel_contains_the_templates(tmp_path):
    # NOTE: built from a copy without build/ and *.egg-info, which setuptools would reuse: a
    # stale build/lib could put a template in the wheel that the source tree no longer ships.
    source = tmp_path / "src"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", ".venv*", ".hypothesis", ".pytest_cache", "__pycache__"))
    out = tmp_path / "wheels"
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "-w", str(out)], cwd=source,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (wheel,) = out.glob("maskc-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    templates = sorted(p.name for p in (REPO / "templates").glob("*.jinja"))
    assert "attention_fwd.py.jinja" in templates
    for name in templates:
        assert f"maskc/_templates/{name}" in names, f"{name} missing from {wheel.name}"
    assert "maskc/__init__.py" in names
    assert not [n for n in names if n.startswith(("tests/", "templates/", "benchmarks/", "examples/"))]
