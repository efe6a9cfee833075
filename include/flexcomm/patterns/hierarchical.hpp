// Moved to patterns/sync/route_hierarchical.hpp; this forward goes after one release.
#pragma once
#include "sync/route_hierarchical.hpp"
