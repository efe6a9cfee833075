// The NCCL backend (see nccl/): communicators made collectively from MPI communicators, requests
// that end in ncclCommAbort and an error instead of a hang, and the operations.
#pragma once

#include "nccl/communicator.hpp"
#include "nccl/operations.hpp"
#include "nccl/request.hpp"
