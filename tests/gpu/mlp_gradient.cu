// The CUDA trainer's model (examples/cuda/mlp.cuh): its cuBLAS backward pass against central
// finite differences of its own loss, so the example trains on correct gradients.
#define BOOST_TEST_MODULE gpu_mlp_gradient
#define BOOST_TEST_NO_MAIN
#include <boost/test/unit_test.hpp>

#include "../examples/cuda/mlp.cuh"

#include <cstdio>
#include <random>
#include <vector>

namespace fc = flexcomm;

BOOST_AUTO_TEST_CASE(backward_matches_finite_differences) {
  const int in = 7, hid = 5, out = 3, batch = 6, ldx = in + 1;  // ldx > in, as inside packed samples
  cudaStream_t stream = nullptr;
  fc::check_cuda(cudaStreamCreate(&stream), "test: cudaStreamCreate");
  cuda_mlp::mlp model(in, hid, out, batch, 11, stream);
  std::mt19937 gen(5);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<float> x(static_cast<std::size_t>(ldx) * batch);
  std::vector<std::int32_t> labels(static_cast<std::size_t>(batch) * 2);
  for (auto& v : x) v = u(gen);
  for (int j = 0; j < batch; ++j) labels[static_cast<std::size_t>(j) * 2] = j % out;
  float* dx = nullptr;
  std::int32_t* dl = nullptr;
  fc::check_cuda(cudaMalloc(&dx, x.size() * sizeof(float)), "test: cudaMalloc");
  fc::check_cuda(cudaMalloc(&dl, labels.size() * sizeof(std::int32_t)), "test: cudaMalloc");
  fc::check_cuda(cudaMemcpy(dx, x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice), "test: upload");
  fc::check_cuda(cudaMemcpy(dl, labels.data(), labels.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice), "test: upload");

  int handed_over = 0;
  auto mean_loss = [&] {
    model.reset_stats();
    model.train_step(dx, ldx, dl, 2, batch, [](int, fc::span<float>) {});
    return static_cast<double>(model.stats().first) / batch;
  };
  model.reset_stats();
  model.train_step(dx, ldx, dl, 2, batch, [&](int, fc::span<float>) { ++handed_over; });
  fc::check_cuda(cudaStreamSynchronize(stream), "test: sync");
  std::vector<float> grad(model.parameters());
  fc::check_cuda(cudaMemcpy(grad.data(), model.gradient(0).data(), grad.size() * sizeof(float), cudaMemcpyDeviceToHost),
                 "test: download");
  std::vector<float> params(model.parameters());
  float* p = model.parameter(0).data();
  fc::check_cuda(cudaMemcpy(params.data(), p, params.size() * sizeof(float), cudaMemcpyDeviceToHost), "test: download");

  int wrong = 0;
  const float eps = 1e-3f;  // small against the ReLU kinks, large against float rounding
  for (std::size_t i = 0; i < params.size(); ++i) {
    float v = params[i] + eps;
    fc::check_cuda(cudaMemcpy(p + i, &v, sizeof v, cudaMemcpyHostToDevice), "test: perturb");
    const double up = mean_loss();
    v = params[i] - eps;
    fc::check_cuda(cudaMemcpy(p + i, &v, sizeof v, cudaMemcpyHostToDevice), "test: perturb");
    const double down = mean_loss();
    fc::check_cuda(cudaMemcpy(p + i, &params[i], sizeof(float), cudaMemcpyHostToDevice), "test: restore");
    const double numeric = (up - down) / (2.0 * eps);
    if (std::fabs(numeric - grad[i]) > 2e-3 + 5e-2 * std::fabs(numeric)) {
      if (++wrong <= 5) BOOST_TEST_MESSAGE("parameter " << i << ": backward " << grad[i] << ", numeric " << numeric);
    }
  }
  BOOST_TEST(handed_over == cuda_mlp::mlp::parts);
  BOOST_TEST(wrong == 0);
  cudaFree(dx);
  cudaFree(dl);
  cudaStreamDestroy(stream);
}

int main(int argc, char** argv) {
  if (!fc::cuda_device_present()) {
    std::puts("no CUDA device: skipped");
    return 77;
  }
  return boost::unit_test::unit_test_main(&init_unit_test, argc, argv);
}
