// Moved to patterns/feed/vocabulary.hpp; this forward goes after one release.
#pragma once
#include "feed/vocabulary.hpp"
