"""Every rank of a group calls maskc.distributed.attention alike, or every rank raises.

Each call all-reduces one 8-byte digest of what the call must share across ranks (the plan,
shapes but for the positions, dtype, scale, score mod, whether a backward is recorded); the
description behind the digest is built once per local call signature. The exchange runs on
every call, never only on calls a rank has not seen: a rank that has seen a call and one that
has not must still make the same collectives in the same order. Only when the digests differ
does a second, fixed-size all-gather carry each rank's description, so that every rank raises
the same message naming who differs on what; fixed sizes keep ranks whose shapes differ from
aborting inside gloo. A rank whose own checks of a call fail takes part in the exchange before
it raises, so that the other ranks raise too instead of waiting for it.
"""
from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from maskc.errors import MaskcError

_DESCRIPTION_BYTES = 2048  # each rank's description in the message exchange, padded or cut to this
_REFUSED = "refused"  # the field of a rank whose own checks failed


def device(group) -> torch.device:
    """Where the group's small exchanges travel: NCCL takes CUDA tensors only (comparing them then
    waits for the GPU); gloo and mixed groups ("cpu:gloo,cuda:nccl") take host tensors."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gathered(mine: torch.Tensor, group, world_size: int) -> list[torch.Tensor]:
    """Every rank's `mine` (the same shape and dtype on each), in group rank order."""
    every = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(every, mine, group=group)
    return every


def digest(description: dict[str, str]) -> int:
    """A 63-bit digest of a description (field -> value): an int64 whose negation is one too."""
    return int.from_bytes(hashlib.blake2b(_text(description), digest_size=8).digest(), "little") >> 1


def check(plan, mine: int, description: dict[str, str]) -> None:
    """Compare this rank's call (its digest `mine` and `description`) with every rank's of
    plan.group, and raise a MaskcError naming the ranks that differ, and on what, where any
    differs (except on a rank that refused the call: it raises its own error). A collective:
    every rank of the group calls it once per call."""
    if plan.world_size == 1:
        return
    at = device(plan.group)
    # the largest digest and the negated smallest in one all-reduce: every rank's equals this one's
    # exactly when both are ours (on gloo, 16 cores: 234 us at 4 ranks, where an all-gather takes 378)
    extremes = torch.tensor([mine, -mine], dtype=torch.int64, device=at)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=plan.group)
    if extremes.tolist() == [mine, -mine]:
        return
    text = _text(description)[:_DESCRIPTION_BYTES]
    padded = torch.zeros(_DESCRIPTION_BYTES, dtype=torch.uint8)
    padded[:len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    descriptions = [_parsed(t) for t in gathered(padded.to(at), plan.group, plan.world_size)]
    if _REFUSED not in description:
        raise MaskcError(_message(descriptions))


def refused(plan, error: Exception) -> Exception:
    """Tell every rank that this rank's own checks of the call failed with `error` (the others
    raise a MaskcError naming this rank), and return `error` for this rank to raise."""
    description = {_REFUSED: f"{type(error).__name__}: {error}"}
    check(plan, digest(description), description)
    return error


def _text(description: dict[str, str]) -> bytes:
    # one line per field: a value's own line breaks (a refusal's message) become spaces
    return "\n".join(f"{field}: {' '.join(str(value).splitlines())}" for field, value in description.items()).encode()


def _parsed(t: torch.Tensor) -> dict[str, str]:
    text = bytes(t.cpu().tolist()).rstrip(b"\0").decode(errors="replace")
    return dict(line.split(": ", 1) for line in text.splitlines() if ": " in line)


def _message(descriptions: list[dict[str, str]]) -> str:
    failed = [r for r, d in enumerate(descriptions) if _REFUSED in d]
    if failed:
        return (f"maskc.distributed.attention failed on {_ranks(failed)}: {descriptions[failed[0]][_REFUSED]}; every "
                f"rank of the group stops with it, so fix the call there")
    fields = dict.fromkeys(field for d in descriptions for field in d)
    differences = []
    for field in fields:
        ranks_of: dict[str, list[int]] = {}
        for r, d in enumerate(descriptions):
            ranks_of.setdefault(d.get(field, "(cut)"), []).append(r)
        if len(ranks_of) > 1:
            differences.append(f"{field} is " + " and ".join(f"{value} on {_ranks(ranks)}"
                                                              for value, ranks in ranks_of.items()))
    # a difference past the exchanged bytes only (descriptions are kept far shorter)
    differences = differences or [f"their descriptions differ past their first {_DESCRIPTION_BYTES} bytes"]
    return ("every rank of the group must call maskc.distributed.attention alike (the same plan, shapes but "
            "for the positions, dtype, scale and score_mod, and each recording a backward or none), but "
            + "; ".join(differences) + "; make the call the same on every rank")


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


__all__ = ["check", "device", "digest", "gathered", "refused"]
