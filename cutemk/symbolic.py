"""Symbolic integer shapes.

A :class:`Sym` is a named dimension with a declared maximum (``sym("T", max=4096)``). Expressions
built from syms and ints with ``+ - * //``, :func:`cdiv`, :func:`smin` and :func:`smax` are
immutable trees, hashable and comparable structurally, and evaluate to a plain ``int`` once a
launch binds every sym (:meth:`Expr.eval`). :meth:`Expr.upper` gives a sound upper bound over
every legal binding by interval arithmetic, used to size buffers and queues for the maximum.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Mapping, Union

from .errors import ShapeError

IntLike = Union[int, "Expr"]
Bindings = Mapping[str, int]


class Expr:
    """An integer expression over symbolic dims."""

    def eval(self, env: Bindings) -> int:
        raise NotImplementedError

    def bounds(self) -> tuple[int, int]:
        """Inclusive (lo, hi) over every binding with each sym in [sym.min, sym.max]."""
        raise NotImplementedError

    def syms(self) -> frozenset["Sym"]:
        raise NotImplementedError

    def upper(self) -> int:
        return self.bounds()[1]

    # arithmetic -------------------------------------------------------------------------
    def __add__(self, o: IntLike) -> "Expr":
        return _bin("+", self, o)

    def __radd__(self, o: IntLike) -> "Expr":
        return _bin("+", o, self)

    def __sub__(self, o: IntLike) -> "Expr":
        return _bin("-", self, o)

    def __rsub__(self, o: IntLike) -> "Expr":
        return _bin("-", o, self)

    def __mul__(self, o: IntLike) -> "Expr":
        return _bin("*", self, o)

    def __rmul__(self, o: IntLike) -> "Expr":
        return _bin("*", o, self)

    def __floordiv__(self, o: IntLike) -> "Expr":
        return _bin("//", self, o)

    def __rfloordiv__(self, o: IntLike) -> "Expr":
        return _bin("//", o, self)

    def __index__(self) -> int:  # pragma: no cover - guard against silent int() use
        raise TypeError(f"symbolic expression {self} has no value until a launch binds it")


@dataclass(frozen=True, eq=True)
class Const(Expr):
    value: int

    def eval(self, env: Bindings) -> int:
        return self.value

    def bounds(self) -> tuple[int, int]:
        return (self.value, self.value)

    def syms(self) -> frozenset["Sym"]:
        return frozenset()

    def __str__(self) -> str:
        return str(self.value)


@dataclass(frozen=True, eq=True)
class Sym(Expr):
    """A named symbolic dimension, legal in [min, max]."""

    name: str
    max: int
    min: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"sym name must be a str, got {self.name!r}")
        if not self.name.isidentifier():
            raise ValueError(f"sym name must be an identifier, got {self.name!r}")
        for f in ("max", "min"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"sym {self.name}: {f} must be an int, got {v!r}")
        if not (0 <= self.min <= self.max):
            raise ValueError(
                f"sym {self.name}: need 0 <= min <= max, got min={self.min} max={self.max}"
            )

    def eval(self, env: Bindings) -> int:
        try:
            v = env[self.name]
        except KeyError:
            raise ShapeError(f"symbolic dim {self.name} is not bound") from None
        if isinstance(v, int) and not isinstance(v, bool):
            return v
        try:  # numpy ints too; never a float or a string, which int() would truncate or parse
            if isinstance(v, bool):
                raise TypeError
            return operator.index(v)
        except TypeError:
            raise ShapeError(f"symbolic dim {self.name} is bound to {v!r}, not an int") from None

    def check(self, value: int, what: str = "") -> int:
        """Validate a value for this sym, naming ``what`` (the argument) in the error."""
        where = f" (from {what})" if what else ""
        if not isinstance(value, int) or isinstance(value, bool):
            raise ShapeError(f"{self.name}{where} must be an int, got {type(value).__name__}")
        if value > self.max:
            raise ShapeError(f"{self.name}={value}{where} exceeds its declared max {self.max}")
        if value < self.min:
            raise ShapeError(f"{self.name}={value}{where} is below its declared min {self.min}")
        return value

    def bounds(self) -> tuple[int, int]:
        return (self.min, self.max)

    def syms(self) -> frozenset["Sym"]:
        return frozenset({self})

    def __str__(self) -> str:
        return self.name


_OPS = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "//": lambda a, b: a // b,
    "cdiv": lambda a, b: -(-a // b),
    "min": min,
    "max": max,
}


@dataclass(frozen=True, eq=True)
class BinOp(Expr):
    op: str
    a: Expr
    b: Expr

    def eval(self, env: Bindings) -> int:
        a, b = self.a.eval(env), self.b.eval(env)
        if self.op in ("//", "cdiv") and b == 0:
            raise ZeroDivisionError(f"division by zero evaluating {self}")
        return _OPS[self.op](a, b)

    def bounds(self) -> tuple[int, int]:
        (alo, ahi), (blo, bhi) = self.a.bounds(), self.b.bounds()
        if self.op == "+":
            return (alo + blo, ahi + bhi)
        if self.op == "-":
            return (alo - bhi, ahi - blo)
        if self.op in ("min", "max"):
            f = _OPS[self.op]
            return (f(alo, blo), f(ahi, bhi))
        if self.op in ("//", "cdiv") and blo <= 0 <= bhi:
            raise ShapeError(f"divisor of {self} may be zero")
        f = _OPS[self.op]
        corners = [f(x, y) for x in (alo, ahi) for y in (blo, bhi)]
        return (min(corners), max(corners))

    def syms(self) -> frozenset[Sym]:
        return self.a.syms() | self.b.syms()

    def __str__(self) -> str:
        if self.op in ("cdiv", "min", "max"):
            return f"{self.op}({self.a}, {self.b})"
        return f"({self.a} {self.op} {self.b})"


def const(v: IntLike) -> Expr:
    if isinstance(v, Expr):
        return v
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"expected int or symbolic expression, got {type(v).__name__}")
    return Const(v)


def _bin(op: str, a: IntLike, b: IntLike) -> Expr:
    a, b = const(a), const(b)
    if op in ("//", "cdiv") and isinstance(b, Const) and b.value == 0:
        raise ZeroDivisionError(f"{op} of {a} by 0")
    if isinstance(a, Const) and isinstance(b, Const):
        return Const(BinOp(op, a, b).eval({}))
    # light simplification keeps printed plans readable
    if op in ("+", "-") and isinstance(b, Const) and b.value == 0:
        return a
    if op == "+" and isinstance(a, Const) and a.value == 0:
        return b
    if op in ("*", "//", "cdiv") and isinstance(b, Const) and b.value == 1:
        return a
    if op == "*" and isinstance(a, Const) and a.value == 1:
        return b
    return BinOp(op, a, b)


def sym(name: str, max: int, min: int = 1) -> Sym:
    """Declare a symbolic dimension legal in ``[min, max]``."""
    return Sym(name, max=max, min=min)


def cdiv(a: IntLike, b: IntLike) -> IntLike:
    """Ceiling division, symbolic when either side is."""
    if isinstance(a, int) and isinstance(b, int):
        if b == 0:
            raise ZeroDivisionError(f"cdiv of {a} by 0")
        return -(-a // b)
    return _bin("cdiv", a, b)


def smin(a: IntLike, b: IntLike) -> IntLike:
    if isinstance(a, int) and isinstance(b, int):
        return min(a, b)
    return _bin("min", a, b)


def smax(a: IntLike, b: IntLike) -> IntLike:
    if isinstance(a, int) and isinstance(b, int):
        return max(a, b)
    return _bin("max", a, b)


def evaluate(v: IntLike, env: Bindings) -> int:
    """Value of an int or expression under ``env``."""
    return v if isinstance(v, int) else v.eval(env)


def upper(v: IntLike) -> int:
    """Largest value of ``v`` over every legal binding."""
    return v if isinstance(v, int) else v.upper()


def free_syms(*vs: IntLike) -> frozenset[Sym]:
    out: frozenset[Sym] = frozenset()
    for v in vs:
        if isinstance(v, Expr):
            out |= v.syms()
    return out


def shape_str(shape: tuple[IntLike, ...]) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ")"
