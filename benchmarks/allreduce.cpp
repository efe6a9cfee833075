// allreduce: an nccl-tests style sweep of flexcomm's two Sync adapters (one gradient, one bucket,
// reduced in place) against MPI_Allreduce on the same buffers, in the same run.
//   mpiexec -n 4 build/benchmarks/allreduce -b 4K -e 64M -f 2 -n 20 -w 5 -c 1 -j allreduce.json
// --hierarchical 1 adds both adapters averaging hierarchically (reduce in each host, across the
// host leaders, broadcast in each host) beside the flat ones: the comparison across hosts.
// "subgroup_allreduce" is the backend's allreduce (shared memory off); "subgroup_allreduce shm"
// is the same adapter with sync_options.shared_memory automatic, i.e. through one shared-memory
// segment when the world is on one host (its flat allreduce otherwise).
// "overlapped_ring shm" likewise, its buckets driven by the progress engine. When the world is on
// one host two limits are measured in the same run: "probe", the plainest shared-memory
// allreduce (every rank's data already in one shared mapping; each reduces its 1/N share in place,
// then copies the others' shares; flags between the halves, no chunks, nothing copied in or out),
// and "memcpy", one core copying the buffer once. "subgroup_allreduce shm in place" (last) is
// subgroup_allreduce shm with the gradient in its gradient_memory(): in shared memory, reduced
// where it lies (on one host; elsewhere, ordinary memory and the adapter's usual route).
// busbw = algbw * 2(n-1)/n (nccl-tests' allreduce factor).
#include <boost/program_options.hpp>

#include <flexcomm/flexcomm.hpp>

#include "../examples/common/counts.hpp"
#include "flags.hpp"

#include <algorithm>
#include <cstdint>
#include <new>
#include <cstring>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

namespace fc = flexcomm;
namespace po = boost::program_options;
using fc::mpi;

namespace {

struct result {
  double time_us = 0, algbw = 0, busbw = 0;
  long wrong = 0;
};

fc::dtype parse_type(const std::string& t) {
  for (fc::dtype d : {fc::dtype::f32, fc::dtype::f64, fc::dtype::i32, fc::dtype::i64, fc::dtype::u8, fc::dtype::f16,
                      fc::dtype::bf16})
    if (t == fc::name_of(d)) return d;
  fc::fail("allreduce", "-d: expected float, double, int32, int64, uint8, half or bfloat16, got '" + t + "'");
}

fc::op parse_op(const std::string& o) {
  for (fc::op x : {fc::op::sum, fc::op::prod, fc::op::min, fc::op::max, fc::op::avg})
    if (o == fc::name_of(x)) return x;
  fc::fail("allreduce", "-o: expected sum, prod, min, max or avg, got '" + o + "'");
}

// Small integers: every op stays exact in every type, so -c counts real errors.
template <class T>
void fill(fc::span<T> buf, int rank) {
  for (std::size_t i = 0; i < buf.size(); ++i)
    buf[i] = T(static_cast<float>((static_cast<std::size_t>(rank) + i) % 3 + 1));
}

template <class T>
long count_wrong(fc::span<T> got, fc::op o, int ranks) {
  std::vector<T> want(got.size()), other(got.size());
  fill(fc::span<T>(want), 0);
  for (int r = 1; r < ranks; ++r) {
    fill(fc::span<T>(other), r);
    fc::combine(o, want.data(), other.data(), want.size());
  }
  if (o == fc::op::avg) fc::divide_by(want.data(), want.size(), ranks);
  long wrong = 0;
  for (std::size_t i = 0; i < got.size(); ++i) wrong += static_cast<double>(got[i]) != static_cast<double>(want[i]);
  return wrong;
}

double max_over_ranks(const mpi::communicator& comm, double v) {
  MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_DOUBLE, MPI_MAX, comm.native());
  return v;
}

// Runs `once` w times, then n timed times; time is the slowest rank's mean.
template <class T>
result measure(const mpi::communicator& comm, fc::span<T> buf, fc::op o, int warmup, int iters, bool check,
               const std::function<void()>& once) {
  result r;
  fill(buf, comm.rank());
  for (int i = 0; i < warmup; ++i) once();
  if (check) {
    fill(buf, comm.rank());
    once();
    long wrong = count_wrong(buf, o, comm.size());
    MPI_Allreduce(MPI_IN_PLACE, &wrong, 1, MPI_LONG, MPI_SUM, comm.native());
    r.wrong = wrong;
  }
  fill(buf, comm.rank());
  MPI_Barrier(comm.native());
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) once();
  const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() / iters;
  r.time_us = max_over_ranks(comm, us);
  const double bytes = static_cast<double>(buf.size() * sizeof(T));
  r.algbw = bytes / r.time_us / 1e3;  // GB/s
  const double n = comm.size();
  r.busbw = r.algbw * 2.0 * (n - 1) / n;
  return r;
}

// The limit the shared-memory path is held against (see the top): the world's ranks on one host,
// each one's data in its region of one shared window.
template <class T>
class shm_probe {
 public:
  shm_probe(const mpi::communicator& world, std::size_t count) : rank_(world.rank()), ranks_(world.size()), count_(count) {
    MPI_Comm_split_type(world.native(), MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &host_);
    int on_host = 0;
    MPI_Comm_size(host_, &on_host);
    one_host_ = on_host == ranks_;
    if (!one_host_) return;
    const std::size_t bytes = 64 + std::max<std::size_t>(count, 1) * sizeof(T);
    void* mine = nullptr;
    MPI_Win_allocate_shared(static_cast<MPI_Aint>(bytes), 1, MPI_INFO_NULL, host_, &mine, &window_);
    new (mine) std::atomic<std::uint64_t>(0);
    for (int r = 0; r < ranks_; ++r) {
      MPI_Aint size = 0;
      int unit = 0;
      void* base = nullptr;
      MPI_Win_shared_query(window_, r, &size, &unit, &base);
      regions_.push_back(static_cast<std::byte*>(base));
    }
    MPI_Barrier(host_);
  }
  ~shm_probe() {
    if (window_ != MPI_WIN_NULL) MPI_Win_free(&window_);
    MPI_Comm_free(&host_);
  }
  bool usable() const { return one_host_; }
  fc::span<T> mine() const { return {data(rank_), count_}; }

  void allreduce(fc::op o) {
    const std::size_t share = (count_ + static_cast<std::size_t>(ranks_) - 1) / static_cast<std::size_t>(ranks_);
    const auto lo = [&](int r) { return std::min(count_, share * static_cast<std::size_t>(r)); };
    const auto hi = [&](int r) { return std::min(count_, lo(r) + share); };
    arrive();
    T* out = data(rank_) + lo(rank_);
    for (int r = 0; r < ranks_; ++r)
      if (r != rank_) fc::combine(o, out, data(r) + lo(rank_), hi(rank_) - lo(rank_));
    if (o == fc::op::avg) fc::divide_by(out, hi(rank_) - lo(rank_), ranks_);
    arrive();
    for (int r = 0; r < ranks_; ++r)
      if (r != rank_) std::memcpy(data(rank_) + lo(r), data(r) + lo(r), (hi(r) - lo(r)) * sizeof(T));
    arrive();  // nobody changes its data for the next call while a peer still copies from it
  }

 private:
  T* data(int r) const { return reinterpret_cast<T*>(regions_[static_cast<std::size_t>(r)] + 64); }
  std::atomic<std::uint64_t>& flag(int r) const {
    return *std::launder(reinterpret_cast<std::atomic<std::uint64_t>*>(regions_[static_cast<std::size_t>(r)]));
  }
  void arrive() {
    flag(rank_).store(++epoch_, std::memory_order_release);
    fc::default_wait().until([&] {
      for (int r = 0; r < ranks_; ++r)
        if (flag(r).load(std::memory_order_acquire) < epoch_) return false;
      return true;
    });
  }

  int rank_, ranks_;
  std::size_t count_;
  MPI_Comm host_ = MPI_COMM_NULL;
  MPI_Win window_ = MPI_WIN_NULL;
  bool one_host_ = false;
  std::vector<std::byte*> regions_;
  std::uint64_t epoch_ = 0;
};

}  // namespace

int main(int argc, char** argv) {
  fc::environment env(argc, argv);
  const auto& world = env.world();
  std::string type_name, op_name, json;
  std::size_t lo = 0, hi = 0, segment = 0, shm_slot = 0;
  double factor = 2;
  int iters = 20, warmup = 5, check = 1, lanes = 2, tiers = 0;
  po::options_description opts("allreduce (nccl-tests flags)");
  opts.add_options()("help,h", "this help")
      ("minbytes,b", benchmark_flags::bytes(&lo, "4K"), "smallest size")
      ("maxbytes,e", benchmark_flags::bytes(&hi, "64M"), "largest size")
      ("stepfactor,f", benchmark_flags::above_one(&factor), "size multiplier")
      ("iters,n", counts::at_least<1>(&iters), "timed iterations")
      ("warmup_iters,w", counts::at_least<0>(&warmup), "warmup iterations (the first plans the bucket)")
      ("check,c", counts::at_least<0>(&check), "check results (#wrong)")
      ("datatype,d", po::value(&type_name)->default_value("float"), "float double int32 int64 uint8 half bfloat16")
      ("op,o", po::value(&op_name)->default_value("sum"), "sum prod min max avg")
      ("segment,s", benchmark_flags::bytes(&segment, "1M"), "overlapped_ring segment bytes")
      ("lanes,l", counts::at_least<1>(&lanes), "overlapped_ring segments in flight")
      ("shm_slot,S", benchmark_flags::bytes(&shm_slot, "1M"), "the shm columns: bytes of each rank's slot")
      ("hierarchical,H", counts::at_least<0>(&tiers),
       "1: also both adapters forced hierarchical (the flat ones forced flat)")
      ("json,j", po::value(&json), "write results as JSON here (rank 0)");
  if (const auto status = benchmark_flags::parse(argc, argv, opts, world.rank())) return *status;
  fc::dtype type{};
  fc::op o{};
  try {  // the same on every rank: rank 0 says why
    type = parse_type(type_name);
    o = parse_op(op_name);
  } catch (const fc::error& e) {
    if (world.rank() == 0) std::cerr << e.what() << "\n";
    return 2;
  }
  const bool root = world.rank() == 0;
  std::vector<std::string> names{"MPI_Allreduce",   "subgroup_allreduce",  "subgroup_allreduce shm",
                                 "overlapped_ring", "overlapped_ring shm", "probe",
                                 "memcpy"};
  std::vector<std::string> labels{"", "subgroup", "sub-shm", "ring", "ring-shm", "probe", "memcpy"};
  if (tiers) {
    names.insert(names.end(), {"subgroup_allreduce hier", "overlapped_ring hier"});
    labels.insert(labels.end(), {"sub-hier", "ring-hier"});
  }
  names.push_back("subgroup_allreduce shm in place");
  labels.push_back("sub-place");
  const std::size_t impls = names.size();
  const auto hosts = fc::hosts_of(world);  // collective
  if (root) {
    std::printf("# flexcomm allreduce on %s: %d ranks on %d host(s) (%s), %d per node, wait %s, in place, segment %zuK x %d "
                "in flight\n", fc::mpi_implementation::name, world.size(), hosts.hosts(), hosts.str().c_str(),
                env.ranks_on_node(), fc::name_of(env.wait().kind),
                segment >> 10, lanes);
    std::printf("# %10s %12s %8s %6s %5s |", "size", "count", "type", "redop", "root");
    for (const auto& n : names) std::printf(" %-39s |", n.c_str());
    std::printf(" busbw ratio vs MPI\n");
    std::printf("# %10s %12s %8s %6s %5s |", "(B)", "(elements)", "", "", "");
    for (std::size_t i = 0; i < impls; ++i) std::printf(" %9s %8s %8s %7s  |", "time(us)", "algbw", "busbw", "#wrong");
    for (std::size_t i = 1; i < impls; ++i) std::printf(" %9s", labels[i].c_str());
    std::printf("\n");
  }
  std::string records;
  std::vector<double> sum_busbw(impls, 0.0);
  int rows = 0;
  bool shm_used = false;
  fc::visit_dtype(type, [&](auto element) {
    using T = decltype(element);
    for (double size = static_cast<double>(lo); size <= static_cast<double>(hi) * 1.0000001; size *= factor) {
      const std::size_t count = std::max<std::size_t>(1, static_cast<std::size_t>(size) / sizeof(T));
      const std::size_t bytes = count * sizeof(T);
      std::vector<T> buf(count);
      fc::sync_options options;
      options.op = o;
      options.bucket_bytes = bytes;
      options.segment_bytes = segment;
      options.segments_in_flight = lanes;
      // Without -H the adapters choose as a user's would (FLEXCOMM_HIERARCHICAL, else automatic).
      if (tiers) options.hierarchical = fc::hierarchy::off;
      options.shared_memory = fc::shared_memory_use::automatic;
      options.shared_memory_slot_bytes = shm_slot;
      fc::subgroup_allreduce<mpi> subgroup_shm(world, options);
      fc::overlapped_ring<mpi> ring_shm(world, options);
      fc::subgroup_allreduce<mpi> subgroup_placed(world, options);
      const auto placed_memory = subgroup_placed.gradient_memory(bytes);
      const fc::span<T> placed(reinterpret_cast<T*>(placed_memory.data()), count);
      shm_used = subgroup_shm.shared_memory();
      options.shared_memory = fc::shared_memory_use::off;
      shm_probe<T> probe(world, count);
      std::vector<T> copy(count);
      fc::subgroup_allreduce<mpi> subgroup(world, options);
      fc::overlapped_ring<mpi> ring(world, options);
      std::optional<fc::subgroup_allreduce<mpi>> subgroup_tiers;
      std::optional<fc::overlapped_ring<mpi>> ring_tiers;
      if (tiers) {
        options.hierarchical = fc::hierarchy::on;
        subgroup_tiers.emplace(world, options);
        ring_tiers.emplace(world, options);
      }
      const MPI_Datatype mt = fc::detail::mpi_type(fc::dtype_of<T>);
      const MPI_Op mo = fc::detail::mpi_op(o, fc::dtype_of<T>);
      auto through = [&](auto& sync) {
        return [&] {
          sync.ready(0, fc::span<T>(buf));
          sync.finish();
        };
      };
      std::vector<std::function<void()>> once{
          [&] {
            MPI_Allreduce(MPI_IN_PLACE, buf.data(), static_cast<int>(count), mt, mo, world.native());
            if (o == fc::op::avg) fc::divide_by(buf.data(), count, world.size());
          },
          through(subgroup), through(subgroup_shm), through(ring), through(ring_shm)};
      if (tiers) {
        once.push_back(through(*subgroup_tiers));
        once.push_back(through(*ring_tiers));
      }
      std::vector<result> r;
      for (const auto& f : once) r.push_back(measure(world, fc::span<T>(buf), o, warmup, iters, check, f));
      // The limits: the probe on its own shared buffers; a copy, timed alone, by every rank at
      // once (as the ranks' copies run in the allreduces).
      r.insert(r.begin() + 5, probe.usable() ? measure(world, probe.mine(), o, warmup, iters, check, [&] { probe.allreduce(o); })
                                             : result{});
      result copied = measure(world, fc::span<T>(buf), o, warmup, iters, false,
                              [&] { std::memcpy(copy.data(), buf.data(), bytes); });
      copied.busbw = copied.algbw;  // one pass over the buffer: no bus factor
      r.insert(r.begin() + 6, copied);
      r.push_back(measure(world, placed, o, warmup, iters, check, [&] {
        subgroup_placed.ready(0, placed);
        subgroup_placed.finish();
      }));
      if (root) {
        std::printf("  %10zu %12zu %8s %6s %5s |", bytes, count, fc::name_of(type), fc::name_of(o), "-1");
        for (auto& x : r) std::printf(" %9.1f %8.3f %8.3f %7ld  |", x.time_us, x.algbw, x.busbw, x.wrong);
        for (std::size_t i = 1; i < impls; ++i) std::printf(" %9.2f", r[0].busbw > 0 ? r[i].busbw / r[0].busbw : 0.0);
        std::printf("  shm/probe %5.2f", r[5].busbw > 0 ? r[2].busbw / r[5].busbw : 0.0);
        std::printf("  in-place/probe %5.2f", r[5].busbw > 0 ? r.back().busbw / r[5].busbw : 0.0);
        std::printf("\n");
        std::fflush(stdout);
        for (std::size_t i = 0; i < impls; ++i) {
          sum_busbw[i] += r[i].busbw;
          records += fc::cat(records.empty() ? "" : ",\n", "  {\"impl\": \"", names[i], "\", \"size\": ", bytes,
                             ", \"count\": ", count, ", \"type\": \"", fc::name_of(type), "\", \"redop\": \"",
                             fc::name_of(o), "\", \"ranks\": ", world.size(), ", \"time_us\": ", r[i].time_us,
                             ", \"algbw\": ", r[i].algbw, ", \"busbw\": ", r[i].busbw, ", \"wrong\": ", r[i].wrong,
                             ", \"busbw_ratio_vs_mpi\": ", r[i].busbw / r[0].busbw, ", \"busbw_ratio_vs_probe\": ",
                             r[5].busbw > 0 ? r[i].busbw / r[5].busbw : 0.0, "}");
        }
      }
      ++rows;
    }
    return 0;
  });
  if (root) {
    std::printf("# Avg bus bandwidth:");
    for (std::size_t i = 0; i < impls; ++i) std::printf(" %s %.3f GB/s;", names[i].c_str(), sum_busbw[i] / std::max(rows, 1));
    std::printf("\n# subgroup_allreduce shm went through shared memory: %s\n", shm_used ? "yes" : "no");
    if (!json.empty()) {
      std::ofstream out(json);
      out << "{\"benchmark\": \"allreduce\", \"ranks\": " << world.size() << ", \"segment_bytes\": " << segment
          << ", \"lanes\": " << lanes << ", \"results\": [\n" << records << "\n]}\n";
      fc::check(static_cast<bool>(out), "allreduce", "cannot write " + json);
    }
  }
  return 0;
}
