// The overlap engine: compressed all-reduce, all-gather and reduce-scatter jobs (and fp32
// all-gather / reduce-scatter ones) run first-in first-out on one worker thread over a c10d
// ProcessGroup (gloo on CPU), so the caller keeps computing (backward, the next matmul) meanwhile.
// On CUDA tensors (only in the CUDA build, PYFAST_WITH_CUDA) the same thread issues the same
// algorithm onto a side stream, ordered after the caller's stream by events (NCCL):
// csrc/cuda/engine_cuda.cu.
// It is an object, not a tensor op, so Python sees it through pybind11 (module.cpp), not the
// dispatcher. Algorithms and bytes: pyfast/comm/collectives.py; Python face: pyfast/comm/engine.py.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "check.h"

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace pyfast {

#ifdef PYFAST_WITH_CUDA
inline constexpr bool kWithCuda = true;  // setup.py's CUDAExtension build
#else
inline constexpr bool kWithCuda = false;
#endif

// The device-specific half of a job on tensors off the CPU; the algorithm (Engine::run) is the
// CPU one. CUDA: events and a side stream (csrc/cuda/engine_cuda.cu).
struct DeviceJob {
  virtual ~DeviceJob() = default;
  // Worker thread: call `ops` (the job's algorithm) so that the work it issues lands where it
  // belongs (CUDA: on the side stream, after the caller's stream reached submit()).
  virtual void issue(const std::function<void()>& ops) = 0;
  // Caller's thread, in Engine::wait once the worker issued the job without error (CUDA: the
  // caller's current stream waits for the job; the host does not).
  virtual void wait() = 0;
};
struct DeviceQueue {  // one per engine: where its jobs run, in order (CUDA: the side stream)
  virtual ~DeviceQueue() = default;
  // Caller's thread, at submit: `tensors` are every tensor the job reads or writes.
  virtual std::unique_ptr<DeviceJob> job(const std::vector<at::Tensor>& tensors) = 0;
};
// Defined in csrc/cuda/engine_cuda.cu, linked only into the CUDA build; engine.cpp calls it
// under `if constexpr (kWithCuda)`, so the CPU build compiles the call but never links it.
std::unique_ptr<DeviceQueue> cuda_queue(c10::DeviceIndex device);

class Engine {
 public:
  explicit Engine(c10::intrusive_ptr<c10d::ProcessGroup> pg);
  ~Engine();  // shutdown()
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Tensors are CPU, or CUDA in the CUDA build (kWithCuda), all of a job's on one device, and
  // all of an engine's CUDA jobs on one GPU.
  // Reduce `t` (flat, contiguous fp32) in place, as pyfast.comm.all_reduce does.
  // kind: none|fp16|bf16|int8|int4|fp8|sign; block: the quantization block; algorithm:
  // native|two-phase|allgather; align: chunk alignment (collectives.py's getattr(c, "block", 8));
  // chunk: elements per pipelined piece (pipelined.py's chunk_elems(); 0 = one piece, the
  // reference functions); ef: empty, or one fp32 memory per compression, per piece in order:
  // allgather [piece], two-phase [part 0..W-1, sum]. Checked here, on the caller's thread.
  // ef_out: empty (each memory updated in place) or as many buffers as ef, where each new
  // memory is written, ef left as it was (check_finite="skip"'s double buffer).
  int64_t submit(const at::Tensor& t, const std::string& kind, int64_t block,
                 const std::string& algorithm, bool avg, std::vector<at::Tensor> ef,
                 int64_t align, int64_t chunk, std::vector<at::Tensor> ef_out = {});
  // All-gather / reduce-scatter jobs on the same FIFO (tensor-parallel overlap: the next
  // chunk's collective runs here while the caller multiplies; ZeRO's gradient reduce-scatter
  // and parameter all-gather). Contiguous float32 tensors, any shape. kind (none|fp16|bf16|
  // int8|int4|fp8|sign) and block: the codec, as submit's; ef: empty (no error feedback) or
  // the fp32 memories, one per compressed piece (kind none: none). Bitwise as
  // pyfast/comm/sharded.py's all_gather / reduce_scatter (8-byte padded slots on the wire).
  // out (W * in.numel() elements) = every rank's `in`, in rank order (all_gather_into_tensor);
  // compressed: each rank's `in` coded once (ef: 1 memory of in.numel()), every rank decodes
  // every rank's bytes, its own included.
  int64_t submit_all_gather(const at::Tensor& out, const at::Tensor& in,
                            const std::string& kind = "none", int64_t block = 1,
                            std::vector<at::Tensor> ef = {});
  // out (in.numel() / W elements) = part `rank` of the sum over ranks of `in`, divided by W if
  // avg. algorithm "rank-order": an all-to-all of the W parts (compressed: part i through
  // memory i, ef: W memories of out.numel()), then decoded and added here in rank order from
  // zero in fp32, so the bits do not depend on the backend's reduction order; "backend" (kind
  // none only): the ProcessGroup's own reduce_scatter_single (comm.reduce_scatter's).
  int64_t submit_reduce_scatter(const at::Tensor& out, const at::Tensor& in, bool avg,
                                const std::string& kind = "none", int64_t block = 1,
                                std::vector<at::Tensor> ef = {},
                                const std::string& algorithm = "rank-order");
  // Block until job `id` is done; rethrows what the worker raised. Returns seconds() and
  // forgets the job (a second wait(id) is an error). CUDA: "done" means issued; the caller's
  // current stream then waits on the job's side-stream event, the host does not.
  double wait(int64_t id);
  // Worker time of a job not yet waited for; NaN while it is queued or running. CUDA: the
  // time to issue the job, not the GPU's time to run it.
  double seconds(int64_t id);
  // Refuse new jobs, run every queued one (every rank issued them: skipping one would leave
  // the peers waiting), then join the worker. Idempotent; wait() and seconds() still answer for
  // jobs submitted before. After it returns the engine no longer touches its ProcessGroup.
  void shutdown();
  int rank() const { return rank_; }
  int world() const { return world_; }

  struct Job;

 private:
  int64_t enqueue(std::shared_ptr<Job> j, const std::string& what);
  void loop();
  void run(Job& j);
  void gather_sum(Job& j);
  void two_phase(Job& j);
  void gather(Job& j);
  void reduce_scatter(Job& j);
  std::unique_ptr<DeviceJob> device_job(const Job& j);  // mu_ held

  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  int rank_, world_;
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<std::shared_ptr<Job>> queue_;
  std::unordered_map<int64_t, std::shared_ptr<Job>> jobs_;  // submitted, not yet waited for
  std::unique_ptr<DeviceQueue> cuda_;  // made by the first CUDA job; null in the CPU build
  int64_t next_id_ = 0;
  bool stop_ = false;
  std::mutex join_mu_;  // shutdown() from two threads: one joins
  std::string broken_;  // worker only: why the group can no longer be trusted
  std::thread worker_;
};

}  // namespace pyfast
