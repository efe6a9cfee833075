// Moved to backend/mpi_watchdog.hpp (shared by the backends over MPI ranks); this forward goes after one release.
#pragma once
#include "../mpi_watchdog.hpp"
