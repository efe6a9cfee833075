// Moved to backend/shm/host_window.hpp (the MPI backend plugs it in: mpi/shared_memory.hpp); this forward goes after one release.
#pragma once
#include "shared_memory.hpp"
