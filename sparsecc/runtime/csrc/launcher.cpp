// The CUDA implementation of sparsecc::linear_kernel, in C++ so that a call costs a few
// microseconds of host time: no Python below the op call, no host synchronisation, and no
// allocation beyond the output (and a stream-K workspace) from torch's caching allocator,
// which is also what makes the op safe to capture in a CUDA graph.
//
// The generated kernels are loaded by sparsecc.runtime (one shared object per kernel); it
// registers each kernel's entry points here by symbol, and the activation codes of
// sparsecc.ir.epilogue, so this file names no kernel and no activation itself. A site carries
// its dispatch table as a string, "bound=symbol:swizzle:splits;...", parsed once and then
// looked up per call.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

using RunFn = int (*)(const void*, const void*, const void*, const void*, void*, int, int, int, int, int,
                      int, void*, void*);
using WorkspaceFn = long long (*)(int, int, int, int, int);
using ErrorFn = const char* (*)();

struct Kernel {
  RunFn run;
  WorkspaceFn workspace_size;
  ErrorFn error;
};

struct Entry {
  int64_t bound;  // the largest M this entry takes; 0 = no bound
  std::string symbol;
  int swizzle;
  int splits;
  int flags;      // added to the activation code (sparsecc.epilogue.UNCHECKED_NONFINITE)
};

std::shared_mutex g_lock;
std::unordered_map<std::string, Kernel> g_kernels;               // by symbol
std::unordered_map<std::string, std::vector<Entry>> g_tables;    // by dispatch string
std::unordered_map<std::string, int> g_activations;              // name -> epilogue code

std::vector<Entry> parse_table(const std::string& text) {
  std::vector<Entry> entries;
  size_t start = 0;
  while (start <= text.size()) {
    size_t end = text.find(';', start);
    if (end == std::string::npos) end = text.size();
    std::string item = text.substr(start, end - start);
    size_t eq = item.find('=');
    TORCH_CHECK_VALUE(eq != std::string::npos, "sparsecc linear: malformed dispatch entry '", item, "'");
    Entry entry{std::stoll(item.substr(0, eq)), "", 1, 1, 0};
    std::string rest = item.substr(eq + 1);
    size_t colon = rest.find(':');
    entry.symbol = rest.substr(0, colon);
    if (colon != std::string::npos) {  // symbol:swizzle:splits:flags, the last ones optional
      size_t second = rest.find(':', colon + 1);
      entry.swizzle = std::stoi(rest.substr(colon + 1, second - colon - 1));
      if (second != std::string::npos) {
        size_t third = rest.find(':', second + 1);
        entry.splits = std::stoi(rest.substr(second + 1, third - second - 1));
        if (third != std::string::npos) entry.flags = std::stoi(rest.substr(third + 1));
      }
    }
    entries.push_back(entry);
    start = end + 1;
  }
  return entries;
}

// The kernel, swizzle, splits and activation flags the table names for m rows.
std::tuple<Kernel, int, int, int> kernel_for(c10::string_view kernels, int64_t m) {
  std::string text(kernels);
  {
    std::shared_lock<std::shared_mutex> read(g_lock);
    auto table = g_tables.find(text);
    if (table != g_tables.end()) {
      for (const Entry& entry : table->second) {
        if (entry.bound == 0 || m <= entry.bound) {
          auto kernel = g_kernels.find(entry.symbol);
          TORCH_CHECK(kernel != g_kernels.end(), "sparsecc linear: kernel ", entry.symbol,
                      " is not loaded in this process: compile the model with sparsecc.compile "
                      "(or call sparsecc.runtime.kernel_op.ensure) first");
          return {kernel->second, entry.swizzle, entry.splits, entry.flags};
        }
      }
      TORCH_CHECK_VALUE(false, "sparsecc linear: no kernel in '", text, "' takes M=", m);
    }
  }
  std::vector<Entry> parsed = parse_table(text);
  {
    std::unique_lock<std::shared_mutex> write(g_lock);
    g_tables.emplace(text, std::move(parsed));
  }
  return kernel_for(kernels, m);
}

int activation_code(c10::string_view name) {
  std::shared_lock<std::shared_mutex> read(g_lock);
  auto found = g_activations.find(std::string(name));
  TORCH_CHECK_VALUE(found != g_activations.end(), "sparsecc linear: unknown activation '", std::string(name), "'");
  return found->second;
}

at::Tensor linear_kernel_cuda(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& metadata,
                              int64_t out_features, int64_t in_features, const std::optional<at::Tensor>& bias,
                              c10::string_view activation, bool x_transposed, bool transpose_out,
                              c10::string_view kernels) {
  TORCH_CHECK_VALUE(x.scalar_type() == weight.scalar_type(), "sparsecc linear: input dtype ", x.scalar_type(),
                    " does not match the weight's ", weight.scalar_type());
  TORCH_CHECK_VALUE(x.is_cuda() && x.device() == weight.device(), "sparsecc linear: input on ", x.device(),
                    ", the weight on ", weight.device());
  const int code = activation_code(activation);
  const bool one_dim = x.dim() == 1;
  at::Tensor xt = (x_transposed && !one_dim) ? x.transpose(-1, -2) : x;
  TORCH_CHECK_VALUE(xt.size(-1) == in_features, "sparsecc linear: input has ", xt.size(-1),
                    " features along K, the weight expects ", in_features);
  std::vector<int64_t> shape(xt.sizes().begin(), xt.sizes().end() - 1);
  at::Tensor rows = xt.reshape({-1, in_features});
  if (!rows.is_contiguous()) rows = rows.contiguous();
  if (reinterpret_cast<std::uintptr_t>(rows.data_ptr()) % 16) rows = rows.clone();  // TMA needs 16-byte alignment
  const int64_t m = rows.size(0);
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty({m, out_features}, x.options());
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == out_features, "sparsecc linear: bias of shape ",
                      bias->sizes(), " for a weight with ", out_features, " outputs (expected [", out_features, "])");
    TORCH_CHECK_VALUE(bias->device() == x.device(), "sparsecc linear: bias on ", bias->device(), ", the input on ",
                      x.device());
  }
  if (m > 0) {
    at::Tensor b;
    if (bias.has_value()) b = bias->to(x.scalar_type()).contiguous();
    auto [kernel, swizzle, splits, flags] = kernel_for(kernels, m);
    const long long workspace_bytes = kernel.workspace_size(out_features, m, in_features, swizzle, splits);
    at::Tensor workspace;
    if (workspace_bytes > 0) workspace = at::empty({workspace_bytes}, x.options().dtype(at::kByte));
    const int status = kernel.run(weight.data_ptr(), metadata.has_value() ? metadata->data_ptr() : nullptr,
                                  rows.data_ptr(), b.defined() ? b.data_ptr() : nullptr, y.data_ptr(),
                                  static_cast<int>(out_features), static_cast<int>(m), static_cast<int>(in_features),
                                  code + flags, swizzle, splits, workspace.defined() ? workspace.data_ptr() : nullptr,
                                  c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
    TORCH_CHECK(status == 0, "sparsecc linear: ", kernel.error());
  }
  shape.push_back(out_features);
  y = y.view(shape);
  if (transpose_out && !one_dim) y = y.transpose(-1, -2).contiguous();
  return y;
}

}  // namespace

extern "C" void sparsecc_launcher_add_kernel(const char* symbol, void* run, void* workspace_size, void* error) {
  std::unique_lock<std::shared_mutex> write(g_lock);
  g_kernels[symbol] = Kernel{reinterpret_cast<RunFn>(run), reinterpret_cast<WorkspaceFn>(workspace_size),
                             reinterpret_cast<ErrorFn>(error)};
}

extern "C" void sparsecc_launcher_add_activation(const char* name, int code) {
  std::unique_lock<std::shared_mutex> write(g_lock);
  g_activations[name] = code;
}

TORCH_LIBRARY_IMPL(sparsecc, CUDA, m) { m.impl("linear_kernel", &linear_kernel_cuda); }
