// Moved to patterns/sync/core.hpp; this forward goes after one release.
#pragma once
#include "sync/core.hpp"
