// Moved to patterns/feed/one_to_many.hpp; this forward goes after one release.
#pragma once
#include "feed/one_to_many.hpp"
