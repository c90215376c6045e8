// CPU autocast switches that tch does not expose (its `autocast` drives the CUDA one only).
// Used by tiny-model training to run matmuls in bfloat16 on CPUs with bf16 units (AMX,
// AVX512-BF16) while weights, optimiser state and the loss stay float32.
#include <ATen/autocast_mode.h>

extern "C" {

// Returns 0 on success, 1 if libtorch threw (no exception may cross the C boundary).
int diffmesh_cpu_autocast_enter() {
  try {
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::increment_nesting();
    return 0;
  } catch (...) {
    return 1;
  }
}

int diffmesh_cpu_autocast_exit() {
  try {
    at::autocast::set_autocast_enabled(at::kCPU, false);
    // The outermost exit drops the cached bf16 copies of the weights, as Python's autocast does.
    if (at::autocast::decrement_nesting() == 0) {
      at::autocast::clear_cache();
    }
    return 0;
  } catch (...) {
    return 1;
  }
}

int diffmesh_cpu_autocast_is_enabled() {
  try {
    return at::autocast::is_autocast_enabled(at::kCPU) ? 1 : 0;
  } catch (...) {
    return -1;
  }
}
}
