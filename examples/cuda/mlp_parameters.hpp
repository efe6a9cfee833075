// What the CUDA trainer's two models share (mlp.cuh on a GPU, mlp_host.hpp on the device
// stand-in): where each parameter lives in the one buffer of parameters (and of gradients), and
// the initial values, so that both start from the same parameters for a seed.
#pragma once

#include <cmath>
#include <cstddef>
#include <random>
#include <vector>

namespace cuda_mlp {

// inputs -> hidden (ReLU) -> classes, in one buffer: W1 (hidden x inputs), b1, W2 (classes x
// hidden), b2, column-major. Gradients use the same layout. Part k is one of the four.
struct parameter_layout {
  static constexpr int parts = 4;  // W1, b1, W2, b2

  parameter_layout(int inputs, int hidden, int classes) {
    offset[0] = 0;
    offset[1] = offset[0] + static_cast<std::size_t>(hidden) * static_cast<std::size_t>(inputs);
    offset[2] = offset[1] + static_cast<std::size_t>(hidden);
    offset[3] = offset[2] + static_cast<std::size_t>(classes) * static_cast<std::size_t>(hidden);
    total = offset[3] + static_cast<std::size_t>(classes);
  }
  std::size_t size(int part) const { return (part == parts - 1 ? total : offset[part + 1]) - offset[part]; }

  std::size_t offset[parts] = {};
  std::size_t total = 0;
};

// He initialization from the member's seed (biases zero): every rank of a member starts identical.
inline std::vector<float> initial_parameters(const parameter_layout& at, int inputs, int hidden, unsigned seed) {
  std::vector<float> init(at.total, 0.f);
  std::mt19937 gen(seed);
  std::normal_distribution<float> w1(0.f, std::sqrt(2.f / static_cast<float>(inputs)));
  std::normal_distribution<float> w2(0.f, std::sqrt(2.f / static_cast<float>(hidden)));
  for (std::size_t i = at.offset[0]; i < at.offset[1]; ++i) init[i] = w1(gen);
  for (std::size_t i = at.offset[2]; i < at.offset[3]; ++i) init[i] = w2(gen);
  return init;
}

}  // namespace cuda_mlp
