// Moved to backend/shm/slot_writer.hpp; this forward goes after one release.
#pragma once
#include "../shm/slot_writer.hpp"
