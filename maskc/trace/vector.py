"""Small vectors in a mod, unrolled into scalars: a captured tensor indexed in fewer dimensions
than it has (`means[q_idx]`, `topk[b, h, q_tile]`, `modalities[b]`), and what is computed from it.

FlexAttention runs a mod through vmap, so a mod may compute on a row of a captured tensor:
`(q_pos - k_pos).pow(2).sum(-1)`, `torch.dot(q_rope[b, h, q_idx], k_rope[b, 0, kv_idx])`,
`(tiles == kv_tile.unsqueeze(-1)).any(dim=-1)`, `for _, offset, length in modalities[b]`. maskc
traces one value per (b, h, q_idx, kv_idx), so a row whose remaining dimensions are static and
hold at most UNROLL_LIMIT elements becomes a Vector: a static shape and one ordinary scalar
Proxy per element, each a load at literal indices in the remaining dimensions. Elementwise
operations broadcast as torch does; reductions, torch.dot and unpacking give scalars back. Every
element being a scalar load, codegen, interval analysis, block maps and gradients see only what
they already handle.
"""
from __future__ import annotations

import functools
import operator

import numpy
import torch

from maskc.errors import MaskTraceError
from maskc.trace import _context
from maskc.trace import proxy as P

# The most elements a vector may have, and the most rows iteration unrolls: each element is a
# load and each step of a reduction a node, in every kernel that reads the mod.
UNROLL_LIMIT = 64

T = torch.Tensor


class Vector(P.Rows):
    """A traced tensor of static `shape`. A captured tensor's partial view (`source`: the tensor
    and the indices given) is read lazily, so that `bias[b][h][q_idx]` completes into one load;
    its elements are loaded when an operation needs them. `origin` says where the vector came from
    (what the mod did, and at which of its lines) for the refusal of a vector left where one value
    is needed."""

    __slots__ = ("shape", "_elements", "source", "origin")

    def __init__(self, shape: tuple, elements: tuple | None, origin: tuple, source: tuple | None = None):
        self.shape, self._elements, self.origin, self.source = tuple(shape), elements, origin, source
        if elements is not None:
            _check_size(self)

    @classmethod
    def view(cls, tensor: torch.Tensor, index: tuple) -> Vector:
        """`tensor[index]`, `index` a traced value or literal for each of the first dimensions."""
        n, dims = len(index), tensor.dim()
        what = (f"indexes a captured tensor of {dims} dimensions with {n} indices ({dims - n} missing)" if n else
                f"uses a captured tensor of shape {tuple(tensor.shape)} whole")
        return cls(tensor.shape[n:], None, (what, _context.location()), (tensor, index))

    @property
    def elements(self) -> tuple:
        """The scalar Proxies, in row-major order."""
        if self._elements is None:
            _check_size(self)
            tensor, index = self.source
            _guard_shape(tensor)
            self._elements = tuple(P.Proxy(P.load(tensor, index + i)) for i in numpy.ndindex(*self.shape))
        return self._elements

    # -- what torch asks of a tensor ----------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self) -> torch.dtype:
        if self.numel():
            return self.elements[0].dtype
        return self.source[0].dtype if self.source else torch.float32  # an empty vector's values are none

    device = P.Proxy.device

    def dim(self) -> int:
        return self.ndim

    def size(self, dim: int | None = None):
        return torch.Size(self.shape) if dim is None else self.shape[dim]

    def numel(self) -> int:
        return int(numpy.prod(self.shape, dtype=numpy.int64))

    def __repr__(self):
        return f"Vector{self.shape}"

    # -- static structure: indexing, iteration ------------------------------------------------
    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        if self.source is not None:
            _guard_shape(self.source[0])
        return self.shape[0]

    def __iter__(self):
        if len(self) > UNROLL_LIMIT:
            _refuse_size(self, f"iterates over its {len(self)} rows", len(self))
        return (self[i] for i in range(len(self)))

    def __getitem__(self, index):
        index = index if isinstance(index, tuple) else (index,)
        if self.source is not None:  # stays a load: bias[b][h][q_idx]
            tensor, given = self.source
            return P.index_tensor(tensor, given + index)
        literal = tuple(_literal(i) for i in index)
        if len(literal) > self.ndim:
            _context.fail(f"indexes a vector of shape {self.shape} with {len(literal)} indices",
                          "give at most one index per dimension")
        for i, n in zip(literal, self.shape):
            if not -n <= i < n:
                _context.fail(f"indexes a vector's dimension of size {n} with {i}", f"index it from {-n} to {n - 1}")
        chosen = _positions(self.shape)[literal]
        if chosen.ndim == 0:
            return self.elements[int(chosen)]
        return Vector(chosen.shape, tuple(self.elements[int(i)] for i in chosen.ravel()), self.origin)

    # -- Python asks a truth value or a number of it -------------------------------------------
    def _only(self, conversion: str):
        if self.numel() != 1:
            _context.fail(f"asks the {conversion} of a vector of shape {self.shape} (torch refuses it for more than "
                          f"one element)", "reduce it first, with .any(), .all(), .sum() or an index")
        return self.elements[0]

    def __bool__(self):
        return bool(self._only("truth value"))

    def __index__(self):
        return operator.index(self._only("int()"))

    __int__ = __index__

    def __float__(self):
        return float(self._only("float()"))

    # -- torch ----------------------------------------------------------------------------------
    def __getattr__(self, name):
        if name.startswith("_") or not hasattr(torch.Tensor, name):
            raise AttributeError(f"'Vector' object has no attribute {name!r}")
        func = getattr(T, name)
        if not callable(func):
            _context.fail(f"reads Tensor.{name} of a vector, which maskc cannot unroll", UNROLL_FIX)
        return functools.partial(call, func, self)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return call(func, *args, **(kwargs or {}))

    __hash__ = object.__hash__


def _elementwise(op, reflected: bool = False):
    """A Vector operator: `op` of each element (a scalar Proxy operator) with its broadcast partner."""
    if reflected:
        return lambda self, other: broadcast(lambda a, b: op(b, a), self, other)
    return lambda self, other: broadcast(op, self, other)


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift"):
    _op = getattr(operator, f"{_name}_" if _name in ("and", "or") else _name)
    setattr(Vector, f"__{_name}__", _elementwise(_op))
    setattr(Vector, f"__r{_name}__", _elementwise(_op, reflected=True))
for _name in ("lt", "le", "gt", "ge", "eq", "ne"):
    setattr(Vector, f"__{_name}__", _elementwise(getattr(operator, _name)))
for _name in ("neg", "pos", "abs", "invert"):
    setattr(Vector, f"__{_name}__", lambda self, _op=getattr(operator, _name): broadcast(_op, self))


def _shape(tensor: torch.Tensor) -> tuple:
    return tuple(tensor.shape)  # a tuple, which a guard compares by value (a torch.Size it would not)


def _guard_shape(tensor: torch.Tensor) -> None:
    """The trace unrolls over `tensor`'s shape: have it traced again if the tensor is resized in
    place (a guard of the trace; a new tensor fails the guard on its identity already)."""
    state = _context.current()
    if state is not None and not any(fetch is _shape and source is tensor for fetch, source, _ in state.guards):
        state.guards.append((_shape, tensor, _shape(tensor)))


def _check_size(vector: Vector) -> None:
    if vector.numel() > UNROLL_LIMIT:
        _refuse_size(vector, f"leaves a vector of {vector.numel()} elements (shape {vector.shape})", vector.numel())


def _refuse_size(vector: Vector, what: str, got: int) -> None:
    _context.fail(f"{vector.origin[0]}, and {what}: maskc unrolls a vector's operations (elementwise, reductions, "
                  f"torch.dot, iteration) into one scalar each, for at most {UNROLL_LIMIT} elements, not {got}",
                  "give one index per dimension, like bias[b, h, q_idx], or compute the reduction outside the mod "
                  "and capture its result, like dist = torch.cdist(means, means) and dist[q_idx, kv_idx]")


def refuse_as_value(vector: Vector):
    """A vector where one value is needed (the mod's result, an operand of a scalar operation)."""
    what, at = vector.origin
    _context.fail(f"{what}, which leaves a vector of shape {vector.shape} where one value is needed: maskc traces "
                  f"mods that compute one value per (b, h, q_idx, kv_idx)",
                  "give one index per dimension, like bias[b][h][q_idx] or bias[b, h, q_idx], or reduce the vector "
                  "to one value (.sum(-1), .any(-1), torch.dot(a, b), an index)", at=at)


def _literal(i) -> int:
    """An index of a computed vector: a Python int, or a traced value that is a constant."""
    if isinstance(i, int) and not isinstance(i, bool):
        return i
    if isinstance(i, P.Proxy) and i.expr.is_Integer:
        return int(i.expr)
    _context.fail(f"indexes a computed vector with {i!r}",
                  "index it with Python ints, or index the captured tensor itself with the traced value "
                  "(table[b, q_idx] rather than (table[b] + 1)[q_idx])")


def _positions(shape: tuple) -> numpy.ndarray:
    return numpy.arange(int(numpy.prod(shape, dtype=numpy.int64))).reshape(shape)


# -- elementwise ---------------------------------------------------------------------------------
def _operand(value):
    """`value` as a vector operand: a captured tensor of one dimension or more is read whole."""
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        return Vector.view(value, ())
    return value


def broadcast(fn, *args, **kwargs) -> Vector:
    """`fn` of the elements of the Vector arguments, broadcast together as torch does, with the
    other arguments as they are; each result a scalar Proxy."""
    args = tuple(_operand(a) for a in args)
    kwargs = {k: _operand(v) for k, v in kwargs.items()}
    vectors = [v for v in (*args, *kwargs.values()) if isinstance(v, Vector)]
    try:
        shape = numpy.broadcast_shapes(*(v.shape for v in vectors))
    except ValueError:
        _context.fail(f"combines vectors of shapes {', '.join(str(v.shape) for v in vectors)}, which do not "
                      f"broadcast (torch refuses them too)", "give them equal sizes, or size 1 where one repeats")
    size = int(numpy.prod(shape, dtype=numpy.int64))
    if size > UNROLL_LIMIT:
        _refuse_size(vectors[0], f"broadcasts to shape {shape}", size)
    where = {id(v): numpy.broadcast_to(_positions(v.shape), shape).ravel() for v in vectors}

    def pick(value, j):
        return value.elements[where[id(value)][j]] if isinstance(value, Vector) else value

    results = []
    for j in range(size):
        result = fn(*(pick(a, j) for a in args), **{k: pick(v, j) for k, v in kwargs.items()})
        if not isinstance(result, P.Proxy):
            result = P.wrap(result)
        results.append(result)
    return Vector(shape, tuple(results), vectors[0].origin)


# -- torch functions of vectors ----------------------------------------------------------------
UNROLL_FIX = ("use elementwise operations, .sum/.prod/.any/.all/.amax/.amin over a dimension, torch.dot, unsqueeze, "
              "iteration or Python int indices, or compute the value outside the mod and capture it")
_VECTOR_HANDLERS: dict = {}
# what reads only a vector's dtype, called with the vector itself (x.new_zeros(()) is a scalar)
_WHOLE = frozenset({T.new_ones, T.new_zeros, T.new_full, T.new_tensor, T.item})


def _register(handler, *funcs):
    for func in funcs:
        _VECTOR_HANDLERS[func] = handler


def call(func, *args, **kwargs):
    """`func(*args, **kwargs)` where an argument is a Vector: a handler of this module's table,
    or else the scalar function, elementwise."""
    handler = _VECTOR_HANDLERS.get(func)
    if handler is not None:
        try:
            return handler(*args, **kwargs)
        except MaskTraceError:
            raise
        except TypeError as error:
            _context.fail(f"calls {P.describe(func)} on a vector with arguments maskc cannot unroll ({error})",
                          "pass the arguments torch documents")
    if func in _WHOLE:
        return P._HANDLERS[func](*args, **kwargs)
    if func not in P._HANDLERS:
        _context.fail(f"calls {P.describe(func)} on a vector, which maskc cannot unroll", UNROLL_FIX)
    return broadcast(functools.partial(P.call, func), *args, **kwargs)


def _reduce(combine, empty=None, to=None):
    """A reduction over `dim` (an int, a tuple, or None for all), as torch's keepdim gives it."""

    def reduction(x, dim=None, keepdim=False, *, dtype=None):
        x = _as_vector(x, "reduces a traced value")
        dims = _dims(x, dim)
        kept = [d for d in range(x.ndim) if d not in dims]
        groups = _positions(x.shape).transpose(*kept, *dims).reshape(-1, _count(x.shape, dims))
        out = []
        for group in groups:
            items = [x.elements[int(i)] for i in group]
            if to is not None:
                items = [to(e) for e in items]
            if not items:
                if empty is None:
                    _context.fail("reduces an empty vector with a maximum or minimum (torch refuses it too)",
                                  "reduce a dimension of size 1 or more")
                out.append(P.wrap(empty))
            else:
                out.append(functools.reduce(combine, items))
        if dtype is not None:
            out = [P.call(T.to, e, dtype) for e in out]
        shape = tuple(1 if d in dims else n for d, n in enumerate(x.shape)) if keepdim else tuple(
            x.shape[d] for d in kept)
        return Vector(shape, tuple(out), x.origin) if shape else out[0]

    return reduction


def _count(shape, dims) -> int:
    return int(numpy.prod([shape[d] for d in dims], dtype=numpy.int64))


def _dims(x: Vector, dim) -> tuple:
    """The dimensions a reduction names (an int, a tuple or None for all), each from 0."""
    if dim is None:
        return tuple(range(x.ndim))
    n = max(x.ndim, 1)  # torch lets a 0-d tensor reduce over dimension 0 or -1
    dims = tuple(dim) if isinstance(dim, (tuple, list)) else (dim,)
    for d in dims:
        if not -n <= d < n:
            _context.fail(f"reduces over dimension {d} of a vector of shape {x.shape}",
                          f"name a dimension from {-n} to {n - 1}")
    return tuple(sorted({d % n for d in dims} & set(range(x.ndim))))


def _as_vector(x, what: str) -> Vector:
    """`x`, a Vector or a scalar (a 0-d one, which `what` made)."""
    return x if isinstance(x, Vector) else Vector((), (P.wrap(x),), (what, _context.location()))


def _number(e):
    return P.Proxy(P.number(P.wrap(e)))  # torch sums and multiplies booleans as 0/1


def _truth(e):
    return P.Proxy(P.boolean(P.wrap(e)))


# a scalar reduces to itself, as a 0-d tensor does in torch
for _handler, _funcs in ((_reduce(operator.add, 0, _number), (torch.sum, T.sum)),
                         (_reduce(operator.mul, 1, _number), (torch.prod, T.prod)),
                         (_reduce(operator.or_, False, _truth), (torch.any, T.any)),
                         (_reduce(operator.and_, True, _truth), (torch.all, T.all)),
                         (_reduce(torch.maximum), (torch.amax, T.amax)),
                         (_reduce(torch.minimum), (torch.amin, T.amin))):
    _register(_handler, *_funcs)
    P.register(_handler, *_funcs)


def _extreme(name: str, elementwise, reduction):
    # torch.max(a, b) is elementwise; torch.max(a) reduces; torch.max(a, dim) also gives indices
    def extreme(a, b=None, *rest, **kwargs):
        if isinstance(b, (Vector, P.Proxy, torch.Tensor)) and not rest and not kwargs:
            return call(elementwise, a, b)
        if b is None and not rest and not kwargs:
            return call(reduction, a)
        _context.fail(f"reduces a vector with torch.{name} over a dimension, which also gives indices",
                      f"use .a{name}(dim) for the values")

    return extreme


_register(_extreme("max", torch.maximum, torch.amax), torch.max, T.max)
_register(_extreme("min", torch.minimum, torch.amin), torch.min, T.min)


def _dot(a, b):
    """torch.dot, and `a @ b` of two vectors of one dimension: the sum of their products."""
    a, b = _operand(a), _operand(b)
    if not (isinstance(a, Vector) and isinstance(b, Vector) and a.ndim == b.ndim == 1 and a.shape == b.shape):
        _context.fail(f"takes the dot product (torch.dot, @) of shapes {getattr(a, 'shape', ())} and "
                      f"{getattr(b, 'shape', ())}", "give two vectors of one dimension and equal length; other "
                      "matrix products are not one value per (b, h, q_idx, kv_idx)")
    return _reduce(operator.add, 0, _number)(a * b)


_register(_dot, torch.dot, T.dot, torch.matmul, T.matmul, T.__matmul__)
_register(lambda a, b: _dot(b, a), T.__rmatmul__)
Vector.__matmul__ = _dot
Vector.__rmatmul__ = lambda self, other: _dot(other, self)


def _unsqueeze(x, dim):
    x = _as_vector(x, "unsqueezes a traced value")
    if not -x.ndim - 1 <= dim <= x.ndim:
        _context.fail(f"unsqueezes dimension {dim} of a vector of shape {x.shape}",
                      f"name a dimension from {-x.ndim - 1} to {x.ndim}")
    dim %= x.ndim + 1
    return Vector(x.shape[:dim] + (1,) + x.shape[dim:], x.elements, x.origin)


# a scalar's unsqueeze is a vector too: `kv_tile.unsqueeze(-1)` broadcasts against a row
_register(_unsqueeze, torch.unsqueeze, T.unsqueeze)
P.register(_unsqueeze, torch.unsqueeze, T.unsqueeze)


def _gather(tensor, index):
    # `table[row]`: a captured tensor indexed by a vector, one load per element
    index = index if isinstance(index, tuple) else (index,)
    return broadcast(lambda *i: P.index_tensor(tensor, i), *index)


_register(_gather, T.__getitem__)


Vector.call = staticmethod(call)
Vector.refuse_as_value = refuse_as_value
P.Rows.kind = Vector
