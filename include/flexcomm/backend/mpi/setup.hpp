// Moved to backend/mpi_setup.hpp (shared by the backends over MPI ranks); this forward goes after one release.
#pragma once
#include "../mpi_setup.hpp"
