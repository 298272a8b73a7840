"""Variants of the tensor-core 2:4 small-batch kernel (templates/gemv_mma_sm90_sparse24) at
M = 8..64 on the large shapes, to find what bounds it past 8 rows: the template as it is
("current"), and the lab copy (gemv_mma_staged_x.cu.j2) with its knobs: x staged in shared
memory (16-byte cp.async, ldmatrix) or loaded 4 bytes per lane, the NaN/Inf probe on or off
(off: timing only, its NaN test is skipped), units in flight per warp, units per block, warps.
Every variant is built here with sparsecc's nvcc command and loaded beside the others (same entry
points, own library); each call reads its own copy of the weight (graph replay, as
benchmarks/decode.py); cuBLAS F.linear + ReLU alongside. Writes mma_staged_x.json to $OUT.

    OUT=/tmp python benchmarks/lab/mma_staged_x.py [--quick]
"""
import argparse
import concurrent.futures
import functools
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
from common import environment, rel_err, time_graph_us  # noqa: E402
from kernels import two_four  # noqa: E402

import sparsecc  # noqa: E402
from sparsecc import build, codegen, gpu, runtime  # noqa: E402
from sparsecc.codegen import Family, KernelSpec  # noqa: E402
from sparsecc.epilogue import ACTIVATION_CODES  # noqa: E402
from sparsecc.timing import copies_for  # noqa: E402

HERE = Path(__file__).resolve().parent
SHAPES = [(11008, 4096), (4096, 11008), (4096, 4096), (1024, 4096)]
MS = [8, 16, 32]


def variants(m):
    """(name, knobs) for M rows: staged or not, probe on or off, loads, units, warps, tiles."""
    tiles = (1, 2) if m > 8 else (1,)
    out = []
    for staged, probe, warps, units, loads, t in itertools.product((False, True), (True, False), (4, 8), (1, 2, 4),
                                                                  (2, 4, 8), tiles):
        if units * loads > 8 or (staged and warps * loads * t > 16):   # registers; 48 KB of static shared memory
            continue
        if not probe and (loads != 4 or warps != 4):
            continue
        out.append((f"{'staged' if staged else 'direct'}{'' if probe else '_noprobe'}_w{warps}_u{units}_l{loads}_x{t}",
                    dict(staged=staged, probe=probe, warps=warps, units=units, loads=loads, tiles=t)))
    return out


@functools.lru_cache(maxsize=1)
def lab_environment() -> jinja2.Environment:
    """sparsecc's template environment, also reading this folder (the lab template imports common.j2)."""
    package = codegen._environment()
    return package.overlay(loader=jinja2.FileSystemLoader([str(HERE), *package.loader.searchpath]))


def render(spec, knob):
    return lab_environment().get_template("gemv_mma_staged_x.cu.j2").render(
        spec=spec, version=sparsecc.__version__, knob=knob, activation_codes=codegen.ACTIVATION_CODES,
        unchecked_nonfinite=codegen.UNCHECKED_NONFINITE)


def build_all(dtype, names_knobs, folder):
    """name -> runtime.Kernel for every variant (and "current"), built in parallel."""
    spec = KernelSpec(Family.GEMV_MMA_SM90_SPARSE24, dtype, tile=(4, 1, 1))
    tools = build.toolchain()
    jobs = {}
    for name, knob in names_knobs:
        source = folder / f"{dtype}_{name}.cu"
        source.write_text(render(spec, knob) if knob else codegen.render(spec))
        jobs[name] = (source, folder / f"{dtype}_{name}.so")

    def compile_one(item):
        name, (source, library) = item
        done = subprocess.run(build.nvcc_command(spec, tools, source, library), capture_output=True, text=True)
        return name, done.returncode, done.stderr[-2000:]
    kernels, failures = {}, {}
    with concurrent.futures.ThreadPoolExecutor(int(os.environ.get("SPARSECC_BUILD_JOBS", "16"))) as pool:
        for name, code, stderr in pool.map(compile_one, jobs.items()):
            if code == 0:
                kernels[name] = runtime.Kernel(spec, jobs[name][1])
            else:
                failures[name] = stderr
    return kernels, failures


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--ms", nargs="*", type=int, default=MS)
    parser.add_argument("--only", nargs="*", help="these variants (and current) only")
    parser.add_argument("--profile", action="store_true",
                        help="no timing: call each variant a few times at M=16 on 11008x4096 (run under ncu)")
    parser.add_argument("--build-only", action="store_true")
    args = parser.parse_args()
    out = Path(os.environ.get("OUT", "/tmp"))
    result = environment("mma_staged_x")
    dtype_name = "float16"
    dtype = torch.float16
    every = {name: knob for m in args.ms for name, knob in variants(m) if not args.only or name in args.only}
    folder = Path(tempfile.mkdtemp())
    kernels, failures = build_all(dtype_name, [("current", None)] + sorted(every.items()), folder)
    result["build_failures"] = failures
    print(f"built {len(kernels)} variants, {len(failures)} failed: {sorted(failures)[:5]}", flush=True)
    for name, stderr in list(failures.items())[:2]:
        print(name, stderr, flush=True)
    if args.build_only:
        return
    gen = torch.Generator().manual_seed(0)
    if args.profile:
        n, k, m = 11008, 4096, 16
        packed = gpu.Sparse24MmaWeight.pack(two_four(n, k, dtype, gen).cuda())
        x = torch.randn(m, k, dtype=dtype, device="cuda")
        y = torch.empty(m, n, dtype=dtype, device="cuda")
        for name, kernel in sorted(kernels.items()):
            for _ in range(3):
                kernel.gemm(packed.values.data_ptr(), packed.metadata.data_ptr(), x.data_ptr(), 0, y.data_ptr(), n, m, k,
                            ACTIVATION_CODES["relu"], torch.cuda.current_stream().cuda_stream, splits=1)
            torch.cuda.synchronize()
            print("profiled", name, flush=True)
        return
    for n, k in SHAPES[:2] if args.quick else SHAPES:
        w = two_four(n, k, dtype, gen)
        bias = torch.randn(n, dtype=dtype, device="cuda")
        packed = gpu.Sparse24MmaWeight.pack(w.cuda())
        copies = copies_for(w.numel() * w.element_size())
        weights = [(packed.values, packed.metadata)] + [(packed.values.clone(), packed.metadata.clone())
                                                        for _ in range(copies - 1)]
        dense = [w.cuda()] + [w.cuda().clone() for _ in range(copies - 1)]
        turn = itertools.count()
        for m in args.ms:
            x = torch.randn(m, k, dtype=dtype, device="cuda")
            ref = torch.relu(x.float() @ w.cuda().float().t() + bias.float())
            y = torch.empty(m, n, dtype=dtype, device="cuda")
            cublas = time_graph_us(lambda: torch.relu(F.linear(x, dense[next(turn) % copies], bias)), calls=max(10, copies))
            rows = []
            names = ["current"] + [name for name, _ in variants(m) if name in every]
            for name in names:
                if name not in kernels:
                    continue
                kernel = kernels[name]
                tile = every[name]["tiles"] if name != "current" else None
                for splits in (1, 2) if name != "current" else (1, 2, 0):
                    def call(kernel=kernel, splits=splits):
                        values, metadata = weights[next(turn) % copies]
                        kernel.gemm(values.data_ptr(), metadata.data_ptr(), x.data_ptr(), bias.data_ptr(), y.data_ptr(),
                                    n, m, k, ACTIVATION_CODES["relu"], torch.cuda.current_stream().cuda_stream,
                                    splits=splits)
                        return y
                    err = rel_err(call().clone(), ref)
                    us = time_graph_us(call, calls=max(10, copies))
                    rows.append({"variant": name, "splits": splits, "M": m, "N": n, "K": k, "us": us, "rel_err": err,
                                 "cublas_us": cublas, "tiles_of_x": tile})
            result["rows"] += rows
            good = sorted((r for r in rows if r["rel_err"] < 3e-3), key=lambda r: r["us"])
            cur = min((r["us"] for r in rows if r["variant"] == "current"), default=float("nan"))
            print(f"M={m:2d} {n:5d}x{k:5d}: cublas {cublas:6.1f}  current(w4u1x1) {cur:6.1f}", flush=True)
            for kind in ("direct_w", "direct_noprobe", "staged_w", "staged_noprobe"):
                best = [r for r in good if r["variant"].startswith(kind)][:2]
                for r in best:
                    print(f"    {r['variant']:28s} s{r['splits']} {r['us']:6.1f} us  {cublas / r['us']:.2f}x  "
                          f"err {r['rel_err']:.1e}", flush=True)
            bad = [r["variant"] for r in rows if not r["rel_err"] < 3e-3]
            if bad:
                print("    WRONG:", bad[:6], flush=True)
            (out / "mma_staged_x.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
