"""A grammar of random FlexAttention-style mask_mods and score_mods, written out as Python source
and exec'd into real functions: code nobody wrote by hand, for tests/test_fuzz_grammar.py (a fixed
sample on the CPU) and tests/gpu/test_fuzz.py (many on a GPU).

>>> mod = random_mask_mod(17, max_len=80)
>>> print(mod.source)
def mask_17(b, h, q_idx, kv_idx):
    return (torch.ceil(torch.remainder(torch.where((WP > q_idx), WP, 3), -7) / 3.0) != 0.5)
>>> mask = maskc.mask_mod(mod.fn)

A seed fixes everything: the expression and the tensors and numbers it captures, which the
generator makes itself (on `device`), so `random_mask_mod(seed)` replays a failure. An expression
draws from index arithmetic (+ - *, // and % with negative operands and index-valued divisors,
floor_divide, remainder, abs, sign, minimum/maximum, clamp with either or both bounds, bit
operations and shifts), torch.where, comparisons and & | ^ ~, casts (.int() .long() .float()
.bool() .to()), floor/ceil/round/trunc, captured ints (W, of either sign; WP > 0) and a captured
float (FC), and lookups in 1-d and 2-d int, float and bool tables at computed indices: wrapped,
clamped, negative within range (counting from the end, as torch's) or a bare position. A score
mod adds float operations on the score: tanh, exp, log1p, sigmoid, sqrt, sin, cos, pow, softcap,
division by index values, rounding, -inf fills, position biases and tables.

Every expression is valid wherever it is evaluated, so that a failure is maskc's:

- no division by zero, and table indices in range for lengths up to `max_len` (tables indexed by
  a bare position are at least that long);
- each integer sub-expression stays within ±2**24 (INT_LIMIT): positions are int32 in the kernel
  (docs/guides/masks.md: a product of large positions can wrap there), and integers this small are exact in
  float32, whichever side of a cast maskc computes them on;
- a score stays within ±SCORE_LIMIT, assuming |q·k·scale| <= SCORE_BOUND (standard normal q and
  k): the kernel keeps scores in float32, whose rounding of larger ones is not maskc's error;
- a rounded score (floor(s * c) and the like) rounds a value within ±ROUNDING_LIMIT: the kernel's
  float32 score is off the float64 reference's by about 1e-6, and where that moves a value across
  a step the answers differ by a step. floor(cos(score - 0.1 * abs(q_idx - kv_idx))) at 3000
  positions differs from float64 by 2e-2 in torch's own float32. Steps crossed near a row's
  largest score can still exceed float32's tolerance: tests/gpu/test_fuzz.py tells those
  cases apart;
- float literals that multiply an index are ones whose float32 product rounds like the rational
  they spell (0.1 and 0.7, not 0.3: `ceil(50 * 0.3)` is 16 in torch and 15 in maskc, a documented
  difference); a sum of such terms compared with an integer can still round across it in
  float32, which is that same difference;
- a score that may be -inf is not fed to what would make it NaN or +inf (sin, pow, abs,
  a product with a float that may be 0 or negative). A mod can still give NaN in rare cases (a
  -inf fill under sqrt(abs(...))'s gradient): drivers skip a case whose reference is NaN.
"""
from __future__ import annotations

import linecache
import math
import random
import re
from typing import Callable, NamedTuple

import torch

INT_LIMIT = 2 ** 24
SCORE_BOUND = 8.0
SCORE_LIMIT = 1024.0
ROUNDING_LIMIT = 32.0
BATCH_HEADS_BOUND = 8  # b and h of the drivers' problems stay below this
_POSITION = re.compile(r"\b(b|h|q_idx|kv_idx)\b")
_CONSTANTS = (-7, -5, -3, -2, -1, 0, 1, 2, 3, 4, 5, 8, 16)
_NONZERO = (-7, -4, -3, -2, -1, 1, 2, 3, 4, 5, 8, 16)
_POSITIVE = (1, 2, 3, 4, 5, 7, 8, 16)
_MULTIPLIERS = (0.1, 0.5, 0.25, 1.5, -0.7, 0.7)  # not 0.3: see the module's docstring
_DIVISORS = (2.0, 3.0, -2.5, 4.0, 7.0)
_ROUNDINGS = ("floor", "ceil", "round", "trunc")
_COMPARISONS = ("<", "<=", ">", ">=", "==", "!=")
_BOOLEAN_OPS = {3: "&", 4: "|", 6: "^"}


class GeneratedMod(NamedTuple):
    """A generated mod: its name (`mask_<seed>` or `score_<seed>`), the source of its `def`, the
    plain function (not traced), and the numbers and tensors it captures, by name."""

    name: str
    source: str
    fn: Callable
    captured: dict

    def __repr__(self) -> str:
        # NOTE: pytest prints the arguments of a failing frame; the tables would fill the screen
        return f"GeneratedMod({self.name})"

    def describe(self) -> str:
        """One line for a failure report: the returned expression and the captured numbers it reads."""
        expr = self.source.splitlines()[1].strip().removeprefix("return ")
        numbers = ", ".join(f"{k}={v}" for k, v in self.captured.items()
                            if not isinstance(v, torch.Tensor) and re.search(rf"\b{k}\b", expr))
        return f"{self.name}: {expr}" + (f"  [{numbers}]" if numbers else "")


def random_mask_mod(seed: int, *, max_len: int = 80, device="cpu", depth: int | None = None) -> GeneratedMod:
    """A mask_mod(b, h, q_idx, kv_idx) valid at lengths up to `max_len`, its tensors on `device`.

    >>> mod = random_mask_mod(3, max_len=3000, device="cuda")
    """
    grammar = _Grammar(seed, max_len)
    body = grammar.boolean(grammar.depth() if depth is None else depth)
    return grammar.build(f"mask_{seed}", "b, h, q_idx, kv_idx", body, device)


def random_score_mod(seed: int, *, max_len: int = 80, device="cpu", depth: int | None = None) -> GeneratedMod:
    """A score_mod(score, b, h, q_idx, kv_idx) valid at lengths up to `max_len`, its tensors on `device`."""
    grammar = _Grammar(seed, max_len)
    body = grammar.score(grammar.depth() if depth is None else depth, SCORE_LIMIT)
    return grammar.build(f"score_{seed}", "score, b, h, q_idx, kv_idx", body, device)


class _Expr(NamedTuple):
    text: str
    bound: float  # |value| <= bound wherever it is evaluated (an infinity aside)
    neg_inf: bool = False  # a score that may be -inf

    def __str__(self) -> str:
        return self.text


class _Grammar:
    """The productions, drawing from one random.Random(seed). Each takes a depth and the bound its
    value must stay within, and passes shares of that bound to its operands."""

    def __init__(self, seed: int, max_len: int):
        self.r = r = random.Random(seed)
        self.max_len = max_len
        self.n1 = r.choice([3, 5, 7, 16, max_len, max_len + 3])  # 1-d tables; long ones take bare positions
        self.n2 = (r.choice([2, 3, 4]), r.choice([3, 5, 9]))  # 2-d tables
        self.numbers = {"W": r.choice([-5, -3, -1, 1, 2, 3, 4, 7, 16]), "WP": r.choice([1, 2, 3, 5, 8]),
                        "FC": r.choice([0.5, 0.1, 1.5, -0.25, 2.0, 0.3])}
        g = torch.Generator().manual_seed(seed)
        n1, (a, c) = self.n1, self.n2
        self.tables = {
            "T1": torch.randint(-4, 20, (n1,), generator=g),
            "T1b": torch.randint(0, 3, (n1,), generator=g).to(torch.int32),
            "TF": torch.rand(n1, generator=g) * 2 - 1,
            "TB": torch.rand(n1, generator=g) > 0.5,
            "T2": torch.randint(-3, 10, (a, c), generator=g),
            "TF2": torch.randn(a, c, generator=g),
            "BIAS": torch.randn(2, max_len, generator=g),
        }

    def depth(self) -> int:
        return self.r.choice([1, 2, 2, 3, 3, 4])

    def build(self, name: str, params: str, body: _Expr, device) -> GeneratedMod:
        source = f"def {name}({params}):\n    return {body}\n"
        filename = f"<fuzz_grammar {name}>"
        # NOTE: registered so that tracebacks and maskc's file:line messages can show the line
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        captured = {**self.numbers, "NEG_INF": float("-inf"),
                    **{k: t.to(device) for k, t in self.tables.items()}}
        namespace = {"torch": torch, **captured}
        exec(compile(source, filename, "exec"), namespace)
        return GeneratedMod(name, source, namespace[name], captured)

    # -- integers ---------------------------------------------------------------------------------
    def _const(self, limit, choices=_CONSTANTS) -> int:
        fitting = [c for c in choices if abs(c) <= limit]
        return self.r.choice(fitting or [1])

    def _position(self, limit) -> _Expr:
        """q_idx, kv_idx or their difference; under a bound below max_len, one wrapped under it."""
        r = self.r
        text = r.choice(["q_idx", "kv_idx", "(q_idx - kv_idx)", "(kv_idx - q_idx)"])
        if self.max_len <= limit:
            return _Expr(text, self.max_len)
        modulus = max(1, min(int(limit), r.choice(_POSITIVE)))
        return _Expr(f"({text} % {modulus})", modulus)

    def _int_leaf(self, limit) -> _Expr:
        r, x = self.r, self.r.random()
        if x < 0.35:
            return self._position(limit)
        if x < 0.5 and limit >= BATCH_HEADS_BOUND:
            return _Expr(r.choice(["b", "h"]), BATCH_HEADS_BOUND)
        if x < 0.75 and limit >= 16:
            name = r.choice(["W", "WP"])
            return _Expr(name, abs(self.numbers[name]))
        c = self._const(limit)
        return _Expr(str(c), abs(c))

    def indexed_int(self, depth, limit) -> _Expr:
        """An integer expression that reads a position (one without is a constant the tracer folds)."""
        for _ in range(20):
            e = self.int_(depth, limit)
            if _POSITION.search(e.text):
                return e
        return self._position(limit)

    def int_(self, depth, limit=INT_LIMIT) -> _Expr:
        r = self.r
        if depth <= 0 or r.random() < 0.1:
            return self._int_leaf(limit)
        d, half = depth - 1, max(1, limit // 2)
        k = r.randrange(30)
        if k in (0, 1):
            a, b = self.int_(d, half), self.int_(d, half)
            e = _Expr(f"({a} {'+-'[k]} {b})", a.bound + b.bound)
        elif k == 2:
            c = self._const(limit)
            a = self.int_(d, limit // max(1, abs(c)))
            e = _Expr(f"({a} * {c})", a.bound * abs(c))
        elif k == 3:
            a = self.int_(d, limit)
            e = _Expr(f"({a} // {r.choice(_NONZERO)})", a.bound)
        elif k == 4:
            c = self._const(limit, _NONZERO)
            e = _Expr(f"({self.int_(d, limit)} % {c})", abs(c))
        elif k == 5:
            a = self.int_(d, limit)
            e = _Expr(f"abs({a})", a.bound)
        elif k in (6, 7):
            a, b = self.indexed_int(d, limit), self.indexed_int(d, limit)
            e = _Expr(f"torch.{['minimum', 'maximum'][k - 6]}({a}, {b})", max(a.bound, b.bound))
        elif k == 8:
            e = self._clamp(d, limit)
        elif k == 9:
            a, b = self.int_(d, limit), self.int_(d, limit)
            e = _Expr(f"torch.where({self.boolean(d)}, {a}, {b})", max(a.bound, b.bound))
        elif k == 10:
            a, c = self.int_(d, half), self._const(half)
            e = _Expr(f"({a} {r.choice('&|^')} {c})", 2 * max(a.bound, abs(c)))  # two's complement
        elif k == 11:
            shift = r.randrange(0, 4)
            if r.random() < 0.5:
                a = self.int_(d, limit)
                e = _Expr(f"({a} >> {shift})", a.bound)
            else:
                a = self.int_(d, limit >> shift)
                e = _Expr(f"({a} << {shift})", a.bound * 2 ** shift)
        elif k == 12:
            e = _Expr(f"T1[{self.index(self.n1, d)}]", 20)
        elif k == 13:
            e = self._table_2d("T2", d, 10)
        elif k == 14:
            root = max(1, math.isqrt(int(limit)))
            a, b = self.int_(d, root), self.int_(d, root)
            e = _Expr(f"({a} * {b})", a.bound * b.bound)
        elif k == 15:
            a = self.int_(d, limit)
            e = _Expr(f"(-{a})", a.bound)
        elif k == 16:  # a divisor that depends on positions, of either sign
            a, b = self.int_(d, limit), self.int_(d, limit - 1)
            sign = r.choice(["", "-"])
            if r.random() < 0.5:
                e = _Expr(f"({a} // {sign}(abs({b}) + 1))", a.bound)
            else:
                e = _Expr(f"({a} % {sign}(abs({b}) + 1))", b.bound + 1)
        elif k == 17:
            f = self.indexed_float(d, limit)
            e = _Expr(f"({f}).{r.choice(['int', 'long'])}()", f.bound)
        elif k == 18:
            f = self.indexed_float(d, limit - 1)
            e = _Expr(f"torch.{r.choice(_ROUNDINGS)}({f}).{r.choice(['int', 'long'])}()", f.bound + 1)
        elif k == 19:
            e = _Expr(f"({self.boolean(d)}).{r.choice(['int', 'long'])}()", 1)
        elif k == 20:
            name = r.choice(["W", "WP"])  # neither is 0
            a = self.int_(d, limit)
            e = _Expr(f"({a} // {name})", a.bound)
        elif k == 21:
            name = r.choice(["W", "WP"])
            e = _Expr(f"({self.int_(d, limit)} % {name})", abs(self.numbers[name]))
        elif k == 22:
            e = _Expr(f"torch.sign({self.indexed_int(d, limit)})", 1)
        elif k == 23:
            a = self.indexed_int(d, limit)
            e = _Expr(f"({a}).to(torch.int32)", a.bound)
        elif k == 24:
            e = _Expr(f"T1b[{self.index(self.n1, d)}]", 2)
        elif k == 25:
            a, b = self.int_(d, half), self.int_(d, half)
            e = _Expr(f"({a} {r.choice('&|^')} {b})", 2 * max(a.bound, b.bound))
        elif k == 26:
            a, c = self.int_(d, limit), self._const(limit)
            e = _Expr(f"torch.where({self.boolean(d)}, {a}, {c})", max(a.bound, abs(c)))
        elif k == 27:
            c = self._const(half)
            a, b = self.int_(d, half), self.int_(d, half // max(1, abs(c)))
            e = _Expr(f"({a} + {b} * {c})", a.bound + b.bound * abs(c))
        elif k == 28:
            a = self.indexed_int(d, limit)
            e = _Expr(f"torch.floor_divide({a}, {r.choice(_NONZERO)})", a.bound)
        else:
            c = self._const(limit, _NONZERO)
            e = _Expr(f"torch.remainder({self.indexed_int(d, limit)}, {c})", abs(c))
        return e if e.bound <= limit else self._int_leaf(limit)

    def _clamp(self, d, limit) -> _Expr:
        r, a = self.r, self.indexed_int(d, limit)
        lo = self._const(limit)
        x = r.random()
        if x < 0.33:
            return _Expr(f"torch.clamp({a}, min={lo})", max(a.bound, abs(lo)))
        if x < 0.66:
            return _Expr(f"torch.clamp({a}, max={lo})", max(a.bound, abs(lo)))
        hi = lo + r.randrange(0, 12)
        return _Expr(f"torch.clamp({a}, {lo}, {hi})", max(abs(lo), abs(hi)))

    def index(self, n, depth) -> str:
        """An index into a table dimension of n entries: wrapped, clamped, negative within range,
        or (where the table covers max_len) a bare position."""
        r, e = self.r, self.indexed_int(depth, INT_LIMIT)
        x = r.random()
        if x < 0.3:
            return f"({e}) % {n}"
        if x < 0.55:
            return f"torch.clamp({e}, 0, {n - 1})"
        if x < 0.75:
            return f"torch.clamp({e}, -{n}, {n - 1})"
        if x < 0.85:
            return f"({e}).clamp(min=-{n}).clamp(max={n - 1})"
        if n >= self.max_len:
            return r.choice(["q_idx", "kv_idx"])
        return f"torch.remainder({e}, {n})"

    def _table_2d(self, name, depth, bound) -> _Expr:
        a, c = self.n2
        i, j = self.index(a, depth), self.index(c, depth)
        return _Expr(f"{name}[{i}, {j}]" if self.r.random() < 0.5 else f"{name}[{i}][{j}]", bound)

    # -- floats computed from positions -------------------------------------------------------------
    def indexed_float(self, depth, limit) -> _Expr:
        for _ in range(20):
            e = self.float_(depth, limit)
            if _POSITION.search(e.text):
                return e
        return _Expr("(q_idx * 0.5)", self.max_len) if self.max_len <= limit else _Expr("(q_idx % 2 * 0.5)", 1)

    def float_(self, depth, limit=INT_LIMIT) -> _Expr:
        r = self.r
        d, half = max(depth - 1, 0), max(1, limit // 2)
        fc = abs(self.numbers["FC"])
        k = r.randrange(12)
        if k == 0:
            c = r.choice(_MULTIPLIERS)
            a = self.int_(d, min(INT_LIMIT, int(limit / abs(c))))
            e = _Expr(f"({a} * {c})", a.bound * abs(c))
        elif k == 1:
            a = self.int_(d, limit)
            e = _Expr(f"({a} / {r.choice(_DIVISORS)})", a.bound)
        elif k == 2:
            a = self.indexed_int(d, limit)
            e = _Expr(f"({a}).float()", a.bound)
        elif k in (3, 11):
            a = self.indexed_int(d, min(INT_LIMIT, int(limit / fc)))
            text = f"({a}).to(torch.float32) * FC" if k == 3 else f"(({a}).float() * FC)"
            e = _Expr(text, a.bound * fc)
        elif k == 4:
            e = _Expr(f"TF[{self.index(self.n1, d)}]", 1)
        elif k == 5:
            e = self._table_2d("TF2", d, float(self.tables["TF2"].abs().max()))
        elif k == 6:
            a = self.int_(d, limit)
            e = _Expr(f"({a} / {r.choice(_POSITIVE)})", a.bound)
        elif k == 7:
            if depth > 0:
                a, b = self.float_(d, half), self.float_(d, half)
                e = _Expr(f"({a} + {b})", a.bound + b.bound)
            else:
                a = self.int_(0, limit)
                e = _Expr(f"({a} * 0.5)", a.bound)
        elif k == 8:
            a = self.float_(d, limit) if depth > 0 else _Expr("1.5", 1.5)
            e = _Expr(f"torch.where({self.boolean(d)}, {a}, {r.choice(['0.0', '-2.0', '3.25'])})",
                      max(a.bound, 3.25))
        elif k == 9:
            a, b = self.int_(d, limit), self.int_(d, INT_LIMIT - 1)
            e = _Expr(f"({a} / (abs({b}) + 1))", a.bound)
        elif k == 10:
            a = self.indexed_int(d, limit - 1)
            e = _Expr(f"torch.{r.choice(_ROUNDINGS)}({a} / {r.choice([2.0, 3.0, 4.0, -3.0])})", a.bound + 1)
        if e.bound <= limit:
            return e
        leaf = self._int_leaf(limit)
        return _Expr(f"({leaf} * 0.5)", leaf.bound * 0.5)

    # -- booleans ---------------------------------------------------------------------------------
    def boolean(self, depth) -> _Expr:
        """A condition that reads a position."""
        for _ in range(20):
            e = self._boolean(depth)
            if _POSITION.search(e.text):
                return e
        return _Expr("(q_idx >= kv_idx)", 1)

    def _boolean(self, depth) -> _Expr:
        r = self.r
        cmp = r.choice(_COMPARISONS)
        if depth <= 0:
            return _Expr(f"({self._int_leaf(INT_LIMIT)} {cmp} {self._int_leaf(INT_LIMIT)})", 1)
        d = depth - 1
        k = r.randrange(14)
        if k in (0, 1, 2):
            text = f"({self.int_(d)} {cmp} {self.int_(d)})"
        elif k in (3, 4, 6):
            text = f"({self.boolean(d)} {_BOOLEAN_OPS[k]} {self.boolean(d)})"
        elif k == 5:
            text = f"(~{self.boolean(d)})"
        elif k == 7:
            text = f"TB[{self.index(self.n1, d)}]"
        elif k == 8:
            text = f"({self.float_(d)} {cmp} {r.choice(['0.0', '0.5', '-1.0', '2.0', '1.0'])})"
        elif k == 9:
            text = f"torch.where({self.boolean(d)}, {self.boolean(d)}, {self.boolean(d)})"
        elif k == 10:
            text = f"({self.indexed_int(d, INT_LIMIT)}).bool()"
        elif k == 11:
            text = f"({self.int_(d)} {cmp} {self._const(INT_LIMIT)})"
        elif k == 12:
            text = f"(({self.int_(d)} % {r.choice(_POSITIVE)}) == {r.randrange(0, 3)})"
        else:
            text = f"({self.float_(d)} {cmp} {self.float_(d)})"
        return _Expr(text, 1)

    # -- scores -----------------------------------------------------------------------------------
    def score(self, depth, limit) -> _Expr:
        """A score expression within ±limit (but for -inf); the bare score where limit is below SCORE_BOUND."""
        if depth <= 0 or limit < SCORE_BOUND:
            return _Expr("score", SCORE_BOUND)
        e = self._score(depth - 1, limit)
        return e if e.bound <= limit else _Expr("score", SCORE_BOUND)

    def _score(self, d, limit) -> _Expr:
        r = self.r
        k = r.randrange(24)
        if k in (4, 6, 7, 8, 16, 21):
            return self._score_finite_only(k, d, limit)
        if k == 0:
            s = self.score(d, limit / 2)
            c = r.choice([0.5, 2.0, 1.5, 0.1] if s.neg_inf else [0.5, 2.0, -1.0, 1.5, 0.1])  # -inf * -1 is +inf
            return _Expr(f"({s} * {c})", s.bound * abs(c), s.neg_inf)
        if k == 1:
            s, f = self.score(d, limit / 2), self.float_(d, int(limit / 2))
            return _Expr(f"({s} + {f})", s.bound + f.bound, s.neg_inf)
        if k == 2:
            return _Expr(f"torch.tanh({self.score(d, limit)})", 1)
        if k == 3:
            return _Expr(f"torch.exp(torch.clamp({self.score(d, limit)}, max=3.0))", math.exp(3))
        if k == 5:
            return _Expr(f"torch.sigmoid({self.score(d, limit)})", 1)
        if k == 9:
            c = r.choice([5.0, 2.0, 30.0, 0.5])
            return _Expr(f"({c} * torch.tanh({self.score(d, limit)} / {c}))", c)
        if k == 10:
            s = self.score(d, limit)
            fill = r.choice(["float('-inf')", "NEG_INF", "-1.0", "0.0", "3.0"])
            inf = "inf" in fill.lower()
            return _Expr(f"torch.where({self.boolean(d)}, {s}, {fill})", max(s.bound, 3.0), s.neg_inf or inf)
        if k == 11:
            s, a = self.score(d, limit / 2), self.int_(d, int(limit / 2))
            return _Expr(f"({s} + {a})", s.bound + a.bound, s.neg_inf)
        if k == 12:
            c = r.choice([0.1, -0.2, 0.05])
            s, a = self.score(d, limit / 2), self.int_(d, int(limit / 2 / abs(c)))
            return _Expr(f"({s} + ({a}) * {c})", s.bound + a.bound * abs(c), s.neg_inf)
        if k == 13:
            s = self.score(d, limit)
            return _Expr(f"({s} / (abs({self.int_(d)}) + 1))", s.bound, s.neg_inf)
        if k == 14:
            s = self.score(d, limit)
            return _Expr(f"({s} / ({self.indexed_int(d, INT_LIMIT)}).float().abs().clamp(min=1.0))",
                         s.bound, s.neg_inf)
        if k == 15:
            c = r.choice([2.0, 4.0])
            s = self.score(d, min(limit, ROUNDING_LIMIT) / c - 1)
            return _Expr(f"torch.{r.choice(_ROUNDINGS)}({s} * {c})", s.bound * c + 1, s.neg_inf)
        if k == 17:
            s = self.score(d, limit / 2)
            bias = float(self.tables["BIAS"].abs().max())
            return _Expr(f"({s} + BIAS[{self.index(2, d)}, {self.index(self.max_len, d)}])", s.bound + bias,
                         s.neg_inf)
        if k == 18:  # ALiBi's shape, where the distances fit the bound
            s = self.score(d, limit / 2)
            distance = (_Expr("abs(q_idx - kv_idx)", self.max_len) if self.max_len <= limit / 2
                        else _Expr(f"abs({self.indexed_int(d, int(limit / 2))})", limit / 2))
            return _Expr(f"({s} - TF[{self.index(self.n1, d)}] * {distance})", s.bound + distance.bound, s.neg_inf)
        if k == 19:
            s = self.score(d, limit)
            if r.random() < 0.5:
                return _Expr(f"torch.clamp({s}, min={r.choice(['0.0', '-1.0'])})", s.bound)
            t = self.score(d, limit)
            if r.random() < 0.5:
                return _Expr(f"torch.minimum({s}, {t})", max(s.bound, t.bound), s.neg_inf or t.neg_inf)
            return _Expr(f"torch.maximum({s}, {t})", max(s.bound, t.bound), s.neg_inf and t.neg_inf)
        if k == 20:
            return _Expr(f"torch.clamp({self.score(d, limit)}, {r.choice(['-2.0', '-1.0'])}, "
                         f"{r.choice(['1.0', '2.0'])})", 2)
        if k == 22:
            s, t = self.score(d, limit), self.score(d, limit)
            return _Expr(f"torch.where({self.boolean(d)}, {s}, {t})", max(s.bound, t.bound), s.neg_inf or t.neg_inf)
        s, t = self.score(d, limit / 2), self.score(d, limit / 2)
        return _Expr(f"({s} + {t})", s.bound + t.bound, s.neg_inf or t.neg_inf)

    def _score_finite_only(self, k, d, limit) -> _Expr:
        """Operations that turn a -inf score into NaN or +inf: their operand is drawn until it cannot
        be -inf (else tanh takes its place)."""
        r = self.r
        sub = limit ** 0.5 if k == 8 else limit
        for _ in range(5):
            s = self.score(d, sub)
            if not s.neg_inf:
                break
        else:
            return _Expr(f"torch.tanh({s})", 1)
        if k == 4:
            return _Expr(f"torch.log1p(torch.abs({s}))", math.log1p(s.bound))
        if k == 6:
            return _Expr(f"torch.sqrt(torch.abs({s}))", s.bound ** 0.5)
        if k == 7:
            return _Expr(f"torch.{r.choice(['sin', 'cos'])}({s})", 1)
        if k == 8:
            return _Expr(f"({s}).pow(2)", s.bound ** 2)
        if k == 16:
            f = self.float_(d, max(1, int(limit / s.bound)))
            return _Expr(f"({s} * {f})", s.bound * f.bound)
        return _Expr(f"({s} * ({self.boolean(d)}).float())", s.bound)


__all__ = ["GeneratedMod", "INT_LIMIT", "ROUNDING_LIMIT", "SCORE_BOUND", "SCORE_LIMIT", "random_mask_mod",
           "random_score_mod"]
