// Moved to patterns/sync/route_shared_memory.hpp; this forward goes after one release.
#pragma once
#include "sync/route_shared_memory.hpp"
