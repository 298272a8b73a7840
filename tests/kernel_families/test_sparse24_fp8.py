"""The FP8 2:4 GEMM family on the CPU (sparsecc.kernels.sparse24_fp8): what it takes, the kernels a
plan needs, how splice calls its op, and (where nvcc is) the shapes the kernel's own
can_implement takes, checked on the host against the family's rule. On the GPU:
test_sparse24_fp8_gpu.py."""
import subprocess

import pytest
import torch

from sparsecc.codegen.render import render
from sparsecc.codegen.spec import Family, KernelSpec
from sparsecc.ir.formats import NM_2_4, FormatSpec
from sparsecc.ir.quant import E4M3
from sparsecc.kernels.sparse24_fp8 import SPARSE24_FP8, CutlassSparse24Fp8Weight
from sparsecc.runtime.kernel_op import linear_fp8_kernel

from conftest import host_program, requires_nvcc


@pytest.mark.parametrize("spec, shape, dtype, input_dtype, refused", [
    (NM_2_4, (4096, 4096), E4M3, torch.float16, None),
    (NM_2_4, (4096, 4096), E4M3, None, None),                       # inputs not known yet
    (NM_2_4, (4096, 4112), E4M3, torch.bfloat16, "K % 32 == 0"),    # K / 2 bytes a row: 16-byte aligned
    (NM_2_4, (4100, 4096), E4M3, torch.float16, "N % 8 == 0"),
    (NM_2_4, (4096, 4096), torch.float16, torch.float16, "runs e4m3 weights"),
    (NM_2_4, (4096, 4096), E4M3, torch.float32, "float16/bfloat16 inputs"),
    (FormatSpec("nm", n=1, m=4), (4096, 4096), E4M3, torch.float16, "run 2:4"),
])
def test_what_the_family_takes(spec, shape, dtype, input_dtype, refused):
    reason = SPARSE24_FP8.refuses(spec, shape, dtype, input_dtype)
    assert reason is None if refused is None else refused in reason


def test_a_plan_builds_the_e4m3_compressor_and_a_gemm_per_input_dtype():
    specs = SPARSE24_FP8.kernel_specs(E4M3, (4096, 4096), NM_2_4, 0.5, 16)
    assert specs[0] == KernelSpec(Family.SM90_COMPRESS24, "float8_e4m3fn")
    assert {(s.family, s.dtype) for s in specs[1:]} == {(Family.SM90_SPARSE24_FP8, "float16"),
                                                         (Family.SM90_SPARSE24_FP8, "bfloat16")}
    table = SPARSE24_FP8.dispatch(torch.bfloat16, (4096, 4096))
    assert [bound for bound, _ in table] == [1, 16, 64, 128, 2048, 0]
    assert all(launch.spec.dtype == "bfloat16" for _, launch in table)


def test_splice_calls_the_fp8_kernel_op_with_the_sites_scales():
    """A quantized site packed for the kernel runs sparsecc::linear_fp8_kernel on its values and
    metadata with the site's own weight and input scales (the node's arguments), then the sizes,
    the epilogue and the dispatch table."""
    import torch.fx as fx

    from sparsecc.ir.site import SITE_KEY
    from sparsecc.passes import splice
    from sparsecc.runtime.torch_ops import linear_fp8

    graph = fx.Graph()
    x = graph.placeholder("x")
    weight, w_scale = graph.get_attr("weight"), graph.get_attr("weight_scale")
    node = graph.call_function(linear_fp8, (x, weight, w_scale, None, None, "relu", False, False))
    graph.output(node)
    root = torch.nn.Module()
    root.register_buffer("weight", torch.zeros(16, 64, dtype=E4M3))
    root.register_buffer("weight_scale", torch.ones(16))
    gm = fx.GraphModule(root, graph)
    node.meta[SITE_KEY] = type("Site", (), {"name": "fc", "quantized": True})()
    packed = CutlassSparse24Fp8Weight(torch.zeros(512, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8),
                                      16, 64, kernels="0=sparsecc_x:1:1:0")
    splice.run(gm, {"fc": packed})
    call = next(n for n in gm.graph.nodes if n.op == "call_function")
    assert call.target is linear_fp8_kernel
    values, metadata, scale, input_scale, *rest = call.args[1:]
    assert (values.target, metadata.target) == ("sparsecc_packed_fc__values", "sparsecc_packed_fc__metadata")
    assert scale.target == "weight_scale" and input_scale is None
    assert rest == [16, 64, None, "relu", False, False, "0=sparsecc_x:1:1:0"]


#: appended to the rendered FP8 kernel and run on the host (no GPU): where make_arguments puts the
#: epilogue's arguments in CUTLASS's visitor tree (x's scales in the row broadcast, the weight's and
#: the bias in the two column broadcasts, the guard's flag in the probe, the activation code), then
#: whether its can_implement takes an m x k weight (with 40 rows of x), for the shapes in argv
HOST_CHECKS = r"""
#include <cstdlib>
int main(int argc, char** argv) {
  float scale_w[8], scale_x[8];
  ElementBias bias[8];
  int flag = 0;
  auto args = make_arguments(nullptr, nullptr, nullptr, bias, nullptr, 256, 40, 4096, 3, &flag, 1, 1, scale_w, scale_x);
  auto const& tree = args.epilogue.thread;
  std::printf("tree %d %d %d %d %d\n", tree.op_0.op_0.op_0.op_1.ptr_row == scale_x, tree.op_0.op_0.op_1.ptr_col == scale_w,
              tree.op_0.op_0.op_2.ptr_col == bias, tree.op_0.op_1.flag == &flag, tree.op_1.kind == 3);
  for (int i = 1; i + 1 < argc; i += 2) {
    const int m = std::atoi(argv[i]), k = std::atoi(argv[i + 1]);
    auto shape = make_arguments(nullptr, nullptr, nullptr, nullptr, nullptr, m, 40, k, 0, nullptr, 1, 1);
    std::printf("%d %d %d\n", m, k, Gemm::can_implement(shape) == cutlass::Status::kSuccess);
  }
  return 0;
}
"""


@requires_nvcc
@pytest.mark.nvcc
@pytest.mark.slow
def test_the_kernels_epilogue_arguments_and_the_shapes_it_takes(tmp_path):
    """The rendered FP8 kernel on the host: each scale, the bias, the flag and the activation reach
    their node of the visitor tree (x's scales and the weight's have the same type, so a swap would
    compile), and its own can_implement agrees with the family's rule on which shapes it takes."""
    program = host_program(render(KernelSpec(Family.SM90_SPARSE24_FP8, "float16")) + HOST_CHECKS, tmp_path)
    shapes = [(4096, 4096), (4096, 4128), (4096, 4112), (4096, 4104), (264, 1056), (264, 1040)]
    result = subprocess.run([str(program), *(str(v) for shape in shapes for v in shape)],
                            capture_output=True, text=True, check=True)
    tree, *lines = result.stdout.splitlines()
    assert tree == "tree 1 1 1 1 1"
    taken = {(int(m), int(k)): bool(int(ok)) for m, k, ok in (line.split() for line in lines)}
    assert taken == {shape: SPARSE24_FP8.refuses(NM_2_4, shape, E4M3) is None for shape in shapes}


#: appended to the rendered FP8 kernel and run on the host: its e4m3 rounding (e4m3_code of
#: value / scale) and per-token scale (e4m3_scale of an amax), on the float32 arrays of a file
ROUNDING = r"""
#include <vector>
int main(int argc, char** argv) {
  std::FILE* in = std::fopen(argv[1], "rb");
  std::FILE* out = std::fopen(argv[2], "wb");
  long count = 0;
  if (std::fread(&count, sizeof(count), 1, in) != 1) return 2;
  std::vector<float> values(count), scales(count), amax(count), got_scales(count);
  std::vector<uint8_t> codes(count);
  if (std::fread(values.data(), 4, count, in) != size_t(count) || std::fread(scales.data(), 4, count, in) != size_t(count)
      || std::fread(amax.data(), 4, count, in) != size_t(count)) return 2;
  for (long i = 0; i < count; ++i) {
    codes[i] = sparsecc::e4m3_code(values[i] / scales[i]);
    got_scales[i] = sparsecc::e4m3_scale(amax[i]);
  }
  std::fwrite(codes.data(), 1, count, out);
  std::fwrite(got_scales.data(), 4, count, out);
  return 0;
}
"""


def rounding_cases() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Values (with their scales) that probe every rounding decision of e4m3: each e4m3 value and
    each midpoint between two neighbours (ties) with the float32 values just beside them, the
    subnormal range, values past 448, zeros of both signs, infinities, NaN of both signs, float32
    subnormals, and random data over many scales; and amax values for the per-token scale."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E4M3).float()
    finite = codes[torch.isfinite(codes)].unique()
    mids = (finite[1:] + finite[:-1]) / 2
    edges = torch.cat([finite, mids, -mids, torch.tensor([448.0, 460.0, 464.0, 470.0, 1e6, 2.0 ** -10, 3 * 2.0 ** -11,
                                                           1e-40, -1e-40, 0.0, -0.0, float("inf"), -float("inf"),
                                                           float("nan"), -float("nan")])])
    edges = torch.cat([edges, torch.nextafter(edges, torch.full_like(edges, float("inf"))),
                       torch.nextafter(edges, torch.full_like(edges, -float("inf")))])
    generator = torch.Generator().manual_seed(0)
    random = torch.randn(200_000, generator=generator) * 10.0 ** torch.randint(-6, 4, (200_000,), generator=generator)
    values = torch.cat([edges, random])
    scales = torch.cat([torch.ones(len(edges)), torch.rand(len(random), generator=generator) * 3 + 1e-3])
    amax = torch.cat([values.abs(), torch.tensor([0.0, float("nan"), float("inf")])])
    values = torch.cat([values, torch.ones(3)])
    scales = torch.cat([scales, torch.ones(3)])
    return values.contiguous(), scales.contiguous(), amax.contiguous()


@requires_nvcc
@pytest.mark.nvcc
@pytest.mark.slow
def test_the_kernels_rounding_to_e4m3_is_sparsecc_ir_quants(tmp_path):
    """The FP8 kernel rounds x to e4m3 itself; its rounding, compiled for the host from the rendered
    kernel, gives the same codes as sparsecc.ir.quant.to_e4m3 (torch's cast) on every probed value,
    and the same per-token scales as amax_scale."""
    from sparsecc.ir.quant import amax_scale, to_e4m3

    program = host_program(render(KernelSpec(Family.SM90_SPARSE24_FP8, "float16")) + ROUNDING, tmp_path)
    values, scales, amax = rounding_cases()
    count = len(values)
    (tmp_path / "in.bin").write_bytes(torch.tensor([count], dtype=torch.int64).numpy().tobytes()
                                      + values.numpy().tobytes() + scales.numpy().tobytes() + amax.numpy().tobytes())
    subprocess.run([str(program), str(tmp_path / "in.bin"), str(tmp_path / "out.bin")], check=True)
    out = (tmp_path / "out.bin").read_bytes()
    codes = torch.frombuffer(bytearray(out[:count]), dtype=torch.uint8)
    got_scales = torch.frombuffer(bytearray(out[count:]), dtype=torch.float32)
    want = to_e4m3(values, scales).view(torch.uint8)
    wrong = (codes != want).nonzero().flatten()
    assert len(wrong) == 0, [(float(values[i]), float(scales[i]), int(codes[i]), int(want[i])) for i in wrong[:10]]
    want_scales = amax_scale(amax)
    assert torch.equal(got_scales.view(torch.int32), want_scales.view(torch.int32))
