"""``sparsecc::linear_kernel``: the custom op that runs a site on a generated kernel, and the
per-batch dispatch table it carries; ``sparsecc::linear_fp8_kernel``, its counterpart for a
quantized (FP8) site.

The op's ``kernels`` argument is a dispatch table by batch size M,
``"16=symbolA:1:1:0;0=symbolB:1:1:0"`` (``bound=symbol:swizzle:splits:flags``): the first entry
whose bound is >= M (0 = no bound) runs, so each M range has its own kernel and launch. Its
CUDA implementation is the C++ launcher (:mod:`sparsecc.runtime.launcher`: a few microseconds
per call, no Python below the op) where that builds, else the Python one here. :func:`ensure`
loads kernels and hands them to whichever runs.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Iterable

import torch

from ..codegen.spec import KernelSpec
from ..errors import InputError, SparseccError
from ..ir.epilogue import ACTIVATION_CODES, Activation
from . import launcher, loader
from .build import KernelCache
from .kernel_dir import prebuilt_launcher
from .torch_ops import output_shape

_LIB = torch.library.Library("sparsecc", "FRAGMENT")
_LIB.define("linear_kernel(Tensor x, Tensor weight, Tensor? metadata, int out_features, int in_features, "
            "Tensor? bias, str activation, bool x_transposed, bool transpose_out, str kernels) -> Tensor")

#: ``sparsecc::linear_kernel``: a site on a generated kernel; ``weight`` is the packed values
#: with their ``metadata``, or (metadata None) the dense [N, K] weight
linear_kernel = torch.ops.sparsecc.linear_kernel.default

_LIB.define("linear_fp8_kernel(Tensor x, Tensor values, Tensor metadata, Tensor weight_scale, Tensor? input_scale, "
            "int out_features, int in_features, Tensor? bias, str activation, bool x_transposed, "
            "bool transpose_out, str kernels) -> Tensor")

#: ``sparsecc::linear_fp8_kernel``: a quantized site on a generated FP8 kernel (the e4m3 weight
#: packed as ``values`` and ``metadata``, its per-channel ``weight_scale``; x rounded per token,
#: or with the static ``input_scale``, as :mod:`sparsecc.ir.quant` defines)
linear_fp8_kernel = torch.ops.sparsecc.linear_fp8_kernel.default


def dispatch_string(entries, flags: int = 0) -> str:
    """The table a site's op call carries: ``bound=symbol:swizzle:splits:flags`` per
    ``(bound, launch)`` entry; ``flags`` is added to the activation code
    (:data:`~sparsecc.ir.epilogue.UNCHECKED_NONFINITE`); only kernels with a NaN pass read it
    (another would take the sum for an unknown activation)."""
    if flags and any(not launch.spec.family.nonfinite_pass for _, launch in entries):
        raise InputError("dispatch flags apply to the sm90 2:4 GEMMs and the BSR kernels only")
    return ";".join(f"{bound}={launch.spec.symbol}:{launch.swizzle}:{launch.splits}:{flags}"
                    for bound, launch in entries)


@lru_cache(maxsize=None)
def parse_dispatch(text: str) -> tuple[tuple[int, str, int, int, int], ...]:
    """``(bound, symbol, swizzle, splits, flags)`` per entry of a dispatch string."""
    entries = []
    for item in text.split(";"):
        bound, _, rest = item.partition("=")
        fields = rest.split(":")
        symbol, swizzle, splits, flags = fields + ["1", "1", "0"][len(fields) - 1:]
        entries.append((int(bound), symbol, int(swizzle), int(splits), int(flags)))
    return tuple(entries)


def kernel_for(text: str, m: int) -> tuple[loader.Kernel, int, int, int]:
    """The kernel, swizzle, splits and activation flags the dispatch table ``text`` names for M rows."""
    for bound, symbol, swizzle, splits, flags in parse_dispatch(text):
        if bound == 0 or m <= bound:
            return loader.get(symbol), swizzle, splits, flags
    raise SparseccError(f"no kernel in {text!r} takes M={m}")


def ensure(specs: Iterable[KernelSpec], *, cache: KernelCache | None = None,
           progress: bool = True) -> dict[KernelSpec, loader.Kernel]:
    """Load ``specs`` (:func:`sparsecc.runtime.loader.load`) and hand them to the op's CUDA
    implementation; the C++ launcher (built once per torch) compiles alongside the kernels."""
    specs = list(specs)
    with ThreadPoolExecutor(max_workers=1) as side:
        if torch.cuda.is_available():
            side.submit(cuda_implementation)
        added = loader.load(specs, cache=cache, progress=progress)
    if added and torch.cuda.is_available() and cuda_implementation() == "c++":
        for kernel in added:
            if kernel.spec.family.product and not kernel.spec.family.fp8:   # linear_kernel's only
                launcher.add_kernel(kernel.spec.symbol, kernel.library)
    return {spec: loader.get(spec.symbol) for spec in specs}


@lru_cache(maxsize=1)
def cuda_implementation() -> str:
    """Install the op's CUDA implementation, once: the C++ launcher where it loads, else the
    Python one below. Returns which: "c++" or "python"."""
    if launcher.load(prebuilt_launcher()) is not None:
        return "c++"
    _LIB.impl("linear_kernel", _linear_kernel_python, "CUDA")
    return "python"


def _linear_kernel_elsewhere(x, weight, metadata, out_features, in_features, bias, activation, x_transposed,
                             transpose_out, kernels):
    raise InputError("sparsecc::linear_kernel runs generated CUDA kernels: this module was compiled for a "
                     f"CUDA GPU and cannot run on {x.device.type}; compile it again for this device")


_LIB.impl("linear_kernel", _linear_kernel_elsewhere, "CPU")


def _linear_fp8_kernel_elsewhere(x, values, metadata, weight_scale, input_scale, out_features, in_features, bias,
                                 activation, x_transposed, transpose_out, kernels):
    raise InputError("sparsecc::linear_fp8_kernel runs generated CUDA kernels: this module was compiled for a "
                     f"CUDA GPU and cannot run on {x.device.type}; compile it again for this device")


_LIB.impl("linear_fp8_kernel", _linear_fp8_kernel_elsewhere, "CPU")


def _kernel_rows(x, weight, out_features, in_features, bias, activation, x_transposed, what: str):
    """A kernel op's arguments checked (device, bias shape, activation, K), and ``x`` as ``[M, K]``
    rows, contiguous and 16-byte aligned: ``(rows, the output's leading shape, activation code)``."""
    if x.device != weight.device or (bias is not None and bias.device != x.device):
        raise InputError(f"{what}: input on {x.device}, the weight on {weight.device}"
                         + (f", the bias on {bias.device}" if bias is not None else ""))
    if bias is not None and tuple(bias.shape) != (out_features,):
        raise InputError(f"{what}: bias of shape {tuple(bias.shape)} for a weight with {out_features} "
                         f"outputs (expected [{out_features}])")
    code = ACTIVATION_CODES.get(activation)
    if code is None:
        Activation.parse(activation)            # raises the clear error
    xt = x.transpose(-1, -2) if x_transposed and x.dim() > 1 else x
    if xt.shape[-1] != in_features:
        raise InputError(f"{what}: input has {xt.shape[-1]} features along K, the weight expects {in_features}")
    rows = xt.reshape(-1, in_features)
    if not rows.is_contiguous() or rows.data_ptr() % 16:
        rows = rows.contiguous() if not rows.is_contiguous() else rows.clone()
    return rows, tuple(xt.shape[:-1]), code


def _kernel_output(y, lead, out_features, transpose_out):
    """A kernel's ``[M, N]`` output in the site's shape (``y^T`` where ``transpose_out``)."""
    y = y.reshape(*lead, out_features)
    return y.transpose(-1, -2).contiguous() if transpose_out and y.dim() > 1 else y


def _linear_kernel_python(x, weight, metadata, out_features, in_features, bias, activation, x_transposed,
                          transpose_out, kernels):
    """The CUDA implementation in Python: what csrc/launcher.cpp does, for where it cannot be built."""
    if x.dtype != weight.dtype:
        raise InputError(f"sparsecc linear: input dtype {x.dtype} does not match the weight's {weight.dtype}")
    rows, lead, code = _kernel_rows(x, weight, out_features, in_features, bias, activation, x_transposed,
                                    "sparsecc linear")
    m = rows.shape[0]
    y = torch.empty(m, out_features, dtype=x.dtype, device=x.device)
    if m > 0:
        if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()):
            bias = bias.to(x.dtype).contiguous()
        kernel, swizzle, splits, flags = kernel_for(kernels, m)
        workspace_bytes = kernel.workspace_size(out_features, m, in_features, swizzle, splits)
        workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=x.device) if workspace_bytes else None
        kernel.gemm(weight.data_ptr(), metadata.data_ptr() if metadata is not None else 0, rows.data_ptr(),
                    bias.data_ptr() if bias is not None else 0, y.data_ptr(), out_features, m, in_features,
                    code + flags, torch.cuda.current_stream().cuda_stream, swizzle=swizzle, splits=splits,
                    workspace=workspace.data_ptr() if workspace is not None else 0)
    return _kernel_output(y, lead, out_features, transpose_out)


@torch.library.register_fake("sparsecc::linear_kernel")
def _(x, weight, metadata, out_features, in_features, bias, activation, x_transposed, transpose_out, kernels):
    return x.new_empty(output_shape(x, x_transposed, out_features, transpose_out))


def _linear_fp8_kernel_cuda(x, values, metadata, weight_scale, input_scale, out_features, in_features, bias,
                            activation, x_transposed, transpose_out, kernels):
    """The FP8 kernel on x's rows: it rounds them to e4m3 itself (per token, or with the static
    ``input_scale``), bit for bit as :func:`sparsecc.ir.quant.quantize_input` does, then multiplies,
    dequantizes and applies the epilogue."""
    if tuple(weight_scale.shape) != (out_features,):
        raise InputError(f"sparsecc FP8 linear: weight_scale has shape {tuple(weight_scale.shape)}, "
                         f"expected ({out_features},)")
    rows, lead, code = _kernel_rows(x, values, out_features, in_features, bias, activation, x_transposed,
                                    "sparsecc FP8 linear")
    m = rows.shape[0]
    y = torch.empty(m, out_features, dtype=x.dtype, device=x.device)
    if m > 0:
        kernel, swizzle, splits, flags = kernel_for(kernels, m)
        if kernel.spec.dtype != str(x.dtype).replace("torch.", ""):
            raise InputError(f"sparsecc FP8 linear: this site was compiled for {kernel.spec.dtype} inputs, "
                             f"not {x.dtype}; compile it again")
        w_scale = weight_scale.to(torch.float32).contiguous()
        static = input_scale.to(torch.float32).reshape(()).contiguous() if input_scale is not None else None
        if bias is not None:
            bias = bias.to(x.dtype).contiguous()
        workspace = torch.empty(kernel.workspace_size(out_features, m, in_features, swizzle, splits),
                                dtype=torch.uint8, device=x.device)
        kernel.gemm(values.data_ptr(), metadata.data_ptr(), rows.data_ptr(), bias.data_ptr() if bias is not None else 0,
                    y.data_ptr(), out_features, m, in_features, code + flags, torch.cuda.current_stream().cuda_stream,
                    swizzle=swizzle, splits=splits, workspace=workspace.data_ptr(),
                    scales=(w_scale.data_ptr(), static.data_ptr() if static is not None else 0))
    return _kernel_output(y, lead, out_features, transpose_out)


_LIB.impl("linear_fp8_kernel", _linear_fp8_kernel_cuda, "CUDA")


@torch.library.register_fake("sparsecc::linear_fp8_kernel")
def _(x, values, metadata, weight_scale, input_scale, out_features, in_features, bias, activation, x_transposed,
      transpose_out, kernels):
    return x.new_empty(output_shape(x, x_transposed, out_features, transpose_out))
