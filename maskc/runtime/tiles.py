"""Tiles: the one owner of tile sizes, warps and stages. `choose` decides them for a problem
(head dim, device, dtype, an autotuned choice, a caller's block map), validated here under one
rule, and the runtime passes the frozen result everywhere else.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import NamedTuple

from maskc.runtime import state

MIN_TILE, MAX_TILE = 16, 256


class TileConfig(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    # Forward only: pipelining depth of the loop over PARTIAL tiles. Their runs are short
    # (one diagonal tile for causal, a few per document boundary), and a deep pipeline's
    # set-up per run costs more than it hides: 2 beat 3 on document masks 275 vs 182
    # TFLOP/s with tensor descriptors, and 1 lost everywhere (benchmarks/NOTES.md).
    partial_stages: int = 2


class BackwardConfig(NamedTuple):
    dq: TileConfig  # block_m: q rows of a program, block_n: kv tile it loops over
    dkdv: TileConfig  # block_n: kv rows of a program, block_m: q tile it loops over


_overrides: dict = {}
state.register(__name__, "_overrides", "the tiles, splits and descriptor switch forced inside use_config blocks",
               "one entry per knob (fwd, bwd, descriptors, dec, splits); not cleared: each block restores its own",
               size=lambda: len(_overrides), clear=None, maxsize=5)


@contextlib.contextmanager
def use_config(forward: TileConfig | None = None, backward: BackwardConfig | None = None,
               descriptors: bool | None = None, decode: TileConfig | None = None, splits: int | None = None):
    """Force tile configs, the decoding kernel's kv splits, or turn tensor descriptors off,
    inside the block (benchmarks/tune.py sweeps with it; tests force splits)."""
    if splits is not None and (not isinstance(splits, int) or splits < 1):
        raise ValueError(f"splits must be a positive int (the decoding kernel's programs per row), got {splits!r}")
    saved = dict(_overrides)
    _overrides.update({k: v for k, v in (("fwd", forward), ("bwd", backward), ("descriptors", descriptors),
                                         ("dec", decode), ("splits", splits)) if v is not None})
    try:
        yield
    finally:
        _overrides.clear()
        _overrides.update(saved)


def override_key() -> tuple:
    return tuple(sorted(_overrides.items()))


def descriptors_enabled() -> bool:
    """Whether the forward and backward kernels may load through tensor descriptors (TMA) where
    the inputs allow."""
    return _overrides.get("descriptors", True)


def forward_forced() -> bool:
    """Whether use_config forces the forward's tiles (which are the Triton-language kernel's)."""
    return "fwd" in _overrides


def backward_forced() -> bool:
    """Whether use_config forces the backward's tiles (which are the Triton-language kernels')."""
    return "bwd" in _overrides


def forward_config(head_dim: int, device_type: str) -> TileConfig:
    if "fwd" in _overrides:
        return _overrides["fwd"]
    if device_type != "cuda":
        # The interpreter runs each tile op in numpy: small tiles keep tests quick and
        # still exercise several tiles per row.
        return TileConfig(32, 32, 4, 1)
    if head_dim <= 128:
        # Swept on an H100 (benchmarks/NOTES.md): 64×64 tiles with 4 warps beat 128×64 and
        # 128×128 with 8 warps on no mask, sliding window and softcap at D=64 and D=128, with
        # and without tensor descriptors.
        return TileConfig(64, 64, 4, 3)
    return TileConfig(64, 32, 4, 2)


def forward_candidates(head_dim: int, device_type: str) -> list[TileConfig]:
    """The configs autotuning times (maskc/runtime/autotune.py), the default first. Each fits
    two programs per H100 multiprocessor in shared memory where its head dim allows."""
    default = forward_config(head_dim, device_type)
    if "fwd" in _overrides or device_type != "cuda":
        return [default]
    if head_dim <= 64:
        # 64×128 won at D=64 with no mask (+9%) and causal (+4-7%), lost on sliding window,
        # prefix-LM and ALiBi (benchmarks/NOTES.md); 128×64 halves the K/V traffic per query.
        return [default, TileConfig(64, 128, 4, 2), TileConfig(128, 64, 4, 3)]
    if head_dim <= 128:
        return [default, TileConfig(128, 64, 8, 3)]
    return [default]


def backward_config(head_dim: int, device_type: str, element_size: int = 2) -> BackwardConfig:
    if "bwd" in _overrides:
        return _overrides["bwd"]
    if device_type != "cuda":
        return BackwardConfig(TileConfig(32, 32, 4, 1), TileConfig(32, 32, 4, 1))
    if element_size > 2:
        # float32 operands take twice the shared memory: 128×64 tiles asked for 288 KiB at
        # D=64 on an H100 (227 KiB there). These are the tiles 16-bit D=256 runs with.
        return BackwardConfig(TileConfig(64, 32, 4, 2), TileConfig(32, 64, 4, 2))
    if head_dim <= 128:
        # Swept on an H100 at D=128 (benchmarks/NOTES.md): long kv tiles for dQ and long q
        # tiles for dK/dV, 8 warps, beat 64×64 with 4 warps by a quarter on no mask and causal.
        return BackwardConfig(TileConfig(128, 64, 8, 3), TileConfig(64, 128, 8, 3))
    return BackwardConfig(TileConfig(64, 32, 4, 2), TileConfig(32, 64, 4, 2))


def decode_config(head_dim: int, device_type: str, rows: int, split: bool = True) -> TileConfig:
    """The decoding kernel's tiles for `rows` packed query rows (query length × GQA group):
    block_m covers them up to 64, block_n is the kv tile; the block map's q tile is 64 on
    CUDA (decode_map_block). `split`: whether programs share rows (the rows alone do not fill
    the GPU)."""
    if "dec" in _overrides:
        return _overrides["dec"]
    block_m = min(64, max(MIN_TILE, 1 << (rows - 1).bit_length()))
    if device_type != "cuda":
        return TileConfig(block_m, 32, 4, 1)
    # Swept on an H100 (benchmarks/tune_decode.py, NOTES.md): where the rows alone fill the GPU
    # (batch 64 × 4096 keys, one program per row) two stages beat three, 365 vs 401 µs; where
    # rows are split (batch 8 × 32768) three won at 16 query rows (364 vs 407 µs) and page size 1.
    return TileConfig(block_m, 64 if head_dim <= 128 else 32, 4, 3 if split else 2)


# The most tiles a decoding block map has where analysing it costs O(tiles) (decode.problem):
# 2**19 took 0.8-1.8 s on the dev CPU.
MAX_DECODE_MAP_TILES = 1 << 19


def decode_map_block(device_type: str, q_positions: int = 0, kv_tiles: int = 0) -> int:
    """The q tile of the block map the decoding kernel reads: its rows span one or two of
    them. Small on the interpreter so that tests see FULL tiles near the diagonal; larger where
    q_positions rows of kv_tiles would make more than MAX_DECODE_MAP_TILES tiles (give them for
    a map whose cost grows with its tiles)."""
    block = 64 if device_type == "cuda" else 16
    while block < q_positions and -(-q_positions // block) * kv_tiles > MAX_DECODE_MAP_TILES:
        block *= 2
    return block


def decode_splits() -> int | None:
    """A forced number of kv splits (use_config), or None: the decoding runtime chooses."""
    return _overrides.get("splits")


@dataclass(frozen=True)
class Tiles:
    """The tiles of one problem. The block map is built once, at `sparse`, and drives every
    kernel of the call: each reads it at its own tiles (BlockMap.for_tiles)."""

    forward: TileConfig
    backward: BackwardConfig
    sparse: tuple[int, int]  # the block map's tile sizes (q, kv)


def choose(head_dim: int, device_type: str, element_size: int, *, block_map_size=None,
           forward: TileConfig | None = None, reads_exactly=None) -> Tiles:
    """The tiles of a problem: `forward` (an autotuned choice) or the default for the head dim,
    the backward's, and the block map's granularity: the caller's map's (`block_map_size`),
    else the forward kernel's own tiles, which skip the most (the backward's larger tiles read
    a coarsened copy). `reads_exactly(block_m, block_n)`: whether kernel tiles of that size
    read the caller's map as its tiles say (BlockMap.coarsens_exactly); a kernel whose tiles
    would not gets tiles no larger than the map's."""
    forward = forward or forward_config(head_dim, device_type)
    backward = backward_config(head_dim, device_type, element_size)
    for config in (forward, *backward):
        check_block_size((config.block_m, config.block_n), "kernel tile")
    sparse = (forward.block_m, forward.block_n) if block_map_size is None else check_block_size(
        block_map_size, "block_map tile")
    if reads_exactly is not None:
        forward = _capped(forward, sparse, reads_exactly)
        backward = BackwardConfig(*(_capped(config, sparse, reads_exactly) for config in backward))
    return Tiles(forward, backward, sparse)


def _capped(config: TileConfig, sparse: tuple[int, int], reads_exactly) -> TileConfig:
    """`config`, or the same with its tiles cut to the map's `sparse` ones where its own would not
    read the map exactly (`reads_exactly`): smaller tiles run slower, and only a map that needs
    them gets them (a hand-made one whose left-out or full tiles disagree with its mask_mod)."""
    if reads_exactly(config.block_m, config.block_n):
        return config
    return config._replace(block_m=min(config.block_m, sparse[0]), block_n=min(config.block_n, sparse[1]))


def check_block_size(block_size, what: str = "block_size") -> tuple[int, int]:
    """The rule for every tile that drives a kernel: two powers of two from 16 to 256 (an int
    for a square). Block maps drawn or counted only (maskc.block_map) may have any size."""
    if isinstance(block_size, int) and not isinstance(block_size, bool):
        block_size = (block_size, block_size)
    try:
        size = tuple(block_size)
    except TypeError:
        size = ()
    if len(size) != 2 or any(not isinstance(b, int) or isinstance(b, bool) or not MIN_TILE <= b <= MAX_TILE
                             or b & (b - 1) for b in size):
        raise ValueError(f"{what} sizes must be two powers of two from {MIN_TILE} to {MAX_TILE}, got "
                         f"{block_size!r}; use for example (64, 64)")
    return size


def kernel_tiles_of(block_size, what: str = "BLOCK_SIZE") -> tuple[int, int]:
    """The tiles at which a BlockMask with blocks of `block_size` (an int or (q, kv)) drives the
    kernels: on each side, the largest power of two up to MAX_TILE that divides the block. Each
    tile lies inside one block and takes that block's status, so the tiles that run are exactly
    the ones FlexAttention runs: (128, 112) blocks are read as (128, 16) tiles."""
    size = (block_size, block_size) if isinstance(block_size, int) else block_size
    size = tuple(size) if isinstance(size, (tuple, list)) else ()
    if len(size) != 2 or any(not isinstance(b, int) or isinstance(b, bool) or b <= 0 or b % MIN_TILE for b in size):
        raise ValueError(f"{what} sizes must be multiples of {MIN_TILE} (the kernels' smallest tile, which a block "
                         f"is cut into), got {block_size!r}; use for example 128 or (128, 112)")
    return tuple(min(b & -b, MAX_TILE) for b in size)


def bh_group(head_dim: int) -> int:
    """How many (b, h) pairs the forward's launch order interleaves (BH_GROUP in the template).
    Two let the last pair's long causal q tiles start sooner: +3-4% on causal and prefix-LM
    at D=128 on an H100; at D=64, where three programs fit per multiprocessor, 1% slower
    (benchmarks/NOTES.md)."""
    return 2 if padded(head_dim) > 64 else 1


def padded(dim: int) -> int:
    """Head dims are padded to a power of two of at least 16 (the smallest tl.dot)."""
    return max(16, 1 << (dim - 1).bit_length())
