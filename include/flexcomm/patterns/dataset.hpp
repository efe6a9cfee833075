// Moved to patterns/feed/dataset.hpp; this forward goes after one release.
#pragma once
#include "feed/dataset.hpp"
