"""Path guards on the GPU image's Python (3.12; CI runs 3.11, whose bytecode differs): values read
through captured objects, changed between traces, change the traced expression, and an unchanged
mod keeps its trace. tests/test_trace_guards.py holds the same rules on the CPU suite's Python."""
from __future__ import annotations

import collections
import types

import pytest
import torch

import maskc


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


cfg = types.SimpleNamespace(window=3, attn=types.SimpleNamespace(window=3))
CFG = {"attn": {"window": 3}}
ordered = collections.OrderedDict(window=3)
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


# name: (mod, change of what it reads, the change undone)
CASES = {
    "cfg.window": (attribute, lambda: setattr(cfg, "window", 9), lambda: setattr(cfg, "window", 3)),
    "cfg.attn.window": (nested, lambda: setattr(cfg.attn, "window", 9), lambda: setattr(cfg.attn, "window", 3)),
    'CFG["attn"]["window"]': (subscript, lambda: CFG["attn"].__setitem__("window", 9),
                              lambda: CFG["attn"].__setitem__("window", 3)),
    'CFG["attn"].get("window")': (method_then_read, lambda: CFG["attn"].__setitem__("window", 11),
                                  lambda: CFG["attn"].__setitem__("window", 3)),
    "Limits.WINDOW": (class_attribute, lambda: setattr(Limits, "WINDOW", 9), lambda: setattr(Limits, "WINDOW", 3)),
    'ordered["window"]': (ordered_dict, lambda: ordered.__setitem__("window", 9),
                          lambda: ordered.__setitem__("window", 3)),
    "nn.Module closure self.window": (model.closure, lambda: setattr(model, "window", 9),
                                      lambda: setattr(model, "window", 3)),
    "method mod self.cfg.window": (model.mask, lambda: setattr(model.cfg, "window", 9),
                                   lambda: setattr(model.cfg, "window", 3)),
    "__call__ self.cfg.window": (callable_object, lambda: setattr(callable_object.cfg, "window", 9),
                                 lambda: setattr(callable_object.cfg, "window", 3)),
}


@pytest.mark.parametrize("case", CASES)
def test_read_path_followed(case):
    fn, change, undo = CASES[case]
    mod = maskc.mask_mod(fn)
    before = mod.signature
    assert mod.traced is mod.traced, "an unchanged mod was traced again"
    change()
    try:
        assert mod.signature != before, "the trace did not follow the change"
    finally:
        undo()
