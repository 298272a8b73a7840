"""The bitmap packing and its kernel's configuration (sparsecc.kernels.bitmap), on the CPU: exact
round trips, the dense tile the kernel's helper warps rebuild from bits and values (their
algorithm replayed here), bytes, capacities, shared memory and refusals."""
import subprocess

import pytest
import torch

from sparsecc.codegen.spec import BITMAP_LAYOUT, TILES, Family, KernelSpec
from sparsecc.errors import InputError, SparseccError
from sparsecc.ir.analysis import analyze
from sparsecc.ir.formats import CSR, NM_2_4
from sparsecc.kernels.bitmap import GROUPS, WORDS, BitmapKernelWeight, BitmapTiled, bit_positions, dispatch
from sparsecc.kernels.csr import TILE_K, CsrKernelWeight, slot
from sparsecc.kernels.csr import dispatch as csr_dispatch
from sparsecc.runtime import loader

from conftest import host_program, requires_nvcc
from kernel_families.test_csr import unstructured
from sparsecc.codegen.render import render


def rebuilt_tile(packed, tile):
    """Tile ``tile`` as the kernel's helper warps write it into shared memory: the lane holding
    word ``w`` starts at its group's offset plus the set bits of its warp's lower words and
    writes its bits' values, lowest bit first, to slots ``b * WORDS + w``."""
    words = [int(v) & 0xFFFFFFFF for v in packed.bits[tile]]
    group_ptr = packed.group_ptr.long()
    shared = torch.zeros(64 * TILE_K, dtype=packed.values.dtype)
    for w, word in enumerate(words):
        group = w // 32
        following = int(group_ptr[tile * GROUPS + group]) + sum(bin(v).count("1") for v in words[32 * group:w])
        for b in range(32):
            if word >> b & 1:
                shared[b * WORDS + w] = packed.values[following]
                following += 1
    return shared


@pytest.mark.parametrize("shape", [(64, 64), (128, 200), (192, 1040)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_pack_round_trips_and_rebuilds_each_tile_as_the_kernel_does(shape, dtype, gen):
    n, k = shape
    weight = unstructured(n, k, 0.3, gen, dtype)
    weight[5] = 0                                                  # an empty row
    packed = BitmapKernelWeight.pack(weight)
    assert torch.equal(packed.to_dense(), weight)
    k_tiles = -(-k // TILE_K)
    assert packed.tile_count == n // 64 * k_tiles and packed.bits.shape == (packed.tile_count, WORDS)
    tile_ptr = packed.group_ptr[::GROUPS].long()
    assert tile_ptr[0] == 0 and (tile_ptr % 8 == 0).all() and tile_ptr[-1] == packed.values.numel()
    row, column = torch.meshgrid(torch.arange(64), torch.arange(TILE_K), indexing="ij")
    for tile in range(packed.tile_count):
        rows, cols = tile // k_tiles * 64, tile % k_tiles * TILE_K
        expected = torch.zeros(64, TILE_K, dtype=dtype)
        part = weight[rows:rows + 64, cols:cols + TILE_K]
        expected[:, :part.shape[1]] = part
        assert torch.equal(rebuilt_tile(packed, tile)[slot(row, column)], expected), tile
        stored = int((expected != 0).sum())                        # then zeros up to a multiple of 8
        assert tile_ptr[tile + 1] - tile_ptr[tile] == -(-stored // 8) * 8
        assert (packed.values[tile_ptr[tile] + stored:tile_ptr[tile + 1]] == 0).all()
    assert packed.metadata.dtype == torch.int32 and packed.spec == CSR


def test_bits_order_lets_a_warps_lanes_write_neighbouring_slots():
    """Bit b of words 0..31 (the lanes of a warp) stands for slots b * WORDS + 0..31: 32
    consecutive 2-byte slots, 16 banks; every element of a tile has exactly one bit."""
    order = bit_positions()
    assert sorted(order.tolist()) == list(range(64 * TILE_K))
    row, column = order // TILE_K, order % TILE_K
    slots = slot(row, column).view(WORDS, 32)                      # [word, bit]
    assert torch.equal(slots, torch.arange(32)[None, :] * WORDS + torch.arange(WORDS)[:, None])


def test_nonfinite_and_negative_values_are_stored_and_zeros_are_not(gen):
    weight = unstructured(64, 128, 0.5, gen)
    weight[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -2.5])
    weight[1, :2] = torch.tensor([0.0, -0.0])
    packed = BitmapKernelWeight.pack(weight)
    assert torch.equal(packed.to_dense().isnan(), weight.isnan())
    assert torch.equal(torch.nan_to_num(packed.to_dense()), torch.nan_to_num(weight))
    assert int((packed.values != 0).sum()) == int((weight != 0).sum())       # -0.0 is not stored


@pytest.mark.parametrize("density", [0.5, 0.3, 0.1])
def test_bytes_scale_with_the_non_zeros(density, gen):
    """2d + 1/8 bytes an element (fp16) plus the padding of each tile's values to 8, as the cost
    model's nbytes counts them; less than the CSR packing's 4d at every density."""
    weight = unstructured(1024, 2048, density, gen, torch.float16)
    packed = BitmapKernelWeight.pack(weight)
    per_element = packed.nbytes / weight.numel()
    assert 2 * density + 1 / 8 <= per_element <= 2 * density + 1 / 8 + 0.01
    assert BitmapTiled().nbytes(analyze(weight), 2) == pytest.approx(packed.nbytes, rel=0.01)
    assert packed.nbytes < CsrKernelWeight.pack(weight).nbytes


def test_capacity_is_the_fullest_tiles_padded_values(gen):
    sparse = BitmapKernelWeight.pack(unstructured(128, 256, 0.1, gen))
    assert sparse.capacity == 512 and 256 < sparse.fullest_tile <= 512
    full = BitmapKernelWeight.pack(torch.randn(64, 128, generator=gen))
    assert full.capacity == 4096 and full.fullest_tile == 4096
    empty = BitmapKernelWeight.pack(torch.zeros(128, 64))
    assert empty.values.numel() == 0 and empty.capacity == 256 and (empty.bits == 0).all()


def test_every_mma_kernel_fits_two_ctas_an_sm():
    """bitmap_sm90's shared memory: per stage x's columns, the values and the bits of its tiles;
    the dense tile twice and the group offsets of a slice (4048 bytes): within 113 KB, three
    stages at least. (bitmap_wgmma_sm90 asserts its own fit when it compiles.)"""
    for tile in TILES[Family.BITMAP_SM90]:
        spec = KernelSpec(Family.BITMAP_SM90, "float16", tile=tile)
        step_k = 64 * spec.csr_step_tiles
        stage = tile[1] * step_k * 2 + tile[2] * spec.csr_step_tiles * 2 + spec.csr_step_tiles * WORDS * 4
        shared = spec.csr_stages * stage + 2 * 64 * step_k * 2 + (252 * GROUPS + 1 + 3) // 4 * 16
        assert 3 <= spec.csr_stages <= 8 and shared <= 113 << 10, tile
        assert spec.symbol.endswith(f"_l{BITMAP_LAYOUT}") and spec.family.csr and spec.family.own_launch


def test_dispatch_is_the_tiled_csr_kernels_on_the_bitmap_packing():
    """The same buckets and rows of x per CTA as the tiled CSR kernels: mma.sync up to 16 rows
    (built for the capacities it has: 1536 runs on 2048), wgmma beyond."""
    for capacity in (1536, 4096):
        table = dispatch(torch.bfloat16, capacity)
        csr_table = csr_dispatch(torch.bfloat16, capacity)
        assert [bound for bound, _ in table] == [bound for bound, _ in csr_table]
        assert [launch.spec.tile for _, launch in table] == [launch.spec.tile for _, launch in csr_table]
        assert [launch.spec.family for _, launch in table] == [
            {Family.CSR_SM90: Family.BITMAP_SM90, Family.CSR_WGMMA_SM90: Family.BITMAP_WGMMA_SM90}[launch.spec.family]
            for _, launch in csr_table]
    assert dispatch(torch.float16, 1536)[0][1].spec.tile == (64, 16, 2048)


def test_refusals_name_the_bitmap_kernel():
    family = BitmapTiled()
    assert "bitmap kernel" in family.refuses(CSR, (100, 256), torch.float16)
    assert "bitmap kernel" in family.refuses(CSR, (128, 250), torch.float16)
    assert "float16/bfloat16" in family.refuses(CSR, (128, 256), torch.float32)
    assert family.refuses(CSR, (128, 256), torch.bfloat16) is None
    assert "CSR" in family.refuses(NM_2_4, (128, 256), torch.float16)
    with pytest.raises(InputError, match="N % 64"):
        BitmapKernelWeight.pack(torch.ones(100, 64))
    with pytest.raises(InputError, match="GPU"):
        family.pack(torch.ones(128, 64, dtype=torch.float16), CSR, 16)


def test_a_kernel_of_another_bitmap_layout_is_refused_with_the_reason():
    """The layout version is part of the bitmap kernel's symbols, as of the CSR kernels'."""
    current = KernelSpec(Family.BITMAP_SM90, "bfloat16", tile=(64, 32, 512)).symbol
    other = current.rsplit("_l", 1)[0] + f"_l{BITMAP_LAYOUT + 1}"
    with pytest.raises(SparseccError, match=rf"another bitmap layout \({BITMAP_LAYOUT + 1}, this sparsecc packs "
                                            rf"layout {BITMAP_LAYOUT}\)"):
        loader.get(other)
    with pytest.raises(SparseccError, match="is not loaded in this process"):
        loader.get(current)


#: appended to the rendered kernel: rebuild every tile of a packed weight read from a file with the
#: kernel's own scatter_word, its tile_count and bits_offset (the metadata layout as the kernel
#: reads it), each word's values starting at its group's offset plus its lower words' set bits
REBUILD = r"""
#include <cstdlib>
#include <fstream>
#include <vector>
int main(int argc, char** argv) {
  using namespace SYMBOL_types;
  const int n = std::atoi(argv[1]), k = std::atoi(argv[2]), count = std::atoi(argv[3]), words = std::atoi(argv[4]);
  std::vector<Element> values(count + 1);
  std::vector<int> meta(words);
  std::ifstream in(argv[5], std::ios::binary);
  in.read(reinterpret_cast<char*>(values.data()), count * sizeof(Element));
  in.read(reinterpret_cast<char*>(meta.data()), words * sizeof(int));
  const int tiles = tile_count(n, k);
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(meta.data() + bits_offset(n, k));
  std::vector<Element> dense(size_t(tiles) * kBlockH * kTileK, Element(0.f));
  for (int t = 0; t < tiles; ++t)
    for (int w = 0; w < kWords; ++w) {
      int lower = 0;
      for (int v = w / 32 * 32; v < w; ++v) lower += __builtin_popcount(bits[size_t(t) * kWords + v]);
      scatter_word(bits[size_t(t) * kWords + w], w, values.data(), meta[t * kGroups + w / 32] + lower,
                   dense.data() + size_t(t) * kBlockH * kTileK);
    }
  std::ofstream(argv[6], std::ios::binary).write(reinterpret_cast<const char*>(dense.data()),
                                                 dense.size() * sizeof(Element));
  return 0;
}
"""


@requires_nvcc
@pytest.mark.nvcc
@pytest.mark.slow
def test_the_kernels_own_scatter_rebuilds_every_tile(tmp_path, gen):
    """The template's scatter_word, tile_count and bits_offset, compiled for the host, rebuild every
    dense tile of a packed weight (odd K, an empty row, a full tile) exactly at its slots."""
    spec = KernelSpec(Family.BITMAP_SM90, "float16", tile=(64, 16, 2048))
    program = host_program(render(spec) + REBUILD.replace("SYMBOL", spec.symbol), tmp_path)
    weight = unstructured(192, 1040, 0.3, gen, torch.float16)
    weight[5] = 0
    weight[64:128, :64] = torch.randn(64, 64, generator=gen).half()
    packed = BitmapKernelWeight.pack(weight)
    (tmp_path / "packed.bin").write_bytes(packed.values.numpy().tobytes() + packed.metadata.numpy().tobytes())
    subprocess.run([str(program), "192", "1040", str(packed.values.numel()), str(packed.metadata.numel()),
                    str(tmp_path / "packed.bin"), str(tmp_path / "dense.bin")], check=True)
    tiles = torch.frombuffer(bytearray((tmp_path / "dense.bin").read_bytes()), dtype=torch.float16)
    tiles = tiles.view(packed.tile_count, 64 * TILE_K)
    row, column = torch.meshgrid(torch.arange(64), torch.arange(TILE_K), indexing="ij")
    k_tiles = -(-1040 // TILE_K)
    for tile in range(packed.tile_count):
        expected = torch.zeros(64, TILE_K, dtype=torch.float16)
        part = weight[tile // k_tiles * 64:tile // k_tiles * 64 + 64, tile % k_tiles * TILE_K:][:, :TILE_K]
        expected[:, :part.shape[1]] = part
        assert torch.equal(tiles[tile][slot(row, column)], expected), tile
