"""Pruning patterns: what a pruned weight must look like, by name or as a config object.

A pattern is written as a string or built as a frozen dataclass; both are the same thing:
``str(pattern)`` writes the canonical string and :func:`parse_pattern` reads it back
(``parse_pattern(str(p)) == p``). Every pattern describes a weight in the canonical
orientation ``[N, K]`` = ``[out features, in features]`` (an ``nn.Linear`` weight); groups
always run along K, the dimension a matmul reduces over.

- ``n:m`` (:class:`NMPattern`): the n largest of every m consecutive weights along K. A K
  that is not a multiple of m is zero-padded, so the last group keeps at most n real ones.
- ``n:m/vw<v>`` (:class:`VectorNMPattern`): vector-wise N:M; v consecutive rows share one
  choice of n positions per group (a last partial vector of N mod v rows is its own unit).
- ``n:m/bw<b>`` (:class:`BlockNMPattern`): block-wise N:M; the n largest of every m
  consecutive b x b blocks along K (N and K must be multiples of b).
- ``block<h>x<w>@<density>`` (:class:`BlockPattern`): that fraction of h x w blocks
  (``block<h>`` means ``block<h>x<h>``; N and K must be multiples of h and w).
- ``unstructured@<density>`` (:class:`UnstructuredPattern`): that fraction of single weights.

``density`` is the fraction KEPT, in (0, 1]: 90% sparsity is ``unstructured@0.1``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from ..errors import PatternError
from ..ir.formats import FormatSpec

_SYNTAX_HELP = ("write 'n:m' (e.g. '2:4', '3:32'), 'n:m/vw<v>' (e.g. '2:4/vw4'), 'n:m/bw<b>' "
                "(e.g. '2:4/bw32'), 'block<h>x<w>@<density>' (e.g. 'block32x32@0.25') or "
                "'unstructured@<density>' (e.g. 'unstructured@0.1'); density is the fraction "
                "of weights kept, in (0, 1]")


class Pattern:
    """Base of the pattern config classes.

    Subclasses are frozen dataclasses that validate themselves on construction and define
    ``SYNTAX`` (a regular expression over the lower-cased string), ``_from_match`` and
    ``__str__``. Each has a ``density``: the fraction of weights (or units) it keeps.
    """

    SYNTAX: ClassVar[re.Pattern]
    #: whether ``scope="global"`` (one threshold across layers) means anything for it
    SUPPORTS_GLOBAL_SCOPE: ClassVar[bool] = False

    @classmethod
    def parse(cls, text: "str | Pattern") -> "Pattern":
        """Read a pattern string (or pass a pattern object through), as this class."""
        pattern = parse_pattern(text)
        if not isinstance(pattern, cls):
            raise PatternError(f"{str(pattern)!r} is a {type(pattern).__name__}, "
                               f"not a {cls.__name__}")
        return pattern

    @classmethod
    def _from_match(cls, match: re.Match) -> "Pattern":
        raise NotImplementedError

    def check_shape(self, shape: tuple[int, int]) -> None:
        """Raise PatternError if a weight of ``shape`` ([N, K]) cannot take the pattern."""

    def formats(self) -> tuple[FormatSpec, ...]:
        """The exact weight formats (:mod:`sparsecc.ir.formats`) every pruned weight fits."""
        return (FormatSpec("csr"),)


def _check_nm(n: int, m: int) -> None:
    _check_positive_int("m", m)
    _check_positive_int("n", n, minimum=0)
    if n < 1:
        raise PatternError(f"n:m needs n >= 1, got {n}:{m}: keep at least one weight per "
                           f"group, e.g. '1:{max(m, 2)}'")
    if n >= m:
        raise PatternError(f"n:m needs n < m, got {n}:{m}: keeping {n} of every {m} is no "
                           f"pruning at all; write e.g. '{max(1, m // 2)}:{max(m, 2)}', or leave "
                           "the layer out with exclude=")


def _check_positive_int(what: str, value, *, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise PatternError(f"{what} must be an integer >= {minimum}, got {value!r}")


def _check_density(density) -> None:
    if (not isinstance(density, (int, float)) or isinstance(density, bool)
            or not 0.0 < density <= 1.0):
        hint = ""
        if isinstance(density, (int, float)) and 1.0 < density <= 100.0:
            hint = (f"; density is the fraction KEPT: for {density:g}% kept write "
                    f"@{density / 100:g}, for {density:g}% sparsity write @{1 - density / 100:g}")
        elif isinstance(density, (int, float)) and density <= 0.0:
            hint = "; a density of 0 or less keeps nothing: write e.g. @0.1 to keep 10%"
        raise PatternError(f"density must be in (0, 1], got {density!r}{hint}")


def _multiple_check(shape: tuple[int, int], block: tuple[int, int], pattern: "Pattern") -> None:
    rows, cols = shape
    h, w = block
    if rows % h or cols % w:
        raise PatternError(f"{pattern} needs the weight's rows to be a multiple of {h} and its "
                           f"input columns a multiple of {w}; a {rows}x{cols} weight is not: "
                           "choose a block that divides it, or exclude= the layer")


@dataclass(frozen=True)
class _GroupPattern(Pattern):
    """What the three N:M patterns share: n kept of every m units along K."""

    n: int
    m: int

    def __post_init__(self):
        _check_nm(self.n, self.m)

    @classmethod
    def _from_match(cls, match):
        return cls(*(int(group) for group in match.groups()))

    @property
    def density(self) -> float:
        return self.n / self.m


@dataclass(frozen=True)
class NMPattern(_GroupPattern):
    """``n:m``: in every group of m consecutive weights along K, keep the n largest.

    A K that is not a multiple of m is zero-padded (as :func:`sparsecc.formats.group_along_k`
    does), so the last, shorter group keeps min(n, its length) weights.
    """

    SYNTAX: ClassVar[re.Pattern] = re.compile(r"^(\d+):(\d+)$")

    def __str__(self):
        return f"{self.n}:{self.m}"

    def formats(self):
        return (FormatSpec("nm", n=self.n, m=self.m),)


@dataclass(frozen=True)
class VectorNMPattern(_GroupPattern):
    """``n:m/vw<v>``: vector-wise N:M (nmSPARSE): v consecutive rows share one n:m choice.

    Each column position of a group is scored by its summed score over the v rows. When N
    is not a multiple of v, the last N mod v rows form a shorter vector of their own.
    """

    v: int

    SYNTAX: ClassVar[re.Pattern] = re.compile(r"^(\d+):(\d+)/vw(\d+)$")

    def __post_init__(self):
        super().__post_init__()
        _check_positive_int("the vector length v", self.v)

    def __str__(self):
        return f"{self.n}:{self.m}/vw{self.v}"

    def formats(self):
        return (FormatSpec("nm", n=self.n, m=self.m),)


@dataclass(frozen=True)
class BlockNMPattern(_GroupPattern):
    """``n:m/bw<b>``: block-wise N:M (nmSPARSE) over b x b blocks.

    Within each strip of b rows, every m consecutive blocks along K keep the n blocks of
    largest L1 norm (summed score). N and K must be multiples of b (:meth:`check_shape`);
    a number of block columns K/b that is not a multiple of m is padded like ``n:m``.
    The pruned weight fits both ``(n*b):(m*b)`` and ``bsr<b>x<b>``.
    """

    b: int

    SYNTAX: ClassVar[re.Pattern] = re.compile(r"^(\d+):(\d+)/bw(\d+)$")

    def __post_init__(self):
        super().__post_init__()
        _check_positive_int("the block size b", self.b)

    def __str__(self):
        return f"{self.n}:{self.m}/bw{self.b}"

    def check_shape(self, shape):
        _multiple_check(shape, (self.b, self.b), self)

    def formats(self):
        return (FormatSpec("nm", n=self.n * self.b, m=self.m * self.b),
                FormatSpec("bsr", block=(self.b, self.b)))


@dataclass(frozen=True)
class BlockPattern(Pattern):
    """``block<h>x<w>@<density>``: keep that fraction of h x w blocks, largest L1 norm first."""

    h: int
    w: int
    density: float

    SYNTAX: ClassVar[re.Pattern] = re.compile(r"^block(\d+)(?:x(\d+))?@(.+)$")
    SUPPORTS_GLOBAL_SCOPE: ClassVar[bool] = True

    def __post_init__(self):
        _check_positive_int("the block height h", self.h)
        _check_positive_int("the block width w", self.w)
        _check_density(self.density)
        object.__setattr__(self, "density", float(self.density))

    @classmethod
    def _from_match(cls, match):
        h = int(match.group(1))
        w = int(match.group(2)) if match.group(2) else h
        return cls(h, w, _parse_density(match.group(3)))

    def __str__(self):
        return f"block{self.h}x{self.w}@{self.density!r}"

    def check_shape(self, shape):
        _multiple_check(shape, (self.h, self.w), self)

    def formats(self):
        return (FormatSpec("bsr", block=(self.h, self.w)),)


@dataclass(frozen=True)
class UnstructuredPattern(Pattern):
    """``unstructured@<density>``: keep that fraction of the weights, largest first."""

    density: float

    SYNTAX: ClassVar[re.Pattern] = re.compile(r"^unstructured@(.+)$")
    SUPPORTS_GLOBAL_SCOPE: ClassVar[bool] = True

    def __post_init__(self):
        _check_density(self.density)
        object.__setattr__(self, "density", float(self.density))

    @classmethod
    def _from_match(cls, match):
        return cls(_parse_density(match.group(1)))

    def __str__(self):
        return f"unstructured@{self.density!r}"


PATTERN_CLASSES: tuple[type[Pattern], ...] = (NMPattern, VectorNMPattern, BlockNMPattern,
                                              BlockPattern, UnstructuredPattern)


def _parse_density(text: str) -> float:
    try:
        density = float(text)
    except ValueError:
        raise PatternError(f"density {text!r} is not a number: write a fraction such as 0.25") from None
    _check_density(density)
    return density


def parse_pattern(text: "str | Pattern") -> Pattern:
    """Read a pattern string such as ``"2:4"`` or ``"unstructured@0.1"``; pass objects through.

    Raises PatternError, saying what to write instead, for anything that does not parse or
    names an impossible pattern (n >= m, n < 1, a density outside (0, 1]).
    """
    if isinstance(text, Pattern):
        return text
    if not isinstance(text, str):
        raise PatternError(f"a pruning pattern is a string or a pattern object; got "
                           f"{type(text).__name__} {text!r}: {_SYNTAX_HELP}")
    canonical = "".join(text.split()).lower()
    for pattern_class in PATTERN_CLASSES:
        if match := pattern_class.SYNTAX.match(canonical):
            return pattern_class._from_match(match)
    raise PatternError(f"pruning pattern {text!r} does not parse: {_SYNTAX_HELP}")
