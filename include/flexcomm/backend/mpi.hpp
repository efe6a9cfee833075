// The MPI backend (see mpi/): communicator, request, operations, and the host map its
// contract promises, its shared mapping and shared-memory reducer for ranks on one host
// (backend/shm/, set up over MPI in mpi/shared_memory.hpp). The environment (MPI_Init and
// shutdown) and trace clock are in mpi/environment.hpp and mpi/trace.hpp.
#pragma once

#include "mpi/communicator.hpp"
#include "mpi/hosts.hpp"
#include "mpi/operations.hpp"
#include "mpi/request.hpp"
#include "mpi/shared_memory.hpp"
