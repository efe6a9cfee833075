// Moved to patterns/feed/local_feed.hpp; this forward goes after one release.
#pragma once
#include "feed/local_feed.hpp"
