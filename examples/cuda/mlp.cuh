// A two-layer perceptron for Fashion-MNIST on the GPU: cuBLAS GEMMs and a few small kernels.
// Backward hands each gradient over as soon as it exists, so communication can overlap the rest.
// mlp_host.hpp is the same model on the host, for the device stand-in.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <flexcomm/flexcomm.hpp>

#include "mlp_parameters.hpp"

#include <cmath>
#include <cstring>
#include <utility>
#include <cstdint>
#include <vector>

namespace cuda_mlp {

inline void check_cublas(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) flexcomm::fail(what, flexcomm::cat("cuBLAS status ", static_cast<int>(s)));
}

namespace kernels {
// a = relu(h + b) per column; h is rows x cols.
__global__ void bias_relu(float* h, const float* b, float* a, int rows, int cols) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= rows * cols) return;
  const float v = h[i] + b[i % rows];
  h[i] = v;
  a[i] = v > 0.f ? v : 0.f;
}
__global__ void add_bias(float* z, const float* b, int rows, int cols) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < rows * cols) z[i] += b[i % rows];
}
// Per sample (column): softmax of z into p; dz = (p - onehot(label)) / batch; loss += -log p[label].
// Labels sit at `label_stride` 32-bit words apart (inside the packed samples); -1 stride: no labels.
__global__ void softmax_xent(const float* z, float* p, float* dz, const std::int32_t* labels, int label_stride,
                             int classes, int batch, float* loss, int* correct) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= batch) return;
  const float* zj = z + j * classes;
  float m = zj[0];
  int best = 0;
  for (int c = 1; c < classes; ++c)
    if (zj[c] > m) m = zj[c], best = c;
  float sum = 0.f;
  for (int c = 0; c < classes; ++c) sum += expf(zj[c] - m);
  const int y = label_stride > 0 ? labels[static_cast<std::size_t>(j) * label_stride] : -1;
  for (int c = 0; c < classes; ++c) {
    const float pc = expf(zj[c] - m) / sum;
    p[j * classes + c] = pc;
    if (dz) dz[j * classes + c] = (pc - (c == y ? 1.f : 0.f)) / static_cast<float>(batch);
  }
  if (y >= 0 && loss) atomicAdd(loss, -logf(fmaxf(p[j * classes + y], 1e-30f)));
  if (y >= 0 && correct && best == y) atomicAdd(correct, 1);
}
// db[r] = sum over columns of d[r, :].
__global__ void row_sum(const float* d, float* db, int rows, int cols) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  float s = 0.f;
  for (int c = 0; c < cols; ++c) s += d[r + static_cast<std::size_t>(c) * rows];
  db[r] = s;
}
// d *= (h > 0): the ReLU's derivative.
__global__ void relu_back(float* d, const float* h, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n && h[i] <= 0.f) d[i] = 0.f;
}
__global__ void sgd(float* w, const float* g, float lr, std::size_t n) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i < n) w[i] -= lr * g[i];
}
inline unsigned blocks(std::size_t n) { return static_cast<unsigned>((n + 255) / 256); }
}  // namespace kernels

// inputs -> hidden (ReLU) -> classes. Parameters and gradients each live in one device buffer,
// laid out as parameter_layout says (W1, b1, W2, b2, column-major).
class mlp {
 public:
  static constexpr int parts = parameter_layout::parts;  // gradients handed over per step: dW2, db2, dW1, db1

  mlp(int inputs, int hidden, int classes, int max_batch, unsigned seed, cudaStream_t stream)
      : in_(inputs), hid_(hidden), out_(classes), max_batch_(max_batch), stream_(stream), at_(inputs, hidden, classes) {
    check_cublas(cublasCreate(&blas_), "cublasCreate");
    check_cublas(cublasSetStream(blas_, stream_), "cublasSetStream");
    params_ = alloc(at_.total);
    grads_ = alloc(at_.total);
    h1_ = alloc(static_cast<std::size_t>(hid_) * max_batch_);
    a1_ = alloc(static_cast<std::size_t>(hid_) * max_batch_);
    z_ = alloc(static_cast<std::size_t>(out_) * max_batch_);
    p_ = alloc(static_cast<std::size_t>(out_) * max_batch_);
    dz_ = alloc(static_cast<std::size_t>(out_) * max_batch_);
    da1_ = alloc(static_cast<std::size_t>(hid_) * max_batch_);
    stats_ = alloc(2);
    const std::vector<float> init = initial_parameters(at_, in_, hid_, seed);
    flexcomm::check_cuda(cudaMemcpy(params_, init.data(), at_.total * sizeof(float), cudaMemcpyHostToDevice),
                         "mlp: upload parameters");
  }
  mlp(const mlp&) = delete;
  mlp& operator=(const mlp&) = delete;
  ~mlp() {
    cublasDestroy(blas_);
    for (float* p : {params_, grads_, h1_, a1_, z_, p_, dz_, da1_, stats_}) cudaFree(p);
  }

  std::size_t parameters() const noexcept { return at_.total; }
  flexcomm::span<float> parameter(int part) const { return {params_ + at_.offset[part], size(part)}; }
  flexcomm::span<float> gradient(int part) const { return {grads_ + at_.offset[part], size(part)}; }

  // Forward and backward on `batch` samples: x is inputs x batch with leading dimension ldx;
  // labels[j * label_stride]. `ready(part, gradient)` is called as each gradient is enqueued on
  // the stream, last layer first. Returns nothing: loss and accuracy accumulate in stats().
  template <class Ready>
  void train_step(const float* x, int ldx, const std::int32_t* labels, int label_stride, int batch, Ready&& ready) {
    forward(x, ldx, batch);
    kernels::softmax_xent<<<kernels::blocks(batch), 256, 0, stream_>>>(z_, p_, dz_, labels, label_stride, out_, batch,
                                                                       stats_, reinterpret_cast<int*>(stats_ + 1));
    const float one = 1.f, zero = 0.f;
    // dW2 = dZ A1^T ; db2 = rowsum dZ
    check_cublas(cublasSgemm(blas_, CUBLAS_OP_N, CUBLAS_OP_T, out_, hid_, batch, &one, dz_, out_, a1_, hid_, &zero,
                             grads_ + at_.offset[2], out_),
                 "mlp: dW2");
    ready(2, gradient(2));
    kernels::row_sum<<<kernels::blocks(out_), 256, 0, stream_>>>(dz_, grads_ + at_.offset[3], out_, batch);
    ready(3, gradient(3));
    // dA1 = W2^T dZ, through the ReLU
    check_cublas(cublasSgemm(blas_, CUBLAS_OP_T, CUBLAS_OP_N, hid_, batch, out_, &one, params_ + at_.offset[2], out_, dz_,
                             out_, &zero, da1_, hid_),
                 "mlp: dA1");
    kernels::relu_back<<<kernels::blocks(static_cast<std::size_t>(hid_) * batch), 256, 0, stream_>>>(da1_, h1_, hid_ * batch);
    // dW1 = dH1 X^T ; db1 = rowsum dH1
    check_cublas(cublasSgemm(blas_, CUBLAS_OP_N, CUBLAS_OP_T, hid_, in_, batch, &one, da1_, hid_, x, ldx, &zero,
                             grads_ + at_.offset[0], hid_),
                 "mlp: dW1");
    ready(0, gradient(0));
    kernels::row_sum<<<kernels::blocks(hid_), 256, 0, stream_>>>(da1_, grads_ + at_.offset[1], hid_, batch);
    ready(1, gradient(1));
    flexcomm::check_cuda(cudaGetLastError(), "mlp: backward kernels");
  }

  void step(float lr) {
    kernels::sgd<<<kernels::blocks(at_.total), 256, 0, stream_>>>(params_, grads_, lr, at_.total);
    flexcomm::check_cuda(cudaGetLastError(), "mlp: sgd");
  }

  // Class probabilities (classes x batch, column per sample) into `probs` (device).
  void predict(const float* x, int ldx, int batch, float* probs) {
    forward(x, ldx, batch);
    kernels::softmax_xent<<<kernels::blocks(batch), 256, 0, stream_>>>(z_, probs, nullptr, nullptr, -1, out_, batch,
                                                                       nullptr, nullptr);
    flexcomm::check_cuda(cudaGetLastError(), "mlp: predict");
  }

  // Summed loss and correct count since the last reset (synchronizes the stream).
  std::pair<float, int> stats() {
    float host[2];
    flexcomm::check_cuda(cudaMemcpyAsync(host, stats_, sizeof host, cudaMemcpyDeviceToHost, stream_), "mlp: stats");
    flexcomm::check_cuda(cudaStreamSynchronize(stream_), "mlp: stats");
    int correct;
    std::memcpy(&correct, &host[1], sizeof correct);
    return {host[0], correct};
  }
  void reset_stats() { flexcomm::check_cuda(cudaMemsetAsync(stats_, 0, 2 * sizeof(float), stream_), "mlp: reset"); }

 private:
  void forward(const float* x, int ldx, int batch) {
    flexcomm::check(batch > 0 && batch <= max_batch_, "mlp", flexcomm::cat("batch of ", batch, " samples, room for ", max_batch_));
    const float one = 1.f, zero = 0.f;
    check_cublas(cublasSgemm(blas_, CUBLAS_OP_N, CUBLAS_OP_N, hid_, batch, in_, &one, params_ + at_.offset[0], hid_, x, ldx,
                             &zero, h1_, hid_),
                 "mlp: H1");
    kernels::bias_relu<<<kernels::blocks(static_cast<std::size_t>(hid_) * batch), 256, 0, stream_>>>(
        h1_, params_ + at_.offset[1], a1_, hid_, batch);
    check_cublas(cublasSgemm(blas_, CUBLAS_OP_N, CUBLAS_OP_N, out_, batch, hid_, &one, params_ + at_.offset[2], out_, a1_,
                             hid_, &zero, z_, out_),
                 "mlp: Z");
    kernels::add_bias<<<kernels::blocks(static_cast<std::size_t>(out_) * batch), 256, 0, stream_>>>(z_, params_ + at_.offset[3],
                                                                                                    out_, batch);
  }
  std::size_t size(int part) const { return at_.size(part); }
  static float* alloc(std::size_t n) {
    float* p = nullptr;
    flexcomm::check_cuda(cudaMalloc(&p, n * sizeof(float)), "mlp: cudaMalloc");
    flexcomm::check_cuda(cudaMemset(p, 0, n * sizeof(float)), "mlp: cudaMemset");
    return p;
  }

  int in_, hid_, out_, max_batch_;
  cudaStream_t stream_;
  parameter_layout at_;
  cublasHandle_t blas_ = nullptr;
  float *params_ = nullptr, *grads_ = nullptr, *h1_ = nullptr, *a1_ = nullptr, *z_ = nullptr, *p_ = nullptr,
        *dz_ = nullptr, *da1_ = nullptr, *stats_ = nullptr;
};

}  // namespace cuda_mlp
