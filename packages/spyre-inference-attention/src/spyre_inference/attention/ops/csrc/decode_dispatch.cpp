// The cpu target's decode-attention call as a torch operator: the checks and
// the kernel call of spyre_inference.attention.ops.host_decode in C++.
//
// Each decoder layer calls the kernel once per step (30 times per decode step
// for SmolLM2-135M). From Python, the call was ~25 tensor checks, three
// no-op conversions and a ctypes call with 35 arguments: tens of microseconds
// per layer, more than the kernel itself takes at batch 1. Through this
// operator it is one dispatcher call.
//
// The kernel itself stays the C library of csrc/paged_decode.c (built per ISA
// by platform.native_build.load_kernel, loaded by ctypes); Python hands its
// address to set_kernel once, before the first step.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <optional>

namespace {

// spyre_paged_decode of csrc/paged_decode.c (see the layout comment there).
using PagedDecode = int (*)(const void*, int, long, long, long, long, long, void*, int, long,
                            long, long, long, const int64_t*, long, long, const float*, float,
                            float, const float*, void*, int, long, long, long, const void*,
                            const void*, long, long, long, long, const int64_t*, long, int);

std::atomic<PagedDecode> g_kernel{nullptr};

// The kernel's element kinds (enum in csrc/paged_decode.c).
int kind_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return 0;
    case at::kBFloat16:
      return 1;
    case at::kHalf:
      return 2;
    default:
      return -1;
  }
}

// Argument errors are ValueErrors in Python (TORCH_CHECK_VALUE), as from the
// Python checks this replaces.
void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.dim() == 3 && t.stride(2) == 1 && kind_of(t.scalar_type()) >= 0,
                    "store_and_decode: ", name, " ", t.sizes(), " ", t.scalar_type(),
                    " (strides ", t.strides(),
                    ") is not [rows, heads, head_size] with contiguous heads");
}

// t as a contiguous tensor of `type` (itself when it already is one).
at::Tensor as_contiguous(const at::Tensor& t, at::ScalarType type) {
  return t.scalar_type() == type && t.is_contiguous() ? t : t.to(type).contiguous();
}

// q: [S, H, D] rows to attend; key/value/slots: the step's new K|V rows and
// their int64 slots (all three or none); pages: [blocks, block, KVH, 2D];
// block_ids [S, NBK] page ids, mask [S, NBK * block] additive (entries below
// skip_below are masked keys); out: its first S rows get the result, the rest
// are zeroed; sinks: [H] logits or none.
void store_and_decode(const at::Tensor& q, const std::optional<at::Tensor>& key,
                      const std::optional<at::Tensor>& value,
                      const std::optional<at::Tensor>& slots, const at::Tensor& pages,
                      const at::Tensor& block_ids, const at::Tensor& mask, double scale,
                      double skip_below, const at::Tensor& out,
                      const std::optional<at::Tensor>& sinks, int64_t max_group) {
  const PagedDecode kernel = g_kernel.load(std::memory_order_acquire);
  TORCH_CHECK(kernel != nullptr, "store_and_decode: the decode kernel is not loaded");
  check_rows(q, "query");
  check_rows(out, "output");
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_size = q.size(2);
  TORCH_CHECK_VALUE(pages.dim() == 4 && pages.size(3) == 2 * head_size &&
                        pages.stride(3) == 1 && kind_of(pages.scalar_type()) >= 0,
                    "store_and_decode: pages ", pages.sizes(), " ", pages.scalar_type(),
                    " (strides ", pages.strides(), ") are not token-major K|V rows of 2 x ",
                    head_size);
  const int64_t block_size = pages.size(1), num_kv_heads = pages.size(2);
  TORCH_CHECK_VALUE(block_ids.dim() == 2 && mask.dim() == 2 && block_ids.size(0) == num_seqs &&
                        mask.size(0) == num_seqs &&
                        mask.size(1) == block_ids.size(1) * block_size,
                    "store_and_decode: ", num_seqs, " queries, block table ", block_ids.sizes(),
                    " and mask ", mask.sizes(), " disagree");
  const int64_t kv_blocks = block_ids.size(1);
  const at::Tensor ids = as_contiguous(block_ids, at::kLong);
  const at::Tensor m = as_contiguous(mask, at::kFloat);
  const int64_t zero_rows = out.size(0) - num_seqs;
  TORCH_CHECK_VALUE(zero_rows >= 0 && out.size(1) == num_heads && out.size(2) == head_size,
                    "store_and_decode: output ", out.sizes(), " does not hold ", q.sizes());
  TORCH_CHECK_VALUE(num_heads % num_kv_heads == 0 && num_heads / num_kv_heads <= max_group,
                    "store_and_decode: ", num_heads, " query heads over ", num_kv_heads,
                    " KV heads");
  at::Tensor sk;
  if (sinks.has_value()) {
    sk = as_contiguous(*sinks, at::kFloat);
    TORCH_CHECK_VALUE(sk.numel() == num_heads, "store_and_decode: ", sk.numel(),
                      " sinks for ", num_heads, " heads");
  }
  const bool store = key.has_value() && value.has_value() && slots.has_value();
  TORCH_CHECK_VALUE(store || (!key.has_value() && !value.has_value() && !slots.has_value()),
                    "store_and_decode: key, value and slots come together");
  const void *k = nullptr, *v = nullptr;
  at::Tensor st;
  int64_t kv_tokens = 0, k_row = 0, k_head = 0, v_row = 0, v_head = 0;
  if (store) {
    const at::Tensor &kt = *key, &vt = *value;
    check_rows(kt, "key");
    check_rows(vt, "value");
    for (const at::Tensor* t : {&kt, &vt}) {
      TORCH_CHECK_VALUE(t->scalar_type() == pages.scalar_type() &&
                            t->size(1) == num_kv_heads && t->size(2) == head_size,
                        "store_and_decode: key/value ", t->sizes(), " ", t->scalar_type(),
                        " does not fit pages of ", num_kv_heads, " x ", head_size, " ",
                        pages.scalar_type());
    }
    kv_tokens = kt.size(0);
    TORCH_CHECK_VALUE(vt.size(0) == kv_tokens && slots->dim() == 1 &&
                          slots->size(0) == kv_tokens && slots->scalar_type() == at::kLong,
                      "store_and_decode: ", kv_tokens, " keys, ", vt.size(0),
                      " values, slots ", slots->sizes(), " ", slots->scalar_type());
    st = slots->contiguous();
    k = kt.data_ptr();
    v = vt.data_ptr();
    k_row = kt.stride(0);
    k_head = kt.stride(1);
    v_row = vt.stride(0);
    v_head = vt.stride(1);
  }
  const int failed = kernel(
      q.data_ptr(), kind_of(q.scalar_type()), q.stride(0), q.stride(1), num_seqs, num_heads,
      head_size, pages.data_ptr(), kind_of(pages.scalar_type()), pages.stride(0), pages.stride(1),
      pages.stride(2), num_kv_heads, ids.data_ptr<int64_t>(), kv_blocks, block_size,
      m.data_ptr<float>(), static_cast<float>(scale), static_cast<float>(skip_below),
      sk.defined() ? sk.data_ptr<float>() : nullptr, out.data_ptr(), kind_of(out.scalar_type()),
      out.stride(0), out.stride(1), zero_rows, k, v, k_row, k_head, v_row, v_head,
      st.defined() ? st.data_ptr<int64_t>() : nullptr, kv_tokens, at::get_num_threads());
  TORCH_CHECK(failed == 0, "store_and_decode: no memory for ", kv_blocks * block_size,
              " scores");
}

void set_kernel(int64_t address) {
  g_kernel.store(reinterpret_cast<PagedDecode>(address), std::memory_order_release);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(spyre_inference_attention_native, m) {
  m.def(
      "store_and_decode(Tensor q, Tensor? key, Tensor? value, Tensor? slots, Tensor pages, "
      "Tensor block_ids, Tensor mask, float scale, float skip_below, Tensor(a!) out, "
      "Tensor? sinks, int max_group) -> ()",
      &store_and_decode);
  m.def("set_kernel(int address) -> ()", &set_kernel);
}
