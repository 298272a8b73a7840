"""Weight formats: how a sparse weight is named, packed and unpacked.

A linear weight ``W`` has shape ``[N, K]`` (out features, in features). Four families:

- ``dense``: ``W`` itself.
- ``n:m`` (e.g. ``2:4``): at most ``n`` non-zeros in every group of ``m`` consecutive
  elements along K. Packed as ``values [N, G*n]`` and ``indices [N, G*n]`` (uint8, the
  position of each value inside its group), with ``G = ceil(K/m)``: a K that is not a
  multiple of ``m`` is padded with zeros, so the last, shorter group also keeps at most
  ``n``. ``2:4`` is the case sparse tensor cores run.
- ``bsr<h>x<w>``: blocks of ``h`` rows by ``w`` columns, stored only where non-zero
  (``crow``, ``col``, ``values [nnzb, h, w]``). N and K must be multiples of the block.
- ``csr``: compressed sparse rows (``crow``, ``col``, ``values``).

Formats are independent of the element type: an FP8 (e4m3) weight packs into the same layouts,
its values moved by their bit patterns where torch's CPU kernels take no float8.

Every packed form round-trips exactly: ``pack(W, spec).to_dense()`` equals ``W`` bit for
bit. :func:`pack` refuses a weight that the format cannot represent exactly.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import FormatError

INDEX_DTYPE = torch.int32

_NM_RE = re.compile(r"^(\d+):(\d+)$")
_BSR_RE = re.compile(r"^bsr(?:(\d+)(?:x(\d+))?)?$")


@dataclass(frozen=True)
class FormatSpec:
    """A weight format by name: ``dense``, ``n:m``, ``bsr``/``bsr<h>x<w>`` or ``csr``.

    ``bsr`` without a block size only appears in user restrictions (``formats=("bsr",)``)
    and means "BSR with any block size"; a packed weight always has a block.
    """

    kind: str
    n: int = 0
    m: int = 0
    block: tuple[int, int] | None = None

    KINDS: ClassVar[tuple[str, ...]] = ("dense", "nm", "bsr", "csr")

    def __post_init__(self):
        if self.kind not in self.KINDS:
            raise FormatError(f"unknown format kind {self.kind!r}")
        if self.kind == "nm" and not (1 <= self.n < self.m):
            raise FormatError(f"n:m needs 1 <= n < m, got {self.n}:{self.m}")
        if self.block is not None and (len(self.block) != 2 or min(self.block) < 1):
            raise FormatError(f"bad block shape {self.block}")

    @classmethod
    def parse(cls, text: "str | FormatSpec") -> "FormatSpec":
        if isinstance(text, FormatSpec):
            return text
        if not isinstance(text, str):
            raise FormatError(f"a format is a string such as 'dense', '2:4', 'bsr32', 'csr'; got {text!r}")
        s = text.strip().lower()
        if s in ("dense", "csr"):
            return cls(s)
        if match := _NM_RE.match(s):
            return cls("nm", n=int(match.group(1)), m=int(match.group(2)))
        if match := _BSR_RE.match(s):
            if match.group(1) is None:
                return cls("bsr")
            h = int(match.group(1))
            w = int(match.group(2)) if match.group(2) else h
            return cls("bsr", block=(h, w))
        raise FormatError(f"format {text!r} does not parse: use 'dense', 'n:m' (e.g. '2:4'), "
                          "'bsr', 'bsr<h>' or 'bsr<h>x<w>' (e.g. 'bsr32', 'bsr16x64'), or 'csr'")

    def __str__(self) -> str:
        if self.kind == "nm":
            return f"{self.n}:{self.m}"
        if self.kind == "bsr":
            return "bsr" if self.block is None else f"bsr{self.block[0]}x{self.block[1]}"
        return self.kind

    def admits(self, other: "FormatSpec") -> bool:
        """Whether a restriction named by ``self`` allows the concrete format ``other``."""
        if self.kind != other.kind:
            return False
        if self.kind == "nm":
            return (self.n, self.m) == (other.n, other.m)
        if self.kind == "bsr":
            return self.block is None or self.block == other.block
        return True


DENSE = FormatSpec("dense")
CSR = FormatSpec("csr")
NM_2_4 = FormatSpec("nm", n=2, m=4)


class PackedWeight:
    """A weight in one format. Subclasses define the tensors and how to unpack them.

    ``tensors()`` are the packed arrays in the order the format's custom op takes them (an
    optional one may be None), ``scalars()`` the integers that follow them.
    """

    spec: FormatSpec
    shape: tuple[int, int]

    def tensors(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def scalars(self) -> dict[str, int]:
        return {}

    def to_dense(self) -> torch.Tensor:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values() if t is not None)

    @property
    def dtype(self) -> torch.dtype:
        tensors = self.tensors()
        return (tensors.get("values") if "values" in tensors else tensors["weight"]).dtype


@dataclass
class DenseWeight(PackedWeight):
    weight: torch.Tensor

    spec = DENSE

    @property
    def shape(self):  # type: ignore[override]
        return tuple(self.weight.shape)

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> "DenseWeight":
        return cls(_check_matrix(weight))

    def tensors(self):
        return {"weight": self.weight}

    def to_dense(self):
        return self.weight


@dataclass
class NMWeight(PackedWeight):
    values: torch.Tensor     # [N, G*n], the weight's dtype
    indices: torch.Tensor    # [N, G*n], uint8 position inside each group of m
    n: int
    m: int
    in_features: int

    @property
    def spec(self):  # type: ignore[override]
        return FormatSpec("nm", n=self.n, m=self.m)

    @property
    def shape(self):  # type: ignore[override]
        return (self.values.shape[0], self.in_features)

    @classmethod
    def from_dense(cls, weight: torch.Tensor, n: int, m: int) -> "NMWeight":
        weight = _check_matrix(weight)
        FormatSpec("nm", n=n, m=m)  # validates n and m
        if m > 256:
            raise FormatError(f"n:m with m={m} > 256 cannot store its positions in uint8")
        groups = group_along_k(weight, m)                       # [N, G, m]
        nonzero = groups != 0
        worst = int(nonzero.sum(-1).max()) if groups.numel() else 0
        if worst > n:
            raise FormatError(f"weight does not fit {n}:{m}: a group of {m} along K has "
                              f"{worst} non-zeros")
        # Keep the non-zeros, then fill up to n with zero positions; keep positions sorted.
        position = torch.arange(m, device=weight.device)
        key = (~nonzero).to(torch.int32) * m + position             # non-zeros sort first
        keep = key.topk(n, dim=-1, largest=False).indices.sort(dim=-1).values
        values = _bits(groups).gather(-1, keep).view(weight.dtype)
        rows = weight.shape[0]
        return cls(values.reshape(rows, -1).contiguous(),
                   keep.to(torch.uint8).reshape(rows, -1).contiguous(), n, m, weight.shape[1])

    def tensors(self):
        return {"values": self.values, "indices": self.indices}

    def scalars(self):
        return {"n": self.n, "m": self.m, "in_features": self.in_features}

    def to_dense(self):
        rows = self.values.shape[0]
        groups = self.values.shape[1] // self.n
        values = _bits(self.values)
        dense = values.new_zeros(rows, groups, self.m)
        dense.scatter_(-1, self.indices.reshape(rows, groups, self.n).long(), values.reshape(rows, groups, self.n))
        return dense.reshape(rows, groups * self.m)[:, : self.in_features].view(self.values.dtype)


@dataclass
class BSRWeight(PackedWeight):
    crow: torch.Tensor       # [N/h + 1] int32
    col: torch.Tensor        # [nnzb] int32
    values: torch.Tensor     # [nnzb, h, w]
    out_features: int
    in_features: int

    @property
    def block(self) -> tuple[int, int]:
        return (self.values.shape[1], self.values.shape[2])

    @property
    def spec(self):  # type: ignore[override]
        return FormatSpec("bsr", block=self.block)

    @property
    def shape(self):  # type: ignore[override]
        return (self.out_features, self.in_features)

    @classmethod
    def from_dense(cls, weight: torch.Tensor, block: tuple[int, int],
                   stored=None) -> "BSRWeight":
        """``weight`` in blocks of ``block``; ``stored(present)`` may add blocks to the [R, C]
        mask of the blocks holding a non-zero (the added ones are stored as zeros)."""
        weight = _check_matrix(weight)
        h, w = block
        rows, cols = weight.shape
        if rows % h or cols % w:
            raise FormatError(f"a {rows}x{cols} weight does not divide into {h}x{w} blocks")
        blocks = weight.reshape(rows // h, h, cols // w, w).transpose(1, 2)   # [R, C, h, w]
        present = blocks.ne(0).any(-1).any(-1)                                # [R, C]
        if stored is not None:
            wanted = stored(present)
            if (present & ~wanted).any():
                raise FormatError("stored() dropped a block holding a non-zero")
            present = wanted
        crow = torch.zeros(rows // h + 1, dtype=INDEX_DTYPE, device=weight.device)
        crow[1:] = present.sum(1).cumsum(0)
        block_row, block_col = present.nonzero(as_tuple=True)
        values = blocks[block_row, block_col].contiguous()
        return cls(crow, block_col.to(INDEX_DTYPE).contiguous(), values, rows, cols)

    def tensors(self):
        return {"crow": self.crow, "col": self.col, "values": self.values}

    def scalars(self):
        return {"out_features": self.out_features, "in_features": self.in_features}

    def to_dense(self):
        h, w = self.block
        rows = torch.repeat_interleave(torch.arange(self.crow.numel() - 1, device=self.crow.device),
                                       (self.crow[1:] - self.crow[:-1]).long())
        dense = self.values.new_zeros(self.out_features // h, self.in_features // w, h, w)
        dense[rows, self.col.long()] = self.values
        return dense.transpose(1, 2).reshape(self.out_features, self.in_features)


@dataclass
class CSRWeight(PackedWeight):
    crow: torch.Tensor       # [N + 1] int32
    col: torch.Tensor        # [nnz] int32
    values: torch.Tensor     # [nnz]
    out_features: int
    in_features: int

    spec = CSR

    @property
    def shape(self):  # type: ignore[override]
        return (self.out_features, self.in_features)

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> "CSRWeight":
        weight = _check_matrix(weight)
        rows, cols = weight.shape
        present = weight != 0
        crow = torch.zeros(rows + 1, dtype=INDEX_DTYPE, device=weight.device)
        crow[1:] = present.sum(1).cumsum(0)
        row, col = present.nonzero(as_tuple=True)
        return cls(crow, col.to(INDEX_DTYPE).contiguous(), weight[row, col].contiguous(), rows, cols)

    def tensors(self):
        return {"crow": self.crow, "col": self.col, "values": self.values}

    def scalars(self):
        return {"out_features": self.out_features, "in_features": self.in_features}

    def to_dense(self):
        rows = torch.repeat_interleave(torch.arange(self.out_features, device=self.crow.device),
                                       (self.crow[1:] - self.crow[:-1]).long())
        dense = self.values.new_zeros(self.out_features, self.in_features)
        dense[rows, self.col.long()] = self.values
        return dense


def pack(weight: torch.Tensor, spec: "FormatSpec | str") -> PackedWeight:
    """Pack ``weight`` ([N, K]) into ``spec``; raises FormatError if it does not fit exactly."""
    spec = FormatSpec.parse(spec)
    if spec.kind == "dense":
        return DenseWeight.from_dense(weight)
    if spec.kind == "nm":
        return NMWeight.from_dense(weight, spec.n, spec.m)
    if spec.kind == "bsr":
        if spec.block is None:
            raise FormatError("pack needs a BSR block size, e.g. 'bsr32' or 'bsr16x64'")
        return BSRWeight.from_dense(weight, spec.block)
    return CSRWeight.from_dense(weight)


def group_along_k(weight: torch.Tensor, m: int) -> torch.Tensor:
    """``weight`` [N, K] as [N, ceil(K/m), m] groups, zero-padding the last group."""
    rows, cols = weight.shape
    pad = (-cols) % m
    if pad:
        weight = torch.nn.functional.pad(weight, (0, pad))
    return weight.reshape(rows, -1, m)


def _bits(values: torch.Tensor) -> torch.Tensor:
    """``values`` as their bit patterns where they are 1-byte floats (FP8, whose zero is the byte
    0 once quantized: sparsecc.ir.quant), else as they are: gather and scatter then move them."""
    return values.view(torch.uint8) if values.is_floating_point() and values.element_size() == 1 else values


def _check_matrix(weight: torch.Tensor) -> torch.Tensor:
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise FormatError(f"a weight must be a 2-D tensor, got "
                          f"{type(weight).__name__}{tuple(getattr(weight, 'shape', ()))}")
    if weight.layout != torch.strided:
        weight = weight.to_dense()
    return weight.detach()
