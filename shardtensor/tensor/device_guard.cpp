// shardtensor's C++ half: the PrivateUse1 device guard, and the tensor-metadata setters behind
// in-place view ops (squeeze_, t_, as_strided_, resize_, set_ ...).
//
// torch's Python device guard is called while autograd unwinds an exception raised in backward();
// with the Python error still set, that call aborts the process ("terminate called without an
// active exception"). This guard never calls Python. shardtensor has one logical device and no
// streams or events, so every method is trivial.
//
// A ShardedTensor's sizes live in its C++ TensorImpl (made by _make_wrapper_subclass) and Python
// cannot change them; set_geometry/share_storage/fresh_storage do, for the dispatcher. Its storage
// holds no data (the values are in JAX): only its byte size and identity matter.
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/DeviceType.h>
#include <c10/core/Stream.h>
#include <c10/core/Storage.h>
#include <c10/core/TensorImpl.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/variable.h>
#include <vector>
namespace {
struct ShardtensorGuardImpl final : public c10::impl::DeviceGuardImplInterface {
  static thread_local c10::DeviceIndex current_device;
  static thread_local c10::StreamId current_stream;
  c10::DeviceType type() const override { return c10::DeviceType::PrivateUse1; }
  c10::Device exchangeDevice(c10::Device d) const override {
    auto old = getDevice(); current_device = d.index(); return old; }
  c10::Device getDevice() const override { return c10::Device(c10::DeviceType::PrivateUse1, current_device); }
  void setDevice(c10::Device d) const override { current_device = d.index(); }
  void uncheckedSetDevice(c10::Device d) const noexcept override { current_device = d.index(); }
  c10::Stream getStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::UNSAFE, d, current_stream); }
  c10::Stream getDefaultStream(c10::Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream exchangeStream(c10::Stream s) const override {
    auto old = getStream(s.device()); current_stream = s.id(); return old; }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeDevice(const c10::DeviceIndex) const override {}
  void record(void**, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
};
thread_local c10::DeviceIndex ShardtensorGuardImpl::current_device = 0;
thread_local c10::StreamId ShardtensorGuardImpl::current_stream = 0;
C10_REGISTER_GUARD_IMPL(PrivateUse1, ShardtensorGuardImpl);

// What torch asks of the accelerator behind torch.accelerator (registering the backend makes it one):
// a DataLoader with pin_memory=True pins for it. shardtensor's device reads host memory through JAX,
// which needs no page-locked buffers, so "pinned" memory is ordinary host memory.
struct ShardtensorHooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  at::Allocator* getPinnedMemoryAllocator() const override { return c10::GetCPUAllocator(); }
  bool isPinnedPtr(const void*) const override { return false; }
  at::Device getDeviceFromPtr(void*) const override { return at::Device(c10::DeviceType::PrivateUse1, 0); }
};

c10::TensorImpl* data_less_impl(const at::Tensor& t) {
  TORCH_CHECK(t.defined() && t.device().type() == c10::DeviceType::PrivateUse1,
              "shardtensor: expected a tensor on the shardtensor device");
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  TORCH_CHECK(impl->has_storage() && impl->storage().data_ptr().get() == nullptr,
              "shardtensor: expected a ShardedTensor (a tensor whose storage holds no data)");
  return impl;
}
}  // namespace

// Give t these sizes, strides and storage offset (its storage grows to cover them).
void set_geometry(const at::Tensor& t, std::vector<int64_t> sizes, std::vector<int64_t> strides,
                  int64_t storage_offset) {
  c10::TensorImpl* impl = data_less_impl(t);
  TORCH_CHECK(sizes.size() == strides.size(), "shardtensor: sizes and strides differ in length");
  int64_t extent = storage_offset;  // one past the last element, in elements
  bool empty = false;
  for (size_t i = 0; i < sizes.size(); ++i) {
    TORCH_CHECK(sizes[i] >= 0 && strides[i] >= 0 && storage_offset >= 0, "shardtensor: negative size, stride or offset");
    empty = empty || sizes[i] == 0;
    extent += (sizes[i] - 1) * strides[i];
  }
  extent = empty ? storage_offset : extent + 1;
  impl->set_sizes_and_strides(sizes, strides, storage_offset);
  size_t nbytes = static_cast<size_t>(extent) * impl->dtype().itemsize();
  auto* storage = impl->storage().unsafeGetStorageImpl();
  if (storage->nbytes() < nbytes) storage->set_nbytes(nbytes);
}

// Make t share src's storage (torch's set_(src)).
void share_storage(const at::Tensor& t, const at::Tensor& src) {
  c10::TensorImpl* impl = data_less_impl(t);
  impl->set_storage_keep_dtype(data_less_impl(src)->storage());
}

// Give t a storage of its own of nbytes bytes (a resize_ that had to reallocate).
void fresh_storage(const at::Tensor& t, int64_t nbytes) {
  c10::TensorImpl* impl = data_less_impl(t);
  impl->set_storage_keep_dtype(c10::Storage(c10::Storage::use_byte_size_t(), static_cast<size_t>(nbytes),
                                            at::DataPtr(nullptr, t.device()), nullptr, false));
}

// An in-place view op changed the geometry of t, an autograd view: make autograd rebuild t from its
// base with as_strided (exact on shardtensor) rather than by replaying the view ops that made it,
// which knows nothing of in-place view ops (pytorch/pytorch#49825; plain CPU tensors use as_strided).
void forget_view_replay(const at::Tensor& t) {
  auto* meta = torch::autograd::impl::get_view_autograd_meta(t);
  if (meta == nullptr) return;
  for (bool forward : {false, true}) {
    if (forward ? !meta->has_fw_view() : !meta->has_bw_view()) continue;
    auto& info = const_cast<torch::autograd::ViewInfo&>(forward ? meta->get_forward_view() : meta->get_backward_view());
    info.view_fn_.reset();
    info.rev_view_fn_ = nullptr;
  }
}

// Register the hooks above (once per process; torch keeps the pointer).
void register_hooks() {
  static ShardtensorHooks hooks;
  at::RegisterPrivateUse1HooksInterface(&hooks);
}
