// The overlap engine: compressed all-reduce jobs (and uncompressed fp32 all-gather /
// reduce-scatter jobs) run first-in first-out on one worker thread over a c10d ProcessGroup
// (gloo on CPU), so the caller keeps computing (backward, the next matmul) meanwhile.
// It is an object, not a tensor op, so Python sees it through pybind11 (module.cpp), not the
// dispatcher. Algorithms and bytes: pyfast/comm/collectives.py; Python face: pyfast/comm/engine.py.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace pyfast {

class Engine {
 public:
  explicit Engine(c10::intrusive_ptr<c10d::ProcessGroup> pg);
  ~Engine();  // shutdown()
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Reduce `t` (flat, contiguous fp32, CPU) in place, as pyfast.comm.all_reduce does.
  // kind: none|fp16|bf16|int8|int4|fp8|sign; block: the quantization block; algorithm:
  // native|two-phase|allgather; align: chunk alignment (collectives.py's getattr(c, "block", 8));
  // chunk: elements per pipelined piece (pipelined.py's chunk_elems(); 0 = one piece, the
  // reference functions); ef: empty, or one fp32 memory per compression, per piece in order:
  // allgather [piece], two-phase [part 0..W-1, sum]. Checked here, on the caller's thread.
  int64_t submit(const at::Tensor& t, const std::string& kind, int64_t block,
                 const std::string& algorithm, bool avg, std::vector<at::Tensor> ef,
                 int64_t align, int64_t chunk);
  // Uncompressed fp32 jobs on the same FIFO (tensor-parallel overlap: the next chunk's
  // collective runs here while the caller multiplies). Contiguous float32 CPU tensors, any shape.
  // out (W * in.numel() elements) = every rank's `in`, in rank order (all_gather_into_tensor).
  int64_t submit_all_gather(const at::Tensor& out, const at::Tensor& in);
  // out (in.numel() / W elements) = part `rank` of the sum over ranks of `in`, added in rank
  // order (in_0 + in_1 + ...), divided by W if avg: an all-to-all of the parts, then the sum here,
  // so the bits do not depend on the backend's reduction order.
  int64_t submit_reduce_scatter(const at::Tensor& out, const at::Tensor& in, bool avg);
  // Block until job `id` is done; rethrows what the worker raised. Returns seconds() and
  // forgets the job (a second wait(id) is an error).
  double wait(int64_t id);
  // Worker time of a job not yet waited for; NaN while it is queued or running.
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

  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  int rank_, world_;
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<std::shared_ptr<Job>> queue_;
  std::unordered_map<int64_t, std::shared_ptr<Job>> jobs_;  // submitted, not yet waited for
  int64_t next_id_ = 0;
  bool stop_ = false;
  std::mutex join_mu_;  // shutdown() from two threads: one joins
  std::string broken_;  // worker only: why the group can no longer be trusted
  std::thread worker_;
};

}  // namespace pyfast
