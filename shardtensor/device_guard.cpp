// The PrivateUse1 device guard for shardtensor's torch device, in C++.
//
// torch's Python device guard is called while autograd unwinds an exception raised in backward();
// with the Python error still set, that call aborts the process ("terminate called without an
// active exception"). This guard never calls Python. shardtensor has one logical device and no
// streams or events, so every method is trivial.
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/DeviceType.h>
#include <c10/core/Stream.h>
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
}
