"""The work model of every implementation the cost model prices: flops, bytes and dependent
pipeline steps of a :class:`~sparsecc.ir.workload.Workload`.

An implementation is what runs a format on a device. Torch's paths are modelled here: its dense
GEMM, its n:m path (unpack to dense, then dense), its BSR product (or, where torch has no BSR
kernel for the dtype or block, batched block products) and its CSR product. sparsecc's own
kernels are modelled by their families (:mod:`sparsecc.kernels`): the registry says which family
prices an implementation.
"""
from __future__ import annotations

from ..ir.workload import Workload
from ..kernels import registry

#: torch's implementations
TORCH_PATHS = ("dense", "nm-unpack", "bsr", "bsr-bmm", "csr")
#: streaming multiprocessors assumed when no GPU is present to ask (an H100 SXM)
DEFAULT_SMS = 132


def known(impl: str) -> bool:
    return impl in TORCH_PATHS or registry.by_impl(impl) is not None


def work(w: Workload, sms: int = DEFAULT_SMS) -> tuple[float, float]:
    """``(flops, bytes)`` the implementation spends on ``w``: flops as executed (zero blocks
    skipped, tiles padded), bytes of the weight in its format plus the activations, and the
    copies torch's sparse paths make (fp32 conversions, the unpacked dense weight)."""
    if w.impl not in TORCH_PATHS:
        return _family(w.impl).work(w, sms)
    e = w.element_size
    m, n, k = w.m, w.n, w.k
    act = (m * k + m * n) * e
    if w.impl == "dense":
        return 2.0 * m * n * k, n * k * e + act
    if w.impl == "nm-unpack":     # values + uint8 indices read, dense weight written and read back
        kept = n * k * w.density
        return 2.0 * m * n * k, kept * (e + 1) + 2 * n * k * e + act
    wide = 4 if e < 4 else e       # torch's sparse products run 16-bit inputs in fp32
    if w.impl in ("bsr", "bsr-bmm"):
        h, bw = w.block or (32, 32)
        stored = w.stored_density * n * k
        blocks = stored / (h * bw)
        converted = (stored + m * k) * (e + wide) if wide != e else 0
        gathered = blocks * (h + bw) * m * wide * 2 if w.impl == "bsr-bmm" else 0   # x gathered, products scattered
        return 2.0 * m * stored, stored * e + blocks * 4 + act + converted + m * n * wide + gathered
    nnz = w.density * n * k                                               # csr
    converted = (nnz + m * k) * (e + wide) if wide != e else 0
    return 2.0 * m * nnz, nnz * (e + 4) + n * 4 + act + converted + m * n * wide


def steps(w: Workload, sms: int = DEFAULT_SMS) -> float:
    """Dependent pipeline steps on the busiest SM (0 for implementations not modelled by steps):
    at small batch sparsecc's BSR and CSR kernels wait on each step's loads, so their time
    follows the steps a CTA runs one after another, not the bytes."""
    return 0.0 if w.impl in TORCH_PATHS else _family(w.impl).steps(w, sms)


def priced_like(impl: str) -> str | None:
    """The implementation whose calibration prices ``impl`` where it has none of its own."""
    return None if impl in TORCH_PATHS else _family(impl).priced_like(impl)


def _family(impl: str):
    family = registry.by_impl(impl)
    if family is None:
        raise ValueError(f"unknown implementation {impl!r} (torch's {TORCH_PATHS}, or a kernel family's)")
    return family
