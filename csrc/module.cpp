// pyfast._C: the op schemas (one TORCH_LIBRARY block) and the Python module entry point.
// Kernels register per device with TORCH_LIBRARY_IMPL: csrc/*.cpp (CPU), csrc/cuda/*.cu (CUDA).
// Formats: docs/FORMATS.md.
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(pyfast, m) {
  m.def("quantize(Tensor x, str kind, int block, bool stochastic, int seed) -> (Tensor, Tensor)");
  m.def("dequantize(Tensor codes, Tensor scales, int n, str kind, int block, ScalarType dtype) -> Tensor");
  m.def("dequantize_accumulate_(Tensor(a!) out, Tensor codes, Tensor scales, str kind, int block) -> ()");
  m.def("topk_count(Tensor x, Tensor? ef, float threshold) -> Tensor");
  m.def("topk_select(Tensor x, Tensor(a!)? ef, float threshold, int limit) -> (Tensor, Tensor)");
}

extern "C" {
// Importing pyfast._C runs the static registrations above; the module itself is empty
// (the overlap engine's pybind11 classes will live here).
PyObject* PyInit__C(void) {
  static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&def);
}
}
