// pyfast._C: the op schemas (one TORCH_LIBRARY block) and the Python module entry point.
// Kernels register per device with TORCH_LIBRARY_IMPL: csrc/*.cpp (CPU), csrc/cuda/*.cu (CUDA).
// Formats: docs/FORMATS.md.
#include <pybind11/pybind11.h>
#include <torch/library.h>

#include "engine.h"

TORCH_LIBRARY(pyfast, m) {
  m.def("quantize(Tensor x, str kind, int block, bool stochastic, int seed) -> (Tensor, Tensor)");
  m.def("dequantize(Tensor codes, Tensor scales, int n, str kind, int block, ScalarType dtype) -> Tensor");
  m.def("dequantize_accumulate_(Tensor(a!) out, Tensor codes, Tensor scales, str kind, int block) -> ()");
  m.def("topk_count(Tensor x, Tensor? ef, float threshold) -> Tensor");
  m.def("topk_select(Tensor x, Tensor(a!)? ef, float threshold, int limit) -> (Tensor, Tensor)");
}

// Importing pyfast._C runs the static registrations above and binds the overlap engine, the one
// thing here that is an object rather than a tensor op (DESIGN.md, STYLE.md 3).
PYBIND11_MODULE(_C, m) {
  pyfast::bind_engine(m);
}
