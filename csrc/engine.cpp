// pyfast::Engine (engine.h). The worker runs pyfast.comm.all_reduce's algorithms for the dense
// compressors with c10d calls and the pyfast:: kernels (wire.h): pipelined.py's pieces (the
// reference functions of collectives.py when chunk = 0), the same wire bytes, decode order (rank
// order into zeroed fp32) and error-feedback arithmetic, so results are bitwise equal to it.
// Like pipelined.py it keeps two all-gathers, or three two-phase stages, in flight: compressing
// piece i+1 and decoding piece i-1 overlap the transfer of piece i.
//
// The algorithm is device-agnostic: buffers are allocated on the job's device and every op is
// ATen's or the dispatcher's. On CUDA (CUDA build only) a DeviceJob puts what the worker
// issues on a side stream ordered by events (csrc/cuda/engine_cuda.cu); on CPU it runs as is.
//
// One deliberate difference on the wire: every rank's slot in a gather / all-to-all buffer is
// padded to 8 bytes, so the fp32 scales of every slot are aligned views; the reference copies
// misaligned slices instead (compress/base.py aligned()). At most 7 bytes per message.
#include "engine.h"

#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <pthread.h>

#include <chrono>
#include <limits>
#include <string_view>

#include "pg_compat.h"
#include "wire.h"

namespace pyfast {
namespace {

const std::pair<std::string_view, Kind> kKinds[] = {
    {"none", Kind::None}, {"fp16", Kind::Fp16}, {"bf16", Kind::Bf16}, {"int8", Kind::Int8},
    {"int4", Kind::Int4}, {"fp8", Kind::Fp8},   {"sign", Kind::Sign}};
// Gather / ReduceScatter: all_gather / reduce_scatter jobs, fp32 or through a codec;
// BackendReduceScatter: the backend's own fp32 reduce-scatter (comm.reduce_scatter's "none").
enum class Algo { Native, TwoPhase, AllGather, Gather, ReduceScatter, BackendReduceScatter };
const std::pair<std::string_view, Algo> kAlgos[] = {
    {"native", Algo::Native}, {"two-phase", Algo::TwoPhase}, {"allgather", Algo::AllGather}};

template <class T, size_t N>
T lookup(const std::pair<std::string_view, T> (&table)[N], const std::string& key,
         const char* what) {
  std::string valid;
  for (const auto& [name, v] : table) {
    if (name == key) return v;
    valid += (valid.empty() ? "" : ", ") + std::string(name);
  }
  PYFAST_CHECK(false, "pyfast engine: unknown ", what, " '", key, "'; valid: ", valid);
  return table[0].second;  // not reached
}

// CPU, or CUDA in the CUDA build; `like` (defined): the device every tensor of the job is on.
void check_device(const at::Tensor& t, const char* what, const at::Tensor& like = {}) {
  PYFAST_CHECK(kWithCuda || !t.is_cuda(), "pyfast._C was built without CUDA: the engine cannot ",
              "take ", what, " on ", t.device(), "; rebuild pyfast where torch is a CUDA build ",
              "and nvcc exists (setup.py), or use pyfast.comm.all_reduce");
  PYFAST_CHECK(t.is_cpu() || t.is_cuda(), "pyfast engine: ", what, " is on ", t.device(),
              "; the engine takes CPU", kWithCuda ? " and CUDA" : "", " tensors");
  PYFAST_CHECK(!like.defined() || t.device() == like.device(), "pyfast engine: ", what,
              " is on ", t.device(), ", the job's other tensors on ", like.device());
}

void check_float(const at::Tensor& t, const char* what, const at::Tensor& like = {}) {
  check_device(t, what, like);
  PYFAST_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 1,
              "pyfast engine: ", what, " must be a flat contiguous float32 tensor, got ",
              t.scalar_type(), " of shape ", t.sizes(), " on ", t.device());
}

// pipelined.py's pieces [a, b): steps of `chunk` rounded up to align (align * W for two-phase);
// chunk <= 0 is one piece, collectives.py's reference functions.
std::vector<std::pair<int64_t, int64_t>> pieces(Algo algo, int64_t n, int64_t align,
                                                int64_t chunk, int64_t W) {
  const int64_t step = chunk <= 0 ? n : round_up(chunk, algo == Algo::TwoPhase ? align * W : align);
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t a = 0; a < n; a += step) out.emplace_back(a, std::min(n, a + step));
  return out;
}

using WorkPtr = c10::intrusive_ptr<c10d::Work>;
at::Tensor bytes(int64_t len, const at::Tensor& like) {  // on like's device
  return at::empty({len}, like.options().dtype(at::kByte));
}

// slot (a send slot, at least c.bytes(x.numel()) bytes) = x's wire image through the
// error-feedback memory m.in (if defined; the new memory into m.out), the rest zeroed.
void pack(const Codec& c, const at::Tensor& x, const Mem& m, const at::Tensor& slot) {
  const int64_t b = c.bytes(x.numel());
  c.compress(x, m.in, m.out, slot.narrow(0, 0, b));
  slot.narrow(0, b, slot.numel() - b).zero_();
}

// A send buffer of x's parts [p, q), each packed (through ef(i)) into a slot of
// round8(c.bytes(q - p)) bytes, in order; `slots` gets the slot sizes.
template <class Ef>
at::Tensor pack_parts(const Codec& c, const at::Tensor& x,
                      const std::vector<std::pair<int64_t, int64_t>>& parts, Ef ef,
                      std::vector<int64_t>& slots) {
  int64_t total = 0;
  for (auto [p, q] : parts) slots.push_back(round8(c.bytes(q - p))), total += slots.back();
  at::Tensor send = bytes(total, x);
  for (size_t i = 0, off = 0; i < parts.size(); off += slots[i], ++i) {
    const auto [p, q] = parts[i];
    pack(c, x.narrow(0, p, q - p), ef(i), send.narrow(0, off, slots[i]));
  }
  return send;
}

// out = the sum in rank order, in fp32 from zero, of the W wire images of out.numel() elements
// that start every `slot` bytes in recv (0 + -0 is +0: no copy of rank 0's).
void sum_slots(const Codec& c, const at::Tensor& recv, int64_t slot, int64_t W,
               const at::Tensor& out) {
  out.zero_();
  for (int64_t r = 0; r < W; ++r) c.decode_add(recv.narrow(0, r * slot, c.bytes(out.numel())), out);
}

}  // namespace

struct Engine::Job {
  int64_t id;
  at::Tensor t;   // reduced in place; the output of Gather / (Backend)ReduceScatter
  at::Tensor in;  // the input of Gather / ReduceScatter
  Codec codec;
  Algo algo;
  bool avg;
  int64_t align, chunk;
  std::vector<at::Tensor> ef, ef_out;  // ef_out: empty (in place) or where each new memory goes
  std::string what;
  Mem mem(size_t i) const {
    if (ef.empty()) return {};
    return {ef[i], ef_out.empty() ? ef[i] : ef_out[i]};
  }  // names the job in errors
  std::unique_ptr<DeviceJob> device;  // null on CPU
  bool done = false;
  double seconds = std::numeric_limits<double>::quiet_NaN();
  std::exception_ptr error;
};

Engine::Engine(c10::intrusive_ptr<c10d::ProcessGroup> pg)
    : pg_(std::move(pg)), rank_(pg_->getRank()), world_(pg_->getSize()) {
  quantize_op(), dequantize_op(), accumulate_op();  // fail here if pyfast._C's ops are missing
  worker_ = std::thread([this] { loop(); });
}

Engine::~Engine() { shutdown(); }

void Engine::shutdown() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  std::lock_guard<std::mutex> g(join_mu_);
  if (worker_.joinable()) worker_.join();
}

int64_t Engine::submit(const at::Tensor& t, const std::string& kind, int64_t block,
                       const std::string& algorithm, bool avg, std::vector<at::Tensor> ef,
                       int64_t align, int64_t chunk, std::vector<at::Tensor> ef_out) {
  auto j = std::make_shared<Job>();
  j->codec = Codec{lookup(kKinds, kind, "compression kind"), kind, block};
  j->algo = lookup(kAlgos, algorithm, "algorithm");
  check_float(t, "the reduced tensor");
  PYFAST_CHECK((j->codec.kind == Kind::None) == (j->algo == Algo::Native),
              "pyfast engine: kind '", kind, "' cannot use algorithm '", algorithm,
              "' (none is reduced natively; the other kinds use two-phase or allgather)");
  PYFAST_CHECK(align >= 1 && block >= 1, "pyfast engine: align and block must be >= 1, got ",
              align, " and ", block);
  const int64_t n = t.numel();
  std::vector<int64_t> want;  // element count of each error-feedback memory, in order
  for (auto [a, b] : pieces(j->algo, n, align, chunk, world_)) {
    if (j->algo == Algo::AllGather) want.push_back(b - a);
    if (j->algo != Algo::TwoPhase) continue;
    const auto parts = chunks(b - a, world_, align);
    for (auto [p, q] : parts) want.push_back(q - p);
    want.push_back(parts[rank_].second - parts[rank_].first);
  }
  PYFAST_CHECK(ef.empty() || ef.size() == want.size(), "pyfast engine: ", algorithm, " of ", n,
              " elements on ", world_, " ranks needs ", want.size(),
              " error-feedback buffers, got ", ef.size());
  for (size_t i = 0; i < ef.size(); ++i) {
    check_float(ef[i], "an error-feedback buffer", t);
    PYFAST_CHECK(ef[i].numel() == want[i], "pyfast engine: error-feedback buffer ", i, " holds ",
                ef[i].numel(), " elements, its part of the tensor has ", want[i]);
  }
  PYFAST_CHECK(ef_out.empty() || ef_out.size() == ef.size(), "pyfast engine: ", ef.size(),
              " error-feedback buffers but ", ef_out.size(), " to write the new memory into");
  for (size_t i = 0; i < ef_out.size(); ++i) {
    check_float(ef_out[i], "an error-feedback output buffer", t);
    PYFAST_CHECK(ef_out[i].numel() == want[i], "pyfast engine: error-feedback output buffer ", i,
                " holds ", ef_out[i].numel(), " elements, its part of the tensor has ", want[i]);
  }
  j->t = t, j->avg = avg, j->ef = std::move(ef), j->align = align, j->chunk = chunk;
  j->ef_out = std::move(ef_out);
  return enqueue(std::move(j), kind + ", " + algorithm + ", " + std::to_string(n) + " elements");
}

namespace {
at::Tensor flat_float(const at::Tensor& t, const char* what, const at::Tensor& like = {}) {
  check_device(t, what, like);
  PYFAST_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous(),
              "pyfast engine: ", what, " must be a contiguous float32 tensor, got ",
              t.scalar_type(), " of shape ", t.sizes(), " on ", t.device());
  return t.view(-1);
}
}  // namespace

namespace {
// kind's codec, and ef checked: empty, or `count` fp32 memories of `each` elements on t's device.
Codec sharded_codec(const std::string& kind, int64_t block, const std::vector<at::Tensor>& ef,
                    size_t count, int64_t each, const at::Tensor& t, const char* what) {
  Codec c{lookup(kKinds, kind, "compression kind"), kind, block};
  PYFAST_CHECK(block >= 1, "pyfast engine: block must be >= 1, got ", block);
  PYFAST_CHECK(ef.empty() || c.kind != Kind::None, "pyfast engine: ", what,
              " without compression takes no error-feedback buffers, got ", ef.size());
  PYFAST_CHECK(ef.empty() || ef.size() == count, "pyfast engine: ", what, " on this many ranks ",
              "needs ", count, " error-feedback buffers (one per compressed piece), got ",
              ef.size());
  for (size_t i = 0; i < ef.size(); ++i) {
    check_float(ef[i], "an error-feedback buffer", t);
    PYFAST_CHECK(ef[i].numel() == each, "pyfast engine: error-feedback buffer ", i, " of ", what,
                " holds ", ef[i].numel(), " elements, its piece has ", each);
  }
  return c;
}
}  // namespace

int64_t Engine::submit_all_gather(const at::Tensor& out, const at::Tensor& in,
                                  const std::string& kind, int64_t block,
                                  std::vector<at::Tensor> ef) {
  auto j = std::make_shared<Job>();
  j->t = flat_float(out, "all_gather's output");
  j->in = flat_float(in, "all_gather's input", out);
  PYFAST_CHECK(j->t.numel() == world_ * j->in.numel(), "pyfast engine: all_gather of ",
              j->in.numel(), " elements on ", world_, " ranks needs an output of ",
              world_ * j->in.numel(), " elements, got ", j->t.numel());
  j->codec = sharded_codec(kind, block, ef, 1, j->in.numel(), j->t, "all_gather");
  j->algo = Algo::Gather, j->avg = false, j->ef = std::move(ef);
  return enqueue(std::move(j),
                 "all_gather, " + kind + ", " + std::to_string(in.numel()) + " elements");
}

int64_t Engine::submit_reduce_scatter(const at::Tensor& out, const at::Tensor& in, bool avg,
                                      const std::string& kind, int64_t block,
                                      std::vector<at::Tensor> ef, const std::string& algorithm) {
  auto j = std::make_shared<Job>();
  j->t = flat_float(out, "reduce_scatter's output");
  j->in = flat_float(in, "reduce_scatter's input", out);
  PYFAST_CHECK(j->in.numel() == world_ * j->t.numel(), "pyfast engine: reduce_scatter into ",
              j->t.numel(), " elements on ", world_, " ranks needs an input of ",
              world_ * j->t.numel(), " elements, got ", j->in.numel());
  j->codec = sharded_codec(kind, block, ef, world_, j->t.numel(), j->t, "reduce_scatter");
  PYFAST_CHECK(algorithm == "rank-order" || (algorithm == "backend" && j->codec.kind == Kind::None),
              "pyfast engine: reduce_scatter's algorithm is 'rank-order', or 'backend' for kind ",
              "'none' only; got '", algorithm, "' with kind '", kind, "'");
  j->algo = algorithm == "backend" ? Algo::BackendReduceScatter : Algo::ReduceScatter;
  j->avg = avg, j->ef = std::move(ef);
  return enqueue(std::move(j), "reduce_scatter, " + kind + ", " + algorithm + ", " +
                                   std::to_string(in.numel()) + " elements");
}

int64_t Engine::enqueue(std::shared_ptr<Job> j, const std::string& what) {
  {
    std::lock_guard<std::mutex> g(mu_);
    PYFAST_CHECK(!stop_, "pyfast engine: submit after shutdown");
    if (!j->t.is_cpu()) j->device = device_job(*j);  // CUDA: records the caller's stream now
    j->id = next_id_++;
    // Plain string arithmetic, no ostream (c10::str): on the lent H200 (torch 2.11, its image's
    // g++ wrapper) formatting an integer through an ostream here segfaulted inside _C.so, on
    // every submit, CPU or CUDA (bench/results/gpu_h200.txt). The job description is built on
    // the success path of every submit, so it must not depend on iostream's locale facets.
    j->what = "pyfast engine job " + std::to_string(j->id) + " (" + what + ", rank " +
              std::to_string(rank_) + " of " + std::to_string(world_) + ")";
    jobs_[j->id] = j;
    queue_.push_back(j);
  }
  work_cv_.notify_one();
  return j->id;
}

std::unique_ptr<DeviceJob> Engine::device_job(const Job& j) {
  std::vector<at::Tensor> tensors{j.t, j.in};
  tensors.insert(tensors.end(), j.ef.begin(), j.ef.end());
  tensors.insert(tensors.end(), j.ef_out.begin(), j.ef_out.end());
  if constexpr (kWithCuda) {  // submit's checks let only CPU and CUDA tensors through
    if (!cuda_) cuda_ = cuda_queue(j.t.device().index());
    return cuda_->job(tensors);
  }
  PYFAST_CHECK(false, "pyfast engine: no device queue for ", j.t.device());  // not reached
  return nullptr;
}

double Engine::wait(int64_t id) {
  std::shared_ptr<Job> j;
  {
    std::unique_lock<std::mutex> g(mu_);
    auto it = jobs_.find(id);
    PYFAST_CHECK(it != jobs_.end(), "pyfast engine: no job ", id, " (already waited for?)");
    j = it->second;
    done_cv_.wait(g, [&] { return j->done; });
    jobs_.erase(id);
  }
  if (j->error) std::rethrow_exception(j->error);
  if (j->device) j->device->wait();
  return j->seconds;
}

double Engine::seconds(int64_t id) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = jobs_.find(id);
  PYFAST_CHECK(it != jobs_.end(), "pyfast engine: no job ", id, " (already waited for?)");
  return it->second->seconds;
}

void Engine::loop() {
  pthread_setname_np(pthread_self(), "pyfast-engine");
  c10::AutoGradMode no_grad(false);
  for (;;) {
    std::shared_ptr<Job> j;
    {
      std::unique_lock<std::mutex> g(mu_);
      work_cv_.wait(g, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and drained
      j = std::move(queue_.front());
      queue_.pop_front();
    }
    const auto t0 = std::chrono::steady_clock::now();
    std::exception_ptr error;
    try {
      // A failed collective may leave ranks at different points of the sequence: running
      // later jobs could pair one rank's bucket 3 with another's bucket 4. Fail them instead.
      PYFAST_CHECK(broken_.empty(), "not run: ", broken_);
      if (j->device)
        j->device->issue([&] { run(*j); });
      else
        run(*j);
    } catch (c10::Error& e) {  // keeps its type (DistBackendError -> torch's Python class)
      e.add_context(j->what);
      error = std::current_exception();
      if (broken_.empty()) broken_ = j->what + " failed: " + e.msg();  // no ostream: check.h
    } catch (std::exception& e) {
      error = std::make_exception_ptr(std::runtime_error(j->what + ": " + e.what()));
      if (broken_.empty()) broken_ = j->what + " failed: " + e.what();
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    j->t.reset();  // release the buffers now, outside the lock
    j->in.reset();
    j->ef.clear();
    j->ef_out.clear();
    {
      std::lock_guard<std::mutex> g(mu_);
      j->done = true, j->seconds = s, j->error = error;
    }
    done_cv_.notify_all();
  }
}

void Engine::run(Job& j) {
  // the job on the engine's thread, a range of pyfast._ranges' naming (its Python call, on the
  // caller's thread, is pyfast.comm.native.*)
  RECORD_FUNCTION(j.algo == Algo::Gather ? "pyfast.comm.engine.all_gather"
                  : j.algo == Algo::ReduceScatter || j.algo == Algo::BackendReduceScatter
                      ? "pyfast.comm.engine.reduce_scatter"
                      : "pyfast.comm.engine.all_reduce",
                  std::vector<c10::IValue>());
  if (j.algo == Algo::Native) {
    std::vector<at::Tensor> ts{j.t};
    pg_->allreduce(ts)->wait();
  } else if (j.algo == Algo::AllGather) {
    gather_sum(j);
  } else if (j.algo == Algo::Gather) {
    gather(j);
  } else if (j.algo == Algo::ReduceScatter) {
    reduce_scatter(j);
  } else if (j.algo == Algo::BackendReduceScatter) {
    pyfast::pg::reduce_scatter_single(*pg_, j.t, j.in)->wait();
  } else {
    two_phase(j);
  }
  if (j.avg) j.t.div_(world_);  // the reference's fp32 `t.div_(world)`
}

// pipelined.gather_sum_into (collectives._gather_sum when one piece): every rank's compressed
// piece, summed in rank order into the zeroed piece of t (0 + -0 is +0: no copy of rank 0's).
void Engine::gather_sum(Job& j) {
  const Codec& c = j.codec;
  struct Flight { int64_t a, len, slot; at::Tensor send, recv; WorkPtr work; };
  std::deque<Flight> flying;
  auto finish = [&](Flight& f) {
    f.work->wait();
    sum_slots(c, f.recv, f.slot, world_, j.t.narrow(0, f.a, f.len));
  };
  size_t e = 0;
  for (auto [a, b] : pieces(j.algo, j.t.numel(), j.align, j.chunk, world_)) {
    Flight f{a, b - a, round8(c.bytes(b - a))};
    f.send = bytes(f.slot, j.t), f.recv = bytes(f.slot * world_, j.t);
    pack(c, j.t.narrow(0, a, f.len), j.mem(e++), f.send);
    f.work = pyfast::pg::all_gather_single(*pg_, f.recv, f.send);
    flying.push_back(std::move(f));
    if (flying.size() > 2) {  // two in flight: the link never idles (pipelined.py)
      finish(flying.front());
      flying.pop_front();
    }
  }
  for (auto& f : flying) finish(f);
}

// pipelined.two_phase_into (collectives._two_phase when one piece): per piece, all-to-all of
// the W compressed parts; each rank sums its part in rank order, compresses the sum (".sum"
// memory) and all-gathers it; every rank decodes every part. Three stages in flight.
void Engine::two_phase(Job& j) {
  const Codec& c = j.codec;
  const int64_t W = world_;
  struct Stage {
    int64_t a;
    std::vector<std::pair<int64_t, int64_t>> parts;
    std::vector<int64_t> slots;
    size_t ef;  // index of part 0's memory
    at::Tensor send, recv;
    WorkPtr work;
  };
  std::deque<Stage> stage_a, stage_b;
  auto ef = [&](size_t i) { return j.mem(i); };
  auto reduce_gather = [&](Stage s) {
    s.work->wait();
    const auto [p, q] = s.parts[rank_];
    at::Tensor acc = at::empty({q - p}, j.t.options());
    sum_slots(c, s.recv, s.slots[rank_], W, acc);
    const int64_t big = s.slots[0];  // part 0 is the longest: every part's sum fits
    s.send = bytes(big, j.t), s.recv = bytes(big * W, j.t);
    pack(c, acc, ef(s.ef + W), s.send);
    s.work = pyfast::pg::all_gather_single(*pg_, s.recv, s.send);
    stage_b.push_back(std::move(s));
  };
  auto decode = [&](Stage& s) {
    s.work->wait();
    for (int64_t i = 0; i < W; ++i) {
      const auto [p, q] = s.parts[i];
      if (q > p) c.decode(s.recv.narrow(0, i * s.slots[0], c.bytes(q - p)), j.t.narrow(0, s.a + p, q - p));
    }
  };
  size_t e = 0;
  for (auto [a, b] : pieces(j.algo, j.t.numel(), j.align, j.chunk, W)) {
    Stage s{a, chunks(b - a, W, j.align)};
    s.ef = e, e += W + 1;
    s.send = pack_parts(c, j.t.narrow(0, a, b - a), s.parts,
                        [&](size_t i) { return ef(s.ef + i); }, s.slots);
    std::vector<int64_t> recv_splits(W, s.slots[rank_]);
    s.recv = bytes(s.slots[rank_] * W, j.t);
    s.work = pyfast::pg::all_to_all_single(*pg_, s.recv, s.send, recv_splits, s.slots);
    stage_a.push_back(std::move(s));
    if (stage_a.size() > 1) reduce_gather(std::move(stage_a.front())), stage_a.pop_front();
    if (stage_b.size() > 1) decode(stage_b.front()), stage_b.pop_front();
  }
  for (; !stage_a.empty(); stage_a.pop_front()) reduce_gather(std::move(stage_a.front()));
  for (; !stage_b.empty(); stage_b.pop_front()) decode(stage_b.front());
}

// sharded.py's all_gather: every rank's input, compressed once (through the one memory) and
// decoded by every rank, its own included, into its place in t. "none": the backend's gather.
void Engine::gather(Job& j) {
  const Codec& c = j.codec;
  if (c.kind == Kind::None) {
    pyfast::pg::all_gather_single(*pg_, j.t, j.in)->wait();
    return;
  }
  const int64_t n = j.in.numel();
  if (n == 0) return;  // as the reference: nothing moves
  const int64_t slot = round8(c.bytes(n));
  at::Tensor send = bytes(slot, j.t), recv = bytes(slot * world_, j.t);
  pack(c, j.in, j.mem(0), send);
  pyfast::pg::all_gather_single(*pg_, recv, send)->wait();
  for (int64_t r = 0; r < world_; ++r)
    c.decode(recv.narrow(0, r * slot, c.bytes(n)), j.t.narrow(0, r * n, n));
}

// sharded.py's reduce_scatter (two-phase's first phase): in's W equal parts compressed (part
// i through memory i), all-to-all, and t = the W received parts decoded and summed in rank
// order in fp32 from zero. "none": the same all-to-all of fp32 parts summed in rank order (so
// the bits do not depend on the backend's reduction order).
void Engine::reduce_scatter(Job& j) {
  const Codec& c = j.codec;
  const int64_t n = j.t.numel();
  std::vector<int64_t> equal;  // empty splits: W equal parts
  if (c.kind == Kind::None) {
    at::Tensor recv = at::empty_like(j.in);  // part `rank` of every rank's input, rank order
    pyfast::pg::all_to_all_single(*pg_, recv, j.in, equal, equal)->wait();
    j.t.copy_(recv.narrow(0, 0, n));
    for (int64_t r = 1; r < world_; ++r) j.t.add_(recv.narrow(0, r * n, n));
    return;
  }
  if (n == 0) return;  // as the reference: nothing moves
  std::vector<std::pair<int64_t, int64_t>> parts;
  for (int64_t r = 0; r < world_; ++r) parts.emplace_back(r * n, (r + 1) * n);
  std::vector<int64_t> slots;  // all equal
  at::Tensor send = pack_parts(
      c, j.in, parts, [&](size_t i) { return j.mem(i); }, slots);
  at::Tensor recv = bytes(slots[0] * world_, j.t);
  pyfast::pg::all_to_all_single(*pg_, recv, send, equal, equal)->wait();
  sum_slots(c, recv, slots[0], world_, j.t);
}

}  // namespace pyfast
