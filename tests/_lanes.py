"""The default lane's sample of a sweep: parameters outside the sample are marked slow, so the
default lane runs a few representative cases and `-m slow` runs the rest."""
from __future__ import annotations

import pytest


def sampled(values, keep):
    """`values` as pytest parameters, those not in `keep` marked slow. A value that is a tuple is
    passed as several arguments; `keep` names values (or, for tuples, their first element)."""
    keep = set(keep)
    params = []
    for value in values:
        name = value[0] if isinstance(value, tuple) else value
        args = value if isinstance(value, tuple) else (value,)
        params.append(pytest.param(*args, marks=() if name in keep else pytest.mark.slow))
    missing = keep - {v[0] if isinstance(v, tuple) else v for v in values}
    if missing:
        raise ValueError(f"the default lane's sample names {sorted(missing)}, which the sweep does not have")
    return params


def every(values, n, ids=lambda value: None):
    """`values` as pytest parameters, all but every n-th marked slow: a deterministic sample of a
    sweep whose cases are alike in what they exercise (the cheaper stages of the same sweep run
    every case in the default lane)."""
    return [pytest.param(value, id=ids(value), marks=() if i % n == 0 else pytest.mark.slow)
            for i, value in enumerate(values)]
