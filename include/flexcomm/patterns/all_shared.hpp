// Moved to patterns/feed/all_shared.hpp; this forward goes after one release.
#pragma once
#include "feed/all_shared.hpp"
