"""Render kernel source from the Jinja templates: Python decides, the template prints."""
from __future__ import annotations

import ast
import functools
import hashlib
import math
import threading
from importlib import resources
from pathlib import Path
from typing import NamedTuple

import jinja2
import sympy
from sympy.functions.elementary.piecewise import ExprCondPair

from maskc._version import __version__
from maskc.codegen.printer import TritonPrinter, describe, tensor_args
from maskc.codegen.separable import separate
from maskc.codegen.source import KernelSource, fuses_multiply_add
from maskc.errors import MaskcError
from maskc.trace import dag
from maskc.trace.symbols import INTEGER_OPS, KV_IDX, Q_IDX, ROUNDED, SCORE, CustomBackward, LoadFloat

TEMPLATES = {"fwd": "attention_fwd.py.jinja", "bwd": "attention_bwd.py.jinja", "dec": "attention_decode.py.jinja",
             "hfwd": "attention_fwd_hopper.py.jinja", "hbwd": "attention_bwd_hopper.py.jinja"}
# The kernels each kind of file defines (@triton.jit, or @gluon.jit for the Gluon kinds).
KERNEL_NAMES = {"fwd": ("attention_fwd",), "bwd": ("attention_bwd_dq", "attention_bwd_dkdv", "attention_bwd_delta"),
                "dec": ("attention_decode", "attention_combine"), "hfwd": ("attention_fwd_hopper",),
                "hbwd": ("attention_bwd_dkdv_hopper",)}
GLUON_KINDS = ("hfwd", "hbwd")
# log2(e): the kernels' softmax runs in base 2. Every kernel file's prelude prints it as LOG2E
# (for the factors the kernel applies itself: a score mod's result, the backward's scale), and
# runtime/plan.kernel_scale folds it into the scale of a forward without a score mod.
LOG2E = math.log2(math.e)


@functools.lru_cache(maxsize=None)
def _environment(folder: str | None = None) -> jinja2.Environment:
    # Templates are loaded from the installed package (maskc/_templates), never the source
    # tree; benchmarks/ab_fwd.py names another folder to time edited copies side by side.
    root = resources.files("maskc._templates") if folder is None else Path(folder)
    loader = jinja2.FunctionLoader(lambda name: root.joinpath(name).read_text())
    return jinja2.Environment(loader=loader, undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                              autoescape=False)


@functools.lru_cache(maxsize=None)
def codegen_hash() -> str:
    """Hash of what decides a kernel's text: every template (included fragments too) and
    maskc's codegen modules. Any edit to either gives new cache entries, so a developer
    changing the printer within one version never runs a stale cached kernel."""
    digest = hashlib.sha256()
    templates = resources.files("maskc._templates").iterdir()
    modules = Path(__file__).parent.glob("*.py")
    for entry in sorted(templates, key=lambda e: e.name):
        if entry.name.endswith(".jinja"):
            digest.update(entry.name.encode() + b"\0" + entry.read_bytes())
    for module in sorted(modules):
        digest.update(module.name.encode() + b"\0" + module.read_bytes())
    return digest.hexdigest()[:16]


class Rendered(NamedTuple):
    """A kernel file's text and, per @triton.jit function in it, its parameter names in order:
    the one statement of each kernel's argument list, which launches bind by name."""

    text: str
    parameters: dict[str, tuple[str, ...]]


def render(spec: KernelSource, templates: str | None = None) -> Rendered:
    """The Triton source of the kernel file described by `spec` (from the templates in the
    folder `templates`, else maskc's own)."""
    extra = []
    for slot, rank in enumerate(spec.tensor_ranks):
        extra += tensor_args(slot, rank)
    extra += [f"p{i}" for i in range(len(spec.param_kinds))]
    try:
        hooks = _hooks(spec)
    except RecursionError:
        # the printer recurses once per level of the expression, as sympy's printers do
        raise MaskcError("maskc cannot render this kernel: its mask or score mod nests too deeply to print (the "
                         "printer recurses once per level of the expression, past Python's recursion limit); "
                         "compute the deep part outside the mod, as a tensor over the positions, and index it "
                         "with q_idx and kv_idx") from None
    text = _environment(templates).get_template(TEMPLATES[spec.kind]).render(
        kernel_name=KERNEL_NAMES[spec.kind][0],
        template_name=TEMPLATES[spec.kind],
        maskc_version=__version__,
        mask_text=describe(spec.mask_expr) if spec.mask_expr is not None else "none (every pair kept)",
        score_text=describe(spec.score_expr) if spec.score_expr is not None else "none (plain scores)",
        extra_args=extra,
        jit="gluon.jit" if spec.kind in GLUON_KINDS else "triton.jit",
        log2e=LOG2E,
        **hooks,
    )
    return Rendered(text, parameters(text))


# NOTE: CPython 3.11's ast.parse is not thread-safe ("AST constructor recursion depth mismatch",
# python/cpython#106905). Everything in maskc that parses Python takes turns on this lock: this
# module's `parameters`, the loader importing a kernel file (Triton parses @triton.jit
# functions) and interpreted launches (Triton's interpreter rewrites the kernel's AST).
AST_LOCK = threading.RLock()


def parameters(text: str) -> dict[str, tuple[str, ...]]:
    """The parameter names of each top-level function in a kernel file's text, in order (a
    cached file read from disk gives them as a fresh rendering would)."""
    with AST_LOCK:
        tree = ast.parse(text)
    return {f.name: tuple(a.arg for a in f.args.args) for f in tree.body if isinstance(f, ast.FunctionDef)}


def _hooks(spec: KernelSource) -> dict:
    """The Triton text the template prints at its named hooks: each `*_expr` with the
    `*_statements` that run before it, and the printer's `helpers` that the text calls."""
    hooks = {}
    # each block has its own names; `helpers` collects over all three
    printer = TritonPrinter(negative_indices=spec.negative_indices)
    mask = sympy.true if spec.mask_expr is None else spec.mask_expr
    _name(hooks, "mask", printer.block([mask], "_mask")[0])
    # the mask is printed first, as a decision; from here on the scores, whose value may round as
    # the GPU does unless the score mod also decides on a float
    printer.decides = not fuses_multiply_add(spec.score_expr)
    score_grad, loads = None, []
    if spec.kind in ("bwd", "hbwd") and spec.score_expr is not None:
        score_grad = score_derivative(spec.score_expr)
        score_grad = None if score_grad == 1 else score_grad
        loads = _float_loads(spec.score_expr, spec.grad_slots)
    load_grads = [_Derivative(load)(spec.score_expr) for load in loads]
    # the derivatives run after the score in the same tile, so they may use the score's names
    scores = [e for e in (spec.score_expr, score_grad) if e is not None] + load_grads
    printed = iter(printer.block(scores, "_score"))
    for hook, expr in (("score", spec.score_expr), ("score_grad", score_grad)):
        _name(hooks, hook, next(printed) if expr is not None else None)
    if spec.score_expr is not None and not _tile_shaped(spec.score_expr):
        # A score that reads neither the score nor both positions (a constant -inf, a per-head
        # or per-row bias) prints a 0-d or one-axis value, where the template's row max and the
        # backward's dot need the tile. tl.where over `score == score` (true wherever it is a
        # number, and either way the same value) broadcasts it to the score's shape, in Triton
        # and Gluon alike (tl.full would need Gluon's layout).
        value = hooks["score_expr"]
        hooks["score_expr"] = f"tl.where(score == score, {value}, {value})"
    load_printed = list(printed)
    # The forwards and the Gluon dK/dV kernel use the split (KernelSource.split_score). float64
    # runs exist for exact checks (gradcheck): there the score mod runs as written, since the
    # split form measured 2e-7 relative error in float64 against 6e-16 (some term of it is
    # computed in float32; not pinned down).
    separable = separate(spec.score_expr) if spec.split_score else None
    hooks["separable"] = separable is not None
    # the row's and coefficient's statements run once per program, before the column's loop
    terms = (separable.coefficient, separable.row, separable.column) if separable else ()
    printed = printer.block(terms, "_split") if separable else [None] * 3
    for hook, p in zip(("coefficient", "row", "column"), printed):
        _name(hooks, hook, p)
    # the column's text runs in the tile function, which takes the names it may read as arguments
    hooks["split_names"] = [name for p in printed[:2] if p for name in p.names]
    # each captured float element the score reads, with its derivative and where its gradient goes
    hooks["load_grads"] = []
    for load, p in zip(loads, load_printed):
        slot = int(load.args[0])
        positions = load.free_symbols & {Q_IDX, KV_IDX}
        # the positions the element's index reads: the tile's contributions are summed over the others
        # first, so that an element read by a whole row, column or tile takes one atomic add per tile,
        # and one read along diagonals (q_idx - kv_idx: a relative-position table) one per diagonal
        reads = "both" if len(positions) == 2 else "rows" if Q_IDX in positions else "columns" if positions else "none"
        target = load
        if reads == "both" and _on_diagonals(load):
            reads = "diagonals"
            # where each diagonal's sum goes: the element at a pair (diag_q, diag_kv) on it
            target = load.xreplace({Q_IDX: _DIAG_Q, KV_IDX: _DIAG_KV})
        offset, inside = printer.address(target, f"G{slot}")
        hooks["load_grads"].append(dict(slot=slot, statements=p.statements, value=p.value, offset=offset,
                                        inside=inside, reads=reads, text=describe(load, limit=30)))
    hooks["diagonal_grads"] = any(g["reads"] == "diagonals" for g in hooks["load_grads"])
    hooks["grad_args"] = [arg for slot in spec.grad_slots
                          for arg in (f"G{slot}", *(f"G{slot}_stride{d}" for d in range(spec.tensor_ranks[slot])))]
    hooks["helpers"] = sorted(printer.helpers)  # the file defines only these
    return hooks


def _tile_shaped(expr) -> bool:
    """Whether `expr` has the shape of the kernel's tile of scores: it reads the score, or both
    q_idx and kv_idx (a row and a column broadcast to a tile, in either kernel's layout)."""
    read = dag.free_symbols(expr)
    return SCORE in read or {Q_IDX, KV_IDX} <= read


def _name(hooks: dict, hook: str, printed) -> None:
    hooks[f"{hook}_expr"] = printed.value if printed else None
    hooks[f"{hook}_statements"] = printed.statements if printed else ()


# -- d(score_mod)/d(score) for the backward --------------------------------------------------
_SMOOTH = (sympy.exp, sympy.log, sympy.tanh, sympy.atan, sympy.sin, sympy.cos, sympy.erf, *ROUNDED)  # ROUNDED: slope 1
# An integer-valued operation of score: its derivative is 0 almost everywhere (torch says 0 for
# floor), which is rarely what was meant. Indices of captured tensors are integers, so one
# of these reaches any index that depends on score.
_STEPS = (sympy.floor, sympy.ceiling, *INTEGER_OPS)


_DIAG_Q = sympy.Symbol("diag_q", integer=True, nonnegative=True)
_DIAG_KV = sympy.Symbol("diag_kv", integer=True, nonnegative=True)


def _on_diagonals(load) -> bool:
    """Whether captured element `load`'s index reads q_idx and kv_idx only through q_idx - kv_idx,
    so that it is one element along each diagonal of a tile."""
    shift = sympy.Symbol("shift", integer=True)
    return not any(i.subs(Q_IDX, KV_IDX + shift).has(KV_IDX) for i in load.args[1:])


def _float_loads(expr, slots) -> list:
    """The distinct elements of captured float tensors numbered `slots` that `expr` reads."""
    found, seen, stack = set(), set(), [expr]
    while stack:
        e = stack.pop()
        if e in seen:
            continue
        seen.add(e)
        if isinstance(e, LoadFloat) and int(e.args[0]) in slots:
            found.add(e)
        stack.extend(e.args)
    return sorted(found, key=sympy.default_sort_key)


def score_derivative(expr) -> sympy.Expr:
    """d expr / d score, as torch's autograd differentiates the same operations.

    Each distinct subexpression is differentiated once (sympy.diff walks the tree, which
    nested torch.where makes exponentially large). Where torch picks a rule, so does this:
    torch.where passes the gradient to the branch taken (conditions are not differentiated);
    abs has slope sign(x), 0 at 0; sign has slope 0; min, max and clamp pass the gradient to
    the argument they return, and at a tie to one that depends on score (clamp passes it at
    its bounds); `%` has slope 1 in its dividend; a torch.autograd.Function has the slopes its
    backward gives. floor, ceil, trunc and integer operations of score have no derivative: an
    error names the operation.

    >>> score_derivative(sympy.Max(SCORE, 0))
    Piecewise((1, score >= 0), (0, True))
    """
    return _Derivative()(expr)


class _Derivative:
    """d expr / d target: the score, or one element of a captured tensor (a load), which the
    rules treat as a variable like the score."""

    def __init__(self, target=SCORE):
        self.done = {}
        self.target = target

    def __call__(self, e):
        d = self.done.get(e)
        if d is None:
            d = self.done[e] = self._rule(e)
        return d

    def _rule(self, e):
        if e == self.target:
            return sympy.Integer(1)
        if not e.args or e.is_Boolean:
            return sympy.Integer(0)
        if isinstance(e, sympy.Add):
            return sympy.Add(*[self(a) for a in e.args])
        if isinstance(e, sympy.Mul):
            return sympy.Add(*[self(a) * sympy.Mul(*e.args[:i], *e.args[i + 1:]) for i, a in enumerate(e.args)
                               if self(a) != 0])
        if isinstance(e, sympy.Pow):
            return self._pow(e)
        if isinstance(e, sympy.Piecewise):
            return _piecewise([(self(branch.expr), branch.cond) for branch in e.args])
        if isinstance(e, (sympy.Min, sympy.Max)):
            return self._extreme(e)
        if isinstance(e, sympy.Abs):
            return sympy.sign(e.args[0]) * self(e.args[0])
        if isinstance(e, sympy.Mod):
            a, m = e.args
            return self(a) - sympy.floor(a / m) * self(m)
        if isinstance(e, CustomBackward):  # the Function's backward, not its value's derivative
            return sympy.Add(*[s * self(x) for x, s in e.pairs])
        slopes = [self(a) for a in e.args]
        if all(s == 0 for s in slopes) or isinstance(e, (sympy.sign, sympy.Heaviside)):
            return sympy.Integer(0)
        if isinstance(e, _SMOOTH):
            return sympy.Add(*[e.fdiff(i + 1) * s for i, s in enumerate(slopes) if s != 0])
        what = "score" if self.target == SCORE else f"its captured tensor element {describe(self.target, limit=30)}"
        fix = (f"use operations differentiable in {'score' if self.target == SCORE else 'it'} (torch.where, clamp, "
               f"abs, exp, tanh, ...), or apply it to b, h, q_idx and kv_idx only" if isinstance(e, _STEPS)
               else "maskc has no derivative rule for it")
        if self.target != SCORE:  # torch gives such a read a zero gradient; maskc asks for it to be said
            fix += "; or read that tensor through .detach() there, if no gradient should flow through that read"
        raise MaskcError(f"score_mod is not differentiable in {what} at {describe(e, limit=40)}, which the "
                         f"backward pass needs; {fix}")

    def _pow(self, e):
        base, exp = e.args
        d_base, d_exp = self(base), self(exp)
        if d_exp == 0:
            return exp * base ** (exp - 1) * d_base
        if d_base == 0:
            return e * sympy.log(base) * d_exp
        return e * (d_exp * sympy.log(base) + exp * d_base / base)

    def _extreme(self, e):
        """The slope of the argument a min or max returns; at a tie, of the first one that
        depends on score, so that clamp passes the gradient at its bounds as torch's does."""
        args = sorted(e.args, key=lambda a: self(a) == 0)
        better = sympy.GreaterThan if isinstance(e, sympy.Max) else sympy.LessThan
        # unevaluated: sympy's verdict on a >= b can be wrong (dag.misleads_sympy)
        branches = [(self(a), sympy.And(*[better(a, b, evaluate=False) for b in args if b is not a]))
                    for a in args[:-1]]
        return _piecewise([*branches, (self(args[-1]), sympy.true)])


def _piecewise(branches):
    """Piecewise of (value, condition) pairs as given, unevaluated: sympy's constructor folds
    the conditions, and a score mod's conditions may hold Piecewise themselves (a where-nest
    on the score), which its folding refuses."""
    if all(value == branches[0][0] for value, _ in branches):
        return branches[0][0]  # the same slope on every branch (0 where none reads the score)
    pairs = [sympy.Basic.__new__(ExprCondPair, value, cond) for value, cond in branches]
    return sympy.Basic.__new__(sympy.Piecewise, *pairs)


__all__ = ["AST_LOCK", "GLUON_KINDS", "Rendered", "codegen_hash", "parameters", "render", "score_derivative"]
