// The CUDA half of the overlap engine (engine.h's DeviceQueue / DeviceJob). Built only into the
// CUDA extension (setup.py defines PYFAST_WITH_CUDA there); tools/cuda_check.py compiles it
// wherever nvcc exists. No kernels: the job's algorithm is engine.cpp's, shared with the CPU,
// and its compression runs the pyfast:: CUDA kernels through the dispatcher (wire.h).
//
// A job on CUDA tensors: submit() records `ready` on the caller's current stream (where the
// gradient was produced). The worker thread makes the engine's side stream current
// (CUDAStreamGuard), makes it wait on `ready`, issues the whole job -- kernels, ATen copies and
// casts, c10d collectives -- and records `done` on it. wait(id) returns once the worker has
// issued the job (or rethrows what it raised), after making the caller's current stream wait
// on `done`: the host never waits for the GPU.
//
// The collectives: ProcessGroupNCCL runs them on its own internal streams. At each launch it
// makes its stream wait on the current stream (the side stream, here), and Work::wait() makes
// the current stream wait on its stream (a host wait only with TORCH_NCCL_BLOCKING_WAIT=1).
// So the order side stream -> NCCL stream -> side stream is c10d's, and the pieces the
// algorithm keeps in flight overlap compression on the side stream with NCCL's transfers.
// c10d also keeps the wire buffers alive for its stream (recordStream, or stashed in the Work
// with TORCH_NCCL_AVOID_RECORD_STREAMS=1). Nothing here has run: this machine has no GPU.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "../engine.h"

namespace pyfast {
namespace {

using c10::cuda::CUDAEvent;
using c10::cuda::CUDAStream;

class CudaJob final : public DeviceJob {
 public:
  CudaJob(CUDAStream side, const std::vector<at::Tensor>& tensors) : side_(side) {
    ready_.record(c10::cuda::getCurrentCUDAStream(side_.device_index()));
    // The worker drops its references once the job is issued, possibly before the side stream
    // ran it; if the caller dropped its own too, the caching allocator would hand the memory
    // to the caller's stream while the side stream still uses it.
    for (const auto& t : tensors)
      if (t.defined())
        c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), side_);
  }
  void issue(const std::function<void()>& ops) override {
    c10::cuda::CUDAStreamGuard on_side(side_);  // this thread's current stream and device
    ready_.block(side_);
    ops();
    done_.record(side_);
  }
  void wait() override { done_.block(c10::cuda::getCurrentCUDAStream(side_.device_index())); }

 private:
  CUDAStream side_;
  CUDAEvent ready_, done_;  // default flags: cudaEventDisableTiming, ordering only
};

class CudaQueue final : public DeviceQueue {
 public:
  // One side stream per engine, so its jobs also run in submission order on the GPU.
  explicit CudaQueue(c10::DeviceIndex device)
      : side_(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device)) {}
  std::unique_ptr<DeviceJob> job(const std::vector<at::Tensor>& tensors) override {
    const auto device = tensors.at(0).device();
    PYFAST_CHECK(device.is_cuda() && device.index() == side_.device_index(),
                "pyfast engine: a job on ", device, ", but this engine's CUDA jobs run on cuda:",
                static_cast<int>(side_.device_index()), " (one engine per GPU)");
    return std::make_unique<CudaJob>(side_, tensors);
  }

 private:
  CUDAStream side_;
};

}  // namespace

std::unique_ptr<DeviceQueue> cuda_queue(c10::DeviceIndex device) {
  return std::make_unique<CudaQueue>(device);
}

}  // namespace pyfast
