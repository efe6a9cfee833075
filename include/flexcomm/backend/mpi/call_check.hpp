// Moved to backend/call_check.hpp (shared by the backends over MPI ranks); this forward goes after one release.
#pragma once
#include "../call_check.hpp"
