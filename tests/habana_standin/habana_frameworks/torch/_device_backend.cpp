// The stand-in's torch device "hpu": torch's own HPU device type and dispatch key, the ones
// Habana's bridge registers its backend under, so its tensors are ordinary torch.Tensor objects
// with device "hpu", dispatch key HPU and their own storage, as on a Gaudi. The storage's bytes
// are host memory, so every op runs as the CPU's kernel over CPU tensors that share the device
// tensors' bytes (no copy), and the results come back as "hpu" tensors. What is checked is the
// rule every non-CPU torch device keeps: an op refuses "hpu" tensors mixed with CPU tensors,
// except CPU 0-d tensors (Python-scalar-like operands).
//
// Built at first use by _torch_device.py (torch.utils.cpp_extension), loaded with
// torch.ops.load_library: the registrations below run when the library is loaded.

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>
#include <ATen/detail/HPUHooksInterface.h>
#include <torch/library.h>

#include <atomic>
#include <map>
#include <mutex>
#include <string>
#include <cstring>
#include <sstream>

namespace {

constexpr c10::DeviceType kDevice = c10::DeviceType::HPU;

c10::Device device() { return c10::Device(kDevice, 0); }

// Device-to-host reads counted since load (the host-sync count): every op that leaves a
// value on the host from "hpu" data (.item(), .tolist(), .cpu(), a copy to a CPU tensor).
std::atomic<int64_t> g_host_reads{0};
std::mutex g_reads_mutex;
std::map<std::string, int64_t> g_reads_by_op;  // the same reads, by the op that made them

void count_read(const std::string& op) {
  g_host_reads.fetch_add(1);
  std::lock_guard<std::mutex> lock(g_reads_mutex);
  ++g_reads_by_op[op];
}

// Bytes of device memory in use (allocated by the device, or results adopted from a host kernel),
// and the most ever in use since the last reset: what memory_allocated() and
// max_memory_allocated() report.
std::atomic<int64_t> g_in_use{0};
std::atomic<int64_t> g_peak{0};

void count(int64_t nbytes) {
  int64_t now = g_in_use.fetch_add(nbytes) + nbytes;
  int64_t peak = g_peak.load();
  while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {
  }
}

// What a device allocation owns: the host block and its size (given back to the count on free).
struct Block {
  void* data;
  int64_t nbytes;
};

void free_block(void* ctx) {
  auto* block = static_cast<Block*>(ctx);
  count(-block->nbytes);
  c10::free_cpu(block->data);
  delete block;
}

struct HostMemoryAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    void* data = nbytes ? c10::alloc_cpu(nbytes) : nullptr;
    count(static_cast<int64_t>(nbytes));
    return {data, new Block{data, static_cast<int64_t>(nbytes)}, &free_block, device()};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

HostMemoryAllocator g_allocator;

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout,
                               std::optional<c10::Device> /*device*/,
                               std::optional<bool> /*pin_memory*/,
                               std::optional<c10::MemoryFormat> memory_format) {
  TORCH_CHECK(!layout || *layout == c10::kStrided, "hpu: only strided tensors");
  return at::detail::empty_generic(size, &g_allocator, c10::DispatchKeySet(c10::DispatchKey::HPU),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<c10::ScalarType> dtype, std::optional<c10::Layout> layout,
                         std::optional<c10::Device> /*device*/, std::optional<bool> /*pin_memory*/) {
  TORCH_CHECK(!layout || *layout == c10::kStrided, "hpu: only strided tensors");
  return at::detail::empty_strided_generic(size, stride, &g_allocator,
                                           c10::DispatchKeySet(c10::DispatchKey::HPU),
                                           c10::dtype_or_default(dtype));
}

// A tensor of `device_type` over the same bytes as `t` (sizes, strides, offset kept), owning
// nothing: `t` (or the storage it came from) keeps the memory alive while it is used.
at::Tensor alias_on(const at::Tensor& t, c10::DeviceType device_type) {
  const c10::Storage& storage = t.storage();
  c10::DispatchKey key =
      device_type == kDevice ? c10::DispatchKey::HPU : c10::DispatchKey::CPU;
  c10::Storage shared(c10::Storage::use_byte_size_t(), storage.nbytes(),
                      c10::DataPtr(storage.mutable_data(), c10::Device(device_type, device_type == kDevice ? 0 : -1)),
                      device_type == kDevice ? static_cast<c10::Allocator*>(&g_allocator)
                                             : c10::GetCPUAllocator(),
                      true);  // an out= kernel may resize it: run_on_host copies such results back
  auto out = at::detail::make_tensor<c10::TensorImpl>(std::move(shared), c10::DispatchKeySet(key),
                                                      t.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  return out;
}

at::Tensor host_view(const at::Tensor& t) {
  if (!t.defined() || t.device().type() != kDevice) return t;
  return alias_on(t, c10::DeviceType::CPU);
}

// A host kernel's result adopted as device memory: counted as device bytes while it lives.
struct Adopted {
  c10::Storage storage;
  int64_t nbytes;
};

void release_adopted(void* ctx) {
  auto* owner = static_cast<Adopted*>(ctx);
  count(-owner->nbytes);
  delete owner;
}

// A CPU result as an "hpu" tensor, without a copy: the device storage's bytes are the result's,
// kept alive by a reference to the result's storage.
at::Tensor to_device(const at::Tensor& result) {
  if (!result.defined() || result.device().type() == kDevice) return result;
  auto* owner = new Adopted{result.storage(), static_cast<int64_t>(result.storage().nbytes())};
  count(owner->nbytes);
  c10::DataPtr data(owner->storage.mutable_data(), owner, &release_adopted, device());
  c10::Storage storage(c10::Storage::use_byte_size_t(), owner->nbytes, std::move(data),
                       &g_allocator, true);
  auto out = at::detail::make_tensor<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::HPU), result.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(result.sizes(), result.strides(),
                                                   result.storage_offset());
  return out;
}

template <typename F>
void for_each_tensor(const c10::IValue& value, F&& f) {
  if (value.isTensor()) {
    f(value.toTensor());
  } else if (value.isTensorList()) {
    for (const at::Tensor& t : value.toTensorVector()) f(t);
  } else if (value.isList()) {
    for (const c10::IValue& item : value.toListRef()) {
      if (item.isTensor()) f(item.toTensor());
    }
  }
}

c10::IValue map_tensors(const c10::IValue& value, at::Tensor (*f)(const at::Tensor&)) {
  if (value.isTensor()) return f(value.toTensor());
  if (value.isTensorList()) {
    std::vector<at::Tensor> out;
    for (const at::Tensor& t : value.toTensorVector()) out.push_back(f(t));
    return c10::IValue(out);
  }
  if (value.isList()) {
    auto list = value.toList();
    bool tensors = false;
    for (const c10::IValue& item : list) tensors = tensors || item.isTensor();
    if (!tensors) return value;
    c10::List<std::optional<at::Tensor>> out;
    for (const c10::IValue& item : list) {
      if (item.isTensor()) {
        out.push_back(f(item.toTensor()));
      } else {
        out.push_back(std::nullopt);
      }
    }
    return c10::IValue(out);
  }
  if (value.isDevice() && value.toDevice().type() == kDevice) return c10::IValue(c10::Device(c10::kCPU));
  return value;
}

bool on_device(const c10::IValue& value) {
  bool found = false;
  for_each_tensor(value, [&](const at::Tensor& t) {
    found = found || (t.defined() && t.device().type() == kDevice);
  });
  return found || (value.isDevice() && value.toDevice().type() == kDevice);
}

// Every op without an "hpu" kernel of its own: the CPU kernel over host views of the operands.
void run_on_host(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = op.schema();
  const size_t num_args = schema.arguments().size();
  const size_t first = stack->size() - num_args;
  std::vector<c10::IValue> originals(stack->begin() + first, stack->end());

  bool device_operand = false;
  const at::Tensor* host_operand = nullptr;
  for (const c10::IValue& value : originals) {
    device_operand = device_operand || on_device(value);
    for_each_tensor(value, [&](const at::Tensor& t) {
      if (t.defined() && t.device().is_cpu() && t.dim() > 0 && host_operand == nullptr) {
        host_operand = &t;
      }
    });
  }
  if (device_operand && host_operand != nullptr) {
    std::ostringstream shape;
    shape << host_operand->sizes();
    TORCH_CHECK(false, schema.operator_name(), ": tensors on hpu and cpu in one op (a cpu tensor of shape ",
                shape.str(), "); move it to the device first");
  }
  for (size_t i = 0; i < num_args; ++i) (*stack)[first + i] = map_tensors(originals[i], host_view);

  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);

  const size_t num_returns = schema.returns().size();
  const size_t ret_first = stack->size() - num_returns;
  for (size_t j = 0; j < num_returns; ++j) {
    const c10::AliasInfo* alias = schema.returns()[j].alias_info();
    c10::IValue& ret = (*stack)[ret_first + j];
    if (alias != nullptr && alias->isWrite()) {
      // In place or out=: the caller's tensor, which the kernel wrote through its host view.
      for (size_t i = 0; i < num_args; ++i) {
        const c10::AliasInfo* arg_alias = schema.arguments()[i].alias_info();
        if (arg_alias != nullptr && arg_alias->beforeSets() == alias->beforeSets()) {
          if (ret.isTensor() && originals[i].isTensor()) {
            at::Tensor written = ret.toTensor();
            at::Tensor target = originals[i].toTensor();
            if (target.defined() && target.device().type() == kDevice &&
                (written.data_ptr() != target.data_ptr() || written.sizes() != target.sizes())) {
              // The kernel resized its out= operand: resize the device tensor and copy back.
              target.resize_(written.sizes());
              host_view(target).copy_(written);
            }
          }
          ret = originals[i];
          break;
        }
      }
      continue;
    }
    if (alias != nullptr) {
      TORCH_CHECK(false, schema.operator_name(),
                  ": a view op with no hpu kernel (the stand-in device registers its view ops)");
    }
    // Results of an op over "hpu" operands, or of a factory op told device="hpu", are "hpu".
    ret = map_tensors(ret, to_device);
  }
  for (const c10::IValue& value : originals) {
    if (value.isTensor() && value.toTensor().defined() &&
        value.toTensor().device().type() == kDevice && num_returns > 0 &&
        !(*stack)[ret_first].isTensor() && !(*stack)[ret_first].isTensorList()) {
      // A value read back to the host from device data (.item(), equal(), is_nonzero()).
      count_read(c10::toString(schema.operator_name()));
      break;
    }
  }
}

at::Tensor& copy_between(const at::Tensor& self, const at::Tensor& dst, bool /*non_blocking*/) {
  if (self.device().type() == kDevice && dst.device().is_cpu()) count_read("copy to host");
  host_view(dst).copy_(host_view(self));
  return const_cast<at::Tensor&>(dst);
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  copy_between(self, dst, non_blocking);
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  const_cast<at::Tensor&>(dst).resize_(self.sizes());
  copy_between(self, dst, false);
  return dst;
}

at::Tensor& set_storage(at::Tensor& self, c10::Storage source, int64_t storage_offset,
                        c10::IntArrayRef size, c10::IntArrayRef stride) {
  TORCH_CHECK(source.device().type() == kDevice,
              "set_: the storage of an hpu tensor must be an hpu storage");
  return at::native::set_storage_cpu_(self, std::move(source), storage_offset, size, stride);
}

at::Tensor& set_empty(at::Tensor& self) {
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0, &g_allocator, true);
  return at::native::set_storage_cpu_(self, std::move(storage), 0, {0}, {});
}

int64_t host_reads() { return g_host_reads.load(); }

std::string host_reads_by_op() {
  std::lock_guard<std::mutex> lock(g_reads_mutex);
  std::ostringstream out;
  for (const auto& [op, n] : g_reads_by_op) out << op << "=" << n << "\n";
  return out.str();
}
int64_t memory_allocated() { return g_in_use.load(); }
int64_t max_memory_allocated() { return g_peak.load(); }
void reset_peak_memory_stats() { g_peak.store(g_in_use.load()); }

// One device per process (index 0) with one stream: work has completed when an op returns.
struct DeviceGuard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kDevice; }
  c10::Device exchangeDevice(c10::Device) const override { return device(); }
  c10::Device getDevice() const override { return device(); }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.index() <= 0, "hpu:", static_cast<int>(d.index()),
                ": a process acquires one Gaudi, named torch.device('hpu') (index 0)");
  }
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device) const override {
    return c10::Stream(c10::Stream::DEFAULT, device());
  }
  c10::Stream exchangeStream(c10::Stream) const override {
    return c10::Stream(c10::Stream::DEFAULT, device());
  }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeDevice(const c10::DeviceIndex) const override {}
};

// Registered under the name torch looks up ("HPUHooks"): torch.accelerator then finds the device.
struct HPUHooks final : at::HPUHooksInterface {
  explicit HPUHooks(at::HPUHooksArgs) {}
  bool isBuilt() const override { return true; }
  void init() const override {}
  bool hasHPU() const override { return true; }
  bool isAvailable() const override { return true; }
  c10::Device getDeviceFromPtr(void*) const override { return device(); }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return 1; }
  c10::DeviceIndex getCurrentDevice() const override { return 0; }
  // Pinned host buffers (a non_blocking copy to the host allocates one) are host memory.
  c10::Allocator* getPinnedMemoryAllocator() const override { return c10::GetCPUAllocator(); }
  // Random numbers come from the host's generators (every kernel runs on the host): the same
  // streams as the emulation's, so a seeded sample on both backends draws the same numbers.
  const at::Generator& getDefaultGenerator(c10::DeviceIndex) const override {
    return at::detail::getDefaultCPUGenerator();
  }
  at::Generator getNewGenerator(c10::DeviceIndex) const override {
    return at::detail::createCPUGenerator();
  }
};

}  // namespace

REGISTER_ALLOCATOR(c10::DeviceType::HPU, &g_allocator);
C10_REGISTER_GUARD_IMPL(HPU, DeviceGuard);
namespace at {
REGISTER_HPU_HOOKS(HPUHooks);  // the name torch looks up
}  // namespace at

TORCH_LIBRARY_IMPL(_, HPU, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&run_on_host>());
}

TORCH_LIBRARY_IMPL(aten, HPU, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("as_strided", at::native::as_strided_tensorimpl);
  m.impl("view", at::native::view);
  m.impl("_reshape_alias", at::native::_reshape_alias);
  m.impl("unfold", at::native::unfold);
  m.impl("resize_", at::native::resize_);
  m.impl("set_.source_Storage", at::native::set_);
  m.impl("set_.source_Storage_storage_offset", set_storage);
  m.impl("set_.source_Tensor", at::native::set_tensor_);
  m.impl("set_", set_empty);
}

TORCH_LIBRARY(habana_standin, m) {
  m.def("host_reads() -> int", host_reads);
  m.def("host_reads_by_op() -> str", host_reads_by_op);
  m.def("memory_allocated() -> int", memory_allocated);
  m.def("max_memory_allocated() -> int", max_memory_allocated);
  m.def("reset_peak_memory_stats() -> ()", reset_peak_memory_stats);
}
