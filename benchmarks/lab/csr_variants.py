"""The CSR tensor-core kernels against other versions of their templates, in one process:
"current" is the package's kernel for each tile of x's rows (csr_kernel.kernel_spec: csr_sm90 for
16 and 32 rows, csr_wgmma_sm90 for 64 and 128), and each ``--template NAME=PATH`` is another
(e.g. an earlier commit's, ``git show REV:templates/csr_sm90.cu.j2 > PATH``), rendered with the
package's macros and built with sparsecc's nvcc command into its own library (same entry
points). ``--head-geometry NAME`` renders NAME with the stage geometry of before the helper
warps (up to four tiles per stage whatever the capacity, two stages at least). Every call reads
its own copy of the weight (graph replay), cuBLAS F.linear + ReLU alongside; ``--splits``
also times fixed K-slice counts. Writes csr_variants.json to $OUT. With ``--profile`` it only
calls each variant twice per point (run under Nsight Compute).

    OUT=/tmp python benchmarks/lab/csr_variants.py --template head=/tmp/csr_head.cu.j2 --head-geometry head
"""
import argparse
import concurrent.futures
import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import jinja2
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from common import environment, rel_err, rotating, time_eager_us, time_graph_us  # noqa: E402
from kernels_csr import unstructured_weight  # noqa: E402

import sparsecc  # noqa: E402
from sparsecc import build, codegen, runtime  # noqa: E402
from sparsecc.codegen import CSR_CAPACITIES, CSR_TILE_N  # noqa: E402
from sparsecc.csr_kernel import CsrKernelWeight, kernel_spec, tile_m_for  # noqa: E402
from sparsecc.epilogue import ACTIVATION_CODES  # noqa: E402


class HeadGeometry:
    """A spec whose CSR stage geometry is the one before the helper warps."""

    def __init__(self, spec):
        self._spec = spec

    def __getattr__(self, name):
        return getattr(self._spec, name)

    @property
    def csr_step_tiles(self):
        _, tile_m, capacity = self._spec.tile
        return min({16: 4, 32: 4, 64: 2, 128: 1}[tile_m], CSR_CAPACITIES[-1] // capacity)

    @property
    def csr_stages(self):
        _, tile_m, capacity = self._spec.tile
        step_k = 64 * self.csr_step_tiles
        stage_bytes = tile_m * step_k * 2 + capacity * self.csr_step_tiles * 4
        return max(2, min(8, (113 * 1024 - 2 * CSR_TILE_N * step_k * 2) // stage_bytes))


def render(path, spec, off=()):
    package = codegen._environment()
    environment_ = package.overlay(loader=jinja2.FileSystemLoader([str(Path(path).parent), *package.loader.searchpath]))
    return environment_.get_template(Path(path).name).render(
        spec=spec, version=sparsecc.__version__, off=off, activation_codes=codegen.ACTIVATION_CODES,
        unchecked_nonfinite=codegen.UNCHECKED_NONFINITE)


def build_variants(specs, templates, head_geometry, folder, knobs):
    """(variant, spec) -> runtime.Kernel, built in parallel; failures as stderr tails."""
    tools = build.toolchain()
    jobs = {}
    for spec in specs:
        for name, path in templates.items():
            shown = HeadGeometry(spec) if name in head_geometry else spec
            source = folder / f"{name}_{spec.symbol}.cu"
            source.write_text(codegen.render(spec) if path is None else render(path, shown, knobs.get(name, ())))
            jobs[(name, spec)] = (source, folder / f"{name}_{spec.symbol}.so")

    def compile_one(item):
        key, (source, library) = item
        done = subprocess.run(build.nvcc_command(key[1], tools, source, library), capture_output=True, text=True)
        return key, done.returncode, done.stderr[-2000:]
    kernels, failures = {}, {}
    with concurrent.futures.ThreadPoolExecutor(int(os.environ.get("SPARSECC_BUILD_JOBS", "16"))) as pool:
        for key, code, stderr in pool.map(compile_one, jobs.items()):
            if code == 0:
                kernels[key] = runtime.Kernel(key[1], jobs[key][1])
            else:
                failures[f"{key[0]}/{key[1].symbol}"] = stderr
    return kernels, failures


def call(kernel, values, metadata, x, bias, y, n, k, splits):
    m = x.shape[0]
    size = kernel.workspace_size(n, m, k, 1, splits)
    workspace = torch.empty(max(size, 1), dtype=torch.uint8, device="cuda")

    def run(v, e):
        kernel.gemm(v.data_ptr(), e.data_ptr(), x.data_ptr(), bias.data_ptr(), y.data_ptr(), n, m, k,
                    ACTIVATION_CODES["relu"], torch.cuda.current_stream().cuda_stream, splits=splits,
                    workspace=workspace.data_ptr() if size else 0)
        return y
    return run, size // max(1, 4 * m * n)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--template", nargs="*", default=[], help="NAME=PATH of another template version")
    parser.add_argument("--off", nargs="*", default=[],
                        help="NAME=PART,PART: variant NAME renders its template with these parts left out (a lab template's"
                             " knobs; timing only, the results are wrong)")
    parser.add_argument("--head-geometry", nargs="*", default=[], help="variants rendered with the old stage geometry")
    parser.add_argument("--shapes", nargs="*", default=["11008x4096", "4096x11008", "4096x4096"])
    parser.add_argument("--densities", nargs="*", type=float, default=[0.3, 0.01])
    parser.add_argument("--ms", nargs="*", type=int, default=[16, 64, 2048])
    parser.add_argument("--splits", nargs="*", type=int, default=[], help="fixed K-slice counts, besides the kernel's own")
    parser.add_argument("--tile-m", nargs="*", type=int, default=[],
                        help="rows of x per CTA to time (default: the dispatch table's for each M)")
    parser.add_argument("--cusparse", action="store_true", help="also time torch.sparse.mm on CSR (eagerly)")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    templates = {"current": None, **{t.split("=", 1)[0]: t.split("=", 1)[1] for t in args.template}}
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    dtype = torch.float16
    gen = torch.Generator().manual_seed(0)
    weights = {}
    for n, k in shapes:
        for density in args.densities:
            weights[(n, k, density)] = CsrKernelWeight.pack(unstructured_weight(n, k, density, dtype, gen))
    def tiles_m(m):
        return args.tile_m or [tile_m_for(m)]
    specs = {kernel_spec("float16", tile_m, packed.capacity)
             for packed in weights.values() for m in args.ms for tile_m in tiles_m(m)}
    knobs = {o.split("=", 1)[0]: tuple(o.split("=", 1)[1].split(",")) for o in args.off}
    kernels, failures = build_variants(sorted(specs, key=lambda s: s.tile), templates, set(args.head_geometry),
                                       Path(tempfile.mkdtemp()), knobs)
    out = Path(os.environ.get("OUT", "/tmp"))
    result = environment("csr_variants")
    result["build_failures"] = failures
    print(f"built {len(kernels)}, failed {sorted(failures)}", flush=True)
    for name, stderr in list(failures.items())[:2]:
        print(name, stderr, flush=True)
    for (n, k, density), packed in weights.items():
        w = packed.to_dense()
        bias = torch.randn(n, generator=gen).to(dtype).cuda()
        for m in args.ms:
            x = torch.randn(m, k, generator=gen).to(dtype).cuda()
            ref = torch.relu(x.float() @ w.float().t() + bias.float())
            base = {"M": m, "N": n, "K": k, "density": density, "capacity": packed.capacity}
            if not args.profile:
                fn, copies = rotating(lambda w_: torch.relu(F.linear(x, w_, bias)), w)
                result["rows"].append({"impl": "cublas", **base, "us": time_graph_us(fn, calls=copies)})
                if args.cusparse:
                    w_csr = w.to_sparse_csr()
                    result["rows"].append({"impl": "cusparse", **base, "us": time_eager_us(
                        lambda: torch.relu(torch.sparse.mm(w_csr, x.t()).t() + bias))})
            for name, tile_m in itertools.product(templates, tiles_m(m)):
                spec = kernel_spec("float16", tile_m, packed.capacity)
                if (name, spec) not in kernels:
                    continue
                for splits in [1] + [s for s in args.splits if s > 1]:
                    y = torch.empty(m, n, dtype=dtype, device="cuda")
                    run, used = call(kernels[(name, spec)], packed.values, packed.metadata, x, bias, y, n, k, splits)
                    if args.profile:
                        run(packed.values, packed.metadata)
                        run(packed.values, packed.metadata)
                        torch.cuda.synchronize()
                        continue
                    fn, copies = rotating(run, packed.values, packed.metadata)
                    row = {"impl": name if not args.tile_m else f"{name}_m{tile_m}", **base, "tile_m": tile_m,
                           "splits_asked": splits, "splits": used or 1,
                           "rel_err": rel_err(fn(), ref), "us": time_graph_us(fn, calls=copies)}
                    result["rows"].append(row)
            if not args.profile:
                (out / "csr_variants.json").write_text(json.dumps(result, indent=1))   # what a crash would lose
                here = [r for r in result["rows"] if all(r[key] == base[key] for key in ("M", "N", "K", "density"))]
                print(f"M={m:5d} {n}x{k} d={density}: " + " ".join(
                    f"{r['impl']}{'/' + str(r['splits']) if r.get('splits_asked', 1) > 1 else ''}={r['us']:.1f}"
                    + (f"(err {r['rel_err']:.1e})" if r.get("rel_err", 0) > 3e-3 else "") for r in here), flush=True)
    if not args.profile:                  # a profiling run times nothing: keep an earlier run's file
        (out / "csr_variants.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
