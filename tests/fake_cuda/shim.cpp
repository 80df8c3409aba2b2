// Fake CUDA for a CPU build of PyTorch: loaded with LD_PRELOAD before torch, it registers
// torch's own fake device guard for the CUDA device type and CUDA hooks that report one
// available device. Tensors then live on "cuda" only as FakeTensors (torch's FakeTensorMode:
// shapes, dtypes and devices, no data), and autograd's device threads, stream lookups and
// the accelerator queries that a CPU build refuses for CUDA all answer. Nothing computes.
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

namespace fake_cuda {

// Current device and stream per thread, eight devices: what autograd's engine asks for.
C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>);

struct CUDAHooks final : at::CUDAHooksInterface {
  explicit CUDAHooks(at::CUDAHooksArgs) {}
  // at::accelerator::getAccelerator asks isAvailable(); Context::hasCUDA asks hasCUDA().
  bool hasCUDA() const override { return true; }
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return 1; }
  c10::DeviceIndex getCurrentDevice() const override { return 0; }
  c10::DeviceIndex current_device() const override { return 0; }
  int getNumGPUs() const override { return 1; }
  bool isPinnedPtr(const void*) const override { return false; }
};

}  // namespace fake_cuda

// The registry key torch looks up is the literal "CUDAHooks" (at::detail::getCUDAHooks, resolved
// once per process: hence LD_PRELOAD, so that this registration comes before torch's first ask).
namespace at {
C10_REGISTER_TYPED_CLASS(CUDAHooksRegistry, "CUDAHooks", fake_cuda::CUDAHooks);
}
