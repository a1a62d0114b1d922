"""Pictures of block maps: the tiles drawn from the map's runs, a PNG read back with the expected
size and colours at known tiles, pairs for small maps, none of L×L for long ones."""
from __future__ import annotations

import sys

import pytest
import torch

import maskc
from maskc import masks
from maskc.analysis.blockmap import BlockMap
from maskc.analysis.classify import EMPTY, FULL, PARTIAL


def _rgb(color: str) -> tuple:
    return tuple(int(color[i:i + 2], 16) for i in (1, 3, 5))


@pytest.fixture
def pyplot():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    yield plt
    plt.close("all")


# -- the grid drawn: from the runs, merged into cells for long maps ------------------------------
def _cells(dense: torch.Tensor, step_q: int, step_kv: int) -> list:
    """The text picture's rule, on the dense tile grid: a cell is FULL or EMPTY where every
    tile it covers is, else PARTIAL."""
    rows = []
    for i in range(0, dense.shape[0], step_q):
        row = []
        for j in range(0, dense.shape[1], step_kv):
            cell = dense[i:i + step_q, j:j + step_kv]
            row.append(int(cell.min()) if int(cell.min()) == int(cell.max()) else PARTIAL)
        rows.append(row)
    return rows


@pytest.mark.parametrize("mask, length, tiles", [
    (masks.causal, 1000, (64, 64)),
    (masks.sliding_window(100), 1000, (16, 32)),
    (masks.document(torch.tensor([0] * 300 + [1] * 450 + [2] * 250), causal=True), 1000, (16, 16)),
    (masks.prefix_lm(700), 2000, (128, 64)),
], ids=["causal", "sliding", "document", "prefix"])
@pytest.mark.parametrize("max_size", [None, 9, 4])
def test_tiles_of_merges_cells_as_the_picture_does(mask, length, tiles, max_size):
    bm = maskc.block_map(mask, length, length, block_size=tiles)
    grid, step_q, step_kv = bm.tiles_of(max_size=max_size)
    if max_size:
        assert max(grid.shape) <= max_size
    assert grid.tolist() == _cells(bm.to_dense()[0, 0], step_q, step_kv)


def test_tiles_of_picks_b_and_h():
    def by_head(b, h, q_idx, kv_idx):
        return (h == b) | (q_idx >= kv_idx)

    bm = maskc.block_map(by_head, 64, 64, block_size=16, B=2, H=3)
    assert bm.tiles_of(1, 1)[0].unique().tolist() == [FULL]
    assert torch.equal(bm.tiles_of(1, 2)[0], maskc.block_map(masks.causal, 64, 64, block_size=16).tiles_of()[0])
    assert "(b=1, h=2)" in bm.picture(1, 2).splitlines()[1]
    with pytest.raises(ValueError, match=r"h must be in \[0, 3\) for this block map, built with H=3, got 3"):
        bm.tiles_of(0, 3)


# -- the picture -------------------------------------------------------------------------------------
def _pixel(ax, image, kv: float, q: float) -> tuple:
    """The RGB of the saved `image` at the data point (kv, q)."""
    x, y = ax.transData.transform((kv, q))
    return tuple(image[int(round(image.shape[0] - y)), int(round(x)), :3])


def test_png_read_back_has_the_size_and_the_colours_of_known_tiles(pyplot, tmp_path):
    from matplotlib.image import imread

    from maskc.plot import COLORS, DROPPED

    bm = maskc.block_map(masks.causal, 512, 512, block_size=(128, 128))
    for pairs in (False, True):
        ax = bm.plot(pairs=pairs)
        ax.figure.canvas.draw()
        path = tmp_path / f"map_{pairs}.png"
        ax.figure.savefig(path, dpi=ax.figure.dpi)
        image = (imread(path) * 255).round().astype(int)
        assert image.shape == (660, 600, 4)  # 6 × 6.6 inches at 100 dpi
        assert _pixel(ax, image, kv=64, q=448) == _rgb(COLORS[FULL])  # tile (3, 0): below the diagonal
        assert _pixel(ax, image, kv=448, q=64) == _rgb(COLORS[EMPTY])  # tile (0, 3): above it
        # tile (1, 1), on the diagonal: one colour, or its pairs kept (below) and dropped (above)
        below, above = _pixel(ax, image, kv=150, q=230), _pixel(ax, image, kv=230, q=150)
        if pairs:
            assert (below, above) == (_rgb(COLORS[PARTIAL]), _rgb(DROPPED))
        else:
            assert below == above == _rgb(COLORS[PARTIAL])
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert labels[0].startswith("FULL") and labels[-1].startswith("EMPTY") and len(labels) == 3 + pairs
        assert ax.get_title().startswith("causal: q_len=512 kv_len=512, tiles 128×128\n6 FULL, 4 PARTIAL, 6 EMPTY")


def test_long_sequences_are_drawn_from_the_runs(pyplot, monkeypatch):
    def no_dense(self):
        raise AssertionError("a long map must not build its whole tile grid")

    monkeypatch.setattr(BlockMap, "to_dense", no_dense)
    ax = maskc.plot(masks.sliding_window(4096), q_len=1 << 20, block_size=(128, 128))
    (image,) = ax.get_images()
    assert image.get_array().shape == (512, 512, 3)  # 8192 tiles a side, 16 to a cell
    assert ax.get_xlim() == (0, 1 << 20) and ax.get_ylim() == (1 << 20, 0)
    assert len(ax.get_legend().get_texts()) == 3  # tiles only, no pairs


def test_plot_picks_b_and_h_and_an_axes(pyplot):
    from maskc.plot import COLORS

    def by_head(b, h, q_idx, kv_idx):
        return (h == 1) | (q_idx >= kv_idx)

    _, (left, right) = pyplot.subplots(1, 2)
    assert maskc.plot(by_head, 64, block_size=16, H=2, h=0, ax=left) is left
    bm = maskc.block_map(by_head, 64, 64, block_size=16, H=2)
    assert bm.plot(right, h=1, pairs=False) is right
    colours = {tuple(c) for c in right.get_images()[0].get_array().reshape(-1, 3).tolist()}
    assert colours == {_rgb(COLORS[FULL])}  # head 1 keeps every pair
    assert "h=0" in left.get_title() and "h=1" in right.get_title()


def test_plot_errors_say_what_to_pass(pyplot):
    bm = maskc.block_map(masks.causal, 64, 64, block_size=16)
    with pytest.raises(ValueError, match="draws it at its own lengths; drop q_len and kv_len"):
        maskc.plot(bm, q_len=128)
    with pytest.raises(ValueError, match="needs q_len"):
        maskc.plot(masks.causal)
    big = maskc.block_map(masks.causal, 8192, 8192)
    with pytest.raises(ValueError, match="pass pairs=False to draw the tiles"):
        big.plot(pairs=True)


def test_blockmap_plot_is_plot_block_map():
    from maskc.plot import plot_block_map

    assert BlockMap.plot is plot_block_map


def test_without_matplotlib_the_error_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)  # as if it were not installed
    bm = maskc.block_map(masks.causal, 64, 64, block_size=16)
    with pytest.raises(ImportError, match=r"pip install 'maskc\[plot\]'"):
        bm.plot()
    assert bm.tiles_of()[0].shape == (4, 4)  # the map itself needs no matplotlib
