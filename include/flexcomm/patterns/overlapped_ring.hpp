// Moved to patterns/sync/overlapped_ring.hpp; this forward goes after one release.
#pragma once
#include "sync/overlapped_ring.hpp"
