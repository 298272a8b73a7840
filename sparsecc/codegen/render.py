"""Render a :class:`~sparsecc.codegen.spec.KernelSpec` into CUDA source with its Jinja2 template.

Templates render only from the spec and the constants below (``StrictUndefined``: a name the
template does not get is an error, never an empty string). Every generated file starts with
a header naming the spec and the sparsecc version.
"""
from __future__ import annotations

import hashlib
import importlib.resources
from functools import lru_cache

import jinja2

from .._version import __version__
from ..ir.epilogue import ACTIVATION_CODES, GELU_POLYNOMIAL, UNCHECKED_NONFINITE
from .spec import GUARD_ALIGNMENT, GUARD_HEADER_WORDS, RESIDUAL_STAGED_MIN_ROWS, KernelSpec


@lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    folder = importlib.resources.files("sparsecc.templates")
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(folder)), undefined=jinja2.StrictUndefined,
                              trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
                              autoescape=False)


def render(spec: KernelSpec) -> str:
    """The CUDA source of ``spec``."""
    return _environment().get_template(spec.template).render(spec=spec, version=__version__,
                                                             activation_codes=ACTIVATION_CODES,
                                                             unchecked_nonfinite=UNCHECKED_NONFINITE,
                                                             gelu_polynomial=GELU_POLYNOMIAL,
                                                             guard_header_words=GUARD_HEADER_WORDS,
                                                             guard_alignment=GUARD_ALIGNMENT,
                                                             staged_min_rows=RESIDUAL_STAGED_MIN_ROWS)


def templates_digest() -> str:
    """sha256 over every template file, so a template change invalidates generated directories."""
    folder = importlib.resources.files("sparsecc.templates")
    digest = hashlib.sha256()
    for entry in sorted(folder.iterdir(), key=lambda p: p.name):
        if entry.name.endswith(".j2"):
            digest.update(entry.name.encode() + b"\0" + entry.read_bytes())
    return digest.hexdigest()
