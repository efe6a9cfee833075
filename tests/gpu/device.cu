// GPU suite probe: exits 77 (skipped) without a GPU; with one, checks that a kernel built for
// this device runs and that device memory round-trips, before the other GPU tests are trusted.
#include <cuda_runtime.h>

#include <cstdio>
#include <vector>

__global__ void scale(float* x, float a, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] *= a;
}

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::puts("no CUDA device: skipped");
    return 77;
  }
  const int n = 1000;
  std::vector<float> host(n, 2.0f);
  float* dev = nullptr;
  if (cudaMalloc(&dev, n * sizeof(float)) != cudaSuccess) return 1;
  cudaMemcpy(dev, host.data(), n * sizeof(float), cudaMemcpyHostToDevice);
  scale<<<(n + 255) / 256, 256>>>(dev, 1.5f, n);
  cudaMemcpy(host.data(), dev, n * sizeof(float), cudaMemcpyDeviceToHost);
  cudaFree(dev);
  for (float v : host)
    if (v != 3.0f) {
      std::printf("kernel result %f, expected 3\n", v);
      return 1;
    }
  std::puts("device ok");
  return 0;
}
