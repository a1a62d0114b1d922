"""Path guards on this machine's Python (the GPU image runs 3.12; CI runs 3.11): values read
through captured objects, changed between traces, must change the traced expression.

    bash benchmarks/run_gpu.sh benchmarks/check_trace_paths.py

Prints one line per case and the number of failures (exit status 1 when any failed).
"""
import collections
import sys
import types

import torch

import maskc

cfg = types.SimpleNamespace(window=3, attn=types.SimpleNamespace(window=3))
CFG = {"attn": {"window": 3}}
ordered = collections.OrderedDict(window=3)


class Limits:
    WINDOW = 3


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.cfg = types.SimpleNamespace(window=3)
        self.window = 3

        def closure(b, h, q_idx, kv_idx):
            return q_idx - kv_idx <= self.window
        self.closure = closure

    def mask(self, b, h, q_idx, kv_idx):
        return q_idx - kv_idx <= self.cfg.window


class Callable:
    def __init__(self):
        self.cfg = types.SimpleNamespace(window=3)

    def __call__(self, b, h, q_idx, kv_idx):
        return q_idx - kv_idx <= self.cfg.window


model, callable_object = Model(), Callable()


def attribute(b, h, q_idx, kv_idx):
    return q_idx - kv_idx <= cfg.window


def nested(b, h, q_idx, kv_idx):
    return q_idx - kv_idx <= cfg.attn.window


def subscript(b, h, q_idx, kv_idx):
    return q_idx - kv_idx <= CFG["attn"]["window"]


def method_then_read(b, h, q_idx, kv_idx):
    return q_idx - kv_idx <= CFG["attn"].get("window")  # a method call ends the chain at CFG["attn"]


def class_attribute(b, h, q_idx, kv_idx):
    return q_idx - kv_idx <= Limits.WINDOW


def ordered_dict(b, h, q_idx, kv_idx):
    return q_idx - kv_idx <= ordered["window"]


CASES = [
    ("cfg.window", attribute, lambda: setattr(cfg, "window", 9)),
    ("cfg.attn.window", nested, lambda: setattr(cfg.attn, "window", 9)),
    ('CFG["attn"]["window"]', subscript, lambda: CFG["attn"].__setitem__("window", 9)),
    ('CFG["attn"].get("window")', method_then_read, lambda: CFG["attn"].__setitem__("window", 11)),
    ("Limits.WINDOW", class_attribute, lambda: setattr(Limits, "WINDOW", 9)),
    ('ordered["window"]', ordered_dict, lambda: ordered.__setitem__("window", 9)),
    ("nn.Module closure self.window", model.closure, lambda: setattr(model, "window", 9)),
    ("method mod self.cfg.window", model.mask, lambda: setattr(model.cfg, "window", 9)),
    ("__call__ self.cfg.window", callable_object, lambda: setattr(callable_object.cfg, "window", 9)),
]


def main() -> int:
    failures = 0
    print(f"Python {sys.version.split()[0]}")
    for name, fn, change in CASES:
        mod = maskc.mask_mod(fn)
        before = mod.signature
        same = mod.traced is mod.traced
        change()
        ok = same and mod.signature != before
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name}: stable {same}, follows the change {mod.signature != before}")
    print(f"{failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
