// Moved to patterns/feed/typed_feed.hpp; this forward goes after one release.
#pragma once
#include "feed/typed_feed.hpp"
