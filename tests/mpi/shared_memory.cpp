#define BOOST_TEST_MODULE mpi_shared_memory
#include "mpi_fixture.hpp"
#include "errors.hpp"
#include "exact_values.hpp"

#include <sys/statvfs.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace fc = flexcomm;
using fc::mpi;
using fc::testing::all_ops;
using fc::testing::all_ranks;
using fc::testing::contains;
using fc::testing::element_types;
using fc::testing::error_of;
using fc::testing::gradient;
using fc::testing::reference;
using fc::testing::same;
using fc::testing::world;

static_assert(fc::has_host_shared_memory<mpi>, "the MPI backend reduces through shared memory");

namespace {

// Pretends the world's ranks sit on hosts (FLEXCOMM_HOSTS) while it lives; every rank sets the same.
struct pretend_hosts {
  explicit pretend_hosts(const std::string& blocks) { setenv("FLEXCOMM_HOSTS", blocks.c_str(), 1); }
  ~pretend_hosts() { unsetenv("FLEXCOMM_HOSTS"); }
};

// The world's ranks on this rank's real host (the cluster suite runs this test across simulated
// hosts): what a reducer can be made over.
const mpi::communicator& this_host() {
  static const mpi::communicator host = [] {
    const auto hosts = fc::hosts_of(world());
    return world().split(hosts.host_of(world().rank()), world().rank(), "this host");
  }();
  return host;
}

// Whether `member` takes the shared-memory path when it is allowed to: 2+ ranks, one real host.
bool shm_possible(const mpi::communicator& member) {
  return member.size() > 1 && mpi::host_reducer::on_one_host(member);
}

std::vector<int> world_ranks_of(const mpi::communicator& comm) {
  std::vector<int> out;
  for (int r = 0; r < comm.size(); ++r) out.push_back(comm.world_rank_of(r));
  return out;
}

// Sizes 0, 1, below the rank count, not divisible by it, several cache lines, several slots.
std::vector<std::size_t> sizes_for(int ranks, std::size_t slot_elements) {
  return {0, 1, static_cast<std::size_t>(ranks > 1 ? ranks - 1 : 1), 1001, slot_elements + 3, 3 * slot_elements + 17};
}

bool bits_equal(const void* a, const void* b, std::size_t bytes) { return bytes == 0 || std::memcmp(a, b, bytes) == 0; }

// Runs every op over `sizes` for `steps` steps through `reducer` (made over `comm`); true when each
// result equals the exact reference, and at the first step MPI_Allreduce's result bit for bit
// (MPICH's allreduce is slow with 5-6 ranks on two cores).
template <class T>
bool reducer_agrees(mpi::host_reducer& reducer, const mpi::communicator& comm, int steps, std::string& detail) {
  const auto ranks = world_ranks_of(comm);
  const int me = world().rank();
  const auto sizes = sizes_for(comm.size(), reducer.slot_bytes() / sizeof(T));
  bool ok = true;
  for (int step = 0; step < steps; ++step)
    for (fc::op o : all_ops)
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        const std::size_t n = sizes[i];
        auto mine = gradient<T>(me, step, static_cast<int>(i), n);
        auto by_mpi = mine;
        if (step == 0) mpi::iallreduce(comm, fc::span<T>(by_mpi), o).wait();
        reducer.allreduce(mine.data(), n, o);
        const auto want = reference<T>(o, ranks, step, static_cast<int>(i), n);
        if (!same(mine, want) || (step == 0 && !bits_equal(mine.data(), by_mpi.data(), n * sizeof(T)))) {
          ok = false;
          detail = fc::cat("step ", step, " op ", fc::name_of(o), " ", n, " elements");
        }
      }
  return ok;
}

// Three steps of subgroup_allreduce on `member` over gradients of awkward sizes: the results.
template <class T>
std::vector<std::vector<T>> run_subgroup(const mpi::communicator& member, const fc::sync_options& options,
                                         bool& used_shm) {
  const std::vector<std::size_t> sizes{0, 1, 3, 64, 333, 2049, 7000};  // 7000: chunks of a 1 KiB slot for every type
  fc::subgroup_allreduce<mpi> sync(member, options);
  used_shm = sync.shared_memory();
  std::vector<std::vector<T>> out;
  for (int step = 0; step < 3; ++step) {
    std::vector<std::vector<T>> grads(sizes.size());
    for (std::size_t i = 0; i < sizes.size(); ++i) grads[i] = gradient<T>(world().rank(), step, static_cast<int>(i), sizes[i]);
    for (std::size_t i = sizes.size(); i-- > 0;) sync.ready(static_cast<int>(i), fc::span<T>(grads[i]));
    sync.finish();
    for (auto& g : grads) out.push_back(std::move(g));
  }
  return out;
}

template <class T>
std::vector<std::vector<T>> subgroup_reference(const mpi::communicator& member, fc::op o) {
  const std::vector<std::size_t> sizes{0, 1, 3, 64, 333, 2049, 7000};  // 7000: chunks of a 1 KiB slot for every type
  const auto ranks = world_ranks_of(member);
  std::vector<std::vector<T>> out;
  for (int step = 0; step < 3; ++step)
    for (std::size_t i = 0; i < sizes.size(); ++i) out.push_back(reference<T>(o, ranks, step, static_cast<int>(i), sizes[i]));
  return out;
}

template <class T>
bool all_same(const std::vector<std::vector<T>>& a, const std::vector<std::vector<T>>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].size() != b[i].size() || !bits_equal(a[i].data(), b[i].data(), a[i].size() * sizeof(T))) return false;
  return true;
}

}  // namespace

// The reducer itself, over the world (one real host here): every type and op, sizes 0, 1, below
// the rank count, not divisible by it and over several slots (small slots: many chunks), three
// steps on one reducer (the segment reused), equal to the exact reference and MPI_Allreduce.
// Small-path thresholds of 0 (every size in chunks), 256 and 4096 bytes send some sizes each way.
BOOST_AUTO_TEST_CASE_TEMPLATE(reducer_equals_mpi_allreduce_for_every_type_and_op, T, element_types) {
  const std::pair<std::size_t, std::size_t> shapes[] = {{64, 0}, {1000, 256}, {4096, 4096}};
  for (const auto& [slot, small] : shapes) {
    mpi::host_reducer reducer(this_host(), slot, small);
    std::string detail;
    BOOST_TEST(all_ranks(reducer_agrees<T>(reducer, this_host(), 3, detail)),
               "slot " << slot << " bytes (" << reducer.slot_bytes() << " used), small path up to " << small
                       << ": " << detail);
  }
}

// The NaN rule (core/reduce_rule.hpp) on every host path, in whatever order contributions meet:
// NaNs of both signs with payloads, infinities, zeros of both signs and subnormals, placed
// differently on each rank. The reducer and MPI (flexcomm's own MPI_Ops) give the host loops' bits,
// and min and max the same bits when the ranks are combined in the opposite order.
namespace {
using floating_types = boost::mpl::list<float, double, fc::half, fc::bfloat16>;

template <class T>
T special(std::size_t k) {
  if constexpr (sizeof(T) == 2) {
    const bool h = std::is_same_v<T, fc::half>;
    const std::uint16_t bits[] = {static_cast<std::uint16_t>(h ? 0xfe01u : 0xffc1u), 0x7fffu, static_cast<std::uint16_t>(h ? 0x7c00u : 0x7f80u),
                                  static_cast<std::uint16_t>(h ? 0xfc00u : 0xff80u), 0x0000u, 0x8000u, 0x0001u,
                                  static_cast<std::uint16_t>(h ? 0x3c00u : 0x3f80u), static_cast<std::uint16_t>(h ? 0xbc00u : 0xbf80u)};
    T x;
    x.bits = bits[k % 9];
    return x;
  } else {
    using L = std::numeric_limits<T>;
    const T values[] = {-L::quiet_NaN(), L::quiet_NaN(), L::infinity(), -L::infinity(), T(0), -T(0), L::denorm_min(), T(1), T(-1)};
    return values[k % 9];
  }
}

template <class T>
std::vector<T> specials_of(int rank, std::size_t n) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = special<T>(i * 5 + static_cast<std::size_t>(rank) * 7 + i / 9);
  return v;
}
}  // namespace

BOOST_AUTO_TEST_CASE_TEMPLATE(specials_reduce_to_the_same_bits_on_every_path, T, floating_types) {
  const auto ranks = world_ranks_of(this_host());
  const std::size_t n = 1001;
  mpi::host_reducer reducer(this_host(), 1024, 256);
  bool ok = true;
  std::string detail;
  for (fc::op o : {fc::op::sum, fc::op::prod, fc::op::min, fc::op::max}) {
    auto want = specials_of<T>(ranks.front(), n), backwards = specials_of<T>(ranks.back(), n);
    for (std::size_t r = 1; r < ranks.size(); ++r) {
      fc::combine(o, want.data(), specials_of<T>(ranks[r], n).data(), n);
      fc::combine(o, backwards.data(), specials_of<T>(ranks[ranks.size() - 1 - r], n).data(), n);
    }
    auto by_reducer = specials_of<T>(world().rank(), n), by_mpi = by_reducer;
    reducer.allreduce(by_reducer.data(), n, o);
    mpi::iallreduce(this_host(), fc::span<T>(by_mpi), o).wait();
    const bool order_free = o == fc::op::sum || o == fc::op::prod || bits_equal(want.data(), backwards.data(), n * sizeof(T));
    if (!bits_equal(by_reducer.data(), want.data(), n * sizeof(T)) || !bits_equal(by_mpi.data(), want.data(), n * sizeof(T)) ||
        !order_free) {
      ok = false;
      detail += fc::cat(" ", fc::name_of(o));
    }
  }
  BOOST_TEST(all_ranks(ok), "differs:" << detail);
}

// Tasks started back to back and polled by another thread (the progress engine), small and
// large interleaved: they run in start order, and each result is right.
BOOST_AUTO_TEST_CASE(tasks_on_the_engine_run_in_start_order) {
  mpi::host_reducer reducer(this_host(), 256, 128);
  const auto ranks = world_ranks_of(this_host());
  std::vector<std::vector<std::int64_t>> data;
  std::vector<std::shared_ptr<fc::completion>> done;
  for (int i = 0; i < 40; ++i) {
    const std::size_t n = (i % 3 == 0) ? 5 + static_cast<std::size_t>(i) : 200 + 13 * static_cast<std::size_t>(i);
    data.push_back(gradient<std::int64_t>(world().rank(), i, 2, n));
  }
  for (auto& d : data) {
    auto task = reducer.start(d.data(), d.size(), fc::op::sum);
    done.push_back(fc::progress_engine::instance().submit([task] { return task->poll(); }, task->what()));
  }
  for (auto& d : done) d->wait();
  bool ok = true;
  for (std::size_t i = 0; i < data.size(); ++i)
    ok = ok && same(data[i], reference<std::int64_t>(fc::op::sum, ranks, static_cast<int>(i), 2, data[i].size()));
  BOOST_TEST(all_ranks(ok));
}

// Polling a task drives every task started before it: a trainer waiting on a small allreduce
// finishes the buckets queued before it on its own thread, never polling them.
BOOST_AUTO_TEST_CASE(polling_a_task_drives_those_started_before_it) {
  const auto& host = this_host();
  if (!shm_possible(host)) {
    BOOST_TEST(all_ranks(true));
    return;
  }
  mpi::host_reducer reducer(host, 256, 64);
  const auto ranks = world_ranks_of(host);
  std::vector<std::vector<float>> data;
  std::vector<std::shared_ptr<mpi::host_reducer::task<float>>> tasks;
  for (int i = 0; i < 5; ++i) data.push_back(gradient<float>(world().rank(), i, 1, 100 + 97 * static_cast<std::size_t>(i)));
  for (auto& d : data) tasks.push_back(reducer.start(d.data(), d.size(), fc::op::sum));
  BOOST_TEST(!tasks.front()->done());
  fc::default_wait().until([&] { return tasks.back()->poll(); });
  bool ok = true;
  for (std::size_t i = 0; i < data.size(); ++i) {
    ok = ok && tasks[i]->done();
    ok = ok && same(data[i], reference<float>(fc::op::sum, ranks, static_cast<int>(i), 1, data[i].size()));
  }
  BOOST_TEST(all_ranks(ok));
}

// overlapped_ring on one host takes the shared-memory path instead of the ring; same bits.
BOOST_AUTO_TEST_CASE(overlapped_ring_on_one_host_goes_through_shared_memory) {
  for (fc::op o : {fc::op::sum, fc::op::avg}) {
    fc::sync_options options;
    options.op = o;
    options.bucket_bytes = 2048;
    options.shared_memory_slot_bytes = 1024;
    options.hierarchical = fc::hierarchy::off;
    std::vector<std::vector<float>> got[2];
    bool used[2] = {false, true};
    for (int on = 0; on < 2; ++on) {
      options.shared_memory = on ? fc::shared_memory_use::on : fc::shared_memory_use::off;
      fc::overlapped_ring<mpi> sync(this_host(), options);
      used[on] = sync.shared_memory();
      const std::vector<std::size_t> sizes{0, 1, 3, 64, 333, 2049, 7000};  // 7000: chunks of a 1 KiB slot for every type
      for (int step = 0; step < 3; ++step) {
        std::vector<std::vector<float>> grads(sizes.size());
        for (std::size_t i = 0; i < sizes.size(); ++i)
          grads[i] = gradient<float>(world().rank(), step, static_cast<int>(i), sizes[i]);  // seeded by world rank
        for (std::size_t i = sizes.size(); i-- > 0;) sync.ready(static_cast<int>(i), fc::span<float>(grads[i]));
        sync.finish();
        for (auto& g : grads) got[on].push_back(std::move(g));
      }
    }
    BOOST_TEST(used[1] == (this_host().size() > 1));
    BOOST_TEST(!used[0]);
    BOOST_TEST(all_ranks(all_same(got[0], got[1])), "op " << fc::name_of(o));
    BOOST_TEST(all_ranks(all_same(got[1], subgroup_reference<float>(this_host(), o))), "op " << fc::name_of(o));
  }
}

// Many calls of many chunks on one small segment: a rank running ahead must not overwrite a slot
// a peer still reads (each call's inputs differ, so a stale or early read changes the result).
BOOST_AUTO_TEST_CASE(segment_reuse_under_many_calls) {
  mpi::host_reducer reducer(this_host(), 128);
  const auto ranks = world_ranks_of(this_host());
  bool ok = true;
  for (int step = 0; step < 100 && ok; ++step) {
    const std::size_t n = 1 + static_cast<std::size_t>(step * 37) % 300;
    auto mine = gradient<std::int32_t>(world().rank(), step, 1, n);
    reducer.allreduce(mine.data(), n, fc::op::sum);
    ok = same(mine, reference<std::int32_t>(fc::op::sum, ranks, step, 1, n));
    BOOST_TEST_INFO("step " << step);
  }
  BOOST_TEST(all_ranks(ok));
}

// A small allreduce carrying words (a step's last bucket and its check, in one round): the data
// reduced as by allreduce(), the words max-reduced, at every size up to a full small slot, mixed
// with plain small and large tasks that reuse the same slots; too much to carry is refused before
// anything moves.
BOOST_AUTO_TEST_CASE(a_small_allreduce_carries_words_max_reduced_in_its_round) {
  const std::size_t small = 256;
  mpi::host_reducer reducer(this_host(), 512, small);
  const auto ranks = world_ranks_of(this_host());
  const int me = this_host().rank(), size = this_host().size();
  bool ok = true;
  for (int step = 0; step < 40; ++step) {  // every step on every rank, whatever this one found
    const std::size_t n = 1 + static_cast<std::size_t>(step * 7) % (small / sizeof(std::int32_t));
    auto mine = gradient<std::int32_t>(world().rank(), step, 1, n);
    std::vector<std::int64_t> words{me == step % size ? 1000 + step : me, -me};
    BOOST_TEST_INFO("step " << step << ", " << n << " elements");
    reducer.allreduce_carrying(mine.data(), n, fc::op::sum, fc::span<std::int64_t>(words));
    ok = ok && same(mine, reference<std::int32_t>(fc::op::sum, ranks, step, 1, n)) && words[0] == 1000 + step &&
         words[1] == 0;
    // A plain small task and a large one in between, on the slots the next carrier reuses.
    auto other = gradient<std::int32_t>(world().rank(), step, 2, 200);
    reducer.allreduce(other.data(), other.size(), fc::op::sum);
    ok = ok && same(other, reference<std::int32_t>(fc::op::sum, ranks, step, 2, 200));
  }
  BOOST_TEST(all_ranks(ok));
  // The words go in the line beside the slot, or where the data leaves room before its end.
  BOOST_TEST(reducer.carries(small, 8));
  BOOST_TEST(!reducer.carries(small, 9));
  BOOST_TEST(reducer.carries(small - 8, 9));
  BOOST_TEST(!reducer.carries(small + 4, 2));
  BOOST_TEST(!reducer.carries(0, 2));
  std::vector<float> too_big((small + 4) / sizeof(float));
  std::vector<std::int64_t> words(2);
  const std::string e = error_of(
      [&] { reducer.allreduce_carrying(too_big.data(), too_big.size(), fc::op::sum, fc::span<std::int64_t>(words)); });
  BOOST_TEST(contains(e, "do not fit a small slot of 256 bytes"), e);
}

// subgroup_allreduce with the path on and off: the same bits, equal to the exact reference;
// the path is taken exactly when the member has 2+ ranks. Two buckets fuse several gradients:
// launched when full, each lands in its gradients on whichever thread finishes it. Launched when full for sum only (the
// launch point does not change the reduction; 6 ranks on 2 cores keep the test short).
BOOST_AUTO_TEST_CASE_TEMPLATE(subgroup_on_and_off_give_the_same_bits, T, element_types) {
  for (fc::op o : all_ops) {
    for (bool early : {false, true}) {
      if (early && o != fc::op::sum) continue;
      fc::sync_options options;
      options.op = o;
      options.bucket_bytes = 4096;
      options.last_bucket_bytes = 16;  // the gradients handed over last, 3, 1 and 0 elements, go apart
      options.launch_when_full = early;
      options.shared_memory_slot_bytes = 1024;
      options.hierarchical = fc::hierarchy::off;
      bool on_used = false, off_used = true;
      options.shared_memory = fc::shared_memory_use::on;
      const auto on = run_subgroup<T>(this_host(), options, on_used);
      options.shared_memory = fc::shared_memory_use::off;
      const auto off = run_subgroup<T>(this_host(), options, off_used);
      BOOST_TEST(on_used == (this_host().size() > 1));
      BOOST_TEST(!off_used);
      BOOST_TEST(all_ranks(all_same(on, off)), "op " << fc::name_of(o) << (early ? " launched when full" : ""));
      BOOST_TEST(all_ranks(all_same(on, subgroup_reference<T>(this_host(), o))), "op " << fc::name_of(o));
    }
  }
}

// Two members (world split by rank parity), each over shared memory of its own: nothing mixes.
BOOST_AUTO_TEST_CASE(two_members_never_mix) {
  const int rank = world().rank();
  auto member = world().split(rank % 2, rank, fc::cat("member ", rank % 2));
  for (fc::op o : {fc::op::sum, fc::op::avg, fc::op::max}) {
    fc::sync_options options;
    options.op = o;
    options.bucket_bytes = 1000;
    options.shared_memory_slot_bytes = 512;
    bool used = false;
    const auto got = run_subgroup<float>(member, options, used);
    // Across simulated hosts the parity members span hosts: the backend's allreduce then.
    BOOST_TEST(used == shm_possible(member));
    BOOST_TEST(all_ranks(all_same(got, subgroup_reference<float>(member, o))), "op " << fc::name_of(o));
  }
}

// A member that pretends to span two hosts does not take the path (auto), and refuses on; one
// pretend host takes it.
BOOST_AUTO_TEST_CASE(pretended_hosts_decide) {
  const int n = world().size();
  fc::sync_options options;
  options.op = fc::op::sum;
  options.hierarchical = fc::hierarchy::off;
  if (n > 1) {
    pretend_hosts pretend(fc::cat("1+", n - 1));
    bool used = true;
    const auto got = run_subgroup<double>(world(), options, used);
    BOOST_TEST(!used);
    BOOST_TEST(all_ranks(all_same(got, subgroup_reference<double>(world(), options.op))));
    options.shared_memory = fc::shared_memory_use::on;
    const auto message = error_of([&] { fc::subgroup_allreduce<mpi> sync(world(), options); });
    BOOST_TEST(all_ranks(contains(message, "spans 2 hosts")), message);
    options.shared_memory = fc::shared_memory_use::automatic;
  }
  {
    pretend_hosts pretend(std::to_string(n));
    bool used = false;
    const auto got = run_subgroup<double>(world(), options, used);
    BOOST_TEST(used == shm_possible(world()));  // a pretended host that is really several: off
    BOOST_TEST(all_ranks(all_same(got, subgroup_reference<double>(world(), options.op))));
  }
}

// The choice and the op must agree across the member; FLEXCOMM_SHM parses auto, on, off only.
BOOST_AUTO_TEST_CASE(settings_and_agreement) {
  setenv("FLEXCOMM_SHM", "sometimes", 1);
  BOOST_TEST(contains(error_of([] { fc::shared_memory_from_env(); }), "expected auto, on or off"));
  setenv("FLEXCOMM_SHM", "off", 1);
  BOOST_TEST((fc::shared_memory_from_env() == fc::shared_memory_use::off));
  BOOST_TEST((fc::sync_options().shared_memory == fc::shared_memory_use::off));
  unsetenv("FLEXCOMM_SHM");
  BOOST_TEST((fc::shared_memory_from_env() == fc::shared_memory_use::automatic));
  if (world().size() > 1) {
    fc::sync_options options;
    options.shared_memory = world().rank() == 0 ? fc::shared_memory_use::off : fc::shared_memory_use::automatic;
    const auto message = error_of([&] { fc::subgroup_allreduce<mpi> sync(world(), options); });
    BOOST_TEST(all_ranks(contains(message, "FLEXCOMM_SHM")), message);
    options = {};
    options.op = world().rank() == 0 ? fc::op::sum : fc::op::avg;
    const auto op_message = error_of([&] { fc::subgroup_allreduce<mpi> sync(world(), options); });
    BOOST_TEST(all_ranks(contains(op_message, "sync_options.op differs")), op_message);
  }
}

// A window /dev/shm has no room for: an error on every rank of the host, naming the cause and the
// way out, when it is made; never a mapping whose first write dies of SIGBUS. Rank 0 asks for
// more than the whole of /dev/shm, the others for a page.
BOOST_AUTO_TEST_CASE(window_larger_than_dev_shm_is_an_error_on_every_rank) {
  const auto& host = this_host();
  struct statvfs shm {};
  BOOST_TEST_REQUIRE(statvfs("/dev/shm", &shm) == 0);
  const std::size_t whole = static_cast<std::size_t>(shm.f_blocks) * shm.f_frsize;
  const std::size_t mine = host.rank() == 0 ? whole + (std::size_t{1} << 20) : 4096;
  const auto message = error_of([&] { mpi::host_window window(host, mine, "too large a window"); });
  BOOST_TEST(contains(message, "too large a window"), message);
  BOOST_TEST(contains(message, "could not make a shared-memory file"), message);
  BOOST_TEST(contains(message, "FLEXCOMM_SHM=off"), message);
  // The next window is made as usual.
  mpi::host_window fine(host, 4096, "a window after it");
  BOOST_TEST(static_cast<bool>(fine));
}

// A rank that never arrives: the others' wait becomes a flexcomm::error after the timeout, naming
// the operation, the waiting rank and the rank that had not arrived.
// Both paths: the large one (small threshold 0) and the one-round small one. Over this rank's
// host; a rank alone on its host (the 2+1+2 cluster layout) only joins the world-wide verdicts.
BOOST_AUTO_TEST_CASE(timeout_names_who_did_not_arrive) {
  const auto& host = this_host();
  const int n = host.size();
  const bool alone = n < 2;
  // Timeouts name world ranks: the host's last rank by its world rank, then its rank on the host.
  int last = n - 1, last_in_world = -1;
  MPI_Group on_host = MPI_GROUP_NULL, everyone = MPI_GROUP_NULL;
  MPI_Comm_group(host.native(), &on_host);
  MPI_Comm_group(MPI_COMM_WORLD, &everyone);
  MPI_Group_translate_ranks(on_host, 1, &last, everyone, &last_in_world);
  MPI_Group_free(&on_host);
  MPI_Group_free(&everyone);
  for (const std::size_t small : {std::size_t{0}, std::size_t{4096}}) {
    mpi::host_reducer reducer(host, 4096, small);
    reducer.set_timeout(std::chrono::milliseconds{300});
    std::vector<float> data(100, 1.0f);
    std::string message = alone ? "timed out (alone on its host)" : "";
    if (!alone && host.rank() != n - 1) {
      message = error_of([&] { reducer.allreduce(data.data(), data.size(), fc::op::sum); });
      BOOST_TEST(contains(message, fc::cat("rank ", host.rank())), message);
      BOOST_TEST(contains(message, fc::cat("not arrived: world rank ", last_in_world, " (rank ", n - 1, ", at step")),
                 message);
      BOOST_TEST(contains(message, "shared-memory allreduce"), message);
    }
    MPI_Barrier(host.native());
    if (!alone && host.rank() == n - 1) {
      // Late: on the large path its peers gave up after copying in, so it times out one stage
      // later; on the small path everything it needs is there, and it finishes.
      message = error_of([&] { reducer.allreduce(data.data(), data.size(), fc::op::sum); });
      if (small == 0) BOOST_TEST(contains(message, "timed out"), message);
      if (small != 0) BOOST_TEST(message.empty(), message);
    }
    if (small == 0) BOOST_TEST(all_ranks(contains(message, "timed out")));
    if (!alone) {
      // The ranks that timed out refuse further use; the late one finds its peers gone.
      const auto next = error_of([&] { reducer.allreduce(data.data(), data.size(), fc::op::sum); });
      BOOST_TEST((contains(next, "unusable") || contains(next, "timed out")), next);
    }
    MPI_Barrier(host.native());
  }
}

// In place: data that lies in the reducer's own shared memory (allocate) at the same offset on
// every rank, reduced with nothing copied in or out. Every type and op, the sizes above at offsets
// that are not cache-line aligned, three steps, each in-place task between two slot tasks on the
// same segment (the steps they take interleave), every other one carrying words that are
// max-reduced in its round: equal to the exact reference.
BOOST_AUTO_TEST_CASE_TEMPLATE(in_place_allreduce_equals_the_reference, T, element_types) {
  mpi::host_reducer reducer(this_host(), 1000, 256);
  const auto ranks = world_ranks_of(this_host());
  const int me = world().rank();
  const auto sizes = sizes_for(this_host().size(), reducer.slot_bytes() / sizeof(T));
  const std::size_t most = *std::max_element(sizes.begin(), sizes.end());
  const fc::span<std::byte> memory = reducer.allocate((most + 8) * sizeof(T));
  BOOST_TEST(memory.size() == (most + 8) * sizeof(T));
  BOOST_TEST(reducer.holds(memory.data(), memory.size()));
  BOOST_TEST(!reducer.holds(memory.data(), memory.size() + 1));
  T* const placed = reinterpret_cast<T*>(memory.data());
  bool ok = true;
  std::string detail;
  for (int step = 0; step < 3; ++step)
    for (fc::op o : all_ops)
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        const std::size_t n = sizes[i], at = i % 8;
        auto before = gradient<T>(me, step, 100 + static_cast<int>(i), 300);
        reducer.allreduce(before.data(), before.size(), o);
        const auto mine = gradient<T>(me, step, static_cast<int>(i), n);
        std::copy(mine.begin(), mine.end(), placed + at);
        // Every other one carries words, max-reduced in its round (the sync core's step check).
        const int h = this_host().rank();
        std::vector<std::int64_t> words{h == step % this_host().size() ? 1000 + step : h, -h, 7};
        const bool carrying = i % 2 == 1 && n > 0;
        if (carrying)
          reducer.allreduce_in_place_carrying(placed + at, n, o, fc::span<std::int64_t>(words));
        else
          reducer.allreduce_in_place(placed + at, n, o);
        if (carrying && !(words[0] == 1000 + step && words[1] == 0 && words[2] == 7)) {
          ok = false;
          detail = fc::cat("step ", step, " carried words ", words[0], " ", words[1], " ", words[2]);
        }
        auto after = gradient<T>(me, step, 200 + static_cast<int>(i), 3 * 1000 / sizeof(T));
        reducer.allreduce(after.data(), after.size(), o);
        const std::vector<T> got(placed + at, placed + at + n);
        if (!same(got, reference<T>(o, ranks, step, static_cast<int>(i), n)) ||
            !same(before, reference<T>(o, ranks, step, 100 + static_cast<int>(i), 300)) ||
            !same(after, reference<T>(o, ranks, step, 200 + static_cast<int>(i), after.size()))) {
          ok = false;
          detail = fc::cat("step ", step, " op ", fc::name_of(o), " ", n, " elements at ", at);
        }
      }
  BOOST_TEST(all_ranks(ok), detail);
}

// In-place misuse is an error on every rank before anything is written: one rank's data outside
// the shared memory, or at another offset; sizes asked for that differ.
// A trainer's own vector registered (register_range: its whole pages made shared where they
// lie), at another misalignment on each rank: three steps of every op, equal to the reference; a
// step handed another vector on one rank goes through the slots on every rank (fell_back), still
// exact. A rank that never arrives: the others time out naming it, as on the other paths (a
// rank alone on its host only joins the verdicts).
BOOST_AUTO_TEST_CASE(registered_vectors_equal_the_reference_and_time_out_by_name) {
  const auto& host = this_host();
  const int n = host.size(), me = world().rank();
  const auto ranks = world_ranks_of(host);
  mpi::host_reducer reducer(host, 4096, 256);
  const std::size_t count = 9000;
  std::vector<float> own(count + 16), other(count);
  float* const data = own.data() + host.rank() % 4;  // 0, 4, 8 or 12 bytes further
  const auto r = reducer.register_range(data, count);
  BOOST_TEST(all_ranks(r != nullptr));
  bool ok = r != nullptr;
  for (const fc::op o : {fc::op::sum, fc::op::max, fc::op::avg})
    for (int step = 0; ok && step < 4; ++step) {
      float* g = step == 2 && host.rank() == n - 1 ? other.data() : data;  // not the registered memory
      const auto values = gradient<float>(me, step, 0, count);
      std::copy(values.begin(), values.end(), g);
      reducer.allreduce_registered(g, count, o, r);
      ok = ok && same(std::vector<float>(g, g + count), reference<float>(o, ranks, step, 0, count));
      ok = ok && mpi::host_reducer::fell_back(r) == (step == 2);
    }
  BOOST_TEST(all_ranks(ok));
  reducer.set_timeout(std::chrono::milliseconds{300});
  std::string message = n > 1 ? "" : "timed out (alone on its host)";
  if (n > 1 && host.rank() != n - 1) {
    message = error_of([&] { reducer.allreduce_registered(data, count, fc::op::sum, r); });
    BOOST_TEST(contains(message, "shared-memory allreduce"), message);
    BOOST_TEST(contains(message, fc::cat("not arrived: world rank ", ranks.back(), " (rank ", n - 1, ", at step")),
               message);
  }
  MPI_Barrier(host.native());
  if (n > 1 && host.rank() == n - 1) message = error_of([&] { reducer.allreduce_registered(data, count, fc::op::sum, r); });
  BOOST_TEST(all_ranks(contains(message, "timed out")));
  MPI_Barrier(host.native());
}

BOOST_AUTO_TEST_CASE(in_place_misuse_is_an_error_on_every_rank) {
  const auto& host = this_host();
  const int last = host.size() - 1, last_in_world = host.world_rank_of(last);
  {
    mpi::host_reducer reducer(host, 4096, 256);
    const auto memory = reducer.allocate(4096);
    std::vector<float> elsewhere(100, 1.0f);
    float* data = host.rank() == last ? elsewhere.data() : reinterpret_cast<float*>(memory.data());
    const std::string e = error_of([&] { reducer.allreduce_in_place(data, 100, fc::op::sum); });
    const std::string named = host.rank() == last ? "does not lie in the shared memory allocated"
                                                  : fc::cat("world rank ", last_in_world, " (rank ", last, ")'s data does not lie");
    BOOST_TEST(contains(e, named), e);
    BOOST_TEST(contains(e, "shared-memory allreduce"), e);
    const std::string next = error_of([&] { reducer.allreduce(elsewhere.data(), 10, fc::op::sum); });
    BOOST_TEST(contains(next, "unusable"), next);
  }
  if (host.size() > 1) {
    mpi::host_reducer reducer(host, 4096, 256);
    const auto memory = reducer.allocate(4096);
    float* data = reinterpret_cast<float*>(memory.data()) + (host.rank() == last ? 16 : 0);
    std::fill(data, data + 100, 7.0f);
    const std::string e = error_of([&] { reducer.allreduce_in_place(data, 100, fc::op::sum); });
    BOOST_TEST(contains(e, "every rank must place the same data at the same offset"), e);
    BOOST_TEST(std::count(data, data + 100, 7.0f) == 100);  // nobody wrote
  }
  if (host.size() > 1) {
    mpi::host_reducer reducer(host, 4096, 256);
    const std::string e = error_of([&] { reducer.allocate(host.rank() == last ? 8192 : 4096); });
    BOOST_TEST(contains(e, "every rank must ask for the same size"), e);
  }
  MPI_Barrier(host.native());
}

// The broadcast task (hierarchical averaging's intra-host stage 3): every rank ends with the
// root's bits, from every root, at every size (0, below the rank count, several slots), for every
// element type; interleaved with allreduces on the same reducer, whose slots it shares.
BOOST_AUTO_TEST_CASE_TEMPLATE(broadcast_from_every_root_gives_the_roots_bits, T, element_types) {
  const auto& host = this_host();
  bool ok = true;
  std::string detail;
  if (shm_possible(host)) {  // a rank alone on its host (the cluster suite) has nothing to share
    mpi::host_reducer reducer(host, 256, 64);
    const auto sizes = sizes_for(host.size(), reducer.slot_bytes() / sizeof(T));
    for (int root = 0; root < host.size(); ++root)
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        const std::size_t n = sizes[i];
        auto data = gradient<T>(host.rank(), 1, static_cast<int>(i), n);
        const auto expected = gradient<T>(root, 1, static_cast<int>(i), n);
        auto other = gradient<T>(host.rank(), 2, static_cast<int>(i), n);
        auto summed = other;
        mpi::iallreduce(host, fc::span<T>(summed), fc::op::max).wait();
        auto task = reducer.start_broadcast(data.data(), n, root);
        auto after = reducer.start(other.data(), n, fc::op::max);
        fc::default_wait().until([&] { return task->poll() && after->poll(); });
        if (!bits_equal(data.data(), expected.data(), n * sizeof(T)) || !same(other, summed)) {
          ok = false;
          detail = fc::cat("root ", root, " size ", n);
        }
      }
  }
  BOOST_TEST(all_ranks(ok), detail);
}
