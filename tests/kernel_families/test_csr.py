"""The CSR kernel's tiled weight layout and dispatch (sparsecc.kernels.csr), on the CPU: exact
round trips, the layout the template reads, tile capacities, refusals, and the cost model's
and the plan's view of an unstructured site where the kernel runs."""
import pytest
import torch

from sparsecc.codegen.spec import CSR_CAPACITIES, CSR_LAYOUT, CSR_SM90_CAPACITIES, TILES, Family, KernelSpec
from sparsecc.errors import InputError, SparseccError
from sparsecc.ir.analysis import analyze
from sparsecc.ir.formats import CSR
from sparsecc.kernels import registry
from sparsecc.kernels.csr import (CSR_BUCKETS, DEFAULT_TILE_M, TILE_K, CsrKernelWeight, capacity_for, coordinates,
                                  dispatch, k_slices, kernel_spec, resident_ctas, shape_supported, slot, tile_m_for)
from sparsecc.planner.cost import CostModel, format_nbytes
from sparsecc.runtime import loader


def unstructured(n, k, density, gen, dtype=torch.float32):
    dense = torch.randn(n, k, generator=gen)
    return (dense * (torch.rand(n, k, generator=gen) < density)).to(dtype)


@pytest.mark.parametrize("shape", [(64, 64), (128, 200), (192, 1040)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_pack_round_trips_and_stores_tiles_as_the_kernel_reads_them(shape, dtype, gen):
    n, k = shape
    weight = unstructured(n, k, 0.3, gen, dtype)
    weight[5] = 0                                                  # an empty row
    packed = CsrKernelWeight.pack(weight)
    assert torch.equal(packed.to_dense(), weight)
    ptr, slots = packed.tile_ptr.long(), packed.slots
    k_tiles = -(-k // TILE_K)
    assert packed.tile_count == n // 64 * k_tiles and ptr[0] == 0 and (ptr % 8 == 0).all()
    assert packed.values.numel() == slots.numel() == ptr[-1]
    for tile in range(packed.tile_count):                          # what the kernel scatters for each tile
        rows, cols = tile // k_tiles * 64, tile % k_tiles * TILE_K
        expected = torch.zeros(64, TILE_K, dtype=dtype)
        part = weight[rows:rows + 64, cols:cols + TILE_K]
        expected[:, :part.shape[1]] = part
        shared = torch.zeros(64 * TILE_K, dtype=dtype)             # the kernel's copy of the tile
        entries = range(ptr[tile].item(), ptr[tile + 1].item())
        for e in entries:                                          # padding included, no test for it
            shared[slots[e]] = packed.values[e]
        assert len(entries) == -(-int((expected != 0).sum()) // 8) * 8
        row, column = torch.meshgrid(torch.arange(64), torch.arange(TILE_K), indexing="ij")
        assert torch.equal(shared[slot(row, column)], expected), tile
        real = int((expected != 0).sum())                          # then copies of the last one
        assert len(set(slots[ptr[tile]:ptr[tile] + real].tolist())) == real
        assert set(slots[ptr[tile] + real:ptr[tile + 1]].tolist()) <= {slots[ptr[tile] + real - 1].item()}
    assert packed.metadata.dtype == torch.int32 and packed.spec == CSR
    assert packed.nbytes == packed.values.numel() * weight.element_size() + packed.metadata.numel() * 4


def test_slots_are_the_128_byte_swizzle_that_wgmma_reads():
    """A tile's rows are 128 bytes; the hardware's 128-byte swizzle (TMA and wgmma) XORs bits
    4-6 of a byte address with bits 7-9 (the tile starts 1024-byte aligned)."""
    row, column = torch.meshgrid(torch.arange(64), torch.arange(TILE_K), indexing="ij")
    plain = row * 128 + column * 2
    swizzled = plain ^ (((plain >> 7) & 7) << 4)
    assert torch.equal(slot(row, column) * 2, swizzled)


def test_slots_are_a_bijection_on_a_tile_that_ldmatrix_reads_without_conflicts():
    row, column = torch.meshgrid(torch.arange(64), torch.arange(TILE_K), indexing="ij")
    slots = slot(row, column)
    assert sorted(slots.flatten().tolist()) == list(range(64 * TILE_K))
    back_row, back_column = coordinates(slots)
    assert torch.equal(back_row, row) and torch.equal(back_column, column)
    # one ldmatrix phase reads 8 rows of one 16-byte chunk: they land in 8 different 16-byte bank groups
    for chunk in range(8):
        groups = {(slot(torch.tensor(r), torch.tensor(chunk * 8)).item() % 64) // 8 for r in range(8)}
        assert len(groups) == 8


def test_capacity_is_the_smallest_that_holds_the_fullest_tile(gen):
    assert [capacity_for(c) for c in (0, 8, 260, 1024, 1032, 1544, 4096)] == [256, 256, 512, 1024, 1536, 2048, 4096]
    sparse = CsrKernelWeight.pack(unstructured(128, 256, 0.1, gen))
    assert sparse.capacity == 512 and 256 < sparse.fullest_tile <= 512
    full = CsrKernelWeight.pack(torch.randn(64, 128, generator=gen))
    assert full.capacity == 4096 and full.fullest_tile == 4096 and full.values.numel() == 64 * 128
    empty = CsrKernelWeight.pack(torch.zeros(128, 64))
    assert empty.values.numel() == 0 and empty.capacity == CSR_CAPACITIES[0]
    assert torch.equal(empty.to_dense(), torch.zeros(128, 64))


def test_refusals():
    with pytest.raises(InputError, match="N % 64"):
        CsrKernelWeight.pack(torch.ones(96, 64))
    with pytest.raises(InputError, match="GPU"):
        registry.CSR_TILED.pack(torch.ones(64, 64, dtype=torch.float16), CSR, None)
    assert "float16/bfloat16" in shape_supported(64, 64, torch.float32)
    assert "K % 16" in shape_supported(64, 72, torch.float16)
    assert shape_supported(11008, 4096, torch.bfloat16) is None
    with pytest.raises(InputError, match="tile"):
        KernelSpec(Family.CSR_SM90, "float16", tile=(64, 16, 300))
    with pytest.raises(InputError):
        KernelSpec(Family.CSR_SM90, "float16", tile=(64, 16, 1024), x_transposed=True)


def test_dispatch_has_a_kernel_per_bucket_and_deep_pipelines_for_sparse_tiles():
    for capacity in CSR_CAPACITIES:
        table = dispatch(torch.bfloat16, capacity)
        assert [bound for bound, _ in table] == [bound for bound, _ in CSR_BUCKETS]
        assert all(launch.spec.tile in TILES[launch.spec.family] and launch.spec.tile[2] >= capacity
                   for _, launch in table)
        assert all(launch.spec.tile[2] == capacity for _, launch in table if launch.spec.family is Family.CSR_WGMMA_SM90)
        # mma.sync tiles of 16 rows up to 16 rows of x, wgmma (64 rows a warpgroup) beyond
        assert [launch.spec.family for _, launch in table] == [Family.CSR_SM90] * 2 + [Family.CSR_WGMMA_SM90] * 3
    assert tile_m_for(1) == DEFAULT_TILE_M[1] == 16 and tile_m_for(100_000) == DEFAULT_TILE_M[0]
    for tile in TILES[Family.CSR_SM90]:             # two CTAs per SM, three stages at least (the helper warps' ring)
        spec = KernelSpec(Family.CSR_SM90, "float16", tile=tile)
        step_k = 64 * spec.csr_step_tiles
        offsets = 1024
        shared = (spec.csr_stages * (tile[1] * step_k * 2 + tile[2] * spec.csr_step_tiles * 4) + 2 * 64 * step_k * 2
                  + offsets)
        assert 3 <= spec.csr_stages <= 8 and shared <= 113 << 10, tile
    steps = [KernelSpec(Family.CSR_SM90, "float16", tile=(64, 16, c)).csr_step_tiles for c in CSR_SM90_CAPACITIES]
    assert steps == sorted(steps, reverse=True) and steps[0] == 4 and steps[-1] == 1
    assert KernelSpec(Family.CSR_SM90, "float16", tile=(64, 32, 2048)).symbol == "sparsecc_csr_sm90_f16_n64_m32_c2048_l2"
    # a 1536 packing: the wgmma kernel's own build, csr_sm90's 2048 one (it has no 1536 build)
    assert kernel_spec("float16", 64, 1536).tile == (64, 64, 1536)
    assert kernel_spec("float16", 16, 1536) == KernelSpec(Family.CSR_SM90, "float16", tile=(64, 16, 2048))
    assert all(KernelSpec(Family.CSR_WGMMA_SM90, "float16", tile=tile).csr_step_tiles == 1
               for tile in TILES[Family.CSR_WGMMA_SM90])
    with pytest.raises(InputError, match="tile"):           # a warpgroup multiplies 64 rows of x
        KernelSpec(Family.CSR_WGMMA_SM90, "float16", tile=(64, 16, 1024))


def test_cost_model_runs_unstructured_weights_on_the_kernel_where_it_can(gen):
    """With kernels available a 16-bit CSR site runs on sparsecc's kernels (the tiled kernel's fit, its
    packed size); float32, or in features that no CSR kernel takes, stay on torch's path."""
    weight = unstructured(512, 1024, 0.05, gen, torch.float16)
    model = CostModel("cuda", calibration=None, kernels_unavailable=None)
    stats = analyze(weight)
    assert model.workload(stats, CSR, 16).impl == "csr-kernel"
    assert model.workload(stats, CSR, 16).tile == (64, 16)
    decision = model.decide(stats, 16, [CSR])
    assert decision.choice == CSR and "runs on sparsecc's tiled CSR kernels" in decision.reason
    predicted = next(p.nbytes for p in decision.candidates if p.format == "csr")
    actual = CsrKernelWeight.pack(weight).nbytes
    assert abs(predicted / actual - 1) < 0.02 and predicted < format_nbytes(stats, CSR, 2)
    for other in (weight.float(), unstructured(128, 1020, 0.05, gen, torch.float16)):    # K % 8 != 0: no CSR kernel
        stats = analyze(other)
        assert model.workload(stats, CSR, 16).impl == "csr"
        assert "not sparsecc's kernel: the CSR kernel" in model.decide(stats, 16, [CSR]).reason


def test_plan_kernels_lists_every_capacity_a_csr_site_may_need():
    from types import SimpleNamespace

    from sparsecc.kernels.registry import plan_kernels
    site = SimpleNamespace(choice="csr", dtype="float16", shape=[1024, 4096], density=0.1, m=16)
    specs = [s for s in plan_kernels([site]) if s.family is Family.CSR_SM90]
    assert {s.tile[2] for s in specs} == {1024, 2048, 4096}      # 410 entries a tile on average: the fullest needs 1024
    denser = [s for s in plan_kernels([SimpleNamespace(**{**vars(site), "density": 0.4})]) if s.family is Family.CSR_SM90]
    assert {s.tile[2] for s in denser} == {2048, 4096}
    assert plan_kernels([SimpleNamespace(**{**vars(site), "dtype": "float32"})]) == []


def test_k_slices_fill_the_gpu_without_a_costly_partial_wave():
    """The kernel's split of K (mirrored by k_slices): none while the CTAs fill two slots per SM;
    else the count with the least waves per slice, the smallest among equals."""
    spec16 = KernelSpec(Family.CSR_SM90, "float16", tile=(64, 16, 2048))
    assert k_slices(11008, 16, 4096, spec16, 132) == 3             # 172 CTAs: 516 in two waves of 264
    assert k_slices(4096, 16, 4096, spec16, 132) == 4              # 64 CTAs: 256 in one wave
    spec128 = KernelSpec(Family.CSR_SM90, "float16", tile=(64, 128, 256))
    assert k_slices(11008, 2048, 4096, spec128, 132) == 1
    assert k_slices(768, 2048, 3072, spec128, 132) == 1               # 192 CTAs: one wave, no fp32 slices
    assert k_slices(768, 128, 3072, spec128, 132) == 16                # 12 CTAs: one wave's worth, at most 16
    wgmma128 = KernelSpec(Family.CSR_WGMMA_SM90, "float16", tile=(64, 128, 256))    # one CTA per SM
    assert resident_ctas(wgmma128) == 1 and k_slices(768, 128, 3072, wgmma128, 132) == 11
    wgmma64 = KernelSpec(Family.CSR_WGMMA_SM90, "float16", tile=(64, 64, 2048))
    assert resident_ctas(wgmma64) == 2 and k_slices(11008, 64, 4096, wgmma64, 132) == 3
    for n, k in [(768, 3072), (3072, 768), (1024, 4096), (4096, 11008)]:
        s = k_slices(n, 16, k, spec16, 132)
        ctas = n // 64
        assert 1 <= s <= max(1, -(-k // 64) // (2 * spec16.csr_step_tiles))
        assert -(-ctas * s // 264) / s <= 1.0


def test_a_kernel_of_an_older_csr_layout_is_refused_with_the_reason():
    """The layout version is part of the CSR kernels' symbols: a module saved with weights packed in
    an earlier layout names a kernel that is never loaded, and the error says why."""
    current = KernelSpec(Family.CSR_WGMMA_SM90, "float16", tile=(64, 64, 1024)).symbol
    assert current.endswith(f"_l{CSR_LAYOUT}")
    older = current.rsplit("_l", 1)[0]                      # layout 1 had no suffix
    with pytest.raises(SparseccError, match=r"another tiled CSR layout \(1, this sparsecc packs layout 2\)"):
        loader.get(older)
    with pytest.raises(SparseccError, match="is not loaded in this process"):
        loader.get(current)
