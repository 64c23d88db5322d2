// The Python module: every entry point of ops.h, bound as torch.utils.cpp_extension.load_inline
// binds its `functions` (C++ exceptions become Python ones, a TORCH_CHECK a RuntimeError).
// torch's pybind11 glue only (tensor type casters, error translation): <torch/extension.h> would
// parse the whole C++ frontend, several times this file's own compile time.
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>

#include "ops.h"

#define KVFLOW_DEF(name) m.def(#name, torch::wrap_pybind_function(name), #name)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  KVFLOW_DEF(paged_decode);
  KVFLOW_DEF(paged_prefill);
  KVFLOW_DEF(paged_decode_invariant);
  KVFLOW_DEF(paged_prefill_amx);
  KVFLOW_DEF(prefill_amx_usable);
  KVFLOW_DEF(prefill_max_group);
  KVFLOW_DEF(vec_size);
  KVFLOW_DEF(rms_norm);
  KVFLOW_DEF(add_rms_norm);
  KVFLOW_DEF(silu_mul);
  KVFLOW_DEF(rope_write);
  KVFLOW_DEF(skinny_linear);
  KVFLOW_DEF(decode_layers);
  KVFLOW_DEF(invariant_linear);
  KVFLOW_DEF(invariant_linear_isa);
}
