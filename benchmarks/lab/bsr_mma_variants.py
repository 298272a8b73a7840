"""Variants of the small-batch mma BSR kernel (templates/bsr_mma_sm90.cu.j2) side by side in one
process (issue: small-batch path): the template rendered for 64x64 blocks, fp16, with named
constants of its source (``constexpr <type> kName = value;``) changed by text, each variant
built with the runtime's nvcc flags and loaded beside the others, the template as it is
(``as-is``) among them.

At 90% block sparsity on the 2:4 issue's six shapes and M = 1, 4 and 16 it times, under CUDA-graph
replay with every call on its own copy of the weight (common.rotating): cuBLAS ``F.linear`` +
ReLU, the dispatched kernel (``dispatch``, checked and unchecked) and every variant checked and
unchecked (each with the launch the dispatch gives the weight); each variant's output is checked
against fp32 first (relative error in the row). Writes bsr_mma_variants.json to $OUT, the
variants' changes under "variants".

The first run (bsr_mma_variants-*-2026-11-26.json: blocks per lane in flight, warps per strip,
share of the warp slots, when the next kernel is let in, the guard's raise and count in one
atomic) was of the template at commit 028ac8c, whose constants kLoads, kMinSplit, kSlotShare,
kLetNextInAtStart and kOneWordGuard have since been settled and removed.

    OUT=/tmp python benchmarks/lab/bsr_mma_variants.py --variant NAME:kConstant=value[,kOther=value] ...
        [--shapes NxK ...] [--ms M ...]
"""
import argparse
import concurrent.futures
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from common import environment, rel_err, rotating, time_graph_us, write_lab  # noqa: E402
from kernels_bsr import SHAPES, block_weight  # noqa: E402

from sparsecc import build, codegen, gpu, runtime  # noqa: E402
from sparsecc.bsr_kernel import BsrKernelWeight  # noqa: E402
from sparsecc.codegen import Family, KernelSpec  # noqa: E402
from sparsecc.epilogue import ACTIVATION_CODES, UNCHECKED_NONFINITE  # noqa: E402

BLOCK = 64
DENSITY = 0.1
SPEC = KernelSpec(Family.BSR_MMA_SM90, "float16", tile=(BLOCK, BLOCK, 16))
CONSTANT = re.compile(r"constexpr\s+\w+\s+(k\w+)\s*=\s*([^;]+);")


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """"name:kA=1,kB=true" -> ("name", {"kA": "1", "kB": "true"})."""
    name, _, changes = text.partition(":")
    return name, dict(change.split("=", 1) for change in changes.split(",") if change)


def source_of(changes: dict[str, str]) -> str:
    text = codegen.render(SPEC)
    constants = {match.group(1): match for match in CONSTANT.finditer(text)}
    for name, value in changes.items():
        if name not in constants:
            raise SystemExit(f"the template has no constant {name} (it has {sorted(constants)})")
        old = constants[name].group(0)
        text = text.replace(old, old.replace(f"= {constants[name].group(2)};", f"= {value};"))
    return text


def build_all(chosen: dict[str, dict[str, str]]) -> dict[str, runtime.Kernel]:
    tools = build.toolchain()
    folder = Path(tempfile.mkdtemp(prefix="bsr_mma_variants-"))

    def one(name):
        source, library = folder / f"{name}.cu", folder / f"{name}.so"
        source.write_text(source_of(chosen[name]))
        done = subprocess.run(build.nvcc_command(SPEC, tools, source, library), capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{name}: nvcc failed\n{done.stderr[-3000:]}")
        return name, runtime.Kernel(SPEC, library)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        return dict(pool.map(one, chosen))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", default=None)
    parser.add_argument("--ms", nargs="*", type=int, default=[1, 4, 16])
    parser.add_argument("--variant", action="append", default=[], help="NAME:kConstant=value[,...]")
    args = parser.parse_args()
    chosen = dict([("as-is", {})] + [parse_variant(text) for text in args.variant])
    kernels = build_all(chosen)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes] if args.shapes else SHAPES
    result = environment("bsr_mma_variants")
    result["variants"] = chosen
    gen = torch.Generator().manual_seed(0)
    relu = ACTIVATION_CODES["relu"]
    for n, k in shapes:
        w = block_weight(n, k, BLOCK, DENSITY, torch.float16, gen)
        bias = torch.randn(n, generator=gen).half().cuda()
        packed = BsrKernelWeight.from_dense(w, (BLOCK, BLOCK))
        table = packed.launches()
        hint = next(launch.splits for _, launch in table if launch.spec.family is Family.BSR_MMA_SM90)
        for m in args.ms:
            x = torch.randn(m, k, generator=gen).half().cuda()
            y = torch.empty(m, n, dtype=torch.float16, device="cuda")
            ref = torch.relu(x.float() @ w.float().t() + bias.float())
            row = {"N": n, "K": k, "M": m, "us": {}, "rel_err": {}}
            cublas, _ = rotating(lambda weight: torch.relu(F.linear(x, weight, bias)), w)
            row["us"]["cublas"] = time_graph_us(cublas)
            for flags, suffix in ((gpu.nonfinite_flags(), ""), (UNCHECKED_NONFINITE, "-unchecked")):
                text = gpu.dispatch_string(table, flags)
                call, _ = rotating(lambda v, e: gpu.linear_kernel(x, v, e, n, k, bias, "relu", False, False, text),
                                   packed.values, packed.metadata)
                row["rel_err"]["dispatch" + suffix] = rel_err(call(), ref)
                row["us"]["dispatch" + suffix] = time_graph_us(call)
            for name, kernel in kernels.items():
                for code, suffix in ((relu, ""), (relu | UNCHECKED_NONFINITE, "-unchecked")):
                    def run(v, e, kernel=kernel, code=code):
                        kernel.gemm(v.data_ptr(), e.data_ptr(), x.data_ptr(), bias.data_ptr(), y.data_ptr(), n, m, k,
                                    code, torch.cuda.current_stream().cuda_stream, splits=hint)
                        return y
                    call, _ = rotating(run, packed.values, packed.metadata)
                    y.fill_(float("nan"))
                    row["rel_err"][name + suffix] = rel_err(call(), ref)
                    row["us"][name + suffix] = time_graph_us(call)
            best = sorted((us, name) for name, us in row["us"].items() if name != "cublas")[:6]
            print(n, k, m, f"cublas {row['us']['cublas']:.2f}",
                  f"dispatch {row['us']['dispatch']:.2f} / {row['us']['dispatch-unchecked']:.2f}",
                  "best", [(name, round(us, 2), round(row["us"]["cublas"] / us, 2)) for us, name in best],
                  "max err", f"{max(row['rel_err'].values()):.1e}", flush=True)
            result["rows"].append(row)
    write_lab(result, "bsr_mma_variants")


if __name__ == "__main__":
    main()
