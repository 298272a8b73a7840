// Prototype: 2:4 sparse linear for small batches (M = 1..64) on tensor cores, y = act(x W^T + b).
//
// The small-batch 2:4 kernel (templates/gemv_sm90_sparse24) multiplies on CUDA cores: at M=1 it
// reads the weight at 85-94% of copy bandwidth, but from M = 4 its arithmetic, not its loads,
// bounds it. This one feeds the same bytes to sparse tensor cores (mma.sp m16n8k32, through
// CUTLASS's arch::SparseMma): W is the sparse A operand (16 output features x 32 inputs per
// instruction), x^T the dense B operand (8 rows of x per instruction).
//
// Weight layout (sparse24_mma_small_batch.py, `mma_layout`): units of 16 output features x 64
// inputs, 1152 bytes each, [N/16][K/64]: 2 x 512 bytes of kept values, one 16-byte fragment per
// lane in the order mma.sp's A operand wants it (rows g, g + 8 and compressed columns 2t, 2t + 1,
// 2t + 8, 2t + 9 for lane 4g + t), then 128 bytes of metadata, a 32-bit word per lane holding
// both 32-input halves' metadata (the first half read by lanes 4q + {0, 1} with sparsity
// selector 0, the second by lanes 4q + {2, 3} with selector 1). Every load is 16 or 4 bytes per
// lane of one contiguous 512 or 128-byte span: the weight streams at full width.
//
// Work: a CTA of WARPS warps owns WARPS x 16 output features; a cluster of CLUSTER CTAs splits K
// between them (the partial sums meet in distributed shared memory), so that small N still
// fills the GPU. Each CTA stages its slice of x (rows padded to a multiple of 8 with zeros) in
// shared memory, from which ldmatrix gives the B fragments; U units of W per warp are in flight.
//
// NaN and Inf of x propagate as in dense F.linear: staging x tests every input
// (__syncthreads_or); only when one is not finite does each warp look, in its K slice, for the
// outputs whose weight row skips it and make their partial sum NaN.
#include <cstdint>
#include <cstdio>
#include <cuda_runtime.h>
#include <cooperative_groups.h>

#include "cutlass/cutlass.h"
#include "cutlass/numeric_types.h"
#include "cutlass/array.h"
#include "cutlass/arch/mma_sparse_sm80.h"
#include "cute/arch/copy_sm75.hpp"

namespace cg = cooperative_groups;

namespace {
constexpr int kUnitBytes = 1152;     // 16 x 64 weights at 2:4: 1024 bytes of values, 128 of metadata
constexpr int kValueBytes = 512;     // one 16 x 32 half of a unit

template <class T>
using SparseMma = cutlass::arch::SparseMma<cutlass::gemm::GemmShape<16, 8, 32>, 32, T, cutlass::layout::RowMajor,
                                           T, cutlass::layout::ColumnMajor, float, cutlass::layout::RowMajor,
                                           cutlass::arch::OpMultiplyAdd, cutlass::arch::SPFormatType::Thread>;

__device__ __forceinline__ uint4 load16(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }
__device__ __forceinline__ uint32_t load4(const void* p) { return __ldg(reinterpret_cast<const uint32_t*>(p)); }

template <class T>
__device__ __forceinline__ bool nonfinite(uint16_t bits) {
  constexpr uint16_t kExponent = std::is_same_v<T, cutlass::half_t> ? 0x7C00 : 0x7F80;
  return (bits & kExponent) == kExponent;
}

template <class T>
__device__ __forceinline__ bool any_nonfinite8(uint4 v) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  bool bad = false;
#pragma unroll
  for (int i = 0; i < 4; ++i) bad |= nonfinite<T>(w[i] & 0xFFFF) | nonfinite<T>(w[i] >> 16);
  return bad;
}

// Whether row r (0..15) of a unit stores input kk (0..63), read from the unit's metadata words.
__device__ __forceinline__ bool stores(const uint8_t* unit, int r, int kk) {
  const int s = kk / 32, piece = (kk % 32) / 16, group = (kk % 16) / 4, position = kk % 4;
  const int lane = 4 * (r % 8) + 2 * s + piece;
  const uint32_t word = load4(unit + 2 * kValueBytes + 4 * lane);
  const uint32_t bits = r < 8 ? (word & 0xFFFF) : (word >> 16);
  const uint32_t code = (bits >> (4 * group)) & 15u;
  return int(code & 3u) == position || int(code >> 2) == position;
}

template <class T, int WARPS, int CLUSTER, int MT, int U>
__global__ void __launch_bounds__(WARPS * 32)
sparse24_mma_small_batch(const uint8_t* __restrict__ w, const T* __restrict__ x, const T* __restrict__ bias,
                         T* __restrict__ y, int n_out, int m, int k, int relu) {
  extern __shared__ __align__(16) uint8_t smem[];
  const int units_k = k / 64;
  const int per_rank = (units_k + CLUSTER - 1) / CLUSTER;
  int rank = 0;
  if constexpr (CLUSTER > 1) rank = static_cast<int>(cg::this_cluster().block_rank());
  const int group = blockIdx.x / CLUSTER;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int tile = group * WARPS + warp;
  const bool active = tile < n_out / 16;
  const int u0 = rank * per_rank;
  const int units = max(0, min(units_k, u0 + per_rank) - u0);
  const int stride = per_rank * 64 + 8;                 // x row in shared memory (elements): +16 bytes, no bank conflicts
  T* xs = reinterpret_cast<T*>(smem);
  float* partial = reinterpret_cast<float*>(smem + ((MT * 8 * stride * 2 + 15) / 16) * 16);   // [WARPS * 16][MT * 8]

  // 1. the first U units of W in flight before x is staged
  const uint8_t* wunit = w + (static_cast<size_t>(active ? tile : 0) * units_k + u0) * kUnitBytes;
  uint4 a0[U], a1[U];
  uint32_t e[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (active && u < units) {
      const uint8_t* p = wunit + static_cast<size_t>(u) * kUnitBytes;
      a0[u] = load16(p + 16 * lane);
      a1[u] = load16(p + kValueBytes + 16 * lane);
      e[u] = load4(p + 2 * kValueBytes + 4 * lane);
    }
  }

  // 2. this CTA's slice of x, rows m .. MT * 8 zero; any input not finite?
  int bad = 0;
  const int vectors = units * 8;                        // 16-byte vectors per row of the slice
  for (int i = threadIdx.x; i < MT * 8 * vectors; i += WARPS * 32) {
    const int r = i / vectors, v = i % vectors;
    uint4 value = make_uint4(0, 0, 0, 0);
    if (r < m) {
      value = load16(x + static_cast<size_t>(r) * k + u0 * 64 + v * 8);
      bad |= any_nonfinite8<T>(value);
    }
    *reinterpret_cast<uint4*>(xs + r * stride + v * 8) = value;
  }
  const int nonfinite_x = __syncthreads_or(bad);

  // 3. the products
  float acc[MT][4];
#pragma unroll
  for (int t = 0; t < MT; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
  SparseMma<T> mma;
  if (active) {
    for (int base = 0; base < units; base += U) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int unit = base + u;
        if (unit < units) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const auto& a = reinterpret_cast<const typename SparseMma<T>::FragmentA&>(half ? a1[u] : a0[u]);
#pragma unroll
            for (int t = 0; t < MT; ++t) {
              typename SparseMma<T>::FragmentB b;
              uint32_t* breg = reinterpret_cast<uint32_t*>(&b);
              const T* row = xs + (t * 8 + lane % 8) * stride + unit * 64 + half * 32 + (lane / 8) * 8;
              cute::SM75_U32x4_LDSM_N::copy(*reinterpret_cast<const cute::uint128_t*>(row),
                                            breg[0], breg[1], breg[2], breg[3]);
              auto& c = reinterpret_cast<typename SparseMma<T>::FragmentC&>(acc[t]);
              mma(c, a, b, c, e[u], half);
            }
          }
          const int next = unit + U;
          if (next < units) {
            const uint8_t* p = wunit + static_cast<size_t>(next) * kUnitBytes;
            a0[u] = load16(p + 16 * lane);
            a1[u] = load16(p + kValueBytes + 16 * lane);
            e[u] = load4(p + 2 * kValueBytes + 4 * lane);
          }
        }
      }
    }
  }

  // 4. partial sums to shared memory: lane 4g + t holds rows g, g + 8 and columns 2t, 2t + 1
  const int cols = MT * 8;
  const int g = lane / 4, tq = lane % 4;
#pragma unroll
  for (int t = 0; t < MT; ++t) {
    float* p = partial + (warp * 16 + g) * cols + t * 8 + 2 * tq;
    p[0] = acc[t][0];
    p[1] = acc[t][1];
    p[8 * cols] = acc[t][2];
    p[8 * cols + 1] = acc[t][3];
  }
  if (nonfinite_x && active) {          // rare: NaN where a non-finite input meets a skipped weight
    __syncwarp();
    for (int i = lane; i < m * units * 64; i += 32) {
      const int r_x = i / (units * 64), kk = i % (units * 64);
      const T value = xs[r_x * stride + kk];
      if (!nonfinite<T>(reinterpret_cast<const uint16_t&>(value))) continue;
      const uint8_t* unit = wunit + static_cast<size_t>(kk / 64) * kUnitBytes;
      for (int r = 0; r < 16; ++r)
        if (!stores(unit, r, kk % 64)) partial[(warp * 16 + r) * cols + r_x] = __int_as_float(0x7fc00000);
    }
  }

  // 5. the cluster's partial sums added, the epilogue, y stored (consecutive threads: consecutive features)
  if constexpr (CLUSTER > 1) cg::this_cluster().sync(); else __syncthreads();
  const int rows = WARPS * 16;
  const int outputs = rows * m;
  const int share = (outputs + CLUSTER - 1) / CLUSTER;
  for (int o = rank * share + threadIdx.x; o < min(outputs, (rank + 1) * share); o += WARPS * 32) {
    const int r = o % rows, col = o / rows;
    const int feature = group * rows + r;
    float sum = 0.f;
    if constexpr (CLUSTER > 1) {
      cg::cluster_group cluster = cg::this_cluster();
#pragma unroll
      for (int c = 0; c < CLUSTER; ++c) sum += cluster.map_shared_rank(partial, c)[r * cols + col];
    } else {
      sum = partial[r * cols + col];
    }
    if (feature < n_out) {
      if (bias != nullptr) sum += float(bias[feature]);
      if (relu && !isnan(sum)) sum = fmaxf(sum, 0.f);
      y[static_cast<size_t>(col) * n_out + feature] = T(sum);
    }
  }
  if constexpr (CLUSTER > 1) cg::this_cluster().sync();    // peers read this CTA's partial sums until here
}

// v2, for m <= 8: no staging. Lane 4g + t loads the B fragments of x row g itself (4-byte loads,
// L1 resident), so the products start with the first weight bytes; the CTA's warps split K
// (a cluster of CLUSTER CTAs splits it further) and their partial sums meet in shared memory.
// R tiles of 16 output features per CTA.
template <class T, int WARPS, int CLUSTER, int R, int U>
__global__ void __launch_bounds__(WARPS * 32)
sparse24_mma_direct(const uint8_t* __restrict__ w, const T* __restrict__ x, const T* __restrict__ bias,
                    T* __restrict__ y, int n_out, int m, int k, int relu) {
  __shared__ float partial[WARPS][R * 16][8];
  const int units_k = k / 64;
  const int per_split = (units_k + CLUSTER * WARPS - 1) / (CLUSTER * WARPS);
  int rank = 0;
  if constexpr (CLUSTER > 1) rank = static_cast<int>(cg::this_cluster().block_rank());
  const int group = blockIdx.x / CLUSTER;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, tq = lane % 4;
  const int u0 = (rank * WARPS + warp) * per_split;
  const int units = max(0, min(units_k, u0 + per_split) - u0);
  const int tiles = n_out / 16;
  const bool row_of_x = g < m;
  const T* xrow = x + static_cast<size_t>(row_of_x ? g : 0) * k + static_cast<size_t>(u0) * 64 + 2 * tq;

  const uint8_t* wunit[R];
#pragma unroll
  for (int r = 0; r < R; ++r)
    wunit[r] = w + (static_cast<size_t>(min(group * R + r, tiles - 1)) * units_k + u0) * kUnitBytes;
  uint4 a0[U][R], a1[U][R];
  uint32_t e[U][R];
  uint32_t b[U][8];
  auto load = [&](int slot, int unit) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const uint8_t* p = wunit[r] + static_cast<size_t>(unit) * kUnitBytes;
      a0[slot][r] = load16(p + 16 * lane);
      a1[slot][r] = load16(p + kValueBytes + 16 * lane);
      e[slot][r] = load4(p + 2 * kValueBytes + 4 * lane);
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) b[slot][i] = row_of_x ? load4(xrow + unit * 64 + 8 * i) : 0u;
  };
#pragma unroll
  for (int u = 0; u < U; ++u)
    if (u < units) load(u, u);

  float acc[R][4];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = 0.f;
  bool bad = false;
  SparseMma<T> mma;
  for (int base = 0; base < units; base += U) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int unit = base + u;
      if (unit < units) {
#pragma unroll
        for (int i = 0; i < 8; ++i) bad |= nonfinite<T>(b[u][i] & 0xFFFF) | nonfinite<T>(b[u][i] >> 16);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const auto& bf = reinterpret_cast<const typename SparseMma<T>::FragmentB&>(b[u][4 * half]);
#pragma unroll
          for (int r = 0; r < R; ++r) {
            const auto& a = reinterpret_cast<const typename SparseMma<T>::FragmentA&>(half ? a1[u][r] : a0[u][r]);
            auto& c = reinterpret_cast<typename SparseMma<T>::FragmentC&>(acc[r]);
            mma(c, a, bf, c, e[u][r], half);
          }
        }
        if (unit + U < units) load(u, unit + U);
      }
    }
  }

#pragma unroll
  for (int r = 0; r < R; ++r) {
    partial[warp][r * 16 + g][2 * tq] = acc[r][0];
    partial[warp][r * 16 + g][2 * tq + 1] = acc[r][1];
    partial[warp][r * 16 + g + 8][2 * tq] = acc[r][2];
    partial[warp][r * 16 + g + 8][2 * tq + 1] = acc[r][3];
  }
  if (__syncthreads_or(bad)) {           // rare: NaN where a non-finite input meets a skipped weight
    for (int i = lane; i < m * units * 64; i += 32) {
      const int r_x = i / (units * 64), kk = i % (units * 64);
      const T value = x[static_cast<size_t>(r_x) * k + u0 * 64 + kk];
      if (!nonfinite<T>(reinterpret_cast<const uint16_t&>(value))) continue;
      for (int r = 0; r < R; ++r) {
        const uint8_t* unit = wunit[r] + static_cast<size_t>(kk / 64) * kUnitBytes;
        for (int row = 0; row < 16; ++row)
          if (!stores(unit, row, kk % 64)) partial[warp][r * 16 + row][r_x] = __int_as_float(0x7fc00000);
      }
    }
  }
  if constexpr (CLUSTER > 1) cg::this_cluster().sync(); else __syncthreads();
  const int rows = R * 16, outputs = rows * m, share = (outputs + CLUSTER - 1) / CLUSTER;
  for (int o = rank * share + threadIdx.x; o < min(outputs, (rank + 1) * share); o += WARPS * 32) {
    const int r = o % rows, col = o / rows, feature = group * rows + r;
    float sum = 0.f;
    if constexpr (CLUSTER > 1) {
      cg::cluster_group cluster = cg::this_cluster();
#pragma unroll
      for (int c = 0; c < CLUSTER; ++c) {
        const float* peer = cluster.map_shared_rank(&partial[0][0][0], c);
#pragma unroll
        for (int v = 0; v < WARPS; ++v) sum += peer[(v * rows + r) * 8 + col];
      }
    } else {
#pragma unroll
      for (int v = 0; v < WARPS; ++v) sum += partial[v][r][col];
    }
    if (feature < n_out) {
      if (bias != nullptr) sum += float(bias[feature]);
      if (relu && !isnan(sum)) sum = fmaxf(sum, 0.f);
      y[static_cast<size_t>(col) * n_out + feature] = T(sum);
    }
  }
  if constexpr (CLUSTER > 1) cg::this_cluster().sync();
}

template <class T, int WARPS, int CLUSTER, int R, int U>
int launch_direct(const void* w, const void* x, const void* bias, void* y, int n_out, int m, int k, int relu,
                  void* stream) {
  if (k % 64 || n_out % 16 || m < 1 || m > 8) return 3;
  auto kernel = sparse24_mma_direct<T, WARPS, CLUSTER, R, U>;
  const int groups = (n_out / 16 + R - 1) / R;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(groups * CLUSTER);
  config.blockDim = dim3(WARPS * 32);
  config.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = CLUSTER;
  attribute[0].val.clusterDim.y = 1;
  attribute[0].val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = CLUSTER > 1 ? 1 : 0;
  cudaError_t error = cudaLaunchKernelEx(&config, kernel, static_cast<const uint8_t*>(w), static_cast<const T*>(x),
                                         static_cast<const T*>(bias), static_cast<T*>(y), n_out, m, k, relu);
  if (error != cudaSuccess) {
    fprintf(stderr, "launch: %s\n", cudaGetErrorString(error));
    cudaGetLastError();
    return 7;
  }
  return 0;
}

template <class T, int WARPS, int CLUSTER, int MT, int U>
int launch(const void* w, const void* x, const void* bias, void* y, int n_out, int m, int k, int relu, void* stream) {
  if (k % 64 || n_out % 16 || m < 1 || m > MT * 8) return 3;
  auto kernel = sparse24_mma_small_batch<T, WARPS, CLUSTER, MT, U>;
  const int per_rank = (k / 64 + CLUSTER - 1) / CLUSTER;
  const size_t xs_bytes = ((MT * 8 * (per_rank * 64 + 8) * 2 + 15) / 16) * 16;
  const size_t bytes = xs_bytes + WARPS * 16 * MT * 8 * 4;
  if (bytes > 227 * 1024) return 4;
  static bool configured = false;       // the largest shared-memory size once, for every shape
  if (!configured) {
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024) != cudaSuccess) return 5;
    if (CLUSTER > 8 && cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess) return 6;
    configured = true;
  }
  const int groups = (n_out / 16 + WARPS - 1) / WARPS;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(groups * CLUSTER);
  config.blockDim = dim3(WARPS * 32);
  config.dynamicSmemBytes = bytes;
  config.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = CLUSTER;
  attribute[0].val.clusterDim.y = 1;
  attribute[0].val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  cudaError_t error = cudaLaunchKernelEx(&config, kernel, static_cast<const uint8_t*>(w), static_cast<const T*>(x),
                                         static_cast<const T*>(bias), static_cast<T*>(y), n_out, m, k, relu);
  if (error != cudaSuccess) {
    fprintf(stderr, "launch: %s\n", cudaGetErrorString(error));
    cudaGetLastError();
    return 7;
  }
  return 0;
}
}  // namespace

#define ENTRY(NAME, T, W, C, MT, U)                                                                        \
  extern "C" int mma24_##NAME##_w##W##_c##C##_mt##MT##_u##U(const void* w, const void* x, const void* b,    \
                                                            void* y, int n, int m, int k, int relu, void* s) { \
    return launch<T, W, C, MT, U>(w, x, b, y, n, m, k, relu, s);                                           \
  }
#define CLUSTERS(NAME, T, W, MT, U) \
  ENTRY(NAME, T, W, 2, MT, U) ENTRY(NAME, T, W, 4, MT, U) ENTRY(NAME, T, W, 8, MT, U) ENTRY(NAME, T, W, 16, MT, U)

#define DIRECT(NAME, T, W, C, R, U)                                                                      \
  extern "C" int mma24d_##NAME##_w##W##_c##C##_r##R##_u##U(const void* w, const void* x, const void* b,     \
                                                           void* y, int n, int m, int k, int relu, void* s) { \
    return launch_direct<T, W, C, R, U>(w, x, b, y, n, m, k, relu, s);                                     \
  }
#define DIRECTS(NAME, T, W) \
  DIRECT(NAME, T, W, 1, 1, 4) DIRECT(NAME, T, W, 2, 1, 4) DIRECT(NAME, T, W, 4, 1, 4) \
  DIRECT(NAME, T, W, 1, 2, 4) DIRECT(NAME, T, W, 2, 2, 4) DIRECT(NAME, T, W, 4, 2, 4) DIRECT(NAME, T, W, 1, 1, 2)

#if PART == 0
CLUSTERS(f16, cutlass::half_t, 4, 1, 2) CLUSTERS(f16, cutlass::half_t, 8, 1, 2)
CLUSTERS(f16, cutlass::half_t, 4, 1, 4) CLUSTERS(f16, cutlass::half_t, 8, 1, 4)
#elif PART == 1
CLUSTERS(f16, cutlass::half_t, 4, 2, 2) CLUSTERS(f16, cutlass::half_t, 8, 2, 2)
CLUSTERS(f16, cutlass::half_t, 4, 2, 4) CLUSTERS(f16, cutlass::half_t, 8, 2, 4)
#elif PART == 2
CLUSTERS(f16, cutlass::half_t, 4, 4, 2) CLUSTERS(f16, cutlass::half_t, 8, 4, 2)
CLUSTERS(f16, cutlass::half_t, 4, 4, 4) CLUSTERS(f16, cutlass::half_t, 8, 4, 4)
#elif PART == 3
CLUSTERS(f16, cutlass::half_t, 4, 8, 2) CLUSTERS(f16, cutlass::half_t, 8, 8, 2)
CLUSTERS(f16, cutlass::half_t, 4, 8, 4) CLUSTERS(f16, cutlass::half_t, 8, 8, 4)
#elif PART == 5
DIRECTS(f16, cutlass::half_t, 4) DIRECTS(f16, cutlass::half_t, 8)
#elif PART == 6
DIRECTS(bf16, cutlass::bfloat16_t, 4) DIRECTS(bf16, cutlass::bfloat16_t, 8)
#elif PART == 4
CLUSTERS(bf16, cutlass::bfloat16_t, 8, 1, 4) CLUSTERS(bf16, cutlass::bfloat16_t, 8, 2, 4)
CLUSTERS(bf16, cutlass::bfloat16_t, 4, 1, 4) CLUSTERS(bf16, cutlass::bfloat16_t, 4, 2, 4)
#endif
