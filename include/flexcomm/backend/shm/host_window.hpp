// shm::host_window: one shared-memory mapping for the ranks of a group that share a host, each
// owning a region of the size it asked for; a backend offers it as B::host_window (contract.hpp:
// has_host_window; the MPI backend's is mpi/shared_memory.hpp). The intra-host allreduce
// (host_reducer.hpp) and the feeds' in-place batches (feed/host_slots.hpp) lay out their
// flags and slots in it.
//
// One POSIX shared-memory file, made by rank 0 and unlinked once every rank has mapped it:
// setting it up takes an allgather, a broadcast and a reduction over the group (host_group.hpp;
// the MPI backend's are nonblocking and waited through the wait policy, where
// MPI_Win_allocate_shared busy-polls), and releasing it is a local munmap, so a rank that leaves
// early never holds its peers in a collective. The file's pages start zeroed; each rank allocates its own region's
// while the window is made (placing them near itself), so a /dev/shm without room is an error on
// every rank then, not a SIGBUS later.
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "../../core/cache_line.hpp"
#include "../../core/error.hpp"
#include "host_group.hpp"

namespace flexcomm::shm {

class host_window {
 public:
  static constexpr std::size_t page = 4096;

  host_window() = default;

  // Collective over `group`, whose ranks must all share one host (the backend decides: otherwise
  // an error on every rank). `bytes`: this rank's region, rounded up to whole pages; ranks may ask
  // for different sizes, 0 included. A failure on any rank (no shared-memory file, no mapping) is
  // an error on every rank, naming `who`.
  host_window(const host_group& group, std::size_t bytes, const std::string& who) {
    rank_ = group.rank();
    size_ = group.size();
    check(group.on_one_host(who), who,
          cat("the communicator's ", size_, " ranks are not all on one host; shared memory needs one host"));
    const std::uint64_t mine = detail::round_up(bytes, page);
    const std::vector<std::uint64_t> sizes = group.allgather(mine, who, "the regions' sizes");
    offsets_.resize(static_cast<std::size_t>(size_) + 1);
    for (std::size_t r = 0; r < sizes.size(); ++r) offsets_[r + 1] = offsets_[r] + sizes[r];
    // An empty file cannot be mapped: every window holds at least a page.
    mapped_ = std::max<std::size_t>(offsets_.back(), page);
    // Rank 0's outcome travels with the name: an empty name and its errno when it failed.
    made_file made{};
    if (rank_ == 0) made = create(mapped_);
    group.broadcast(&made, sizeof made, who, "the segment's name");
    check(made.error == 0, who,
          cat("rank 0 could not make a shared-memory file of ", mapped_, " bytes: ", std::strerror(made.error),
              made.error == ENOSPC ? room_advice : ""));
    const int error = map(made.name);
    // Everyone has mapped (or failed to) before the name goes; the file lives on in the mappings.
    const int failures = group.sum(error != 0, who, "mapping the segment");
    if (rank_ == 0) shm_unlink(made.name);
    check(error == 0, who,
          cat("mapping shared-memory file ", made.name, " (this rank's region: ", region_bytes(rank_), " bytes): ",
              std::strerror(error), error == ENOSPC ? room_advice : ""));
    check(failures == 0, who, cat(failures, " of the ranks could not map shared-memory file ", made.name));
  }
  host_window(host_window&& o) noexcept { swap(o); }
  host_window& operator=(host_window&& o) noexcept {
    host_window gone(std::move(o));
    swap(gone);
    return *this;
  }
  host_window(const host_window&) = delete;
  host_window& operator=(const host_window&) = delete;
  ~host_window() {
    if (base_) munmap(base_, mapped_);
  }

  explicit operator bool() const noexcept { return base_ != nullptr; }
  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  // Rank r's region as this process maps it: page-aligned, zeroed when the window was made.
  std::byte* region(int r) const noexcept { return base_ + offsets_[static_cast<std::size_t>(r)]; }
  std::size_t region_bytes(int r) const noexcept {
    return offsets_[static_cast<std::size_t>(r) + 1] - offsets_[static_cast<std::size_t>(r)];
  }

 private:
  static constexpr const char* room_advice =
      " (/dev/shm too small? a container's is 64 MiB unless told otherwise: enlarge it, e.g. docker run "
      "--shm-size, or set FLEXCOMM_SHM=off to send messages instead)";
  struct made_file {
    char name[56];
    int error;
  };
  // Rank 0: a new, sized shared-memory file: its name, or errno.
  static made_file create(std::size_t bytes) {
    made_file made{};
    static std::atomic<unsigned> made_here{0};
    for (int attempt = 0; attempt < 16; ++attempt) {
      std::snprintf(made.name, sizeof made.name, "/flexcomm-%ld-%u", static_cast<long>(getpid()), made_here++);
      const int fd = shm_open(made.name, O_CREAT | O_EXCL | O_RDWR, 0600);
      if (fd < 0 && errno == EEXIST) continue;
      if (fd < 0) break;
      // Sized, not reserved (each owner places its own pages, map()), so a file larger than the
      // room left would map and then kill a writer with SIGBUS: a container's /dev/shm is 64 MiB
      // unless told otherwise.
      struct statvfs room {};
      int error = fstatvfs(fd, &room) == 0 && static_cast<std::uint64_t>(room.f_bavail) * room.f_frsize < bytes ? ENOSPC : 0;
      if (error == 0 && ftruncate(fd, static_cast<off_t>(bytes)) != 0) error = errno;
      close(fd);
      if (error == 0) return made;
      shm_unlink(made.name);
      made.error = error;
      made.name[0] = '\0';
      return made;
    }
    made.error = errno ? errno : EEXIST;
    made.name[0] = '\0';
    return made;
  }
  // Maps the whole file and puts in this rank's own pages; 0 or errno (ENOSPC: no room for them).
  int map(const char* name) {
    const int fd = shm_open(name, O_RDWR, 0600);
    if (fd < 0) return errno;
    void* p = mmap(nullptr, mapped_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    const int error = p == MAP_FAILED ? errno : 0;
    close(fd);
    if (error) return error;
    base_ = static_cast<std::byte*>(p);
    // Its owner allocates each page (placed on its memory node), here and now, where a full
    // /dev/shm is an error (EFAULT: a write would have raised SIGBUS) instead of a crash later.
    // Kernels before 5.14 do not know the advice: their pages come on first write.
#ifdef MADV_POPULATE_WRITE
    const std::size_t own = region_bytes(rank_);
    if (own > 0 && madvise(region(rank_), own, MADV_POPULATE_WRITE) != 0 && errno != EINVAL)
      return errno == EFAULT ? ENOSPC : errno;
#endif
    return 0;
  }
  void swap(host_window& o) noexcept {
    std::swap(rank_, o.rank_);
    std::swap(size_, o.size_);
    std::swap(offsets_, o.offsets_);
    std::swap(mapped_, o.mapped_);
    std::swap(base_, o.base_);
  }

  int rank_ = 0, size_ = 0;
  std::vector<std::size_t> offsets_;  // size_ + 1: where each rank's region starts
  std::size_t mapped_ = 0;
  std::byte* base_ = nullptr;
};

}  // namespace flexcomm::shm
