"""Guards: a trace is re-checked against the globals, cells and attributes it read, and traced
again when one changed; the callables FlexAttention accepts; captured values no kernel can hold;
tracing from several threads."""
import functools
import math
import sys
import threading

import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import and_masks, noop_mask, or_masks

import maskc
from _inputs import qkv
from _work import python_calls
from maskc import MaskTraceError, masks
from maskc.analysis.dense import evaluate, symbols_env
from maskc.testing import assert_block_map_exact, dense_mask
from maskc.testing.reference import attention_reference
from maskc.trace import as_mask_mod, as_score_mod
from maskc.trace.proxy import Proxy
from maskc.trace.symbols import Q_IDX

THIS = sys.modules[__name__]
WINDOW = 4  # module globals the mods below read; tests change them with monkeypatch
DOC_IDS = torch.tensor([0] * 10 + [1] * 20 + [2] * 10)
FLAG = True
BOUNDS = [3, 9]
WINDOWS = np.array([[4, 8], [2, 6]])
NEG_INF = float("-inf")


def sliding_global(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= WINDOW)


def document_global(b, h, q_idx, kv_idx):
    return DOC_IDS[q_idx] == DOC_IDS[kv_idx]


def _values(mod):
    return [(p.origin, p.value) for p in mod.traced.params]


def _assert_attention_matches(q, k, v, **mods):
    out = maskc.compiled_attention(q, k, v, **mods)
    ref, _ = attention_reference(q, k, v, **mods)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


def _assert_traces_like_eager(fn, n=12):
    """The traced expression of mask `fn` (any callable), evaluated, equals calling `fn`."""
    mm = as_mask_mod(fn)
    ar = torch.arange
    env = symbols_env(ar(1).view(-1, 1, 1, 1), ar(2).view(1, -1, 1, 1), ar(n).view(1, 1, -1, 1),
                      ar(n).view(1, 1, 1, -1))
    traced = evaluate(mm.expr, env, mm.traced.tensors, mm.traced.param_values()).expand(1, 2, n, n)
    assert torch.equal(traced, dense_mask(mm, n, n, 1, 2))


# -- 1. guards -------------------------------------------------------------------------------
def test_changed_global_retraces_end_to_end_without_a_new_kernel(monkeypatch):
    q, k, v = qkv()
    _assert_attention_matches(q, k, v, mask_mod=sliding_global)
    before = as_mask_mod(sliding_global).traced
    misses = maskc.runtime.cache_info().misses
    monkeypatch.setattr(THIS, "WINDOW", 100)
    _assert_attention_matches(q, k, v, mask_mod=sliding_global)
    after = as_mask_mod(sliding_global).traced
    assert after is not before and after.signature == before.signature
    assert [p.value for p in after.params] == [100]
    assert maskc.runtime.cache_info().misses == misses  # only a parameter value changed


def test_rebound_global_tensor_is_used_end_to_end(monkeypatch):
    q, k, v = qkv()
    _assert_attention_matches(q, k, v, mask_mod=document_global)
    new_ids = torch.tensor([0] * 25 + [1] * 15)
    monkeypatch.setattr(THIS, "DOC_IDS", new_ids)
    assert as_mask_mod(document_global).traced.tensors == (new_ids,)
    _assert_attention_matches(q, k, v, mask_mod=document_global)


def test_unchanged_values_keep_the_same_trace_object():
    mm = masks.and_masks(masks.sliding_window(8), masks.document(DOC_IDS), masks.causal)
    assert mm.traced is mm.traced
    window = int("1000000")
    plain = as_mask_mod(lambda b, h, q_idx, kv_idx: q_idx - kv_idx <= window)
    first = plain.traced
    window = int("1000000")  # noqa: F841 (read by the lambda's cell): an equal value, another object
    assert plain.traced is first


def test_decorated_mod_follows_its_closure():
    window = 3

    @maskc.mask_mod
    def sliding(b, h, q_idx, kv_idx):
        return q_idx - kv_idx <= window

    before = sliding.traced
    window = 300  # noqa: F841 (read by the closure)
    assert _values(sliding) == [("window", 300)]
    assert sliding.signature == before.signature


@pytest.mark.parametrize("new, expect_same_signature", [(4.0, False), (5, True), (True, False)])
def test_captured_scalars_are_compared_by_type_and_value(monkeypatch, new, expect_same_signature):
    before = as_mask_mod(sliding_global).traced
    monkeypatch.setattr(THIS, "WINDOW", new)
    after = as_mask_mod(sliding_global).traced
    assert after is not before
    assert (after.signature == before.signature) is expect_same_signature
    _assert_traces_like_eager(sliding_global)


def test_a_changed_parameter_alone_keeps_the_expression_without_tracing_again(monkeypatch):
    # a decoding step's offset or a new window: the trace is the old one with the new value
    mm = as_mask_mod(sliding_global)
    before = mm.traced
    monkeypatch.setattr("maskc.trace.tracer._trace_once", None)  # a new trace would fail here
    for window in (7, 0, -3):
        monkeypatch.setattr(THIS, "WINDOW", window)
        after = mm.traced
        assert after.expr is before.expr and _values(mm) == [("WINDOW", window)]
        assert mm.traced is after  # its guards hold the new value
    monkeypatch.undo()
    _assert_traces_like_eager(sliding_global)
    # a parameter that becomes an infinity changes what the trace folds: traced again
    monkeypatch.setattr(THIS, "WINDOW", float("inf"))
    assert mm.traced.params == () and mm.signature == masks.causal.signature


def test_changed_flag_changes_the_structure(monkeypatch):
    def flagged(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) if FLAG else (q_idx <= kv_idx)  # a Python bool: structure

    causal = as_mask_mod(flagged).signature
    monkeypatch.setattr(THIS, "FLAG", False)
    assert as_mask_mod(flagged).signature != causal
    _assert_traces_like_eager(flagged)


def test_rebound_helper_function_and_composed_mods_are_guarded():
    def narrow(b, h, q_idx, kv_idx):
        return q_idx - kv_idx <= 2

    def wide(b, h, q_idx, kv_idx):
        return q_idx - kv_idx <= 20

    helper = narrow

    def outer(b, h, q_idx, kv_idx):
        return helper(b, h, q_idx, kv_idx) & (q_idx >= kv_idx)

    composed = masks.and_masks(outer, masks.causal)
    first = composed.signature
    helper = wide  # noqa: F841 (read by outer's cell)
    assert composed.signature != first
    _assert_traces_like_eager(composed)


def test_list_changed_in_place_retraces():
    def bounded(b, h, q_idx, kv_idx):
        return (kv_idx >= BOUNDS[0]) & (kv_idx <= BOUNDS[1])

    mods = [masks.causal]

    def any_of(b, h, q_idx, kv_idx):
        return mods[0](b, h, q_idx, kv_idx)

    try:
        first = as_mask_mod(bounded).signature
        BOUNDS[1] = 5
        assert as_mask_mod(bounded).signature != first
        _assert_traces_like_eager(bounded)
    finally:
        BOUNDS[1] = 9
    mm = as_mask_mod(any_of)
    assert mm.signature == masks.causal.signature
    mods[0] = masks.sliding_window(3)
    assert mm.signature == masks.sliding_window(3).signature


def test_a_numpy_array_changed_in_place_retraces():
    # lists were guarded, arrays were not: WINDOWS[0, 0] = 10 kept the old 4 (error 1.07)
    def element(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= WINDOWS[0, 0])

    def converted(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= int(WINDOWS[1][1]))

    def closure(windows):
        return lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= windows[0])

    q, k, v = qkv()
    row = WINDOWS[0].copy()
    in_closure = closure(row)
    try:
        for mod in (element, converted, in_closure):
            first = as_mask_mod(mod).traced
            assert as_mask_mod(mod).traced is first  # unchanged: the numpy scalars compare by value
            _assert_attention_matches(q, k, v, mask_mod=mod)
        WINDOWS[0, 0], WINDOWS[1, 1], row[0] = 10, 1, 20
        for mod, literal in ((element, lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= 10)),
                             (converted, lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= 1)),
                             (in_closure, lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= 20))):
            assert as_mask_mod(mod).signature == as_mask_mod(literal).signature  # the new value, a constant
            _assert_attention_matches(q, k, v, mask_mod=mod)
    finally:
        WINDOWS[:] = [[4, 8], [2, 6]]


@pytest.mark.parametrize("read", ["int", "float", "item", "if", "tolist", "numpy", "equal"])
def test_a_tensor_element_read_as_a_python_value_is_refused(read):
    # int(T[0]) kept the value read when traced, and T[0] = 10 never reached the kernel; a guard
    # re-reading it on every call would wait for the GPU
    windows = torch.tensor([4, 8])
    reads = {"int": lambda: int(windows[0]), "float": lambda: float(windows[0]), "item": lambda: windows[0].item(),
             "if": lambda: 4 if windows[0] else 0, "tolist": lambda: windows.tolist()[0],
             "numpy": lambda: windows.numpy()[0], "equal": lambda: 4 if torch.equal(windows, windows) else 0}

    def sliding(b, h, q_idx, kv_idx):
        return q_idx - kv_idx <= reads[read]()

    with pytest.raises(MaskTraceError, match=r"reads a tensor's element as a Python value .* use the element as a "
                                             r"tensor .* or index it with an index argument"):
        as_mask_mod(sliding)


def test_a_tensor_element_used_as_a_tensor_follows_the_tensor():
    windows = torch.tensor([4, 8])

    def sliding(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= windows[0])

    q, k, v = qkv()
    _assert_attention_matches(q, k, v, mask_mod=sliding)
    windows[0] = 10
    _assert_attention_matches(q, k, v, mask_mod=sliding)


def test_attributes_of_captured_objects_are_guarded():
    # a config namespace, a dataclass and a module read through their attributes: the chains of
    # reads are guarded (found by running code nobody here wrote)
    import dataclasses
    import types

    @dataclasses.dataclass
    class Config:
        window: int

    cfg, opts, module = Config(3), types.SimpleNamespace(window=3), types.ModuleType("user_config")
    module.window = 3

    def through_dataclass(b, h, q_idx, kv_idx):
        assert isinstance(cfg, Config)  # the stand-in passes isinstance
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= cfg.window)

    def through_namespace(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= opts.window)

    def through_module(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= module.window)

    q, k, v = qkv()
    for fn, holder in ((through_dataclass, cfg), (through_namespace, opts), (through_module, module)):
        mm = as_mask_mod(fn)
        first = mm.traced
        assert mm.traced is first  # nothing changed: the same trace
        holder.window = 20
        assert mm.traced is not first
        _assert_traces_like_eager(fn)
        _assert_attention_matches(q, k, v, mask_mod=fn)


def test_an_nn_module_closure_follows_its_attributes_and_buffers():
    # the mod built once in __init__ over self: its window changed, its ids buffer reassigned
    class Attention(torch.nn.Module):
        def __init__(self, ids):
            super().__init__()
            self.window = 4
            self.register_buffer("ids", ids)

            def mask(b, h, q_idx, kv_idx):
                return (self.ids[q_idx] == self.ids[kv_idx]) & (q_idx - kv_idx <= self.window) & (q_idx >= kv_idx)
            self.mask = mask

    module = Attention(DOC_IDS.clone())
    q, k, v = qkv()
    _assert_attention_matches(q, k, v, mask_mod=module.mask)
    module.window = 30
    _assert_attention_matches(q, k, v, mask_mod=module.mask)
    module.ids = torch.tensor([0] * 25 + [1] * 15)
    _assert_attention_matches(q, k, v, mask_mod=module.mask)
    _assert_traces_like_eager(module.mask)


def test_a_nested_config_changed_in_place_retraces():
    config = {"attention": {"window": 3}, "bounds": ([2, 8],)}

    def windowed(b, h, q_idx, kv_idx):
        low, high = config["bounds"][0]
        return (q_idx - kv_idx <= config["attention"]["window"]) & (kv_idx >= low) & (kv_idx <= high)

    first = as_mask_mod(windowed).signature
    config["attention"]["window"] = 5
    second = as_mask_mod(windowed).signature
    assert second != first
    config["bounds"][0][1] = 6  # a list inside a tuple
    assert as_mask_mod(windowed).signature != second
    _assert_traces_like_eager(windowed)


def test_captured_objects_reach_the_mod_as_themselves():
    # guarding their reads must not change what the mod sees: type, str, identity, equality
    import dataclasses

    @dataclasses.dataclass
    class Mode:
        name: str = "causal"

        def __str__(self):
            return self.name

    mode, default = Mode(), Mode()
    mode_id = id(mode)

    def by_identity(b, h, q_idx, kv_idx):
        same = type(mode) is Mode and str(mode) == "causal" and id(mode) == mode_id and mode == default
        return (q_idx >= kv_idx) if same else (q_idx == q_idx)

    assert as_mask_mod(by_identity).signature == masks.causal.signature


def test_a_class_attribute_is_guarded():
    class Limits:
        WINDOW = 3

    def windowed(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= Limits.WINDOW)

    first = as_mask_mod(windowed).signature
    Limits.WINDOW = 9
    assert as_mask_mod(windowed).signature != first
    _assert_traces_like_eager(windowed)


def test_paths_past_self_and_through_modules_lists_and_ordered_dicts():
    # a second review's cases: a method mod reading self.cfg.window, a ModuleList indexed with a
    # constant, an OrderedDict; an attribute that is a new tuple of tensors on each read (not
    # guarded, no crash); a dict with attribute access raising KeyError for unknown names
    import collections
    import types

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cfg = types.SimpleNamespace(window=3)
            self.layers = torch.nn.ModuleList([torch.nn.Module()])
            self.layers[0].window = 3

        def mask(self, b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx <= self.cfg.window)

    model = Model()
    ordered = collections.OrderedDict(window=3)

    def through_list(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= model.layers[0].window)

    def through_ordered(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= ordered["window"])

    class AttrDict(dict):
        __getattr__ = dict.__getitem__

    settings = AttrDict(window=3)

    def through_attr_dict(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= settings.window)

    class Fresh:
        def __getattr__(self, name):  # a new tuple of tensors on each read, which == cannot compare
            return (torch.zeros(2), torch.zeros(2))

    fresh = Fresh()

    def through_fresh(b, h, q_idx, kv_idx):
        first, _ = fresh.pair  # the chain ends at the tuple
        return q_idx >= kv_idx + first.sum()

    assert as_mask_mod(through_fresh).signature
    for fn, change in ((model.mask, lambda: setattr(model.cfg, "window", 9)),
                       (through_list, lambda: setattr(model.layers[0], "window", 9)),
                       (through_ordered, lambda: ordered.__setitem__("window", 9)),
                       (through_attr_dict, lambda: settings.__setitem__("window", 9))):
        first = maskc.mask_mod(fn)
        signature = first.signature
        change()
        assert first.signature != signature
        _assert_traces_like_eager(fn)


def test_a_callable_attribute_of_a_callable_object_keeps_its_parameters():
    # self.inner.offset, inner itself callable: a parameter of inner's stand-in, so a new value
    # needs no new trace (a path guard there had made it a constant, traced again on each change)
    class Inner:
        def __init__(self):
            self.offset = 2

        def __call__(self, b, h, q_idx, kv_idx):
            return q_idx >= kv_idx + self.offset

    class Outer:
        def __init__(self):
            self.inner = Inner()

        def __call__(self, b, h, q_idx, kv_idx):
            return self.inner(b, h, q_idx, kv_idx) & (kv_idx >= self.inner.offset)

    outer = Outer()
    mm = as_mask_mod(outer)
    expr = mm.traced.expr
    outer.inner.offset = 5
    assert mm.traced.expr is expr and [p.value for p in mm.traced.params] == [5]


def test_an_object_indexed_by_the_mod_works():
    # a sequence of the user's: indexed with a constant, an operator the mod's code applies
    class Sizes:
        def __init__(self):
            self.values = [3, 5]

        def __getitem__(self, i):
            return self.values[i]

    sizes = Sizes()

    def first_size(b, h, q_idx, kv_idx):
        return q_idx - kv_idx <= sizes[0]

    _assert_traces_like_eager(first_size)


def test_deleted_global_is_not_silently_kept(monkeypatch):
    mm = as_mask_mod(sliding_global)
    assert mm.traced is not None
    monkeypatch.delattr(THIS, "WINDOW")
    with pytest.raises(NameError):
        mm.traced


def test_guard_check_is_cheap():
    # it runs on every call: two Python calls (the property and guards_hold's flat loop), none
    # per guard, whose reads and comparisons are C-level
    for mm in (as_mask_mod(sliding_global), masks.and_masks(masks.sliding_window(8), masks.document(DOC_IDS))):
        traced = mm.traced
        calls = python_calls(lambda: [mm.traced for _ in range(1000)])  # noqa: B023
        assert calls <= 2 * 1000 + 2, f"{mm.__name__}: {calls / 1000:.1f} Python calls per guard check"
        assert mm.traced is traced  # and no trace again


# -- 2. callables FlexAttention accepts --------------------------------------------------------
class Window:
    """A callable object: its attributes are read through `self`."""

    limit = 1000  # a class attribute, read like an instance one

    def __init__(self, window):
        self.window = window

    def inside(self, q_idx, kv_idx):
        return q_idx - kv_idx <= self.window

    def __call__(self, b, h, q_idx, kv_idx):
        return self.inside(q_idx, kv_idx) & (q_idx >= kv_idx) & (kv_idx < self.limit)


def shifted(b, h, q_idx, kv_idx, shift=0):
    return q_idx + shift >= kv_idx


def test_torch_and_or_noop_masks_are_traced_through(monkeypatch):
    prefix = functools.partial(lambda b, h, q_idx, kv_idx, n: kv_idx < n, n=5)
    mod = and_masks(sliding_global, or_masks(prefix, masks.causal), noop_mask)
    assert _values(as_mask_mod(mod)) == [("mask_mods[0].WINDOW", 4), ("mask_mods[1].mask_mods[0].n", 5)]
    _assert_traces_like_eager(mod)
    before = as_mask_mod(mod).signature
    monkeypatch.setattr(THIS, "WINDOW", 7)
    assert as_mask_mod(mod).signature == before
    assert _values(as_mask_mod(mod))[0] == ("mask_mods[0].WINDOW", 7)
    q, k, v = qkv()
    _assert_attention_matches(q, k, v, mask_mod=mod)


def test_partial_arguments_are_parameters_and_guarded():
    by_keyword = functools.partial(shifted, shift=3)
    assert _values(as_mask_mod(by_keyword)) == [("shift", 3)]
    _assert_traces_like_eager(by_keyword)
    by_keyword.keywords["shift"] = 5
    assert _values(as_mask_mod(by_keyword)) == [("shift", 5)]
    positional = functools.partial(lambda w, b, h, q_idx, kv_idx: q_idx - kv_idx <= w, 2)
    assert _values(as_mask_mod(positional)) == [("args[0]", 2)]
    assert as_mask_mod(positional).__name__ == "partial(<lambda>)"
    _assert_traces_like_eager(positional)


def test_callable_object_attributes_are_parameters_and_guarded():
    obj = Window(3)
    mm = as_mask_mod(obj)
    assert mm.__name__ == "Window" and _values(mm) == [("window", 3), ("limit", 1000)]
    _assert_traces_like_eager(obj)
    obj.window = 6
    assert _values(mm)[0] == ("window", 6)
    Window.limit = 7
    try:
        assert _values(mm)[1] == ("limit", 7)
        _assert_traces_like_eager(obj)
    finally:
        Window.limit = 1000
    assert not hasattr(mm, "window")  # the object's attributes are not copied onto the mod


def test_nested_partials_and_objects():
    obj = Window(2)
    partial_of_object = functools.partial(obj)
    assert _values(as_mask_mod(partial_of_object))[0] == ("window", 2)
    both = and_masks(functools.partial(shifted, shift=1), partial_of_object)
    mm = as_mask_mod(both)
    assert [v for _, v in _values(mm)] == [1, 2, 1000]
    _assert_traces_like_eager(both)
    obj.window = 9
    assert [v for _, v in _values(mm)] == [1, 9, 1000]


def test_bound_method_and_score_mod_objects():
    class Model:
        def __init__(self, window):
            self.window = window

        def mask(self, b, h, q_idx, kv_idx):
            return q_idx - kv_idx <= self.window

    model = Model(5)
    mm = maskc.mask_mod(model.mask)
    assert _values(mm) == [("window", 5)]
    model.window = 8
    assert _values(mm) == [("window", 8)]

    class Softcap:
        def __init__(self, cap):
            self.cap = cap

        def __call__(self, score, b, h, q_idx, kv_idx):
            return self.cap * torch.tanh(score / self.cap)

    cap = Softcap(20.0)
    sm = as_score_mod(cap)
    assert sm.signature == maskc.scores.softcap(30).signature
    cap.cap = 50.0
    assert [p.value for p in sm.traced.params] == [50.0]


def test_what_is_not_a_python_callable_is_refused():
    with pytest.raises(TypeError, match="mask_mod must be a Python function or lambda, got int; .*functools.partial"):
        maskc.mask_mod(42)
    with pytest.raises(TypeError, match="got builtin_function_or_method"):
        maskc.mask_mod(torch.where)


# -- 3. captured values no kernel can hold -----------------------------------------------------
@pytest.mark.parametrize("value, what", [(2**64, "WINDOW = 18446744073709551616, outside ±2\\*\\*62"),
                                          (-(2**63) - 1, "WINDOW = -9223372036854775809, outside ±2\\*\\*62"),
                                          (2**63 - 1, "WINDOW = 9223372036854775807, outside ±2\\*\\*62"),
                                          (float("nan"), "WINDOW = nan")])
def test_out_of_range_captures_are_refused_when_traced(monkeypatch, value, what):
    mm = as_mask_mod(sliding_global)
    mm.traced
    monkeypatch.setattr(THIS, "WINDOW", value)
    with pytest.raises(ValueError, match=f"mask_mod 'sliding_global' captures {what}"):
        maskc.block_map(sliding_global, 64, 64, block_size=(16, 16))
    monkeypatch.setattr(THIS, "WINDOW", 2**62)  # the largest the kernel sums with positions
    assert [p.value for p in mm.traced.params] == [2**62]
    q = torch.randn(1, 1, 40, 16)
    out = maskc.compiled_attention(q, q, q, mask_mod=sliding_global)
    torch.testing.assert_close(out.double(), attention_reference(q, q, q, mask_mod=sliding_global)[0], atol=2e-6, rtol=0)


def test_nan_in_a_score_mod_is_refused():
    nan = float("nan")
    with pytest.raises(ValueError, match="score_mod '<lambda>' captures nan = nan"):
        maskc.score_mod(lambda score, b, h, q_idx, kv_idx: score * nan)


def test_a_division_by_zero_is_refused_with_the_rule():
    # sympy's x / 0 is complex infinity, signless: the printer had no rule for it and said so
    # in a message for maskc's developers
    with pytest.raises(ValueError, match="score_mod '<lambda>' divides by zero; .* divide by a nonzero number"):
        maskc.score_mod(lambda score, b, h, q_idx, kv_idx: score / 0.0)
    with pytest.raises(ValueError, match="mask_mod '<lambda>' divides by zero"):
        maskc.mask_mod(lambda b, h, q_idx, kv_idx: q_idx / 0 > kv_idx)


@pytest.mark.parametrize("window", [float("inf"), float("-inf")])
def test_infinite_window_in_a_mask_works(monkeypatch, window):
    monkeypatch.setattr(THIS, "WINDOW", window)
    mm = as_mask_mod(sliding_global)
    assert mm.traced.params == ()
    expected = masks.causal.signature if window > 0 else None
    assert expected is None or mm.signature == expected
    assert_block_map_exact(sliding_global, q_len=40, kv_len=40, block_size=(16, 16))
    q, k, v = qkv()
    _assert_attention_matches(q, k, v, mask_mod=sliding_global)


def test_infinity_that_does_not_fold_is_refused(monkeypatch):
    monkeypatch.setattr(THIS, "WINDOW", float("inf"))
    with pytest.raises(ValueError, match="mask_mod '<lambda>' captures WINDOW = inf, used where it does not fold"):
        maskc.mask_mod(lambda b, h, q_idx, kv_idx: q_idx * WINDOW >= kv_idx)  # 0 * inf: nan at q_idx 0


def test_a_remainder_by_infinity_folds_as_torch_computes_it(monkeypatch):
    # q_idx % inf is q_idx for q_idx >= 0 (tests/test_trust_leftovers.py runs it against torch)
    monkeypatch.setattr(THIS, "WINDOW", float("inf"))
    assert maskc.mask_mod(lambda b, h, q_idx, kv_idx: q_idx % WINDOW >= kv_idx).traced.signature == \
        maskc.masks.causal.traced.signature


def test_negative_infinity_in_a_score_mod_works():
    def masked_score(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx >= kv_idx, score, NEG_INF)

    assert [p.value for p in as_score_mod(masked_score).traced.params] == [NEG_INF]
    q, k, v = qkv()
    _assert_attention_matches(q, k, v, score_mod=masked_score)


# -- 4. threads --------------------------------------------------------------------------------
def _in_thread(target, timeout=60):
    errors = []
    thread = threading.Thread(target=_collect, args=(errors, target), daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), "deadlocked"
    if errors:
        raise errors[0]


def test_threads_trace_and_check_guards_at_once():
    shared = as_mask_mod(sliding_global)
    shared_trace = shared.traced

    def uses_if(b, h, q_idx, kv_idx):
        return q_idx if q_idx > kv_idx else kv_idx

    def work(i):
        for j in range(15):
            window = 100 * i + j
            mm = maskc.mask_mod(lambda b, h, q_idx, kv_idx: q_idx - kv_idx <= window)  # noqa: B023
            assert [p.value for p in mm.traced.params] == [window]
            assert shared.traced is shared_trace
            with pytest.raises(MaskTraceError, match="mask_mod 'uses_if' uses Python control flow"):
                maskc.mask_mod(uses_if)

    errors = []
    threads = [threading.Thread(target=lambda i=i: _collect(errors, work, i)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads) and not errors, errors


def _collect(errors, fn, *args):
    try:
        fn(*args)
    except BaseException as e:  # noqa: BLE001 (reported by the main thread)
        errors.append(e)


def test_trace_state_belongs_to_its_thread():
    started, release = threading.Event(), threading.Event()

    def slow(b, h, q_idx, kv_idx):
        started.set()
        release.wait(30)
        return q_idx >= kv_idx

    tracer = threading.Thread(target=maskc.mask_mod, args=(slow,), daemon=True)
    tracer.start()
    try:
        assert started.wait(30)
        # a proxy misused on this thread must not be reported as the other thread's mod
        with pytest.raises(MaskTraceError, match="outside of tracing"):
            bool(Proxy(Q_IDX) >= 0)
    finally:
        release.set()
        tracer.join(30)


def test_a_mod_built_inside_a_mod_does_not_deadlock():
    def outer(b, h, q_idx, kv_idx):
        inner = maskc.mask_mod(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)
        return inner(b, h, q_idx, kv_idx) & (kv_idx < DOC_IDS[q_idx] + 8)

    def build():
        mm = maskc.mask_mod(outer)
        assert len(mm.traced.tensors) == 1  # the outer trace kept its state through the inner one

    _in_thread(build)


def test_plain_functions_are_freed_with_their_trace():
    """A plain function's wrapper lives as long as the function, not forever: a weak-keyed
    table whose values hold the function kept every lambda ever passed alive."""
    import gc
    import weakref

    from maskc.trace.mods import as_mask_mod

    refs = []
    for i in range(5):
        fn = eval(f"lambda b, h, q_idx, kv_idx: q_idx >= kv_idx - {i}")  # a new function each time
        as_mask_mod(fn)
        refs.append(weakref.ref(fn))
        del fn
    gc.collect()
    assert [r for r in refs if r() is not None] == []


STRIDES = 3


def test_captured_count_in_range_becomes_a_constant(monkeypatch):
    """A captured int that reaches range() (or int(), or a list index) decides the structure:
    it is traced again as a constant, and a new value gives a new signature."""
    def strided(b, h, q_idx, kv_idx):
        keep = q_idx < 0
        for i in range(STRIDES):
            keep = keep | (q_idx - kv_idx == 4 * i)
        return keep

    mod = as_mask_mod(strided)
    three = mod.traced
    assert three.params == ()
    assert_block_map_exact(mod, 40, 40, (16, 16))
    monkeypatch.setattr(THIS, "STRIDES", 5)
    five = mod.traced
    assert five.signature != three.signature
    assert_block_map_exact(mod, 40, 40, (16, 16))


MAX_DISTANCE = 128


def test_python_decisions_on_captured_numbers_make_them_constants(monkeypatch):
    """Arithmetic on captured numbers alone that Python itself decides (`if WINDOW > 0`,
    min(WINDOW, 5), int(WINDOW / 2)) is decided as FlexAttention decides it: the numbers are
    traced again as constants. It was refused as Python control flow on a traced value."""
    def decides(b, h, q_idx, kv_idx):
        if WINDOW > 0:
            return (q_idx >= kv_idx) & (q_idx - kv_idx < min(WINDOW, 5) + int(WINDOW / 2))
        return q_idx >= kv_idx

    mod = as_mask_mod(decides)
    for window in (4, 9, 0):
        monkeypatch.setattr(THIS, "WINDOW", window)
        assert mod.traced.params == ()
        _assert_traces_like_eager(decides)
        assert_block_map_exact(mod, 40, 40, (16, 16))
    assert mod.signature == masks.causal.signature


def test_python_decisions_on_a_folded_constant(monkeypatch):
    # an infinite window is a constant in a mask (it folds its comparisons): Python's decision
    # on it is taken as it folded, not refused as control flow
    def decides(b, h, q_idx, kv_idx):
        if WINDOW > 0:
            return (q_idx >= kv_idx) & (q_idx - kv_idx <= WINDOW)
        return q_idx == kv_idx

    monkeypatch.setattr(THIS, "WINDOW", float("inf"))
    assert as_mask_mod(decides).signature == masks.causal.signature


def test_math_on_a_captured_number_in_a_score(monkeypatch):
    # T5's relative-position bucket: math.log(max_distance / max_exact) of a bound number
    def log_scaled(score, b, h, q_idx, kv_idx):
        return score + torch.log((q_idx - kv_idx).abs().float() + 1) / math.log(MAX_DISTANCE / 8)

    q, k, v = qkv()
    _assert_attention_matches(q, k, v, score_mod=log_scaled)
    monkeypatch.setattr(THIS, "MAX_DISTANCE", 32)
    _assert_attention_matches(q, k, v, score_mod=log_scaled)


def test_python_decisions_on_positions_are_still_refused():
    def decides_on_position(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx if q_idx > WINDOW else q_idx == kv_idx

    with pytest.raises(MaskTraceError, match="uses Python control flow"):
        maskc.mask_mod(decides_on_position)


DIVISOR = 3.0
PERIOD = 4


def test_a_captured_divisor_made_zero_is_refused_with_the_rule(monkeypatch):
    # the block-map analysis met sympy's complex infinity there and crashed with
    # "Cannot convert complex to float"
    def chunked(b, h, q_idx, kv_idx):
        return torch.trunc(q_idx / DIVISOR) >= torch.trunc(kv_idx / DIVISOR)

    def periodic(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx) % (PERIOD - 1) == 0

    assert_block_map_exact(chunked, 40, 40, (16, 16))
    monkeypatch.setattr(THIS, "DIVISOR", 0.0)
    with pytest.raises(ValueError, match=r"mask_mod 'chunked' divides by zero with DIVISOR = 0.0; .* capture a nonzero"):
        maskc.block_map(chunked, 40, 40, block_size=(16, 16))
    monkeypatch.setattr(THIS, "DIVISOR", 5.0)
    assert_block_map_exact(chunked, 40, 40, (16, 16))
    # traced with PERIOD = 4 first: then only the value changes (the trace is kept), and 1 is
    # no zero itself but makes the divisor one
    assert_block_map_exact(periodic, 40, 40, (16, 16))
    monkeypatch.setattr(THIS, "PERIOD", 1)
    with pytest.raises(ValueError, match="mask_mod 'periodic' divides by zero with PERIOD = 1"):
        maskc.block_map(periodic, 40, 40, block_size=(16, 16))
