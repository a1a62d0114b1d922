"""Pictures of block maps with matplotlib (the `plot` extra): `maskc.plot(...)` and `BlockMap.plot(...)`.

FULL, PARTIAL and EMPTY tiles take three colours, with a legend. Small maps (both lengths up
to PAIRS_UP_TO) also show each pair of a PARTIAL tile, kept or dropped, as attention-gym's
`visualize_attention_scores` draws masks; longer ones are drawn from the map's runs at no
more than `max_cells` cells a side, never as an L×L image.

NOTE: this module is a tool over the core (docs/architecture.md): it imports BlockMap, and attaches
`BlockMap.plot` itself below, so that maskc/analysis never imports a drawing library or
this module. The first public name of maskc in use imports it (maskc/__init__.py); matplotlib is
imported on the first drawing.

>>> ax = maskc.plot(maskc.masks.sliding_window(256), q_len=4096, kv_len=4096)
>>> ax.figure.savefig("sliding.png")
"""
from __future__ import annotations

import numpy as np

from maskc.analysis.blockmap import BlockMap
from maskc.analysis.build import block_map
from maskc.analysis.classify import EMPTY, FULL, PARTIAL
from maskc.testing.reference import dense_mask

COLORS = {FULL: "#1f4e9c", PARTIAL: "#f2a541", EMPTY: "#e6e6e6"}
DROPPED = "#fbe3bd"  # a pair the mask drops inside a PARTIAL tile (pair-level pictures)
NAMES = {FULL: "FULL tile (no mask code)", PARTIAL: "PARTIAL tile (mask evaluated)", EMPTY: "EMPTY tile (skipped)"}
# Both lengths at most this: one pixel per (q, kv) pair by default.
PAIRS_UP_TO = 1024
# pairs=True draws at most this many pairs (an RGB image of 48 MB).
PAIRS_MAX = 4096 * 4096


def plot(mask, q_len: int | None = None, kv_len: int | None = None, *, block_size=(128, 128), B: int | None = None,
         H: int | None = None, device=None, **kwargs):
    """Draw the block map of `mask` (a mask_mod, or a BlockMap) on a matplotlib Axes and return it.

    Lengths, tiles, B and H are block_map()'s (kv_len defaults to q_len); the keyword
    arguments are plot_block_map()'s (ax, b, h, pairs, max_cells, title).

    >>> ax = maskc.plot(maskc.masks.causal, q_len=1024, block_size=(64, 64))
    >>> ax = maskc.plot(bm, b=1, h=3)            # an existing BlockMap
    """
    if isinstance(mask, BlockMap):
        if q_len is not None or kv_len is not None:
            raise ValueError("maskc.plot of a BlockMap draws it at its own lengths; drop q_len and kv_len, or pass "
                             "the mask_mod to build a map at other lengths")
        return plot_block_map(mask, **kwargs)
    if q_len is None:
        raise ValueError("maskc.plot of a mask_mod needs q_len (and kv_len where it differs) to build its block map")
    bm = block_map(mask, q_len, kv_len if kv_len is not None else q_len, block_size=block_size, B=B, H=H,
                   device=device)
    return plot_block_map(bm, **kwargs)


def plot_block_map(bm: BlockMap, ax=None, *, b: int = 0, h: int = 0, pairs: bool | None = None,
                   max_cells: int = 512, title: str | None = None):
    """Draw (b, h)'s tiles of `bm` on `ax` (a new figure's when None) and return the Axes.

    pairs: show each pair of PARTIAL tiles (None: where both lengths are at most
    PAIRS_UP_TO and the map knows its mask). max_cells: the most cells drawn a side; longer
    maps merge tiles into cells as the text picture does (FULL or EMPTY only where every tile
    of the cell is). Also `bm.plot(...)`.

    >>> ax = bm.plot()
    >>> ax.figure.savefig("map.png")
    """
    plt, patch = _matplotlib()
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 6.6))
    if pairs is None:
        pairs = max(bm.q_len, bm.kv_len) <= PAIRS_UP_TO and bm.mask_mod is not None
    elif pairs and bm.mask_mod is None:
        raise ValueError(f"block map '{bm.mask_name}' keeps no mask_mod to evaluate its pairs; pass pairs=False")
    elif pairs and bm.q_len * bm.kv_len > PAIRS_MAX:
        raise ValueError(f"pairs=True draws one pixel per pair, and {bm.q_len}×{bm.kv_len} is over {PAIRS_MAX} "
                         f"pairs; pass pairs=False to draw the tiles")
    m, n = bm.block_size
    if pairs:
        image = _pairs_image(bm, b, h)
        extent = (0, bm.kv_len, bm.q_len, 0)
        cells_q, cells_kv = bm.n_q, bm.n_kv
    else:
        grid, step_q, step_kv = bm.tiles_of(b, h, max_cells)
        image = _RGB[grid.long().numpy()]
        extent = (0, grid.shape[1] * step_kv * n, grid.shape[0] * step_q * m, 0)
        cells_q, cells_kv = grid.shape
    ax.imshow(image, extent=extent, interpolation="nearest", aspect=_aspect(bm))
    ax.set_xlim(0, bm.kv_len)
    ax.set_ylim(bm.q_len, 0)
    if max(cells_q, cells_kv) <= 64:  # tile borders, where they stay visible
        ax.vlines(np.arange(1, bm.n_kv) * n, 0, bm.q_len, colors="white", linewidth=0.6)
        ax.hlines(np.arange(1, bm.n_q) * m, 0, bm.kv_len, colors="white", linewidth=0.6)
    ax.xaxis.tick_top()
    ax.xaxis.set_label_position("top")
    ax.set_xlabel("kv_idx")
    ax.set_ylabel("q_idx")
    ax.set_title(title if title is not None else _title(bm, b, h), fontsize=9, pad=24)
    ax.legend(handles=_legend(patch, pairs), loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=2, fontsize=8,
              frameon=False)
    return ax


BlockMap.plot = plot_block_map


def _matplotlib():
    """(pyplot, Patch), imported on the first drawing: matplotlib is an optional dependency."""
    try:
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise ImportError("maskc's pictures need matplotlib, which is not installed; install it with "
                          "pip install 'maskc[plot]'") from None
    return plt, Patch


def _rgb(color: str) -> list[int]:
    return [int(color[i:i + 2], 16) for i in (1, 3, 5)]


# one row per verdict value (EMPTY 0, PARTIAL 1, FULL 2), indexed by a verdict grid
_RGB = np.array([_rgb(COLORS[v]) for v in (EMPTY, PARTIAL, FULL)], dtype=np.uint8)


def _pairs_image(bm: BlockMap, b: int, h: int) -> np.ndarray:
    """RGB [q_len, kv_len]: each pair its tile's colour, a dropped pair of a PARTIAL tile lighter."""
    grid, _, _ = bm.tiles_of(b, h)
    m, n = bm.block_size
    tiles = grid.repeat_interleave(m, 0)[:bm.q_len].repeat_interleave(n, 1)[:, :bm.kv_len]
    # the user's function on every pair of (b, h), as maskc.testing evaluates it
    keep = dense_mask(bm.mask_mod, bm.q_len, bm.kv_len, B=b + 1, H=h + 1, device=bm.device)[b, h].cpu()
    image = _RGB[tiles.long().numpy()]
    image[((tiles == PARTIAL) & ~keep).numpy()] = _rgb(DROPPED)
    return image


def _aspect(bm: BlockMap) -> str:
    # square pixels unless one length dwarfs the other (decode-like maps would be a sliver)
    return "equal" if max(bm.q_len, bm.kv_len) <= 8 * min(bm.q_len, bm.kv_len) else "auto"


def _title(bm: BlockMap, b: int, h: int) -> str:
    where = f", b={b} h={h}" if (bm.B, bm.H) != (1, 1) or (b, h) != (0, 0) else ""
    tiles = f"{bm.block_size[0]}×{bm.block_size[1]}"
    return (f"{bm.mask_name}: q_len={bm.q_len} kv_len={bm.kv_len}, tiles {tiles}{where}\n"
            f"{bm.num_full} FULL, {bm.num_partial} PARTIAL, {bm.num_empty} EMPTY ({bm.sparsity:.1%} skipped)")


def _legend(patch, pairs: bool) -> list:
    handles = [patch(color=COLORS[FULL], label=NAMES[FULL])]
    if pairs:
        handles += [patch(color=COLORS[PARTIAL], label="PARTIAL tile: pair kept"),
                    patch(color=DROPPED, label="PARTIAL tile: pair dropped")]
    else:
        handles.append(patch(color=COLORS[PARTIAL], label=NAMES[PARTIAL]))
    handles.append(patch(color=COLORS[EMPTY], label=NAMES[EMPTY]))
    return handles


__all__ = ["COLORS", "DROPPED", "PAIRS_MAX", "PAIRS_UP_TO", "plot", "plot_block_map"]
