// The device buffers and streams of tests/backend_cases.hpp (the host ones are in
// tests/test_buffer.hpp): memory from cudaMalloc, and a CUDA stream of its own.
#pragma once

#include <cuda_runtime.h>

#include <flexcomm/backend/cuda/error.hpp>

#include "../test_buffer.hpp"

#include <cstddef>
#include <vector>

namespace flexcomm::testing {

template <class T>
class test_buffer<memory_space::device, T> {
 public:
  explicit test_buffer(std::size_t n) : n_(n) {
    if (n_) check_cuda(cudaMalloc(&p_, n_ * sizeof(T)), "test: cudaMalloc");
    if (n_) check_cuda(cudaMemset(p_, 0xff, n_ * sizeof(T)), "test: cudaMemset");  // not a plausible result
  }
  explicit test_buffer(const std::vector<T>& host) : test_buffer(host.size()) {
    if (n_) check_cuda(cudaMemcpy(p_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice), "test: upload");
  }
  test_buffer(const test_buffer&) = delete;
  test_buffer& operator=(const test_buffer&) = delete;
  ~test_buffer() {
    if (p_) cudaFree(p_);
  }
  std::vector<T> host() const {
    check_cuda(cudaDeviceSynchronize(), "test: cudaDeviceSynchronize");
    std::vector<T> out(n_);
    if (n_) check_cuda(cudaMemcpy(out.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost), "test: download");
    return out;
  }
  flexcomm::span<T> span() const { return {p_, n_}; }
  flexcomm::span<const T> cspan() const { return {p_, n_}; }

 private:
  T* p_ = nullptr;
  std::size_t n_;
};

template <>
struct side_stream<memory_space::device> {
  cudaStream_t s = nullptr;
  side_stream() { check_cuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "test: cudaStreamCreate"); }
  side_stream(const side_stream&) = delete;
  side_stream& operator=(const side_stream&) = delete;
  ~side_stream() { cudaStreamDestroy(s); }
};

}  // namespace flexcomm::testing
