// The emulated Spyre card's device: PrivateUse1 tensors backed by host memory.
//
// The emulated target runs the spyre target's code path without a card. Its
// device tensors live in host memory but carry their own device type, so
// torch refuses to mix them with host tensors exactly as it would on the card,
// and the few placement rules the card adds are checked here:
//
// * every host<->device copy goes through _copy_from and is counted;
// * bool and small-integer tensors cannot be placed on the device (the card
//   computes floats; the spec's only integer device tensors are int64 gather
//   indices and the int32 page index, "Device Placement Strategy");
// * allocations are charged against a fixed device capacity, so the card's
//   memory accounting (not the host's) decides the KV budget, and running out
//   raises torch.OutOfMemoryError instead of growing into host RAM.
//
// Compute is borrowed from the CPU kernels through a boxed fallback that
// hands each CPU kernel zero-copy host views of the device operands and wraps
// its results as device tensors again (no copies, so aliasing and in-place ops
// behave as on any device).
#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/EmptyTensor.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/as_strided_native.h>
#include <c10/core/CachingDeviceAllocator.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace {

constexpr c10::DeviceType kDevice = c10::DeviceType::PrivateUse1;
constexpr size_t kAlignment = 64;

std::atomic<int64_t> g_h2d{0};
std::atomic<int64_t> g_d2h{0};
std::atomic<int64_t> g_in_use{0};
std::atomic<int64_t> g_peak{0};
std::atomic<int64_t> g_capacity{0};  // bytes; 0 = unlimited

void charge(int64_t nbytes) {
  const int64_t now = g_in_use += nbytes;
  const int64_t cap = g_capacity.load();
  if (cap > 0 && now > cap) {
    g_in_use -= nbytes;
    TORCH_CHECK_WITH(OutOfMemoryError, false,
                     "emulated Spyre card: out of device memory: ", nbytes,
                     " bytes requested with ", now - nbytes, " of ", cap,
                     " in use (SPYRE_EMULATED_DEVICE_MEMORY_GB sets the size)");
  }
  int64_t peak = g_peak.load();
  while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {
  }
}

struct Block {
  void* ptr;
  int64_t nbytes;
};

void release_block(void* ctx) {
  auto* block = static_cast<Block*>(ctx);
  g_in_use -= block->nbytes;
  std::free(block->ptr);
  delete block;
}

// A DeviceAllocator (not a bare Allocator): torch.accelerator's memory calls
// (empty_cache, memory stats, get_memory_info), which vLLM makes on its
// accelerator, reach the device's own accounting.
struct EmulatedAllocator final : c10::DeviceAllocator {
  at::DataPtr allocate(size_t nbytes) override {
    charge(static_cast<int64_t>(nbytes));
    void* ptr = nullptr;
    if (nbytes > 0) {
      ptr = std::aligned_alloc(kAlignment, (nbytes + kAlignment - 1) / kAlignment * kAlignment);
      if (ptr == nullptr) {
        g_in_use -= static_cast<int64_t>(nbytes);
        TORCH_CHECK_WITH(OutOfMemoryError, false, "emulated Spyre card: host allocation of ",
                         nbytes, " bytes failed");
      }
    }
    return {ptr, new Block{ptr, static_cast<int64_t>(nbytes)}, &release_block,
            c10::Device(kDevice, 0)};
  }
  at::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
  bool initialized() override { return true; }
  void emptyCache(c10::MempoolId_t) override {}  // no cache: every block is freed at once
  void recordStream(const c10::DataPtr&, c10::Stream) override {}  // one synchronous stream
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex) override {
    c10::CachingDeviceAllocator::DeviceStats stats;
    constexpr auto all = static_cast<size_t>(c10::CachingDeviceAllocator::StatType::AGGREGATE);
    for (auto* stat : {&stats.allocated_bytes[all], &stats.reserved_bytes[all]}) {
      stat->current = g_in_use.load();
      stat->peak = g_peak.load();
    }
    return stats;
  }
  void resetAccumulatedStats(c10::DeviceIndex) override {}
  void resetPeakStats(c10::DeviceIndex) override { g_peak = g_in_use.load(); }
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex) override {
    const int64_t cap = g_capacity.load();
    const int64_t used = g_in_use.load();
    return {static_cast<size_t>(cap > used ? cap - used : 0), static_cast<size_t>(cap)};
  }
};
EmulatedAllocator g_allocator;

void check_device_dtype(c10::ScalarType dtype, const std::string& what) {
  const bool index_int = dtype == at::kLong || dtype == at::kInt;
  TORCH_CHECK(!(dtype == at::kBool || (at::isIntegralType(dtype, false) && !index_int)),
              "emulated Spyre card: ", what, " would place a ", c10::toString(dtype),
              " tensor on the device; the card has no ", c10::toString(dtype),
              " support (bool and small-integer tensors stay on the host)");
}

bool on_device(const at::Tensor& t) { return t.defined() && t.device().type() == kDevice; }

// A host tensor over the same bytes as a device tensor; keeps its storage alive.
// Built directly (as device_view below), not with at::empty + set_: those are
// dispatched ops, and the profiler would count the emulator's own plumbing
// among the card path's eager device ops (two per operand of every op).
at::Tensor host_view(const at::Tensor& t) {
  c10::Storage storage = t.storage();
  auto* keep = new c10::Storage(storage);
  c10::DataPtr data(storage.mutable_data(), keep,
                    [](void* p) { delete static_cast<c10::Storage*>(p); }, c10::Device(c10::kCPU));
  c10::Storage host(c10::Storage::use_byte_size_t(), storage.nbytes(), std::move(data), nullptr,
                    /*resizable=*/false);
  at::Tensor out = at::detail::make_tensor<c10::TensorImpl>(
      std::move(host), c10::DispatchKeySet(c10::DispatchKey::CPU), t.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  return out;
}

// A device tensor over the bytes a host kernel produced; keeps its storage alive.
at::Tensor device_view(const at::Tensor& h) {
  c10::Storage storage = h.storage();
  const auto nbytes = static_cast<int64_t>(storage.nbytes());
  charge(nbytes);
  auto* keep = new Block{new c10::Storage(storage), nbytes};
  c10::DataPtr data(storage.mutable_data(), keep,
                    [](void* p) {
                      auto* block = static_cast<Block*>(p);
                      g_in_use -= block->nbytes;
                      delete static_cast<c10::Storage*>(block->ptr);
                      delete block;
                    },
                    c10::Device(kDevice, 0));
  c10::Storage dev(c10::Storage::use_byte_size_t(), storage.nbytes(), std::move(data),
                   &g_allocator, /*resizable=*/false);
  at::Tensor out = at::detail::make_tensor<c10::TensorImpl>(
      std::move(dev), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), h.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(h.sizes(), h.strides(), h.storage_offset());
  return out;
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout>, std::optional<at::Device>,
                               std::optional<bool>, std::optional<at::MemoryFormat> format) {
  const auto dt = c10::dtype_or_default(dtype);
  check_device_dtype(dt, "an allocation");
  return at::detail::empty_generic(size, &g_allocator,
                                   c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), dt, format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<at::ScalarType> dtype, std::optional<at::Layout>,
                         std::optional<at::Device>, std::optional<bool>) {
  const auto dt = c10::dtype_or_default(dtype);
  check_device_dtype(dt, "an allocation");
  return at::detail::empty_strided_generic(size, stride, &g_allocator,
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), dt);
}

at::Tensor as_strided(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride,
                      std::optional<int64_t> offset) {
  return at::native::as_strided_tensorimpl(self, size, stride, offset);
}

const at::Tensor& resize_(const at::Tensor& self, c10::IntArrayRef size,
                          std::optional<at::MemoryFormat> format) {
  return at::native::resize_(self, size, format);
}

// Every copy that crosses the host/device boundary lands here (copy_, .to()).
at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool /*non_blocking*/) {
  const bool src_dev = on_device(self);
  const bool dst_dev = on_device(dst);
  if (dst_dev) check_device_dtype(dst.scalar_type(), "a copy");
  if (dst_dev && !src_dev) ++g_h2d;
  if (src_dev && !dst_dev) ++g_d2h;
  at::Tensor d = dst_dev ? host_view(dst) : dst;
  d.copy_(src_dev ? host_view(self) : self);
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  dst.resize_(self.sizes());
  return copy_from(self, dst, false);
}

// Every other aten op: the CPU kernel on host views, results back on the device.
void cpu_kernel_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t num_args = schema.arguments().size();
  const size_t base = stack->size() - num_args;
  bool any_device = false;
  bool any_host = false;
  auto to_host = [&](const at::Tensor& t) -> at::Tensor {
    if (on_device(t)) {
      any_device = true;
      return host_view(t);
    }
    // 0-dim host tensors are scalars, which every torch device accepts.
    if (t.defined() && t.dim() > 0) any_host = true;
    return t;
  };
  const std::vector<c10::IValue> originals(stack->begin() + base, stack->end());
  for (size_t i = 0; i < num_args; ++i) {
    auto& value = (*stack)[base + i];
    if (value.isTensor()) {
      value = to_host(value.toTensor());
    } else if (value.isTensorList()) {
      auto list = value.toTensorList();
      for (size_t j = 0; j < list.size(); ++j) list[j] = to_host(list[j]);
      value = list;
    } else if (value.isOptionalTensorList()) {
      auto list = value.toOptionalTensorList();
      for (size_t j = 0; j < list.size(); ++j) {
        std::optional<at::Tensor> item = list[j];
        if (item.has_value()) list[j] = to_host(*item);
      }
      value = list;
    }
  }
  TORCH_CHECK(!(any_device && any_host), "emulated Spyre card: ", schema.name(),
              " mixes device (spyre) and host (cpu) tensors; move one of them first");
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
  const size_t num_returns = schema.returns().size();
  const size_t rbase = stack->size() - num_returns;
  for (size_t i = 0; i < num_returns; ++i) {
    auto& value = (*stack)[rbase + i];
    // A result that aliases a device operand (an in-place op's self, an out=
    // argument, a view) is that operand's storage again, not a new one: in-place
    // ops return the operand itself and views share its storage, as on any device.
    const auto* alias = schema.returns()[i].alias_info();
    if (alias != nullptr && value.isTensor()) {
      bool done = false;
      for (size_t j = 0; j < num_args && !done; ++j) {
        const auto* arg_alias = schema.arguments()[j].alias_info();
        if (arg_alias == nullptr || arg_alias->beforeSets() != alias->beforeSets() ||
            !originals[j].isTensor() || !on_device(originals[j].toTensor())) {
          continue;
        }
        const at::Tensor& operand = originals[j].toTensor();
        const at::Tensor result = value.toTensor();
        if (alias->isWrite() && result.sizes().equals(operand.sizes()) &&
            result.strides().equals(operand.strides()) &&
            result.storage_offset() == operand.storage_offset()) {
          value = operand;
        } else {
          value = at::native::as_strided_tensorimpl(operand, result.sizes(), result.strides(),
                                                    result.storage_offset());
        }
        done = true;
      }
      if (done) continue;
    }
    auto to_device = [&](const at::Tensor& t) -> at::Tensor {
      if (!t.defined() || !t.device().is_cpu()) return t;
      check_device_dtype(t.scalar_type(), "the result of " + schema.name());
      return device_view(t);
    };
    if (value.isTensor()) {
      value = to_device(value.toTensor());
    } else if (value.isTensorList()) {
      auto list = value.toTensorList();
      for (size_t j = 0; j < list.size(); ++j) list[j] = to_device(list[j]);
      value = list;
    }
  }
}

// `param.data = param.data.to("spyre")` swaps a parameter's tensor for one on
// the device, as model loading does on every device; torch allows that only
// between backends it lists as dense unless the backend says so.
bool has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  auto dense = [](const at::Tensor& t) { return t.layout() == at::kStrided; };
  return dense(self) && dense(from);
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_has_compatible_shallow_copy_type", has_compatible_shallow_copy_type);
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", as_strided);
  m.impl("resize_", resize_);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&cpu_kernel_fallback>());
}

REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &g_allocator);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "The emulated Spyre card's device (host memory, its own device type).";
  m.def("host_view", &host_view, "A host tensor over a device tensor's bytes (no copy).");
  m.def("device_view", &device_view, "A device tensor over a host tensor's bytes (no copy).");
  m.def("counters", []() {
    return std::make_tuple(g_h2d.load(), g_d2h.load(), g_in_use.load(), g_peak.load());
  }, "(host-to-device copies, device-to-host copies, bytes in use, peak bytes in use)");
  m.def("reset_counters", []() {
    g_h2d = 0;
    g_d2h = 0;
    g_peak = g_in_use.load();
  });
  m.def("set_capacity", [](int64_t nbytes) { g_capacity = nbytes; },
        "Device memory size in bytes (0: unlimited).");
  m.def("capacity", []() { return g_capacity.load(); });
}
