// Moved to patterns/collect/many_to_one.hpp; this forward goes after one release.
#pragma once
#include "collect/many_to_one.hpp"
