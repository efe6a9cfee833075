// shm::registered_range: a trainer's own memory (a std::vector's gradient) made shared where it
// lies, so that host_reducer reduces it in place, as it does memory from host_reducer::allocate,
// instead of copying it through the slots (about 1.8x the traffic).
//
// Made collectively over a host_group, once per bucket (when the plan is formed). Each rank's
// page-aligned interior [page_up(p), page_down(p + bytes)) is moved into a memfd: the pages are
// copied into it and it is mapped over them (MAP_FIXED), so the vector keeps its address and its
// contents, and its pages are now shared. Peers map each other's memfd through
// /proc/<pid>/fd/<fd>. The partial head and tail pages are never remapped (other heap objects may
// share them, written by other threads): the elements there go another way (host_reducer). Every
// rank uses the same element range, the interiors' intersection, each at its own offset.
// The user may free the vector and get another at the same address (zero_grad with set_to_none;
// glibc munmaps large chunks): current() says whether the registered pages are still the ones at
// the user's address, so stale memory is never reduced. Destruction unmaps the peers' views and
// this rank's second view; the user's pages stay valid (their mapping keeps the memfd alive).
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "../../core/error.hpp"
#include "host_group.hpp"
#include "host_window.hpp"

namespace flexcomm::shm {

class registered_range {
 public:
  static constexpr std::size_t page = host_window::page;

  // Collective over `group`: registers [data, data + bytes) of elements `width` bytes wide on
  // every rank, or on none (null everywhere) where the common interior is under `min_bytes` or a
  // rank could not share its pages (no memfd, no mapping, no access to a peer's).
  static std::unique_ptr<registered_range> make(const host_group& group, std::byte* data, std::size_t bytes,
                                                std::size_t width, std::size_t min_bytes, const std::string& who) {
    const std::vector<std::uint64_t> spans = group.allgather(interior_of(data, bytes, width), who, "the interiors");
    std::uint64_t lo = 0, hi = ~std::uint64_t{0};
    for (const std::uint64_t s : spans) {
      lo = std::max(lo, s >> 48);
      hi = std::min(hi, s & span_mask);
    }
    if (hi <= lo || hi - lo < min_bytes) return nullptr;  // the same answer on every rank
    std::unique_ptr<registered_range> r(new registered_range(group.rank(), data, bytes, lo, hi - lo));
    const std::uint64_t mine = spans[static_cast<std::size_t>(group.rank())];
    int error = r->share(mine >> 48, (mine & span_mask) - (mine >> 48));
    const std::uint64_t id = static_cast<std::uint64_t>(getpid()) << 32 | static_cast<std::uint32_t>(r->fd_);
    const std::vector<std::uint64_t> ids = group.allgather(error ? ~std::uint64_t{0} : id, who, "the memfds");
    if (!error) error = r->view_peers(spans, ids);
    // Every peer has opened this rank's memfd (or failed to) before it is closed: the mappings keep it.
    const int failures = group.sum(error != 0, who, "sharing the gradients' pages");
    close(std::exchange(r->fd_, -1));
    if (failures) return nullptr;
    return r;
  }
  registered_range(const registered_range&) = delete;
  registered_range& operator=(const registered_range&) = delete;
  ~registered_range() {
    for (std::size_t r = 0; r < views_.size(); ++r)
      if (views_[r] && static_cast<int>(r) != rank_) munmap(views_[r], view_bytes_[r]);
    if (alias_) munmap(alias_, own_bytes_);
    if (fd_ >= 0) close(fd_);
  }

  // The user's memory as registered, the common range's first byte and its length.
  const std::byte* data() const noexcept { return data_; }
  std::size_t bytes() const noexcept { return bytes_; }
  std::size_t head() const noexcept { return head_; }
  std::size_t interior() const noexcept { return interior_; }
  // Where rank r's common range lies as this process maps it (its own: the second view).
  std::byte* base(int r) const noexcept { return bases_[static_cast<std::size_t>(r)]; }

  // Whether [data, data + bytes) is still the registered memory with its shared pages: a byte of
  // the first and last interior page flipped through the second view must show at the user's
  // address. The caller's data is ready (nobody writes it), and peers read it only later.
  bool current(const std::byte* data, std::size_t bytes) const noexcept {
    if (data != data_ || bytes != bytes_) return false;
    return shows(0) && shows(own_bytes_ - page);
  }

 private:
  static constexpr std::uint64_t span_mask = (std::uint64_t{1} << 48) - 1;

  registered_range(int rank, std::byte* data, std::size_t bytes, std::size_t head, std::size_t interior)
      : rank_(rank), data_(data), bytes_(bytes), head_(head), interior_(interior) {}

  // This rank's interior as bytes into data, packed: first << 48 | end; none (0, 0) when data is
  // not aligned to its elements or holds no whole page.
  static std::uint64_t interior_of(const std::byte* data, std::size_t bytes, std::size_t width) {
    const auto at = reinterpret_cast<std::uintptr_t>(data);
    if (width == 0 || at % width != 0 || bytes >= span_mask) return 0;
    const std::uintptr_t first = (at + page - 1) / page * page, end = (at + bytes) / page * page;
    if (end <= first) return 0;
    return static_cast<std::uint64_t>(first - at) << 48 | static_cast<std::uint64_t>(end - at);
  }

  // Moves this rank's interior [data_ + lo, + n) into a new memfd mapped over it; 0 or errno.
  int share(std::size_t lo, std::size_t n) {
    std::byte* const interior = data_ + lo;
    own_bytes_ = n;
    fd_ = memfd_create("flexcomm-gradient", MFD_CLOEXEC);
    if (fd_ < 0) return errno;
    if (ftruncate(fd_, static_cast<off_t>(n)) != 0) return errno;
    void* alias = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    if (alias == MAP_FAILED) return errno;
    alias_ = static_cast<std::byte*>(alias);
    std::memcpy(alias_, interior, n);
    if (mmap(interior, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd_, 0) == MAP_FAILED) {
      const int error = errno;
      // The old pages may be gone: fresh private ones with the contents, or the process is broken.
      if (mmap(interior, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) == MAP_FAILED)
        fail("shared-memory registration", cat("remapping a gradient's pages failed (", std::strerror(error),
                                               ") and so did restoring them (", std::strerror(errno), ")"));
      std::memcpy(interior, alias_, n);
      return error;
    }
    return 0;
  }
  // Maps every peer's memfd (ids: pid << 32 | fd; all ones where it failed); 0 or errno.
  int view_peers(const std::vector<std::uint64_t>& spans, const std::vector<std::uint64_t>& ids) {
    views_.assign(spans.size(), nullptr);
    view_bytes_.assign(spans.size(), 0);
    bases_.assign(spans.size(), nullptr);
    for (std::size_t r = 0; r < spans.size(); ++r) {
      const std::size_t lo = spans[r] >> 48, n = (spans[r] & span_mask) - lo;
      if (static_cast<int>(r) == rank_) {
        views_[r] = alias_;
        bases_[r] = alias_ + (head_ - lo);
        continue;
      }
      if (ids[r] == ~std::uint64_t{0}) return ECANCELED;  // the peer failed: it says why
      const std::string path = cat("/proc/", ids[r] >> 32, "/fd/", ids[r] & 0xffffffffu);
      const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
      if (fd < 0) return errno;
      void* view = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      const int error = view == MAP_FAILED ? errno : 0;
      close(fd);
      if (error) return error;
      views_[r] = static_cast<std::byte*>(view);
      view_bytes_[r] = n;
      bases_[r] = views_[r] + (head_ - lo);
    }
    return 0;
  }
  // Whether the byte `at` into this rank's interior is the memfd's at the user's address.
  bool shows(std::size_t at) const noexcept {
    volatile unsigned char* mine = reinterpret_cast<volatile unsigned char*>(alias_ + at);
    const volatile unsigned char* users = reinterpret_cast<const volatile unsigned char*>(first_page() + at);
    const unsigned char was = *mine;
    *mine = static_cast<unsigned char>(~was);
    const bool same = *users == static_cast<unsigned char>(~was);
    *mine = was;
    return same;
  }
  const std::byte* first_page() const noexcept {
    const auto at = reinterpret_cast<std::uintptr_t>(data_);
    return data_ + ((at + page - 1) / page * page - at);
  }

  int rank_;
  std::byte* data_;
  std::size_t bytes_, head_, interior_;
  std::size_t own_bytes_ = 0;
  int fd_ = -1;
  std::byte* alias_ = nullptr;  // this rank's second view of its memfd
  std::vector<std::byte*> views_, bases_;
  std::vector<std::size_t> view_bytes_;
};

}  // namespace flexcomm::shm
