// pyfast._C: the op schemas (one TORCH_LIBRARY block) and the Python module entry point.
// Kernels register per device with TORCH_LIBRARY_IMPL: csrc/*.cpp (CPU), csrc/cuda/*.cu (CUDA).
// Formats: docs/FORMATS.md.
#include <torch/csrc/utils/pybind.h>  // intrusive_ptr holders: ProcessGroup from Python
#include <torch/library.h>

#include "engine.h"

TORCH_LIBRARY(pyfast, m) {
  m.def("quantize(Tensor x, str kind, int block, bool stochastic, int seed) -> (Tensor, Tensor)");
  m.def("dequantize(Tensor codes, Tensor scales, int n, str kind, int block, ScalarType dtype) -> Tensor");
  m.def("dequantize_accumulate_(Tensor(a!) out, Tensor codes, Tensor scales, str kind, int block) -> ()");
  m.def("topk_count(Tensor x, Tensor? ef, float threshold) -> Tensor");
  m.def("topk_select(Tensor x, Tensor(a!)? ef, float threshold, int limit) -> (Tensor, Tensor)");
  // csrc/adamw.cpp; grad_scale_t (a 0-d tensor: a clip coefficient) multiplies grad_scale
  m.def("adamw_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
        "int step, float lr, float beta1, float beta2, float eps, float weight_decay, "
        "Tensor? grad_scale_t, float grad_scale) -> ()");
}

namespace py = pybind11;

namespace {
// The Python object may be the last owner: join the worker without the GIL, which the worker
// may need to free a tensor whose Python object it kept alive.
struct ReleaseGilDelete {
  void operator()(pyfast::Engine* e) const {
    if (!PyGILState_Check()) return delete e;
    py::gil_scoped_release nogil;
    delete e;
  }
};
}  // namespace

// Importing pyfast._C runs the static registrations above and binds the overlap engine, the one
// thing here that is an object rather than a tensor op (DESIGN.md; STYLE.md 3). Every call that
// may block releases the GIL; the worker never takes it.
PYBIND11_MODULE(_C, m) {
  using pyfast::Engine;
  using nogil = py::call_guard<py::gil_scoped_release>;
  py::class_<Engine, std::unique_ptr<Engine, ReleaseGilDelete>> engine(m, "Engine",
      "Compressed all-reduce, all-gather and reduce-scatter jobs, first-in first-out "
      "on one worker thread over a "
      "ProcessGroup (pyfast/comm/engine.py is the Python face). CUDA tensors (cuda_enabled "
      "builds only) run on a side stream ordered by events.");
  engine.def(py::init<c10::intrusive_ptr<c10d::ProcessGroup>>(), py::arg("group"))
      .def("submit", &Engine::submit, nogil(), py::arg("tensor"), py::arg("kind"),
           py::arg("block"), py::arg("algorithm"), py::arg("avg"), py::arg("ef"),
           py::arg("align"), py::arg("chunk"), py::arg("ef_out") = std::vector<at::Tensor>{})
      .def("submit_all_gather", &Engine::submit_all_gather, nogil(), py::arg("out"),
           py::arg("input"), py::arg("kind") = "none", py::arg("block") = 1,
           py::arg("ef") = std::vector<at::Tensor>{})
      .def("submit_reduce_scatter", &Engine::submit_reduce_scatter, nogil(), py::arg("out"),
           py::arg("input"), py::arg("avg"), py::arg("kind") = "none", py::arg("block") = 1,
           py::arg("ef") = std::vector<at::Tensor>{}, py::arg("algorithm") = "rank-order")
      .def("wait", &Engine::wait, nogil(), py::arg("id"))
      .def("seconds", &Engine::seconds, nogil(), py::arg("id"))
      .def("shutdown", &Engine::shutdown, nogil(),
           "Run the queued jobs, join the worker, refuse new jobs (idempotent).")
      .def_property_readonly("rank", &Engine::rank)
      .def_property_readonly("world", &Engine::world);
  // True only in the CUDA build (setup.py's CUDAExtension, PYFAST_WITH_CUDA).
  engine.attr("cuda_enabled") = pyfast::kWithCuda;
}
