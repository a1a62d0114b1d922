"""What `import maskc` and `maskc --help` load: the public names load their modules on first use
(maskc/__init__.py), and the command line imports a command's module only to run it or print its
help (maskc/cli/__init__.py). Read from sys.modules in a fresh process: which modules, not how
long, so the test does not depend on the machine's speed. (`python -X importtime` shows the
times, but not the modules importlib.import_module loads, which the lazy names use.)
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# What `import maskc` leaves to the first use of a name that needs it.
HEAVY = {"torch", "sympy", "triton", "jinja2", "torch._dynamo", "transformers"}
MARK = "-- modules --"


def _python(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT)] + [p for p in
                                                                     os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                                     if p])}
    result = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env,
                            cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def _imported(code: str) -> set:
    """The modules a fresh process has imported after running `code`."""
    out = _python("-c", f"{code}\nimport sys\nprint({MARK!r}, *sys.modules, sep='\\n')").stdout
    return set(out.split(MARK + "\n")[1].split())


def _maskc_command(*argv: str) -> str:
    """Code that runs `maskc argv...` as `python -m maskc` does (exit included)."""
    return (f"import runpy, sys\nsys.argv = ['maskc', *{list(argv)!r}]\ntry:\n"
            f"    runpy.run_module('maskc', run_name='__main__', alter_sys=True)\nexcept SystemExit as stop:\n"
            f"    assert stop.code == 0, stop.code")


@pytest.mark.parametrize("code", ["import maskc", _maskc_command("--help")], ids=["import", "help"])
def test_import_and_help_load_no_heavy_module(code):
    imported = _imported(code)
    assert "maskc" in imported
    assert not imported & HEAVY, f"{sorted(imported & HEAVY)} imported"


def test_a_command_loads_its_module_alone_and_the_public_names_stay_whole():
    # one process for both (each loads the pipeline): `maskc show` imports the submodule
    # maskc.plot, which must not hide the function maskc.plot
    _python("-c", f"""
{_maskc_command("show", "--help")}
assert "maskc.cli.mask" in sys.modules and "torch" in sys.modules
assert not {{"maskc.cli.cache", "maskc.cli.doctor", "maskc.cli.bench"}} & set(sys.modules)
import maskc
assert maskc.plot is sys.modules["maskc.plot"].plot, maskc.plot
for name in maskc.__all__:
    assert name in dir(maskc), name
    value = getattr(maskc, name)
    exec(f"from maskc import {{name}} as again")
    assert again is value, name
assert maskc.masks is sys.modules["maskc.masks"] and maskc.scores is sys.modules["maskc.scores"]
assert isinstance(maskc.masks.causal, maskc.MaskMod) and maskc.MaskMod is sys.modules["maskc.trace.mods"].MaskMod
assert maskc.compile is sys.modules["maskc.runtime.api"].compile
try:
    maskc.no_such_name
except AttributeError as error:
    assert "module 'maskc' has no attribute 'no_such_name'" in str(error), error
else:
    raise AssertionError("maskc.no_such_name")
""")


def test_torch_compile_of_maskc_calls_right_after_import():
    # Dynamo reads maskc.flex_attention, maskc.compiled_attention and maskc.masks for the first
    # time while it traces: their modules, and maskc's torch operators, load then.
    _python("-c", """
import sys
import torch
import maskc
from torch.nn.attention.flex_attention import flex_attention
assert "maskc.runtime.ops" not in sys.modules

def attend(q, k, v):
    return maskc.flex_attention(q, k, v) + maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal)

g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 2, 40, 16, generator=g) for _ in range(3))
got = torch.compile(attend, backend="aot_eager", fullgraph=True)(q, k, v)
causal = lambda score, b, h, q_idx, kv_idx: torch.where(q_idx >= kv_idx, score, -float("inf"))
want = flex_attention(q, k, v) + flex_attention(q, k, v, score_mod=causal)
torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
# the first name in use loaded maskc.plot too, which gives every BlockMap its plot method
assert sys.modules["maskc.analysis.blockmap"].BlockMap.plot is sys.modules["maskc.plot"].plot_block_map
""", timeout=300)


@pytest.mark.parametrize("statement", ["import maskc; maskc.PagedKVCache", "import maskc.inference.paged",
                                       "import maskc.inference.decode", "import maskc.runtime"])
def test_each_package_imports_first_in_a_fresh_process(statement):
    """The runtime's package imports inference's modules (its public functions decode and take
    a PagedKVCache) and they import the runtime's: whichever comes first, the import is whole."""
    done = subprocess.run([sys.executable, "-c", statement], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
