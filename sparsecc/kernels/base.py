"""What every family of generated kernels tells the rest of sparsecc: the family interface.

A kernel family is one packed layout of a weight and the kernels (templates) that read it:
which weights, dtypes and batch sizes it serves, how it packs a weight, the launch it runs
for each batch-size bucket (tuned on the user's GPU and shapes where its time does not depend
on the weight's values), the work a call costs it (flops, bytes, dependent steps: what the
cost model prices) and the kernels it builds. :mod:`sparsecc.kernels.registry` lists the
families; the planner asks the registry and never names a family.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..codegen.spec import Family, KernelSpec
from ..config import settings
from ..errors import InputError, KernelBuildError, SparseccError
from ..ir.analysis import WeightStats
from ..ir.epilogue import UNCHECKED_NONFINITE
from ..ir.formats import FormatSpec, PackedWeight
from ..ir.workload import Workload, dtype_name
from ..runtime.build import toolchain
from ..runtime.kernel_dir import directories
from ..runtime.kernel_op import dispatch_string, linear_kernel

#: alignment the kernels need: K a multiple of 16 (the 2:4 compressor's chunk), N a multiple of
#: 8 (16-byte rows of the output); other shapes run on torch and the plan says so
K_MULTIPLE, N_MULTIPLE = 16, 8
KERNEL_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Launch:
    """A kernel and the run-time knobs of its launch: one way to run a product."""

    spec: KernelSpec
    swizzle: int = 1        # rasterization swizzle of the persistent / stream-K scheduler
    splits: int = 1         # split-K, K slices, cluster blocks or the family's own knob (its docs say)

    @property
    def label(self) -> str:
        return f"{self.spec.symbol}:{self.swizzle}:{self.splits}"

    def describe(self) -> dict:
        """The launch as plain data (for the tuning table)."""
        return {"spec": json.loads(self.spec.describe()), "swizzle": self.swizzle, "splits": self.splits}

    @classmethod
    def from_description(cls, data: dict, **changes) -> "Launch":
        spec = KernelSpec(**{**data["spec"], **changes})
        return cls(spec, swizzle=data.get("swizzle", 1), splits=data.get("splits", 1))


#: the batch sizes every dispatch table's buckets are drawn from: a bucket holds the batches up
#: to its bound (above the one before); past the last a family's open bucket takes every M
M_BOUNDS = (1, 4, 8, 16, 32, 64, 96, 128, 256, 512, 1024, 2048, 4096)


@dataclass(frozen=True)
class Buckets:
    """A family's dispatch buckets: ``bounds`` (a subset of :data:`M_BOUNDS`) and the open
    bucket past them, measured at ``open_m`` rows."""

    bounds: tuple[int, ...]
    open_m: int

    def __post_init__(self):
        if not set(self.bounds) <= set(M_BOUNDS) or list(self.bounds) != sorted(self.bounds):
            raise ValueError(f"bucket bounds {self.bounds} must be increasing values of {M_BOUNDS}")

    def __iter__(self):
        """``(bound, measured M)`` per bucket, the open one last as ``(0, open_m)``."""
        return iter([(b, b) for b in self.bounds] + [(0, self.open_m)])

    def bound_for(self, m: int) -> int:
        """The bound of the bucket that holds ``m`` rows (0: the open one)."""
        return next((b for b in self.bounds if m <= b), 0)

    def measured_for(self, m: int) -> int:
        """The M the bucket that holds ``m`` rows is measured (and tuned) at."""
        bound = self.bound_for(m)
        return bound or self.open_m

    def meeting(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """The ``(bound, measured M)`` of every bucket that holds some M in ``lo..hi``."""
        found, previous = [], 0
        for bound, measured in self:
            top = bound or max(hi, previous + 1)
            if lo <= top and previous < hi:
                found.append((bound, measured))
            previous = bound
        return found


def launch_for(table: list[tuple[int, Launch]], m: int) -> Launch:
    """The launch a dispatch table runs M rows with: its first bucket that holds M."""
    for bound, launch in table:
        if bound == 0 or m <= bound:
            return launch
    raise SparseccError(f"no launch for M={m}")


def shape_supported(out_features: int, in_features: int, dtype: torch.dtype) -> str | None:
    """Why a weight of this shape and dtype cannot use the GEMM-style kernels, or None."""
    if dtype not in KERNEL_DTYPES:
        return f"the kernels take float16/bfloat16, not {dtype_name(dtype)}"
    if in_features % K_MULTIPLE or out_features % N_MULTIPLE:
        return (f"the kernels need K % {K_MULTIPLE} == 0 and N % {N_MULTIPLE} == 0 "
                f"(this weight is {out_features}x{in_features})")
    return None


def kernels_unavailable(device: torch.device | str) -> str | None:
    """Why sparsecc's kernels cannot run on ``device``, or None if they can."""
    device = torch.device(device)
    if device.type != "cuda":
        return "sparsecc's kernels run on CUDA GPUs"
    if not torch.cuda.is_available():
        return "torch sees no CUDA GPU"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        return f"the generated kernels target sm_90a (Hopper); this GPU is sm_{major}{minor}"
    if directories():
        return None                 # generated kernels: no compiler needed
    try:
        toolchain()
    except KernelBuildError as error:
        return str(error).splitlines()[0]
    return None


def finish_packing(device) -> None:
    """Wait until the kernels that packed a weight on ``device`` have finished. The small-batch
    kernels are programmatic dependent launches that read their weight before they wait for the
    kernel ahead of them (templates/common.j2, dependent_launch): a packed weight must be
    finished, not only ordered, before its first call. Packing while a CUDA graph is being
    captured is refused (the graph would pack on every replay)."""
    if torch.cuda.is_current_stream_capturing():
        raise InputError("a weight cannot be packed for sparsecc's kernels while a CUDA graph is being "
                         "captured: pack it (compile the model) before capturing")
    torch.cuda.current_stream(device).synchronize()


def nonfinite_flags() -> int:
    """What a site with a NaN pass packed now adds to its activation codes: 0 (NaN and Inf
    propagate as in dense), or :data:`~sparsecc.ir.epilogue.UNCHECKED_NONFINITE` under
    SPARSECC_NONFINITE=unchecked."""
    return UNCHECKED_NONFINITE if settings().nonfinite == "unchecked" else 0


@dataclass
class KernelWeight(PackedWeight):
    """A weight packed for a kernel family: two arrays in the family's layout and the dispatch
    table the op runs (``sparsecc::linear_kernel``)."""

    values: torch.Tensor
    metadata: torch.Tensor | None
    out_features: int
    in_features: int
    kernels: str = ""         # the dispatch table the op runs

    op = linear_kernel

    @property
    def extra_args(self) -> tuple:
        return (self.kernels,)

    @property
    def shape(self):  # type: ignore[override]
        return (self.out_features, self.in_features)

    def tensors(self):
        return {"values": self.values, "metadata": self.metadata}

    def scalars(self):
        return {"out_features": self.out_features, "in_features": self.in_features}

    def running(self, table: list[tuple[int, Launch]], flags: int = 0) -> "KernelWeight":
        """This weight with ``table`` as its dispatch (the same tensors)."""
        return dataclasses.replace(self, kernels=dispatch_string(table, flags))


def check_cuda_weight(weight: torch.Tensor, reason: str | None = None) -> None:
    """Refuse a weight the kernels cannot take: not on CUDA, or ``reason``."""
    if weight.device.type != "cuda":
        raise InputError("sparsecc's kernels run on the GPU: move the weight to CUDA first")
    if reason:
        raise InputError(reason)


class KernelFamily:
    """One packed layout and the kernels that read it (see the module docstring).

    Class attributes: ``name`` (also the cost model's implementation name where the family has
    one), ``kind`` (the format kind it runs: "dense", "nm", "bsr" or "csr"), ``templates``
    (what it renders), ``unit`` (how a plan's reason names it), ``impls`` (the cost model's
    implementations it prices), ``max_m`` (the largest planned batch a site is packed for it
    at; None: any), ``opt_in`` (compile uses it only where ``SPARSECC_OPT_IN`` names it: a new
    family starts so until its work model is calibrated and its gains measured) and, for a
    ``tunable`` family (its time does not depend on the weight's values), ``buckets``.
    """

    name: ClassVar[str]
    kind: ClassVar[str]
    templates: ClassVar[tuple[Family, ...]]
    unit: ClassVar[str]
    impls: ClassVar[tuple[str, ...]] = ()
    max_m: ClassVar[int | None] = None
    opt_in: ClassVar[bool] = False
    tunable: ClassVar[bool] = False
    buckets: ClassVar[Buckets]

    # -- what it serves
    def refuses(self, spec: FormatSpec, shape: tuple[int, int], dtype: torch.dtype) -> str | None:
        """Why this family cannot run ``spec`` for a weight of this shape and dtype, or None."""
        raise NotImplementedError

    # -- packing
    def pack(self, weight: torch.Tensor, spec: FormatSpec, m: int | None, *,
             tune_range: tuple[int, int] | None = None, progress: bool = False) -> PackedWeight:
        """``weight`` packed for this family's kernels for a site planned at ``m`` rows, its
        kernels loaded; ``tune_range``: the batches whose launches may be tuned now."""
        raise NotImplementedError

    def kernel_specs(self, dtype: torch.dtype, shape: tuple[int, int], spec: FormatSpec,
                     density: float, m: int | None) -> list[KernelSpec]:
        """Every kernel a site of this shape and density, planned at ``m`` rows, may run
        (what ``sparsecc generate`` builds ahead of time)."""
        raise NotImplementedError

    # -- the cost model
    def nbytes(self, stats: WeightStats, element: int) -> int | None:
        """The packed bytes of a weight with these statistics, where the layout's differ from the
        portable format's (None: they do not)."""
        return None

    def workloads(self, stats: WeightStats, spec: FormatSpec, m: int, planned_m: int | None) -> list[Workload]:
        """The work a call with ``m`` rows costs a site packed for ``planned_m`` rows, one
        :class:`Workload` per priced implementation (summed by the cost model)."""
        raise NotImplementedError

    def work(self, w: Workload, sms: int) -> tuple[float, float]:
        """``(flops, bytes)`` of ``w`` on this family's kernels: flops as executed (padding
        included), bytes of the weight in its layout plus the activations."""
        raise NotImplementedError

    def steps(self, w: Workload, sms: int) -> float:
        """Dependent pipeline steps on the busiest SM (0: not modelled by steps)."""
        return 0.0

    def priced_like(self, impl: str) -> str | None:
        """The implementation whose calibration prices ``impl`` where it has none of its own."""
        return None

    # -- tuning (tunable families)
    def candidates(self, dtype: torch.dtype, shape: tuple[int, int], m: int) -> list[Launch]:
        """The launches tuning times for ``m`` rows."""
        raise NotImplementedError

    def default_launch(self, dtype: str, bound: int) -> Launch:
        """The launch of the bucket ``bound`` where nothing was measured."""
        raise NotImplementedError

    def layout(self, weight: torch.Tensor) -> KernelWeight:
        """The packing alone (no kernels loaded, no dispatch)."""
        raise NotImplementedError

    def tuning_weight(self, n: int, k: int, dtype: torch.dtype, device, generator: torch.Generator) -> torch.Tensor:
        """A random weight of this family's format that tuning times launches on."""
        raise NotImplementedError

    def reference(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """What a launch must compute for ``x`` and a tuning weight (without bias or activation),
        in fp32: the product, which tuning holds each launch's result to."""
        return torch.nn.functional.linear(x.float(), weight.float())

    def __repr__(self) -> str:
        return f"<kernel family {self.name}>"
