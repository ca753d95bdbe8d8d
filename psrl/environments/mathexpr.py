"""A small, safe parser for answer expressions (LaTeX-ish arithmetic with variables).

Model output is untrusted, so nothing here calls ``eval`` or a computer-algebra parser that
does: expressions are parsed by hand into a tree and evaluated with ``cmath``. Two expressions
are equivalent when they agree at several random points (``x``, ``y``, ... drawn from a fixed
seed), which is enough for the "simple symbolic equivalence" of final answers
(``2x+1`` vs ``1+2*x``, ``\\frac{1}{2}`` vs ``0.5``).
"""

from __future__ import annotations

import cmath
import random
import re
from collections.abc import Callable

MAX_LEN = 400
_TOKEN = re.compile(r"\s*(\d+\.\d*|\.\d+|\d+|\\[A-Za-z]+|[A-Za-z]|\*\*|[-+*/^(){}\[\]!])")
_CONSTS = {"\\pi": cmath.pi, "\\e": cmath.e}
_FUNCS: dict[str, Callable[[complex], complex]] = {
    "\\sin": cmath.sin, "\\cos": cmath.cos, "\\tan": cmath.tan, "\\ln": cmath.log, "\\log": cmath.log,
    "\\exp": cmath.exp, "\\arcsin": cmath.asin, "\\arccos": cmath.acos, "\\arctan": cmath.atan,
}
_MUL_WORDS = {"\\cdot", "\\times"}

Node = tuple


class ParseError(ValueError):
    pass


def _tokenize(text: str) -> list[str]:
    text = text.strip()
    if len(text) > MAX_LEN:
        raise ParseError(f"expression longer than {MAX_LEN} characters")
    out, pos = [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            if text[pos:].strip() == "":
                break
            raise ParseError(f"unexpected {text[pos:pos + 10]!r}")
        out.append(m.group(1))
        pos = m.end()
    return out


class _Parser:
    def __init__(self, tokens: list[str]) -> None:
        self.t, self.i = tokens, 0

    def peek(self) -> str | None:
        return self.t[self.i] if self.i < len(self.t) else None

    def take(self, want: str | None = None) -> str:
        tok = self.peek()
        if tok is None or (want is not None and tok != want):
            raise ParseError(f"expected {want or 'more input'}, got {tok!r}")
        self.i += 1
        return tok

    def parse(self) -> Node:
        node = self.expr()
        if self.peek() is not None:
            raise ParseError(f"unexpected {self.peek()!r}")
        return node

    def expr(self) -> Node:
        node = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()
            node = (op, node, self.term())
        return node

    def _starts_atom(self, tok: str | None) -> bool:
        return tok is not None and (tok[0].isdigit() or tok[0] == "." or tok.isalpha() or tok in ("(", "{")
                                    or tok in _CONSTS or tok in _FUNCS or tok in ("\\frac", "\\sqrt"))

    def term(self) -> Node:
        node = self.unary()
        while True:
            tok = self.peek()
            if tok in ("*", "/") or tok in _MUL_WORDS:
                self.take()
                node = ("/" if tok == "/" else "*", node, self.unary())
            elif self._starts_atom(tok):  # implicit multiplication: 2x, 3\pi, (a)(b)
                node = ("*", node, self.power())
            else:
                return node

    def unary(self) -> Node:
        if self.peek() in ("-", "+"):
            op = self.take()
            inner = self.unary()
            return ("neg", inner) if op == "-" else inner
        return self.power()

    def power(self) -> Node:
        base = self.postfix()
        if self.peek() in ("^", "**"):
            self.take()
            return ("^", base, self.unary())
        return base

    def postfix(self) -> Node:
        node = self.atom()
        while self.peek() == "!":
            self.take()
            node = ("!", node)
        return node

    def group(self) -> Node:
        if self.peek() == "{":
            self.take("{")
            node = self.expr()
            self.take("}")
            return node
        tok = self.peek()
        if tok is not None and tok.isdigit() and len(tok) > 1:  # \frac34: one digit per argument
            self.t[self.i] = tok[1:]
            return ("num", complex(int(tok[0])))
        return self.atom()

    def atom(self) -> Node:
        tok = self.take()
        if tok[0].isdigit() or tok[0] == ".":
            return ("num", complex(float(tok)))
        if tok in ("(", "{"):
            node = self.expr()
            self.take(")" if tok == "(" else "}")
            return node
        if tok == "\\frac":
            return ("/", self.group(), self.group())
        if tok == "\\sqrt":
            if self.peek() == "[":
                self.take("[")
                degree = self.expr()
                self.take("]")
                return ("^", self.group(), ("/", ("num", 1 + 0j), degree))
            return ("^", self.group(), ("num", 0.5 + 0j))
        if tok in _CONSTS:
            return ("num", complex(_CONSTS[tok]))
        if tok in _FUNCS:
            return ("fn", tok, self.power() if self.peek() != "(" else self.atom())
        if tok.isalpha() and len(tok) == 1:
            return ("var", tok)
        raise ParseError(f"unsupported token {tok!r}")


def parse(text: str) -> Node:
    return _Parser(_tokenize(text)).parse()


def variables(node: Node) -> set[str]:
    if node[0] == "var":
        return {node[1]}
    out: set[str] = set()
    for child in node[1:]:
        if isinstance(child, tuple):
            out |= variables(child)
    return out


def evaluate(node: Node, env: dict[str, complex]) -> complex:
    kind = node[0]
    if kind == "num":
        return node[1]
    if kind == "var":
        return env[node[1]]
    if kind == "neg":
        return -evaluate(node[1], env)
    if kind == "fn":
        return _FUNCS[node[1]](evaluate(node[2], env))
    if kind == "!":
        n = evaluate(node[1], env)
        if n.imag or n.real != int(n.real) or not 0 <= n.real <= 170:
            raise ParseError("factorial of a non-integer")
        out = 1
        for k in range(2, int(n.real) + 1):
            out *= k
        return complex(out)
    a, b = evaluate(node[1], env), evaluate(node[2], env)
    if kind == "+":
        return a + b
    if kind == "-":
        return a - b
    if kind == "*":
        return a * b
    if kind == "/":
        return a / b
    if kind == "^":
        if abs(b) > 1000 or abs(a) > 1e100:
            raise ParseError("exponent out of range")
        if b.imag == 0 and b.real == int(b.real) and a.imag == 0:
            return complex(a.real ** int(b.real))  # exact for integer powers of reals
        return a**b
    raise ParseError(f"unknown node {kind!r}")


def equivalent(a: str, b: str, *, rel_tol: float = 1e-6, points: int = 5, seed: int = 0) -> bool:
    """Whether two expressions agree everywhere we look; False when either cannot be parsed."""
    try:
        ta, tb = parse(a), parse(b)
    except (ParseError, ValueError, OverflowError):
        return False
    names = sorted(variables(ta) | variables(tb))
    rng = random.Random(seed)
    trials = [dict.fromkeys(names, 0j)] if not names else [
        {n: complex(rng.uniform(0.5, 3.0), 0) for n in names} for _ in range(points)
    ]
    agreed = 0
    for env in trials:
        try:
            va, vb = evaluate(ta, env), evaluate(tb, env)
        except (ZeroDivisionError, OverflowError, ValueError):
            continue
        if not (cmath.isfinite(va) and cmath.isfinite(vb)):
            continue
        if abs(va - vb) > rel_tol * max(1.0, abs(va), abs(vb)):
            return False
        agreed += 1
    return agreed > 0
