// Moved to patterns/sync/subgroup_allreduce.hpp; this forward goes after one release.
#pragma once
#include "sync/subgroup_allreduce.hpp"
