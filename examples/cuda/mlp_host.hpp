// The CUDA trainer's model (mlp.cuh) on the host, for the device stand-in (FLEXCOMM_DEVICE_STANDIN,
// docs/cuda.md): the same class, the same math (Eigen's products where mlp.cuh calls cuBLAS, loops
// where it launches kernels), the same initial parameters, and parameters and gradients in the
// stand-in's device memory, which is host RAM, so the sync backends average them as they would
// on a GPU.
//
// On a GPU the model's work runs as kernels on the stream it was given, after whatever the
// trainer queued there before. Here it runs on the calling thread, so it first waits for that
// stream (device::stream_synchronize) wherever it reads what the stream may still be writing or
// writes what it may still be reading: the batch (device_feed copies it and orders the stream
// after the copy), uploaded test images, and the gradients (the previous step's averages land
// there, and finish() orders the stream after them). Then each gradient is complete when it is
// handed to ready(), and the averages are in place when step() reads them.
#pragma once

#include <Eigen/Core>

#include <flexcomm/flexcomm.hpp>

#include "mlp_parameters.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace cuda_mlp {

class mlp {
 public:
  static constexpr int parts = parameter_layout::parts;  // gradients handed over per step: dW2, db2, dW1, db1

  mlp(int inputs, int hidden, int classes, int max_batch, unsigned seed, flexcomm::device::stream_t stream)
      : in_(inputs), hid_(hidden), out_(classes), max_batch_(max_batch), stream_(stream), at_(inputs, hidden, classes),
        params_(at_.total), grads_(at_.total) {
    // Fresh memory, which no stream has touched yet: written directly.
    const std::vector<float> init = initial_parameters(at_, in_, hid_, seed);
    std::memcpy(params_.data(), init.data(), at_.total * sizeof(float));
    std::memset(grads_.data(), 0, at_.total * sizeof(float));
  }
  mlp(const mlp&) = delete;
  mlp& operator=(const mlp&) = delete;

  std::size_t parameters() const noexcept { return at_.total; }
  flexcomm::span<float> parameter(int part) const { return {params_.data() + at_.offset[part], at_.size(part)}; }
  flexcomm::span<float> gradient(int part) const { return {grads_.data() + at_.offset[part], at_.size(part)}; }

  // As mlp.cuh: x is inputs x batch with leading dimension ldx (device memory); labels[j *
  // label_stride]; `ready(part, gradient)` as each gradient is complete, last layer first; loss
  // and accuracy accumulate in stats().
  template <class Ready>
  void train_step(const float* x, int ldx, const std::int32_t* labels, int label_stride, int batch, Ready&& ready) {
    wait_for_stream("mlp: train step");  // the batch has landed; the last averages were read
    forward(x, ldx, batch);
    softmax(batch, labels, label_stride, true);
    // dW2 = dZ A1^T ; db2 = rowsum dZ
    grad(2, out_, hid_).noalias() = dz_ * a1_.transpose();
    ready(2, gradient(2));
    grad(3, out_).noalias() = dz_.rowwise().sum();
    ready(3, gradient(3));
    // dA1 = W2^T dZ, through the ReLU
    da1_.noalias() = param(2, out_, hid_).transpose() * dz_;
    da1_.array() *= (h1_.array() > 0.f).cast<float>();
    // dW1 = dH1 X^T ; db1 = rowsum dH1
    grad(0, hid_, in_).noalias() = da1_ * samples(x, ldx, batch).transpose();
    ready(0, gradient(0));
    grad(1, hid_).noalias() = da1_.rowwise().sum();
    ready(1, gradient(1));
  }

  void step(float lr) {
    wait_for_stream("mlp: sgd");  // finish() queued the averages ahead of this
    vector_map(params_.data(), at_.total) -= lr * vector_map(grads_.data(), at_.total);
  }

  // Class probabilities (classes x batch, column per sample) into `probs` (device memory).
  void predict(const float* x, int ldx, int batch, float* probs) {
    wait_for_stream("mlp: predict");  // the images have landed; an earlier download of probs is done
    forward(x, ldx, batch);
    softmax(batch, nullptr, -1, false);
    matrix_map(probs, out_, batch) = p_;
  }

  // Summed loss and correct count since the last reset (already complete: the work ran on the host).
  std::pair<float, int> stats() const { return {loss_, correct_}; }
  void reset_stats() {
    loss_ = 0.f;
    correct_ = 0;
  }

 private:
  using matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic>;  // column-major, as cuBLAS
  using matrix_map = Eigen::Map<matrix>;
  using const_matrix_map = Eigen::Map<const matrix>;
  using vector_map = Eigen::Map<Eigen::VectorXf>;
  using sample_map = Eigen::Map<const matrix, Eigen::Unaligned, Eigen::OuterStride<>>;

  void wait_for_stream(const char* what) const {
    flexcomm::check_cuda(flexcomm::device::stream_synchronize(stream_), what, ": cudaStreamSynchronize");
  }
  // Part `part` of the gradients or the parameters as a rows x cols matrix (a bias: one column).
  matrix_map grad(int part, int rows, int cols = 1) const { return {grads_.data() + at_.offset[part], rows, cols}; }
  const_matrix_map param(int part, int rows, int cols = 1) const { return {params_.data() + at_.offset[part], rows, cols}; }
  sample_map samples(const float* x, int ldx, int batch) const {
    return {x, in_, batch, Eigen::OuterStride<>(ldx)};
  }

  // H1 = W1 X + b1, A1 = relu(H1), Z = W2 A1 + b2.
  void forward(const float* x, int ldx, int batch) {
    flexcomm::check(batch > 0 && batch <= max_batch_, "mlp", flexcomm::cat("batch of ", batch, " samples, room for ", max_batch_));
    h1_.noalias() = param(0, hid_, in_) * samples(x, ldx, batch);
    h1_.colwise() += param(1, hid_).col(0);
    a1_ = h1_.cwiseMax(0.f);
    z_.noalias() = param(2, out_, hid_) * a1_;
    z_.colwise() += param(3, out_).col(0);
  }

  // Per sample (column): softmax of Z into P; with labels, dZ = (P - onehot(label)) / batch and the
  // loss and correct count of the batch added to stats(). Labels sit `label_stride` words apart.
  void softmax(int batch, const std::int32_t* labels, int label_stride, bool gradient) {
    p_.resize(out_, batch);
    if (gradient) dz_.resize(out_, batch);
    for (int j = 0; j < batch; ++j) {
      Eigen::Index best = 0;
      const float top = z_.col(j).maxCoeff(&best);
      p_.col(j) = (z_.col(j).array() - top).exp();
      p_.col(j) /= p_.col(j).sum();
      if (!labels) continue;
      const int y = labels[static_cast<std::size_t>(j) * static_cast<std::size_t>(label_stride)];
      flexcomm::check(y >= 0 && y < out_, "mlp", flexcomm::cat("label ", y, " of sample ", j, ", classes 0..", out_ - 1));
      loss_ += -std::log(std::max(p_(y, j), 1e-30f));
      correct_ += best == y;
      if (gradient) {
        dz_.col(j) = p_.col(j) / static_cast<float>(batch);
        dz_(y, j) -= 1.f / static_cast<float>(batch);
      }
    }
  }

  int in_, hid_, out_, max_batch_;
  flexcomm::device::stream_t stream_;
  parameter_layout at_;
  flexcomm::cuda::device_buffer<float> params_, grads_;
  matrix h1_, a1_, z_, p_, dz_, da1_;  // the activations: private to the model, plain host memory
  float loss_ = 0.f;
  int correct_ = 0;
};

}  // namespace cuda_mlp
