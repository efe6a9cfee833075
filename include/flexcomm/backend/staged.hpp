// The staged backend (see staged/): device buffers over MPI through pinned host memory
// (`staged`), or handed to a CUDA-aware MPI as they are (`cuda_aware_mpi`).
#pragma once

#include "staged/communicator.hpp"
#include "staged/operations.hpp"
#include "staged/request.hpp"
