// The peers' synthetic backward (overlap_ddp.py, through ctypes) computes each gradient here, so
// that DDP's backward does per parameter exactly the arithmetic of benchmarks/overlap.cpp's
// compute_gradient (keep the two loops identical) with the same compiler flags.
#include <cstddef>

extern "C" void flexcomm_peer_gradient(float* g, std::size_t n, int work, int step) {
  for (std::size_t i = 0; i < n; ++i) {
    float x = static_cast<float>((i + static_cast<std::size_t>(step)) % 7) * 0.125f;
    for (int k = 0; k < work; ++k) x = x * 0.999f + 0.001f;
    g[i] = x;
  }
}
