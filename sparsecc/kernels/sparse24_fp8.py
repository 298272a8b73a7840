"""Quantized (FP8) 2:4 weights on the Hopper CUTLASS GEMM (templates/gemm_sm90_sparse24_fp8.cu.j2).

A quantized site (``sparsecc.quantize``: an e4m3 weight with per-channel fp32 scales) whose zeros
fall 2:4 is compressed as the fp16 2:4 GEMM's weights are, by CUTLASS's compressor for e4m3,
followed by the site's NaN/Inf guard. Its op, ``sparsecc::linear_fp8_kernel``, hands x to the
kernel, which rounds its rows to e4m3 in a first pass (per token or with the static scale, bit for
bit as :func:`sparsecc.ir.quant.quantize_input` does), multiplies the e4m3 values on the sparse
tensor cores (``wgmma.sp``, 64 inputs a step), scales each fp32 sum by x's per-token and the
weight's per-channel scale in its epilogue, adds the bias and applies the activation: the
reference op's sums in another order. A 2:4 e4m3 weight is 5/16 of
the fp16 dense weight's bytes.

The launch per batch bucket is tuned on the user's GPU and shapes (:mod:`sparsecc.kernels.tune`)
among :data:`CANDIDATES`, each held to the FP8 reference product; :data:`DEFAULTS` where nothing was
measured. The cost model does not price it: a quantized site runs 2:4 where its plan's ``formats``
asks for it.
"""
from __future__ import annotations

import torch

from ..codegen.spec import E4M3 as E4M3_NAME
from ..codegen.spec import Family, KernelSpec, Scheduler
from ..ir.formats import NM_2_4, FormatSpec
from ..ir.quant import FP8_DTYPES, fp8_product, quantize_weight
from ..ir.weights import random_weight
from ..ir.workload import dtype_name
from ..runtime.kernel_op import ensure, linear_fp8_kernel
from . import nonfinite_guard, tune
from .base import Buckets, KernelFamily, KernelWeight, Launch, check_cuda_weight, nonfinite_flags

#: the dtypes the kernels write y in (the site's input dtype)
OUTPUT_DTYPES = (torch.float16, torch.bfloat16)
#: K a multiple of this: a row of the compressed e4m3 values is K / 2 bytes, 16-byte aligned for TMA
K_MULTIPLE = 32
#: the tile per batch bucket where nothing was measured: narrow tiles of x for small batches, wide for
#: large ones
DEFAULTS = {1: (128, 64, 128), 16: (128, 64, 128), 64: (128, 64, 128), 128: (128, 64, 128), 2048: (128, 256, 128),
            0: (128, 256, 128)}
#: every way of running the GEMM that tuning times
CANDIDATES = [
    (dict(tile=(128, 64, 128)), {}), (dict(tile=(128, 128, 128)), {}), (dict(tile=(128, 256, 128)), {}),
    (dict(tile=(256, 128, 128)), {}), (dict(tile=(256, 128, 128), cluster=(2, 1)), {}),
    (dict(tile=(128, 256, 128), cluster=(1, 2)), {}), (dict(tile=(128, 64, 128), scheduler=Scheduler.STREAMK), {}),
]


class CutlassSparse24Fp8Weight(KernelWeight):
    """An e4m3 2:4 weight in the layout the sm90 FP8 GEMM reads: compressed values and metadata,
    as CUTLASS's compressor writes them, the metadata followed by the site's NaN/Inf guard. The
    per-channel scales stay the site's own argument."""

    spec = NM_2_4
    op = linear_fp8_kernel

    @classmethod
    def compress(cls, weight: torch.Tensor) -> "CutlassSparse24Fp8Weight":
        """Compress ``weight`` (a 2:4 e4m3 [N, K] CUDA tensor) with CUTLASS's compressor kernel."""
        kernel = next(iter(ensure([KernelSpec(Family.SM90_COMPRESS24, E4M3_NAME)], progress=False).values()))
        n, k = weight.shape
        value_count, metadata_bytes = kernel.sizes(n, k)
        dense = weight.detach().contiguous()
        values = torch.zeros(value_count, dtype=torch.uint8, device=weight.device).view(weight.dtype)
        metadata = torch.zeros(metadata_bytes, dtype=torch.uint8, device=weight.device)
        with torch.cuda.device(weight.device):
            kernel.compress(dense.data_ptr(), values.data_ptr(), metadata.data_ptr(), n, k,
                            torch.cuda.current_stream().cuda_stream)
        # every e4m3 zero is +0 (sparsecc.ir.quant), so a zero's byte is 0: columns no row stores
        # are listed for the NaN/Inf pass, as for the fp16 GEMM
        metadata = nonfinite_guard.append_guard(metadata, ~(dense.view(torch.uint8) != 0).any(dim=0))
        return cls(values, metadata, n, k)

    def runner_args(self) -> tuple:
        """What a timing or tuning call passes where a site passes its scales: the weight's of one,
        x's per token (sparsecc.runtime.timing.packed_runner)."""
        return torch.ones(self.out_features, dtype=torch.float32, device=self.values.device), None

    def to_dense(self) -> torch.Tensor:
        """Unpack exactly by running the kernel on an identity with scales of one: x's rows round to
        e4m3 1.0, each sum is one stored e4m3 value, which fp16 holds exactly (needs :attr:`kernels`)."""
        device = self.values.device
        eye = torch.eye(self.in_features, dtype=torch.float16, device=device)
        ones = torch.ones(self.out_features, dtype=torch.float32, device=device)
        y = linear_fp8_kernel(eye, self.values, self.metadata, ones, torch.ones((), device=device),
                              self.out_features, self.in_features, None, "none", False, False, self.kernels)
        return y.t().contiguous().to(self.values.dtype)


class Sparse24Fp8Gemm(KernelFamily):
    """Quantized 2:4 weights (e4m3) on the FP8 CUTLASS GEMM, for fp16 and bf16 inputs."""

    name = "sparse24-fp8-gemm"
    kind = "nm"
    templates = (Family.SM90_SPARSE24_FP8,)        # and the 2:4 GEMM's compressor, for e4m3
    unit = "sparsecc's sm90 FP8 2:4 CUTLASS kernel"
    tunable = True
    buckets = Buckets((1, 16, 64, 128, 2048), 8192)

    def refuses(self, spec: FormatSpec, shape: tuple[int, int], dtype: torch.dtype,
                input_dtype: torch.dtype | None = None) -> str | None:
        """Why the kernel cannot run ``spec`` for an e4m3 weight of this shape with inputs of
        ``input_dtype`` (None: not known yet), or None."""
        if spec != NM_2_4:
            return f"the FP8 sparse tensor cores run 2:4, not {spec}"
        if dtype not in FP8_DTYPES:
            return f"{self.unit} runs e4m3 weights, not {dtype_name(dtype)}"
        n, k = shape
        if k % K_MULTIPLE or n % 8:
            return (f"{self.unit} needs K % {K_MULTIPLE} == 0 and N % 8 == 0 "
                    f"(this weight is {n}x{k})")
        if input_dtype is not None and input_dtype not in OUTPUT_DTYPES:
            return f"{self.unit} takes float16/bfloat16 inputs, not {dtype_name(input_dtype)}"
        return None

    def candidates(self, dtype, shape, m):
        return [Launch(KernelSpec(Family.SM90_SPARSE24_FP8, dtype_name(dtype), **config), **knobs)
                for config, knobs in CANDIDATES]

    def default_launch(self, dtype: str, bound: int) -> Launch:
        return Launch(KernelSpec(Family.SM90_SPARSE24_FP8, dtype, tile=DEFAULTS[bound]))

    def dispatch(self, input_dtype: torch.dtype, shape: tuple[int, int], tune_range=None, *,
                 progress=False) -> list[tuple[int, Launch]]:
        """The launch per bucket for inputs (and y) of ``input_dtype`` (see
        :func:`sparsecc.kernels.tune.dispatch`: its dtype is the kernels', the inputs')."""
        return tune.dispatch(self, input_dtype, shape, tune_range, progress=progress)

    def tuning_weight(self, n, k, dtype, device, generator):
        """A random 2:4 weight in e4m3 (whatever the inputs' ``dtype``)."""
        return quantize_weight(random_weight(n, k, "2:4", 0.5, torch.float32, device, generator))[0]

    def reference(self, x, weight):
        """The FP8 product with the tuning call's scales (the weight's of one): x rounded to e4m3 per
        token, exact products summed in fp32 (sparsecc.ir.quant.fp8_product)."""
        ones = torch.ones(weight.shape[0], dtype=torch.float32, device=weight.device)
        return fp8_product(x, weight, ones, None)

    def pack(self, weight, spec, m, *, input_dtype: torch.dtype | None = None, tune_range=None, progress=False):
        """``weight`` packed for sites whose inputs are ``input_dtype`` (fp16 unless known), the
        launches of the batches in ``tune_range`` tuned first where they may be."""
        input_dtype = input_dtype or torch.float16
        check_cuda_weight(weight, self.refuses(spec, tuple(weight.shape), weight.dtype, input_dtype))
        table = self.dispatch(input_dtype, tuple(weight.shape), tune_range, progress=progress)
        ensure([launch.spec for _, launch in table], progress=progress)
        return self.layout(weight).running(table, nonfinite_flags())

    def layout(self, weight):
        return CutlassSparse24Fp8Weight.compress(weight)

    def kernel_specs(self, dtype, shape, spec, density, m):
        return [KernelSpec(Family.SM90_COMPRESS24, E4M3_NAME)] + list(dict.fromkeys(
            launch.spec for input_dtype in OUTPUT_DTYPES for _, launch in self.dispatch(input_dtype, shape)))


SPARSE24_FP8 = Sparse24Fp8Gemm()
