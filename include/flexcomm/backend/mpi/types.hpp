// Moved to backend/mpi_types.hpp (shared by the backends over MPI ranks); this forward goes after one release.
#pragma once
#include "../mpi_types.hpp"
