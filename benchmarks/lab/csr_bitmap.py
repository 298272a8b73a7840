"""The CSR wgmma kernel on a bitmap packing (csr_bitmap.cu.j2) beside the (value, slot) one
(templates/csr_wgmma_sm90.cu.j2) and cuBLAS F.linear + ReLU, in one process: each tile's mask
(512 bytes) and values alone move 2 + 0.125/d bytes per stored entry against 4. fp16, M rows
of x, every call on its own weight copy (graph replay), relative error against fp32. Writes
csr_bitmap.json to $OUT.

    OUT=/tmp python benchmarks/lab/csr_bitmap.py --ms 64 --densities 0.3 0.1
"""
import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from common import environment, rel_err, rotating, time_graph_us  # noqa: E402
from csr_variants import build_variants, call  # noqa: E402
from kernels_csr import unstructured_weight  # noqa: E402

from sparsecc.codegen import CSR_TILE_N, Family, KernelSpec  # noqa: E402
from sparsecc.csr_kernel import (TILE_K, CsrKernelWeight, capacity_for, coordinates, metadata_header,  # noqa: E402
                                 tile_m_for)
from sparsecc.formats import INDEX_DTYPE  # noqa: E402

HERE = Path(__file__).resolve().parent
TEMPLATES = {"slots": str(HERE.parent.parent / "templates" / "csr_wgmma_sm90.cu.j2"),
             "bitmap": str(HERE / "csr_bitmap.cu.j2"), "bitmap_set_bits": str(HERE / "csr_bitmap.cu.j2"),
             "bitmap_two_warps": str(HERE / "csr_bitmap.cu.j2")}
#: the variants' knobs (csr_bitmap.cu.j2's `off`): set_bits, one load per set bit of a chunk's mask
#: byte instead of eight predicated ones; two_warps, two scatter warps per dense tile (two groups
#: of chunks each; four did not compile: 40 registers a thread at two CTAs per SM)
KNOBS = {"bitmap_set_bits": ("set_bits",), "bitmap_two_warps": ("two_warps",)}


def pack_bitmap(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(values, metadata, capacity) of csr_bitmap.cu.j2's layout for a [N, K] weight (N, K
    multiples of 64): per tile, chunk q of the dense tile's shared-memory order (8 elements
    each) sits at position r * 128 + l * 4 + c where q = r * 128 + c * 32 + l, its mask byte at
    that position and its non-zeros, in that order, among the tile's values."""
    n, k = weight.shape
    rows, columns = coordinates(torch.arange(CSR_TILE_N * TILE_K, device=weight.device))
    tiles = weight.reshape(n // CSR_TILE_N, CSR_TILE_N, k // TILE_K, TILE_K).permute(0, 2, 1, 3)
    tiles = tiles.reshape(-1, CSR_TILE_N, TILE_K)[:, rows, columns].reshape(-1, 512, 8)   # chunks in slot order
    p = torch.arange(512, device=weight.device)
    ordered = tiles[:, (p // 128) * 128 + (p % 4) * 32 + (p % 128) // 4, :]
    nonzero = ordered != 0
    masks = (nonzero.int() << torch.arange(8, device=weight.device, dtype=torch.int32)).sum(-1).to(torch.uint8)
    flat, flat_nonzero = ordered.reshape(len(ordered), -1), nonzero.reshape(len(ordered), -1)
    counts = flat_nonzero.sum(1)
    padded = (counts + 7) // 8 * 8
    tile_ptr = torch.cat([padded.new_zeros(1), padded.cumsum(0)])
    tile, position = flat_nonzero.nonzero(as_tuple=True)
    rank = flat_nonzero.int().cumsum(1)[tile, position] - 1
    values = weight.new_zeros(int(tile_ptr[-1]))
    values[tile_ptr[tile] + rank] = flat[tile, position]
    metadata = torch.cat([metadata_header(tile_ptr), masks.reshape(-1).view(INDEX_DTYPE)])
    return values, metadata, capacity_for(int(padded.max()))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", default=["11008x4096", "4096x11008", "4096x4096"])
    parser.add_argument("--densities", nargs="*", type=float, default=[0.3, 0.1, 0.05])
    parser.add_argument("--ms", nargs="*", type=int, default=[64])
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    points = []
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        for density in args.densities:
            w = unstructured_weight(n, k, density, torch.float16, gen)
            csr = CsrKernelWeight.pack(w)
            bitmap = pack_bitmap(w)
            assert bitmap[2] == csr.capacity
            points.append((n, k, density, w, {"slots": (csr.values, csr.metadata), "bitmap": bitmap[:2]},
                           csr.capacity))
    specs = {KernelSpec(Family.CSR_WGMMA_SM90, "float16", tile=(CSR_TILE_N, tile_m_for(m), capacity))
             for *_, capacity in points for m in args.ms}
    kernels, failures = build_variants(sorted(specs, key=lambda s: s.tile), TEMPLATES, set(), Path(tempfile.mkdtemp()), KNOBS)
    result = environment("csr_bitmap")
    result["build_failures"] = failures
    print(f"built {len(kernels)}, failed {sorted(failures)}", flush=True)
    for name, stderr in list(failures.items())[:2]:
        print(name, stderr, flush=True)
    for n, k, density, w, packings, capacity in points:
        bias = torch.randn(n, generator=gen).half().cuda()
        for m in args.ms:
            x = torch.randn(m, k, generator=gen).half().cuda()
            ref = torch.relu(x.float() @ w.float().t() + bias.float())
            base = {"M": m, "N": n, "K": k, "density": density, "capacity": capacity}
            fn, copies = rotating(lambda w_: torch.relu(F.linear(x, w_, bias)), w)
            result["rows"].append({"impl": "cublas", **base, "us": time_graph_us(fn, calls=copies)})
            spec = KernelSpec(Family.CSR_WGMMA_SM90, "float16", tile=(CSR_TILE_N, tile_m_for(m), capacity))
            for name in TEMPLATES:
                values, metadata = packings["slots" if name == "slots" else "bitmap"]
                if (name, spec) not in kernels:
                    continue
                y = torch.empty(m, n, dtype=torch.float16, device="cuda")
                run, splits = call(kernels[(name, spec)], values, metadata, x, bias, y, n, k, 1)
                fn, copies = rotating(run, values, metadata)
                nbytes = values.numel() * 2 + metadata.numel() * 4
                result["rows"].append({"impl": name, **base, "splits": splits or 1, "nbytes": nbytes,
                                       "rel_err": rel_err(fn(), ref), "us": time_graph_us(fn, calls=copies)})
            here = [r for r in result["rows"] if all(r[key] == base[key] for key in ("M", "N", "K", "density"))]
            print(f"M={m} {n}x{k} d={density}: " + " ".join(
                f"{r['impl']}={r['us']:.1f}" + (f"(err {r['rel_err']:.1e}, {r['nbytes'] / 2**20:.0f} MiB)" if "rel_err" in r else "")
                for r in here), flush=True)
            (Path(os.environ.get("OUT", "/tmp")) / "csr_bitmap.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
