"""The `maskc` command: every subcommand's exit code and output, bad arguments, and the cache
commands on a temporary cache with other processes loading kernels from it."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import maskc
from maskc import masks
from maskc.cli import main
from maskc.runtime import KERNELS, cache, plan
from maskc.runtime.kernel import provenance

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    path = tmp_path / "kernels"
    monkeypatch.setenv("MASKC_CACHE_DIR", str(path))
    for name in ("MASKC_DEBUG", "MASKC_LOG", "MASKC_CACHE_MAX_SIZE"):
        monkeypatch.delenv(name, raising=False)
    KERNELS.clear()
    plan.BLOCK_MAPS.clear()
    yield path
    KERNELS.clear()


def cli(capsys, *argv):
    """(exit code, stdout, stderr) of `maskc argv...` run in this process."""
    try:
        code = main(list(argv))
    except SystemExit as stop:  # argparse: --help, --version and bad arguments
        code = stop.code
    out, err = capsys.readouterr()
    return code, out, err


def _env(**extra) -> dict:
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


# -- help --------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [[], ["show"], ["source"], ["cache"], ["cache", "info"], ["cache", "list"],
                                  ["cache", "clear"], ["cache", "prune"], ["doctor"], ["bench"]], ids=" ".join)
def test_every_command_has_help(capsys, argv):
    code, out, _ = cli(capsys, *argv, "--help")
    assert code == 0
    assert out.startswith(f"usage: maskc {' '.join(argv)}".rstrip())


def test_version(capsys):
    assert cli(capsys, "--version")[:2] == (0, f"maskc {maskc.__version__}\n")


# -- show ----------------------------------------------------------------------------------------
def test_show_prints_the_picture_counts_and_time(capsys):
    code, out, err = cli(capsys, "show", "sliding_window:16", "--q-len", "100", "--block-size", "16")
    assert (code, err) == (0, "")
    head, *rows, timing = out.splitlines()
    bm = maskc.block_map(masks.sliding_window(16), 100, 100, block_size=16)
    assert head == str(bm).splitlines()[0]
    assert "full=" in head and "sparsity=" in head
    assert rows == str(bm).splitlines()[1:] and len(rows) == 7 + 1  # ceil(100 / 16) tile rows and the legend
    assert rows[-1] == "█ FULL: no mask code  ░ PARTIAL: mask evaluated  · EMPTY: skipped"
    assert timing.startswith("block map built in ") and timing.endswith(" ms")


def test_show_reads_lengths_from_documents_and_tiles_from_mxn(capsys):
    code, out, _ = cli(capsys, "show", "document:lengths=30,50,20:causal=true", "--block-size", "32x16",
                       "--kv-len", "100")
    assert code == 0
    assert out.startswith("BlockMap(document_causal, q_len=100, kv_len=100, block_size=(32, 16)")
    code, out, _ = cli(capsys, "show", "document:30,50,20")  # positional lengths, not causal
    assert code == 0 and out.startswith("BlockMap(document, q_len=100")


def test_show_draws_the_head_asked_for(capsys):
    code, out, _ = cli(capsys, "show", "causal", "--q-len", "64", "--block-size", "16", "--b", "3", "--h", "1")
    assert code == 0
    assert out.splitlines()[1] == "(b=3, h=1)"  # causal ignores b and h: one map serves them all


USER_MASKS = '''
def band(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx <= 4) & (kv_idx - q_idx <= 4)


def make_band(width):
    def band(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx <= width) & (kv_idx - q_idx <= width)
    return band


def branchy(b, h, q_idx, kv_idx):
    if q_idx > kv_idx:
        return True
    return False


def first_head_causal(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (h == 0)
'''


@pytest.fixture
def user_masks(tmp_path, monkeypatch):
    path = tmp_path / "user" / "cli_user_masks.py"
    path.parent.mkdir()
    path.write_text(USER_MASKS)
    monkeypatch.chdir(path.parent)
    monkeypatch.syspath_prepend(str(path.parent))  # restored afterwards, with what maskc adds
    yield path
    sys.modules.pop("cli_user_masks", None)


def test_show_takes_the_users_own_masks(capsys, user_masks):
    for spec in ("cli_user_masks:band", f"{user_masks}:band", "cli_user_masks:make_band:4"):
        code, out, _ = cli(capsys, "show", spec, "--q-len", "64", "--block-size", "16")
        assert code == 0, spec
        # a band of ±4: the diagonal tiles PARTIAL, the ones beside them PARTIAL at their corners
        assert out.splitlines()[1:5] == ["░░··", "░░░·", "·░░░", "··░░"]


def test_a_mask_that_reads_h_asks_for_the_options_that_give_it(capsys, user_masks):
    code, out, err = cli(capsys, "show", "cli_user_masks:first_head_causal", "--q-len", "64")
    assert code == 2 and "reads h, so its block map differs per h; pass --heads H (and --h to pick" in err
    code, out, err = cli(capsys, "show", "cli_user_masks:first_head_causal", "--q-len", "64", "--heads", "2",
                         "--h", "1", "--block-size", "16")
    assert code == 0 and "█" not in out.split("\n█ FULL")[0] and "░" not in out.split("\n█ FULL")[0]


def test_a_users_module_named_like_a_maskc_mask_is_imported(capsys, user_masks):
    # "casual" is close to causal: the did-you-mean applies only where no such module exists
    (user_masks.parent / "casual.py").write_text(USER_MASKS)
    try:
        code, out, err = cli(capsys, "show", "casual:band", "--q-len", "64", "--block-size", "16")
    finally:
        sys.modules.pop("casual", None)
    assert (code, err) == (0, "") and out.startswith("BlockMap(band")


# -- bad arguments: exit code 2, the usage and a message that says what to do --------------------
@pytest.mark.parametrize("argv, message", [
    ([], "the following arguments are required: COMMAND"),
    (["show"], "the following arguments are required: MASK"),
    (["show", "foo"], "unknown mask 'foo'; name one of causal, "),
    (["show", "casual"], "unknown mask 'casual'; did you mean causal? name one of causal, "),
    (["show", "slidng_window:10"], "unknown mask 'slidng_window' in 'slidng_window:10' (no maskc mask and no module "
                                   "of that name); did you mean sliding_window or dilated_sliding_window?"),
    (["show", "softcap:30"], "'softcap' is a maskc score, not a mask; name a mask here"),
    (["show", "and_masks"], "maskc.masks.and_masks takes mask_mods, which a command line cannot spell; combine "
                            "them in your code and name the result module:function"),
    (["source", "causal", "--score-mod", "alibi_slopes:8"], "maskc.scores.alibi_slopes gives alibi's slopes, not a "
                                                            "score_mod; name alibi:HEADS"),
    (["show", "sliding_window"], "'sliding_window' does not fit sliding_window:WINDOW"),
    (["show", "sliding_window:-1"], "window must be a non-negative int, got -1"),
    (["show", "sliding_window:window=8:2"], "follows a name=value one; put it first"),
    (["show", "causal:3"], "mask 'causal' takes no arguments"),
    (["show", "causal", "--q-len", "0"], "argument --q-len: must be a positive integer, got '0'"),
    (["show", "causal", "--block-size", "big"], "must be a tile size like 128 or 128x64"),
    (["show", "causal", "--block-size", "0"], "must be a tile size like 128 or 128x64"),
    (["show", "cli_no_such_module:mask"], "cannot import 'cli_no_such_module'"),
    (["show", "missing_file.py:mask"], "no file missing_file.py"),
    (["show", ":mask"], "'' in ':mask' is not a module name; write module:function"),
    (["show", "..up:mask"], "'..up' in '..up:mask' is not a module name; write module:function"),
    (["show", "document:lengths=10,20", "--q-len", "50"], "hold 30 tokens but --q-len is 50"),
    (["show", "document:lengths=10,-2"], "lengths must be positive integers"),
    (["show", "causal", "--b", "-1"], "b must be in [0, 1)"),
    (["source", "causal", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    (["source", "causal", "--head-dim", "8"], "head_dim must be between 16 and 256, got 8"),
    (["source", "causal", "--score-mod", "softcap:-1"], "cap must be a positive finite number"),
    (["source", "causal", "--score-mod", "tanh"], "unknown score 'tanh'; name one of softcap, alibi"),
    (["source", "causal", "--score-mod", "sofcap:30"], "unknown score 'sofcap' in 'sofcap:30' (no maskc score and "
                                                       "no module of that name); did you mean softcap?"),
    (["source", "causal", "--score-mod", "causal"], "'causal' is a maskc mask, not a score; name a score here"),
    (["cache"], "the following arguments are required: ACTION"),
    (["cache", "prune", "--max-size", "lots"], "--max-size must be a size like 500M or 2G"),
    (["bench", "--dtype", "fp8"], "invalid choice: 'fp8'"),
    # these ended in tracebacks, or ran (causal=maybe as true)
    (["show", "causal", "--q-len", "99999999999999"], "q_len must be at most 2**31 - 1"),
    (["show", "causal", "--q-len", "64", "--kv-len", "2147483648"], "kv_len must be at most 2**31 - 1"),
    (["show", "causal", "--q-len", "64", "--png", "/nonexistent/dir/x.png"], "--png /nonexistent/dir/x.png: no folder"),
    (["show", "document:lengths=10,20:causal=maybe"], "causal must be true or false, got 'maybe'"),
    (["show", "document:10,20:1"], "causal must be true or false, got 1"),
    (["show", "document:lengths=1000000000000"], "lengths must add up to at most 2**31 - 1"),
    (["cache", "clear", "--wait", "-1"], "argument --wait: must be a number of seconds, 0 or more"),
], ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_bad_arguments_exit_2_with_the_reason(capsys, argv, message):
    code, out, err = cli(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("usage: maskc"), err
    assert message in err, err


def test_show_says_when_a_png_cannot_be_written(capsys, tmp_path):
    (tmp_path / "taken.png").mkdir()  # a folder where the file would go
    code, _, err = cli(capsys, "show", "causal", "--q-len", "64", "--png", str(tmp_path / "taken.png"))
    assert code == 2 and "cannot write --png" in err, err


def test_show_refuses_a_png_path_that_is_a_folder(capsys, tmp_path):
    # matplotlib adds ".png" to a name without a suffix: `--png /tmp` wrote /tmp.png
    code, out, err = cli(capsys, "show", "causal", "--q-len", "64", "--png", str(tmp_path))
    assert code == 2 and out == "" and err.startswith("usage: maskc"), err
    assert f"cannot write --png {tmp_path}: it is a folder; name a file in it, like {tmp_path / 'map.png'}" in err
    assert not tmp_path.with_suffix(".png").exists()


def test_show_writes_the_png_it_names(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    target = tmp_path / "map"  # no suffix: written as named, not as map.png
    code, out, _ = cli(capsys, "show", "causal", "--q-len", "64", "--png", str(target))
    assert code == 0 and out.splitlines()[-1].startswith(f"wrote {target} (")
    assert target.read_bytes().startswith(b"\x89PNG") and not target.with_suffix(".png").exists()


def test_show_says_when_a_map_does_not_fit_in_memory(capsys, monkeypatch):
    def too_large(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr("maskc.cli.mask.block_map", too_large)
    code, _, err = cli(capsys, "show", "causal", "--batch", "100000", "--heads", "100000")
    assert code == 1 and "does not fit in this machine's memory" in err, err


def test_a_mask_maskc_cannot_trace_is_a_bad_argument(capsys, user_masks):
    code, _, err = cli(capsys, "show", "cli_user_masks:branchy")
    assert code == 2
    assert "'cli_user_masks:branchy' is not a mask_mod maskc can trace" in err and "torch.where" in err


# -- source ----------------------------------------------------------------------------------------
def test_source_prints_the_kernel_that_runs(capsys, cache_dir):
    code, out, _ = cli(capsys, "source", "sliding_window:8", "--score-mod", "softcap:30", "--dtype", "fp32",
                       "--head-dim", "64")
    kernel = maskc.compile(masks.sliding_window(8), maskc.scores.softcap(30.0), dtype=torch.float32, head_dim=64,
                           device="cpu")
    assert code == 0 and out == kernel.source
    code, out, _ = cli(capsys, "source", "sliding_window:8", "--score-mod", "softcap:30", "--path")
    assert code == 0 and out == f"{kernel.path}\n"  # bf16 and D=128 by default: the same file
    code, out, _ = cli(capsys, "source", "none", "--score-mod", "alibi:4", "--backward", "--path")
    path = Path(out.strip())
    assert code == 0 and path.parent == cache_dir and path.name.startswith("bwd_") and path.is_file()


# -- PNG ----------------------------------------------------------------------------------------
def test_show_writes_a_png(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    image = pytest.importorskip("matplotlib.image")
    target = tmp_path / "map.png"
    code, out, _ = cli(capsys, "show", "causal", "--q-len", "512", "--block-size", "128", "--png", str(target))
    assert code == 0
    assert out.splitlines()[-1] == f"wrote {target} (600×660 px)"
    pixels = (image.imread(target)[..., :3] * 255).round().astype(int).reshape(-1, 3)
    assert pixels.shape[0] == 600 * 660
    from maskc.plot import COLORS

    colors = {tuple(int(c[i:i + 2], 16) for i in (1, 3, 5)) for c in COLORS.values()}
    found = {tuple(p) for p in pixels.tolist()}
    assert colors <= found  # FULL, PARTIAL and EMPTY are all drawn


def test_show_png_without_matplotlib_says_how_to_get_it(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)  # as if it were not installed
    code, out, err = cli(capsys, "show", "causal", "--q-len", "64", "--png", str(tmp_path / "map.png"))
    assert code == 1
    assert out.startswith("BlockMap(causal")  # the text picture still comes
    assert err == "maskc show: maskc's pictures need matplotlib, which is not installed; install it with pip " \
                  "install 'maskc[plot]'\n"
    assert not (tmp_path / "map.png").exists()


# -- doctor and bench ------------------------------------------------------------------------------
def test_doctor_reports_and_runs_a_kernel(capsys, cache_dir):
    code, out, err = cli(capsys, "doctor")
    assert code == 0, out + err
    fields = {line.split()[0] for line in out.splitlines()}
    assert {"maskc", "python", "torch", "triton", "sympy", "cache", "settings", "interpreter"} <= fields
    assert "gpu" in fields or "gpu 0" in out
    assert f"{cache_dir}, writable" in out
    assert f"MASKC_CACHE_DIR={cache_dir}" in out
    interpreter = next(line for line in out.splitlines() if line.startswith("interpreter"))
    assert "ok: causal attention interpreted on cpu" in interpreter


def test_doctor_says_what_failed(capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("the interpreter is broken\nsecond line")

    monkeypatch.setattr("maskc.cli.doctor.compiled_attention", broken)
    code, out, _ = cli(capsys, "doctor")
    assert code == 1
    assert "FAILED: RuntimeError: the interpreter is broken" in out and "second line" not in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: bench would run")
def test_bench_without_a_gpu_says_so(capsys):
    code, out, err = cli(capsys, "bench", "--quick")
    assert (code, out) == (1, "")
    assert err.startswith("maskc bench: bench times kernels on a CUDA GPU and torch ") and "sees none" in err


# -- cache -----------------------------------------------------------------------------------------
def _kernels(cache_dir) -> list[Path]:
    return sorted(p for p in cache_dir.iterdir() if p.suffix == ".py")


def _write_entry(cache_dir, name, text, tags):
    path = cache_dir / name
    path.write_text(cache.stamped(text, tags))
    return path


def test_cache_info_and_list(capsys, cache_dir):
    code, out, _ = cli(capsys, "cache", "list")
    assert (code, out) == (0, f"no kernels in {cache_dir}\n")
    causal = maskc.compile(masks.causal, device="cpu")
    window = maskc.compile(masks.sliding_window(4), maskc.scores.softcap(5.0), device="cpu")
    stale = _write_entry(cache_dir, "fwd_00000000000000aa.py", "pass\n", {**provenance(), "maskc": "0.0.1"})
    code, out, _ = cli(capsys, "cache", "list")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith(f"3 kernels in {cache_dir}")
    assert lines[1].split() == ["file", "size", "written", "last", "used", "made", "by", "first", "made", "for"]
    rows = {line.split()[0]: line for line in lines[2:]}
    assert set(rows) == {causal.path.name, window.path.name, stale.name}
    assert "causal: -kv_idx + q_idx >= 0" in rows[causal.path.name]
    assert "sliding_window_4:" in rows[window.path.name] and "softcap_5: " in rows[window.path.name]
    assert f"maskc {maskc.__version__}, triton " in rows[causal.path.name]
    assert "stale: written by maskc 0.0.1" in rows[stale.name]
    code, out, _ = cli(capsys, "cache", "info")
    assert code == 0
    info = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in out.splitlines())
    assert info["directory"] == f"{cache_dir} (writable)"
    assert info["kernels"].startswith("3 files, ") and info["stale"].startswith("1 files, ")
    assert info["size cap"] == "none (set MASKC_CACHE_MAX_SIZE)"
    assert info["autotune.json"] == "none"
    assert info["this install"].startswith(f"maskc {maskc.__version__}, codegen ")


def test_cache_clear(capsys, cache_dir):
    maskc.compile(masks.causal, device="cpu")
    (cache_dir / "autotune.json").write_text("{}")
    fresh, old = cache_dir / "fwd_x.tmp", cache_dir / "fwd_y.tmp"  # another process's write, a dead one's
    fresh.write_text(""), old.write_text("")
    os.utime(old, (time.time() - 2 * cache.TEMPORARY_AGE,) * 2)
    (cache_dir / "notes.py").write_text("# not maskc's\n")
    code, out, _ = cli(capsys, "cache", "clear")
    assert code == 0
    assert out.startswith(f"deleted 1 kernel, autotune.json from {cache_dir} (")
    assert sorted(p.name for p in cache_dir.iterdir()) == ["fwd_x.tmp", "notes.py"]


def test_cache_prune_deletes_stale_then_least_recently_used(capsys, cache_dir, monkeypatch):
    kept = [maskc.compile(m, device="cpu").path for m in (masks.causal, masks.prefix_lm(4), masks.sliding_window(3))]
    text = kept[0].read_text().split("\n", 2)[2]
    old = _write_entry(cache_dir, "fwd_00000000000000aa.py", text, {**provenance(), "maskc": "0.0.1"})
    untagged = _write_entry(cache_dir, "fwd_00000000000000bb.py", text, None)
    edited = _write_entry(cache_dir, "bwd_00000000000000cc.py", text, {**provenance(), "codegen": "0" * 16})
    now = time.time()
    for age, path in enumerate(kept):  # kept[0] used last, kept[2] first
        os.utime(path, (now - 100 * age, now - 1000))
    before = sorted(cache_dir.iterdir())
    code, out, _ = cli(capsys, "cache", "prune", "--dry-run")
    assert code == 0 and sorted(cache_dir.iterdir()) == before
    assert f"would delete {old.name}" in out and "stale, written by maskc 0.0.1" in out
    assert f"would delete {untagged.name}" in out and "written before maskc tagged its files" in out
    assert f"would delete {edited.name}" in out and "written by other templates or codegen" in out
    assert out.splitlines()[-1].startswith(f"3 kernels would be deleted; 3 kept in {cache_dir}")
    # room for the two most recently used
    room = kept[0].stat().st_size + kept[1].stat().st_size
    code, out, _ = cli(capsys, "cache", "prune", "--max-size", str(room))
    assert code == 0
    assert f"deleted {kept[2].name}" in out and "last used 3 min ago" in out
    assert _kernels(cache_dir) == sorted(kept[:2])
    # MASKC_CACHE_MAX_SIZE is the default size
    monkeypatch.setenv("MASKC_CACHE_MAX_SIZE", str(kept[0].stat().st_size))
    assert cli(capsys, "cache", "prune")[0] == 0
    assert _kernels(cache_dir) == [kept[0]]


def test_the_size_cap_evicts_the_least_recently_used_and_a_deleted_kernel_is_written_again(cache_dir, monkeypatch):
    first = maskc.compile(masks.causal, device="cpu")
    monkeypatch.setenv("MASKC_CACHE_MAX_SIZE", str(int(first.path.stat().st_size * 1.5)))
    second = maskc.compile(masks.prefix_lm(4), device="cpu")
    assert _kernels(cache_dir) == [second.path]  # the cap keeps the one just written
    # this process still holds the first kernel's text: loading it writes the file again
    first.function(interpret=True)
    assert first.path.is_file() and first.path.read_text() == first.source
    monkeypatch.setenv("MASKC_CACHE_MAX_SIZE", "a lot")
    with pytest.raises(ValueError, match=r"MASKC_CACHE_MAX_SIZE must be a size like 500M or 2G .*, got 'a lot'"):
        maskc.compile(masks.sliding_window(2), device="cpu")


# -- two processes -------------------------------------------------------------------------------
_HOLDER = """
import sys, time, torch, maskc
from maskc.runtime import KERNELS
kernel = maskc.compile(maskc.masks.causal, device="cpu")
with KERNELS.loading(kernel.path, kernel.source):
    print("loading", flush=True)
    sys.stdin.readline()  # held until the test says
print("done", flush=True)
"""


def test_cache_commands_never_delete_a_file_another_process_is_loading(capsys, cache_dir, monkeypatch):
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=_env())
    try:
        assert holder.stdout.readline() == "loading\n"
        (kernel,) = _kernels(cache_dir)
        code, _, err = cli(capsys, "cache", "clear", "--wait", "0.3")
        assert code == 1
        assert f"another process kept loading kernels from {cache_dir} for 0.3 s, so nothing was deleted" in err
        assert cli(capsys, "cache", "prune", "--max-size", "0", "--wait", "0.3")[0] == 1
        assert kernel.is_file()
        # the cap gives way too: it skips a write's eviction rather than wait
        monkeypatch.setenv("MASKC_CACHE_MAX_SIZE", "1")
        other = maskc.compile(masks.prefix_lm(2), device="cpu")
        monkeypatch.delenv("MASKC_CACHE_MAX_SIZE")
        assert _kernels(cache_dir) == sorted([kernel, other.path])
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline() == "done\n"
    finally:
        holder.stdin.close()
        assert holder.wait(timeout=60) == 0
    code, out, _ = cli(capsys, "cache", "clear")
    assert code == 0 and _kernels(cache_dir) == []


_LOADER = """
import torch, maskc
from maskc.runtime import KERNELS
from maskc.runtime.kernel import kernel_for
mods = [maskc.masks.causal, maskc.masks.prefix_lm(3), maskc.masks.sliding_window(5)]
for i in range(30):
    KERNELS.clear()  # read (or render) each file again, and import it again
    for kind in ("fwd", "bwd"):
        kernel_for(kind, mods[i % 3].traced, None, torch.float32, torch.device("cpu")).function(interpret=True)
print("ok", flush=True)
"""


def test_clearing_while_another_process_loads_kernels(capsys, cache_dir):
    loader = subprocess.Popen([sys.executable, "-c", _LOADER], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=_env())
    cleared = 0
    while loader.poll() is None:
        code, out, err = cli(capsys, "cache", "clear", "--wait", "30")
        assert code == 0, err
        cleared += int(out.split()[1])
        time.sleep(0.01)
    out, err = loader.communicate()
    assert (loader.returncode, out) == (0, "ok\n"), err
    assert "Warning" not in err  # no file was found damaged, no directory unwritable
    assert cleared > 0  # the two processes did meet


# -- python -m maskc -----------------------------------------------------------------------------
def test_python_m_maskc_with_logging_on(cache_dir):
    result = subprocess.run([sys.executable, "-m", "maskc", "show", "prefix_lm:100", "--q-len", "256",
                             "--block-size", "64"], capture_output=True, text=True, env=_env(MASKC_LOG="info"),
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("BlockMap(prefix_lm_100, q_len=256")
    assert "maskc.trace.tracer: traced mask_mod 'prefix_lm_100' in " in result.stderr
    assert "maskc.analysis.build: block map of 'prefix_lm_100' at 256×256, 64×64 tiles on cpu in " in result.stderr
