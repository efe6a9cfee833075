// Moved to patterns/feed/typed_batch.hpp; this forward goes after one release.
#pragma once
#include "feed/typed_batch.hpp"
