"""The `maskc` logger: quiet by default; what it reports (traced, analysed, rendered, read from
the cache, first launches) with times; MASKC_LOG / MASKC_DEBUG; the progress line on a terminal."""
from __future__ import annotations

import io
import logging
import time

import pytest
import torch

import maskc
from maskc import _log, masks
from maskc.runtime import KERNELS, plan
from maskc.settings import cache_max_size, log_level, parse_size


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MASKC_CACHE_DIR", str(tmp_path / "kernels"))
    for name in ("MASKC_DEBUG", "MASKC_LOG", "MASKC_CACHE_MAX_SIZE"):
        monkeypatch.delenv(name, raising=False)
    KERNELS.clear()
    plan.BLOCK_MAPS.clear()
    plan.PLANS.clear()
    yield tmp_path / "kernels"
    KERNELS.clear()


@pytest.fixture
def logger():
    """The maskc logger, put back as it was (level and handlers) after the test."""
    level, handlers = _log.LOGGER.level, list(_log.LOGGER.handlers)
    yield _log.LOGGER
    _log.LOGGER.setLevel(level)
    _log.LOGGER.handlers[:] = handlers


def _messages(caplog, name: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == name]


def test_quiet_by_default(capsys):
    assert _log.LOGGER.level == logging.NOTSET  # records follow the application's logging settings
    assert [type(h) for h in _log.LOGGER.handlers] == [logging.NullHandler]
    maskc.block_map(masks.sliding_window(7), 100, 100, block_size=16)
    assert capsys.readouterr() == ("", "")


def test_records_say_what_was_traced_analysed_rendered_read_and_launched(caplog):
    caplog.set_level(logging.INFO, logger="maskc")
    mask = masks.sliding_window(7)
    (traced,) = _messages(caplog, "maskc.trace.tracer")
    assert traced.startswith("traced mask_mod 'sliding_window_7' in ")
    assert traced.endswith(" ms; parameters: window=7; captured tensors: 0")

    maskc.block_map(mask, 100, 90, block_size=(32, 16))
    (built,) = _messages(caplog, "maskc.analysis.build")
    assert built.startswith("block map of 'sliding_window_7' at 100×90, 32×16 tiles on cpu in ")
    bm = maskc.block_map(mask, 100, 90, block_size=(32, 16))
    assert built.endswith(f" ms: {bm.num_full} FULL, {bm.num_partial} PARTIAL, {bm.num_empty} EMPTY")

    kernel = maskc.compile(mask, dtype=torch.float32, head_dim=16, device="cpu")
    KERNELS.clear()
    maskc.compile(mask, dtype=torch.float32, head_dim=16, device="cpu")
    rendered, read = _messages(caplog, "maskc.runtime.cache")
    assert rendered.startswith(f"rendered {kernel.path.stem} in ")
    assert rendered.endswith(f" ms into {kernel.path.parent}")
    assert read == f"read {kernel.path.stem} from {kernel.path.parent}"

    q = torch.randn(1, 1, 80, 16, generator=torch.Generator().manual_seed(0))  # the forward kernel, not decoding
    maskc.compiled_attention(q, q, q, mask_mod=mask)
    maskc.compiled_attention(q, q, q, mask_mod=mask)  # launched again: not a first launch
    (launch,) = _messages(caplog, "maskc.runtime.launch")
    assert launch.startswith(f"first launch of attention_fwd of {kernel.path.name} (interpreting) took ")
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name.startswith("maskc"))


def test_maskc_log_and_debug_choose_the_level(monkeypatch):
    assert log_level() is None
    monkeypatch.setenv("MASKC_DEBUG", "1")
    assert log_level() == "debug"
    monkeypatch.setenv("MASKC_LOG", "INFO")
    assert log_level() == "info"  # named, it wins
    monkeypatch.setenv("MASKC_LOG", "loud")
    with pytest.raises(ValueError, match="MASKC_LOG must be one of debug, info, warning, error or off, got 'loud'"):
        log_level()


def test_a_bad_maskc_log_warns_and_stays_quiet(monkeypatch, logger):
    monkeypatch.setenv("MASKC_LOG", "loud")
    with pytest.warns(UserWarning, match="MASKC_LOG must be one of"):
        _log._from_settings()
    assert [type(h) for h in logger.handlers] == [logging.NullHandler]


def test_configure_prints_on_the_stderr_of_the_moment(logger, capsys):
    _log.configure("info")
    _log.configure("info")  # once: no second handler
    assert len(logger.handlers) == 2
    logging.getLogger("maskc.runtime.cache").info("rendered %s", "fwd_x")
    logging.getLogger("maskc.runtime.cache").debug("not at info")
    assert capsys.readouterr().err == "maskc.runtime.cache: rendered fwd_x\n"


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_long_first_call_prints_one_line_on_a_terminal(monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    with _log.slow("compiling attention_fwd", after=0.05):
        time.sleep(0.3)
    with _log.slow("quick", after=5.0):
        pass
    _log.progress("autotuning 3 tile configs")
    assert terminal.getvalue() == "maskc: compiling attention_fwd...\nmaskc: autotuning 3 tile configs...\n"
    piped = io.StringIO()  # not a terminal: a log file or CI must not get these lines
    monkeypatch.setattr("sys.stderr", piped)
    with _log.slow("compiling", after=0.0):
        time.sleep(0.05)
    _log.progress("autotuning")
    assert piped.getvalue() == ""


def test_sizes():
    assert [parse_size(s) for s in ("1024", "2K", "1.5m", "2G", "64KiB", "3 GB")] == \
        [1024, 2048, 1572864, 2 << 30, 65536, 3 << 30]
    with pytest.raises(ValueError, match="size must be a size like 500M or 2G"):
        parse_size("2 potatoes")
    assert cache_max_size() is None


def test_debug_names_the_decoding_plan_once(caplog):
    """MASKC_LOG=debug says which kernel family a call signature runs, and why, once a plan."""
    q, k, v = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    window = maskc.masks.sliding_window(7)
    with caplog.at_level(logging.DEBUG, logger="maskc"), torch.no_grad():
        for _ in range(3):
            maskc.compiled_attention(q, k, v, enable_gqa=True, mask_mod=window)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("decoding ")]
    assert len(said) == 1 and "Lq=1 over 40 keys" in said[0] and "no gradients" in said[0], said
