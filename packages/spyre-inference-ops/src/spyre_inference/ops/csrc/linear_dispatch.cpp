// The cpu target's linear ops as C++ kernels: no Python between the block
// graph and the GEMM.
//
// The block graphs call spyre_inference::onednn_linear_t (16-bit weights on
// CPUs with a fast 16-bit GEMM), spyre_inference::host_gemm_w16 (16-bit
// weights elsewhere) or spyre_inference::int8_mm (INT8 W8A8 weights) once per
// linear layer (120 times per decode step for a 30-layer Llama). Registered
// from Python, each call went dispatcher -> Python -> dispatcher -> oneDNN (or
// ctypes -> a host kernel); these kernels go dispatcher -> C++ -> oneDNN or the
// host kernel directly.
//
// State, set from Python (spyre_inference.ops.onednn_linear) through the ops
// below, never during a step:
//  * the oneDNN-packed copy of every [in, out] weight of record, keyed by the
//    weight's data pointer (packed once at load; replaced after a reload);
//  * optionally a host GEMM kernel (csrc/host_gemm.c, loaded by ctypes) and
//    the largest row count onednn_linear_t gives it: at a few rows oneDNN's
//    fixed per-call cost dominates a product that only streams the weight once;
//  * the host GEMM kernel host_gemm_w16 runs at every row count (a separate
//    pointer: onednn_linear_t may use none while host_gemm_w16 needs one);
//  * optionally the INT8 host kernel (csrc/host_int8_mm.c, loaded by ctypes),
//    its largest row count and inner dimension (int32 sums stay exact).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string_view>
#include <unordered_map>

namespace {

// spyre_gemm_w16 of csrc/host_gemm.c: y[M, N] = x[M, K] (float32) @ w[K, N]
// (bfloat16 or float16), accumulated in float32. Returns non-zero on failure.
using HostGemm = int (*)(const float*, long, long, long, const void*, long, long, float*, long,
                         int, int);

// spyre_int8_mm of csrc/host_int8_mm.c: y[M, N] (int32) = x[M, K] @ w[K, N]
// (int8), exact. Returns non-zero on failure.
using HostInt8 = int (*)(const int8_t*, long, long, long, const int8_t*, long, long, int32_t*,
                         long, int);

std::shared_mutex g_lock;
std::unordered_map<const void*, at::Tensor> g_packed;
HostGemm g_host_gemm = nullptr;
int64_t g_host_gemm_max_rows = 0;
HostGemm g_host_gemm_w16 = nullptr;
HostInt8 g_host_int8 = nullptr;
int64_t g_host_int8_max_rows = 0;
int64_t g_host_int8_max_k = 0;

at::Tensor onednn_product(const at::Tensor& x2, const at::Tensor& packed) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                                         const std::optional<at::Tensor>&, std::string_view,
                                         c10::List<std::optional<c10::Scalar>>,
                                         std::optional<std::string_view>)>();
  return op.call(x2, packed, std::nullopt, "none", c10::List<std::optional<c10::Scalar>>(), "");
}

at::Tensor host_product(const at::Tensor& x2, const at::Tensor& weight_t, HostGemm gemm) {
  const int64_t m = x2.size(0), k = x2.size(1), n = weight_t.size(1);
  at::Tensor xf = x2.to(at::kFloat).contiguous();
  at::Tensor w = weight_t.stride(1) == 1 ? weight_t : weight_t.contiguous();
  at::Tensor y = at::empty({m, n}, x2.options().dtype(at::kFloat));
  const int failed = gemm(xf.data_ptr<float>(), m, k, xf.stride(0), w.data_ptr(), n, w.stride(0),
                          y.data_ptr<float>(), n, w.scalar_type() == at::kHalf ? 1 : 0,
                          at::get_num_threads());
  TORCH_CHECK(!failed, "host GEMM [", m, ", ", k, "] x [", k, ", ", n,
              "]: no memory for its scratch");
  return y.to(weight_t.scalar_type());
}

at::Tensor onednn_linear_t(const at::Tensor& x, const at::Tensor& weight_t) {
  TORCH_CHECK(weight_t.dim() == 2, "onednn_linear_t takes a 2-D [in, out] weight");
  const int64_t k = weight_t.size(0), n = weight_t.size(1);
  TORCH_CHECK(x.size(-1) == k, "onednn_linear_t: x has ", x.size(-1), " features, the weight ",
              k, " rows");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor x2 = x.reshape({-1, k});
  if (x2.scalar_type() != weight_t.scalar_type()) {
    x2 = x2.to(weight_t.scalar_type());
  }
  x2 = x2.contiguous();
  at::Tensor packed;
  HostGemm gemm;
  int64_t max_rows;
  {
    std::shared_lock<std::shared_mutex> read(g_lock);
    gemm = g_host_gemm;
    max_rows = g_host_gemm_max_rows;
    auto it = g_packed.find(weight_t.data_ptr());
    if (it != g_packed.end()) packed = it->second;
  }
  if (gemm != nullptr && x2.size(0) > 0 && x2.size(0) <= max_rows) {
    return host_product(x2, weight_t, gemm).view(shape);
  }
  TORCH_CHECK(packed.defined(), "onednn_linear_t: the [in, out] weight ", weight_t.sizes(),
              " has no packed copy (ops.onednn_linear.pack must run at load and after its "
              "values change)");
  return onednn_product(x2, packed).view(shape);
}

// Same contract as host_gemm.host_gemm_w16_in_python (the fallback without a C++
// toolchain): x (any leading dimensions) widened to float32, a float32 result.
at::Tensor host_gemm_w16(const at::Tensor& x, const at::Tensor& weight_t) {
  TORCH_CHECK_VALUE(weight_t.dim() == 2 && (weight_t.scalar_type() == at::kBFloat16 ||
                                            weight_t.scalar_type() == at::kHalf),
                    "host_gemm_w16 takes a 2-D bfloat16/float16 weight, got ",
                    weight_t.scalar_type(), " ", weight_t.sizes());
  const int64_t k = weight_t.size(0), n = weight_t.size(1);
  TORCH_CHECK_VALUE(x.size(-1) == k, "host_gemm_w16: x has ", x.size(-1),
                    " features, the weight ", k, " rows");
  HostGemm gemm;
  {
    std::shared_lock<std::shared_mutex> read(g_lock);
    gemm = g_host_gemm_w16;
  }
  TORCH_CHECK(gemm != nullptr, "host_gemm_w16: no host GEMM kernel is loaded "
              "(ops.host_gemm.dispatch must run first)");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor x2 = x.reshape({-1, k});
  if (x2.scalar_type() != at::kFloat || x2.stride(1) != 1) {
    x2 = x2.to(at::kFloat).contiguous();
  }
  const at::Tensor w = weight_t.stride(1) == 1 ? weight_t : weight_t.contiguous();
  const int64_t m = x2.size(0);
  at::Tensor y = at::empty({m, n}, x2.options().dtype(at::kFloat));
  if (m > 0 && n > 0) {
    const int failed = gemm(x2.data_ptr<float>(), m, k, x2.stride(0), w.data_ptr(), n,
                            w.stride(0), y.data_ptr<float>(), n,
                            w.scalar_type() == at::kHalf ? 1 : 0, at::get_num_threads());
    TORCH_CHECK(!failed, "host GEMM [", m, ", ", k, "] x [", k, ", ", n,
                "]: no memory for its scratch");
  }
  return y.view(shape);
}

// Same contract as host_int8.int8_mm_in_python (the fallback without a C++
// toolchain): argument errors are ValueErrors, up to the row count Python set
// (a few where torch._int_mm runs oneDNN, all where it is a scalar loop) on the
// host kernel, the rest on torch._int_mm; both exact, so the choice never
// changes a result.
at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& weight_t) {
  TORCH_CHECK_VALUE(x.scalar_type() == at::kChar && weight_t.scalar_type() == at::kChar &&
                        weight_t.dim() == 2,
                    "int8_mm takes int8 x and a 2-D int8 weight, got ", x.scalar_type(), " and ",
                    weight_t.scalar_type(), " ", weight_t.sizes());
  const int64_t k = weight_t.size(0), n = weight_t.size(1);
  TORCH_CHECK_VALUE(x.size(-1) == k, "int8_mm: x has ", x.size(-1), " features, the weight ", k,
                    " rows");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor x2 = x.reshape({-1, k});
  const int64_t m = x2.size(0);
  HostInt8 kernel;
  {
    std::shared_lock<std::shared_mutex> read(g_lock);
    const bool served = m > 0 && m <= g_host_int8_max_rows && k <= g_host_int8_max_k && n > 0;
    kernel = served ? g_host_int8 : nullptr;
  }
  if (kernel == nullptr) {
    return at::_int_mm(x2, weight_t).view(shape);
  }
  if (x2.stride(1) != 1) x2 = x2.contiguous();
  const at::Tensor w = weight_t.stride(1) == 1 ? weight_t : weight_t.contiguous();
  at::Tensor y = at::empty({m, n}, x2.options().dtype(at::kInt));
  const int failed = kernel(x2.data_ptr<int8_t>(), m, k, x2.stride(0), w.data_ptr<int8_t>(), n,
                            w.stride(0), y.data_ptr<int32_t>(), n, at::get_num_threads());
  TORCH_CHECK(!failed, "INT8 host kernel [", m, ", ", k, "] x [", k, ", ", n,
              "]: no memory for its scratch");
  return y.view(shape);
}

void register_packed(const at::Tensor& weight_t, const at::Tensor& packed) {
  std::unique_lock<std::shared_mutex> write(g_lock);
  g_packed[weight_t.data_ptr()] = packed;
}

void forget_packed(int64_t address) {
  std::unique_lock<std::shared_mutex> write(g_lock);
  g_packed.erase(reinterpret_cast<const void*>(address));
}

void set_host_gemm(int64_t address, int64_t max_rows) {
  std::unique_lock<std::shared_mutex> write(g_lock);
  g_host_gemm = reinterpret_cast<HostGemm>(address);
  g_host_gemm_max_rows = address ? max_rows : 0;
}

void set_host_gemm_w16(int64_t address) {
  std::unique_lock<std::shared_mutex> write(g_lock);
  g_host_gemm_w16 = reinterpret_cast<HostGemm>(address);
}

void set_host_int8(int64_t address, int64_t max_rows, int64_t max_k) {
  std::unique_lock<std::shared_mutex> write(g_lock);
  g_host_int8 = reinterpret_cast<HostInt8>(address);
  g_host_int8_max_rows = address ? max_rows : 0;
  g_host_int8_max_k = address ? max_k : 0;
}

}  // namespace

// The ops' schemas and fake kernels are defined from Python (ops.linear_op), so
// the ops exist with or without this library; this adds their CPU kernels.
TORCH_LIBRARY_IMPL(spyre_inference, CPU, m) {
  m.impl("onednn_linear_t", &onednn_linear_t);
  m.impl("host_gemm_w16", &host_gemm_w16);
  m.impl("int8_mm", &int8_mm);
}

TORCH_LIBRARY_FRAGMENT(spyre_inference_native, m) {
  m.def("register_packed(Tensor weight_t, Tensor packed) -> ()", &register_packed);
  m.def("forget_packed(int address) -> ()", &forget_packed);
  m.def("set_host_gemm(int address, int max_rows) -> ()", &set_host_gemm);
  m.def("set_host_gemm_w16(int address) -> ()", &set_host_gemm_w16);
  m.def("set_host_int8(int address, int max_rows, int max_k) -> ()", &set_host_int8);
}
