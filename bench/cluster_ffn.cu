// Probe (bench/probe_cluster_ffn.py), not engine code: the Action Cache's whole gathered FFN for one
// layer-step in ONE kernel, its K reduction done inside thread-block clusters through distributed shared
// memory instead of through L2 (the split-K fix-up that did not pay, README) or a second kernel.
//
//   delta[m, n] = gelu_tanh(x[m] . Wg[idx[n]]) * (x[m] . Wu[idx[n]]) - anchor[m, idx[n]]   (rounded to bf16)
//   partials[c, m, :] = sum over the 128 neurons n of chunk c of delta[m, n] * down_t[idx[n], :]
//
// The selected neurons come in chunks of 128; a cluster of 8 CTAs takes one chunk. CTA j of a cluster
// holds the chunk's gate/up weights for K slice j and its down-projection weights for output columns
// slice j (96 KB, fetched before the PDL wait, i.e. while the previous kernel runs). After the wait:
//   1. partial gate/up sums over K slice j -> its shared memory (fp32, 64 x 128 each);
//   2. cluster barrier; CTA j sums neurons [16j, 16j+16) over the 8 CTAs' partials (DSMEM), applies the
//      GeGLU and subtracts the anchor -> 64 x 16 bf16 in its shared memory;
//   3. cluster barrier; every CTA gathers all 128 neurons' deltas (DSMEM), then multiplies them by its
//      down-projection slice -> partials[c, :, slice j] (fp32, rows padded to 64).
// add_norm sums the chunks' partials (its split-K input), adds the anchor's FFN output and the residual.
// Shapes: width (K and the output) 1024 = 8 slices of 128, rows <= 64, selected neurons a multiple of 128.

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <unordered_set>
#include <mma.h>
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

namespace cg = cooperative_groups;
using namespace nvcuda;
using bf16 = __nv_bfloat16;

constexpr int CLUSTER = 8;     // CTAs per cluster = K slices = output column slices
constexpr int WIDTH = 1024;    // the action expert's width (pi05): K of gate/up, N of down
constexpr int SLICE = WIDTH / CLUSTER;  // 128
constexpr int CHUNK = 128;     // neurons per cluster
constexpr int ROWS = 64;       // activation rows, padded
constexpr int THREADS = 256;   // 8 warps
constexpr int PAD = 8;         // bf16 row padding (16 bytes) against bank conflicts
constexpr int LDW = SLICE + PAD;        // 136: rows of the weight and activation tiles
constexpr int LDF = CHUNK + 4;          // 132: rows of the fp32 partial sums
constexpr int OWN = CHUNK / CLUSTER;    // 16 neurons finished by each CTA

// Shared memory, 89.6 KB, so that two CTAs fit on an SM: the GPU then holds all 16 clusters at once (at
// 187 KB, one CTA per SM, it held 15 and ran the 16th in a second wave). The gate/up weights' space is
// reused for the partial sums once the gate/up products are done, then for the down-projection's weights
// (held in registers until then) once the cluster has read the partial sums.
struct Smem {
  union {
    struct {
      bf16 wg[CHUNK][LDW];
      bf16 wu[CHUNK][LDW];
    } gate_up;
    struct {
      float g[ROWS][LDF];
      float u[ROWS][LDF];
    } sums;
    bf16 wd[CHUNK][LDW];
  } big;
  bf16 x[ROWS][LDW];  // the activations' K slice, later all 128 neurons' deltas
  bf16 h[ROWS][OWN];  // this CTA's 16 neurons' deltas, read by the whole cluster
  int idx[CHUNK];     // the chunk's neuron indices
};

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}

__device__ __forceinline__ long long global_ns() {
  long long ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  return ns;
}

__global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(THREADS, 2)
cluster_ffn_kernel(const bf16* __restrict__ x, int m_rows, int stride_x,
                   const bf16* __restrict__ gate_up, int f_total,
                   const bf16* __restrict__ down_t,
                   const int* __restrict__ idx,
                   const bf16* __restrict__ anchor, int stride_anchor,
                   float* __restrict__ partials, long long* __restrict__ stamps) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  Smem& s = *reinterpret_cast<Smem*>(smem_raw);
  cg::cluster_group cluster = cg::this_cluster();
  const int j = static_cast<int>(cluster.block_rank());  // K slice and output slice
  const int c = blockIdx.y;                                // neuron chunk
  const int t = threadIdx.x, warp = t / 32;
  // stamps (diagnostics, may be null): per CTA, the SM's clock at each phase boundary (cycles) and the
  // global timer at start and end (ns)
  long long* stamp = stamps == nullptr ? nullptr : stamps + (blockIdx.y * CLUSTER + j) * 8;
  auto mark = [&](int k) {
    if (stamp != nullptr && t == 0) stamp[k] = clock64();
  };
  if (stamp != nullptr && t == 0) stamp[6] = global_ns();
  mark(0);

  // Before the PDL wait, everything written before the call: indices, weights, the anchor's activations.
  if (t < CHUNK) s.idx[t] = idx[c * CHUNK + t];
  __syncthreads();
  for (int q = t; q < CHUNK * (SLICE / 8); q += THREADS) {  // 16-byte pieces: 128 rows x 16
    const int n = q / (SLICE / 8), piece = (q % (SLICE / 8)) * 8;
    const long row = s.idx[n];
    cp_async16(&s.big.gate_up.wg[n][piece], gate_up + row * WIDTH + j * SLICE + piece);
    cp_async16(&s.big.gate_up.wu[n][piece], gate_up + (f_total + row) * WIDTH + j * SLICE + piece);
  }
  asm volatile("cp.async.commit_group;\n" ::);
  constexpr int WD_PIECES = CHUNK * (SLICE / 8) / THREADS;  // 8 per thread, in registers until phase 3
  uint4 wd[WD_PIECES];
#pragma unroll
  for (int i = 0; i < WD_PIECES; ++i) {
    const int q = t + i * THREADS, n = q / (SLICE / 8), piece = (q % (SLICE / 8)) * 8;
    wd[i] = *reinterpret_cast<const uint4*>(down_t + static_cast<long>(s.idx[n]) * WIDTH + j * SLICE + piece);
  }
  const int r2 = t / 4, n2 = j * OWN + (t % 4) * 4;  // phase 2: this thread's row and 4 neurons
  float anchor_v[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    anchor_v[e] = r2 < m_rows ? __bfloat162float(anchor[static_cast<long>(r2) * stride_anchor + s.idx[n2 + e]])
                              : 0.0f;
  }
  mark(1);
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::);
  for (int q = t; q < ROWS * (SLICE / 8); q += THREADS) {
    const int r = q / (SLICE / 8), piece = (q % (SLICE / 8)) * 8;
    if (r < m_rows) {
      cp_async16(&s.x[r][piece], x + static_cast<long>(r) * stride_x + j * SLICE + piece);
    } else {
      *reinterpret_cast<uint4*>(&s.x[r][piece]) = make_uint4(0, 0, 0, 0);
    }
  }
  asm volatile("cp.async.commit_group;\n" ::);
  asm volatile("cp.async.wait_all;\n" ::: "memory");
  __syncthreads();
  mark(2);

  // 1. partial gate and up sums over K slice j: warp w takes neurons [16w, 16w+16), all 64 rows.
  {
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc_g[ROWS / 16], acc_u[ROWS / 16];
#pragma unroll
    for (int mt = 0; mt < ROWS / 16; ++mt) {
      wmma::fill_fragment(acc_g[mt], 0.0f);
      wmma::fill_fragment(acc_u[mt], 0.0f);
    }
#pragma unroll
    for (int k = 0; k < SLICE; k += 16) {
      wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> bg, bu;
      wmma::load_matrix_sync(bg, &s.big.gate_up.wg[warp * 16][k], LDW);
      wmma::load_matrix_sync(bu, &s.big.gate_up.wu[warp * 16][k], LDW);
#pragma unroll
      for (int mt = 0; mt < ROWS / 16; ++mt) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> a;
        wmma::load_matrix_sync(a, &s.x[mt * 16][k], LDW);
        wmma::mma_sync(acc_g[mt], a, bg, acc_g[mt]);
        wmma::mma_sync(acc_u[mt], a, bu, acc_u[mt]);
      }
    }
    __syncthreads();  // every warp is done with the weights: their space takes the sums
#pragma unroll
    for (int mt = 0; mt < ROWS / 16; ++mt) {
      wmma::store_matrix_sync(&s.big.sums.g[mt * 16][warp * 16], acc_g[mt], LDF, wmma::mem_row_major);
      wmma::store_matrix_sync(&s.big.sums.u[mt * 16][warp * 16], acc_u[mt], LDF, wmma::mem_row_major);
    }
  }
  cluster.sync();
  mark(3);

  // 2. neurons [16j, 16j+16): the 8 slices' partials summed in rank order, GeGLU, minus the anchor.
  {
    float4 gv[CLUSTER], uv[CLUSTER];
#pragma unroll
    for (int rank = 0; rank < CLUSTER; ++rank) {  // all 16 loads in flight before any sum
      gv[rank] = *reinterpret_cast<const float4*>(cluster.map_shared_rank(&s.big.sums.g[r2][n2], rank));
      uv[rank] = *reinterpret_cast<const float4*>(cluster.map_shared_rank(&s.big.sums.u[r2][n2], rank));
    }
    float gs[4] = {0, 0, 0, 0}, us[4] = {0, 0, 0, 0};
#pragma unroll
    for (int rank = 0; rank < CLUSTER; ++rank) {
      gs[0] += gv[rank].x; gs[1] += gv[rank].y; gs[2] += gv[rank].z; gs[3] += gv[rank].w;
      us[0] += uv[rank].x; us[1] += uv[rank].y; us[2] += uv[rank].z; us[3] += uv[rank].w;
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float d = 0.0f;
      if (r2 < m_rows) {
        const float g = gs[e];
        const float z = 0.7978845608028654f * (g + 0.044715f * g * g * g);
        d = g / (1.0f + __expf(-2.0f * z)) * us[e] - anchor_v[e];
      }
      s.h[r2][(t % 4) * 4 + e] = __float2bfloat16(d);
    }
  }
  cluster.sync();  // the cluster has read the sums: their space takes the down-projection's weights

  // 3. all 128 deltas from the cluster (into the activation tile's space), then this CTA's output slice.
#pragma unroll
  for (int i = 0; i < WD_PIECES; ++i) {
    const int q = t + i * THREADS, n = q / (SLICE / 8), piece = (q % (SLICE / 8)) * 8;
    *reinterpret_cast<uint4*>(&s.big.wd[n][piece]) = wd[i];
  }
  for (int q = t; q < CLUSTER * ROWS * 2; q += THREADS) {  // 16-byte pieces: 8 ranks x 64 rows x 2
    const int rank = q / (ROWS * 2), r = (q / 2) % ROWS, half = q % 2;
    const bf16* src = cluster.map_shared_rank(&s.h[r][half * 8], rank);
    *reinterpret_cast<uint4*>(&s.x[r][rank * OWN + half * 8]) = *reinterpret_cast<const uint4*>(src);
  }
  cluster.sync();  // also: no CTA leaves while another still reads its deltas
  mark(4);
  {
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[ROWS / 16];
#pragma unroll
    for (int mt = 0; mt < ROWS / 16; ++mt) wmma::fill_fragment(acc[mt], 0.0f);
#pragma unroll
    for (int k = 0; k < CHUNK; k += 16) {
      wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> b;
      wmma::load_matrix_sync(b, &s.big.wd[k][warp * 16], LDW);
#pragma unroll
      for (int mt = 0; mt < ROWS / 16; ++mt) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> a;
        wmma::load_matrix_sync(a, &s.x[mt * 16][k], LDW);
        wmma::mma_sync(acc[mt], a, b, acc[mt]);
      }
    }
    float* out = partials + static_cast<long>(c) * ROWS * WIDTH + j * SLICE + warp * 16;
#pragma unroll
    for (int mt = 0; mt < ROWS / 16; ++mt) {
      wmma::store_matrix_sync(out + mt * 16 * WIDTH, acc[mt], WIDTH, wmma::mem_row_major);
    }
  }
  mark(5);
  if (stamp != nullptr && t == 0) stamp[7] = global_ns();
}

// The floor of the design: a kernel with the same grid, clusters, shared memory and PDL wait that only
// passes its three cluster barriers (no loads, no arithmetic).
__global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(THREADS, 2) cluster_sync_kernel(int syncs) {
  cg::cluster_group cluster = cg::this_cluster();
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::);
  for (int i = 0; i < syncs; ++i) cluster.sync();
}

// Host side: launches of either kernel over `chunks` clusters, with its shared memory, PDL as asked.
static void allow_shared_memory(const void* kernel) {
  static std::unordered_set<const void*> done;  // once per kernel
  if (done.insert(kernel).second) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, sizeof(Smem)));
  }
}

static cudaLaunchConfig_t cluster_config(int chunks, bool pdl, cudaLaunchAttribute* attr) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(CLUSTER, chunks, 1);
  config.blockDim = dim3(THREADS, 1, 1);
  config.dynamicSmemBytes = sizeof(Smem);
  config.stream = at::cuda::getCurrentCUDAStream();
  attr->id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr->val.programmaticStreamSerializationAllowed = pdl ? 1 : 0;
  config.attrs = attr;
  config.numAttrs = 1;
  return config;
}

void cluster_sync_only(int chunks, int syncs, bool pdl) {
  allow_shared_memory(reinterpret_cast<const void*>(cluster_sync_kernel));
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t config = cluster_config(chunks, pdl, &attr);
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, cluster_sync_kernel, syncs));
}

void cluster_ffn(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down_t,
                 const at::Tensor& idx, const at::Tensor& anchor, at::Tensor& partials, bool pdl,
                 c10::optional<at::Tensor> stamps) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(1) == WIDTH &&
                  x.stride(1) == 1 && x.size(0) <= ROWS,
              "x: (rows <= 64, 1024) bf16, unit column stride");
  TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16 && gate_up.is_contiguous() && gate_up.size(1) == WIDTH,
              "gate_up: (2F, 1024) bf16, contiguous");
  const long f = gate_up.size(0) / 2;
  TORCH_CHECK(down_t.scalar_type() == at::kBFloat16 && down_t.is_contiguous() && down_t.size(0) == f &&
                  down_t.size(1) == WIDTH,
              "down_t: (F, 1024) bf16, contiguous");
  TORCH_CHECK(idx.scalar_type() == at::kInt && idx.is_contiguous() && idx.numel() % CHUNK == 0,
              "idx: int32, a multiple of 128 neurons");
  TORCH_CHECK(anchor.scalar_type() == at::kBFloat16 && anchor.size(1) == f && anchor.stride(1) == 1,
              "anchor: (rows, F) bf16");
  const int chunks = static_cast<int>(idx.numel() / CHUNK);
  TORCH_CHECK(!stamps.has_value() || (stamps->scalar_type() == at::kLong && stamps->numel() >= chunks * CLUSTER * 8),
              "stamps: int64, 8 per CTA");
  TORCH_CHECK(partials.scalar_type() == at::kFloat && partials.is_contiguous() && partials.size(0) == chunks &&
                  partials.size(1) == ROWS && partials.size(2) == WIDTH,
              "partials: (selected / 128, 64, 1024) float32, contiguous");
  allow_shared_memory(reinterpret_cast<const void*>(cluster_ffn_kernel));
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t config = cluster_config(chunks, pdl, &attr);
  C10_CUDA_CHECK(cudaLaunchKernelEx(
      &config, cluster_ffn_kernel, reinterpret_cast<const bf16*>(x.data_ptr()), static_cast<int>(x.size(0)),
      static_cast<int>(x.stride(0)), reinterpret_cast<const bf16*>(gate_up.data_ptr()), static_cast<int>(f),
      reinterpret_cast<const bf16*>(down_t.data_ptr()), idx.data_ptr<int>(),
      reinterpret_cast<const bf16*>(anchor.data_ptr()), static_cast<int>(anchor.stride(0)),
      partials.data_ptr<float>(), stamps.has_value() ? reinterpret_cast<long long*>(stamps->data_ptr<int64_t>()) : nullptr));
}

int max_active_clusters(int chunks) {
  // How many of the kernel's clusters the GPU can hold at once (one wave needs `chunks`).
  allow_shared_memory(reinterpret_cast<const void*>(cluster_ffn_kernel));
  cudaLaunchAttribute attr;
  cudaLaunchConfig_t config = cluster_config(chunks, false, &attr);
  config.numAttrs = 0;
  int clusters = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, cluster_ffn_kernel, &config));
  return clusters;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("cluster_ffn", &cluster_ffn, "the Action Cache's gathered FFN in one cluster kernel (probe)",
        py::arg("x"), py::arg("gate_up"), py::arg("down_t"), py::arg("idx"), py::arg("anchor"),
        py::arg("partials"), py::arg("pdl"), py::arg("stamps") = py::none());
  m.def("max_active_clusters", &max_active_clusters, "clusters the GPU holds at once");
  m.def("cluster_sync_only", &cluster_sync_only, "the same launch passing only its cluster barriers");
}
