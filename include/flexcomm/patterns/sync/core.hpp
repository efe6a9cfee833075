// The sync core: what subgroup_allreduce and overlapped_ring are. It keeps the bucket plan and
// the step's bookkeeping behind ready()/finish(), picks a member's route once, and starts each
// bucket on it: the flat route the adapter names, shared memory, or hierarchical tiers.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <string>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

#include "../../backend/contract.hpp"
#include "../../core/agreement.hpp"
#include "../../core/cache_line.hpp"
#include "../../core/datatype.hpp"
#include "../../core/error.hpp"
#include "../../core/hosts.hpp"
#include "../../core/reduce.hpp"
#include "../../core/span.hpp"
#include "../../core/trace.hpp"
#include "bucket_plan.hpp"
#include "flight.hpp"
#include "options.hpp"
#include "route_hierarchical.hpp"
#include "route_shared_memory.hpp"
#include "step_capture.hpp"
#include "step_check.hpp"

namespace flexcomm::detail {

// `Flat` is the route a member takes where neither shared memory nor hierarchical tiers apply,
// and the one across the host leaders where tiers do (route_allreduce.hpp, route_ring.hpp).
// Called from one trainer thread.
template <class B, class Flat>
class sync_core {
 public:
  // Collective over `member` (the member's own communicator); traffic goes on private duplicates.
  // `who` names the adapter in errors and communicator names; `launch_early`: a bucket starts as
  // soon as it fills (in bucket-index order) and the engine drives it, instead of in finish().
  sync_core(const typename B::communicator& member, const sync_options& options, const char* who, bool launch_early)
      : comm_(member.dup(cat(member.name(), " ", who))),
        options_(options),
        tiers_(comm_, options_, Flat::algorithm, who),
        control_(control_channel<B>::make(member, cat(member.name(), " ", who, " control"))),
        who_(who),
        step_calls_{cat(who, ": ready"), cat(who, ": finish")},
        launch_early_(launch_early),
        flat_(options_),
        plan_(options_.bucket_bytes) {
    check(options_.bucket_bytes > 0, who_, "sync_options.bucket_bytes must be positive");
    Flat::check_options(options_, who_);
    shared_.setup(comm_, tiers_.hosts(), tiers_.enabled(), options_, who_);
    route_ = tiers_.enabled() ? route::hierarchical : shared_ ? route::shared_memory : route::flat;
  }
  sync_core(const sync_core&) = delete;
  sync_core& operator=(const sync_core&) = delete;
  // A bucket may still be travelling (the trainer threw mid-step): it writes into buffers that
  // must outlive it, and goes on communicators that must too.
  ~sync_core() { drain(); }

  // Gradient `index` is final: it joins its bucket (the average lands here by finish()).
  template <class T>
  void ready(int index, span<T> grad) {
    static_assert(is_element_v<T>, "ready(): gradients must be float, double, int32, int64, uint8, half or bfloat16");
    static_assert(!std::is_const_v<T>, "ready(): the average is written back into the gradient");
    if (sequence_.handed == 0) begin_step(step_calls_[0]);
    const dtype type = dtype_of<T>;
    step_hash_.add(static_cast<std::uint64_t>(index)).add(static_cast<std::uint64_t>(type)).add(grad.size());
    sequence_.add(index, grad.size());
    if (planning_) {
      if (!planned_.insert(index).second) return misuse(cat("gradient ", index, " handed over twice in one step"));
      plan_.add(index, type, grad.size());
      pointers_.push_back(grad.data());
      return;
    }
    const auto* g = plan_.find(index);
    if (!g) return misuse(cat("gradient ", index, " is not in the bucket plan fixed at the first step"));
    if (g->type != type || g->count != grad.size())
      return misuse(cat("gradient ", index, " is ", grad.size(), " x ", name_of(type), " but was ", g->count, " x ",
                        name_of(g->type), " at the first step"));
    const std::size_t pos = plan_.position(*g);
    if (pointers_[pos]) return misuse(cat("gradient ", index, " handed over twice in one step"));
    pointers_[pos] = grad.data();
    ++arrived_[static_cast<std::size_t>(g->bucket)];
    if (launch_early_) launch_full();
  }

  // Memory for gradients, collective over the member (the same `bytes` on every rank): where the
  // buckets go through one host's shared memory it lies there, and a bucket whose one gradient
  // lies in it (at the same offset on every rank, as identical code places it) is reduced where
  // it lies, with nothing copied in or out (DDP's gradient_as_bucket_view, NCCL's registered
  // buffers). On every other route it is the backend's ordinary memory (device memory on a device
  // backend): trainer code that places its gradients here runs unchanged on any Sync. Lives as
  // long as the adapter; write it before reading it. Between steps only (an error mid-step).
  span<std::byte> gradient_memory(std::size_t bytes) {
    const std::string who = cat(who_, ": gradient_memory");
    // Refused before any collective: identical trainer code calls it at the same point on every
    // rank, so every rank fails alike (a rank alone here leaves its peers to their timeout).
    check(sequence_.handed == 0, who,
          cat("called mid-step, after ", sequence_.handed, " gradient(s) were handed over and before finish(); call ",
              "it between steps (it is collective over the member, and this step's buckets may be in flight)"));
    if (route_ == route::shared_memory) return shared_.allocate(bytes);
    agreement same({static_cast<std::int64_t>(bytes)});
    control_channel<B>::backend::iallreduce(control_, same.buffer(), op::max).wait();  // host memory
    check(same.agreed(0), who, cat("every rank must ask for the same size; this rank asked for ", bytes, " bytes"));
    auto& memory = owned_.emplace_back();
    memory.resize(bytes);
    return {memory.data(), bytes};
  }

  // Before the optimizer step: every bucket reduced, averages in place; mismatches across the
  // member's ranks (order, sizes) are a flexcomm::error on every rank (the gradients then hold
  // what the buckets reduced, or what was handed over: nothing to step with).
  void finish() {
    if (sequence_.handed == 0) begin_step(step_calls_[1]);
    trace::span traced(trace::names::finish, -1, "step", "sync");
    std::string verdict;
    signature_check<typename control_channel<B>::backend> step_check;
    step_check.carry = std::exchange(carry_, 0);
    if (planning_) {
      // The plan is formed now; every rank must have formed the same one before a bucket moves.
      plan_.seal(options_.last_bucket_bytes);
      find_in_place();
      fingerprint planned = fingerprint(step_hash_).add(plan_.signature());
      for (const char placed : in_place_) planned.add(static_cast<std::uint64_t>(placed));
      start_check(step_check, planned);
      verdict = step_check.verdict(misuse_, sequence_);
      carried_ = step_check.carried();
      if (!verdict.empty()) {
        plan_.clear();
        pointers_.clear();
        planned_.clear();
        end_step();
        fail(cat(who_, ": finish"), verdict);
      }
      planned_.clear();
      if (plan_.empty()) return end_step();  // nothing handed over: the plan waits for a step that does
      planning_ = false;
      const auto& buckets = plan_.buckets();
      arrived_.assign(buckets.size(), 0);
      for (std::size_t b = 0; b < buckets.size(); ++b) arrived_[b] = buckets[b].last - buckets[b].first;
      staging_.resize(buckets.size());
      stage_in_shared_memory();
      register_own();
      flights_.resize(buckets.size());
      choose_launchers();
      launch_full();
      if (next_ == carrier_) launch_bucket(next_++);  // this step's check is behind it already
    } else {
      if (misuse_.empty() && sequence_.handed < plan_.gradients().size())
        misuse(cat("finish() after ", sequence_.handed, " of the plan's ", plan_.gradients().size(), " gradients"));
      // Every rank launches every bucket, in order, whatever was handed over: no peer waits
      // forever on a bucket this rank skipped.
      while (next_ < plan_.buckets().size() && next_ != carrier_) launch_bucket(next_++);
      if (next_ == carrier_) {
        carrier_route ride{*this};
        step_check.through(ride, control_, step_hash_, !misuse_.empty());
        ++next_;
      } else {
        start_check(step_check, step_hash_);
      }
      verdict = step_check.verdict(misuse_, sequence_);
      carried_ = step_check.carried();
    }
    const std::exception_ptr failure = end_flights();
    if (!failure && verdict.empty()) {
      copy_out();
      renew_registrations();
    }
    end_step();
    if (failure) std::rethrow_exception(failure);
    if (!verdict.empty()) fail(cat(who_, ": finish"), verdict);
  }

  // The trainer's stream (device backends): buckets are copied and reduced on it, after the
  // kernels that made the gradients and before those that read the averages, with no host wait,
  // and a step captured on it into a CUDA graph replays whole (on nccl; step_capture.hpp says
  // what is refused). Unnamed: the legacy default stream and the communicators' own streams.
  // Between steps; every rank names one.
  void on_stream(typename B::stream s) {
    static_assert(!holds_host_memory<B>, "on_stream(): a host backend's operations run on no stream");
    static_assert(Flat::algorithm == flat_algorithm::backend_allreduce,
                  "on_stream(): overlapped_ring runs its segments on the progress engine's thread, on the "
                  "communicators' own streams; synchronize the trainer's stream before ready() instead");
    check(sequence_.handed == 0, cat(who_, ": on_stream"), "called mid-step; name the stream between steps");
    capture_.use(s);
  }

  // A word for every rank of the member, carried by the next finish()'s check (the highest of
  // the ranks' words); carried() is what the last finish() brought, 0 once taken
  // (the pipeline's hand-over notice, pipeline/handover.hpp).
  void carry(std::int64_t word) noexcept { carry_ = word; }
  std::int64_t carried() noexcept { return std::exchange(carried_, 0); }

  const bucket_plan& plan() const noexcept { return plan_; }
  const sync_options& options() const noexcept { return options_; }
  // True when buckets are averaged hierarchically across hosts (decided at construction).
  bool hierarchical() const noexcept { return route_ == route::hierarchical; }
  const host_map& hosts() const noexcept { return tiers_.hosts(); }
  // True when buckets are reduced through shared memory (decided at construction): the member's
  // ranks all share one host, or, averaging hierarchically, in this rank's host's stages.
  bool shared_memory() const noexcept { return route_ == route::shared_memory || tiers_.shared_memory(); }

 private:
  // Where every bucket goes, chosen once at construction: across hosts in tiers, through one
  // host's shared memory (on one host a ring only adds copies: every rank reaches every peer's
  // memory directly), or the flat route the adapter names.
  enum class route { flat, shared_memory, hierarchical };
  // Starts one bucket of T on the route; each bucket's is picked once, when the plan is formed.
  // Bucket b's average lands in its gradients in copy_out(), after every bucket is reduced, except
  // on the shared-memory route, which lands each bucket where it finishes (route_shared_memory.hpp).
  using launcher = flight<B> (sync_core::*)(void* data, std::size_t count, std::size_t b);

  // A captured step's buckets are left to the graph: none goes to the engine, which would poll it.
  template <class T>
  flight<B> through_flat(void* data, std::size_t count, std::size_t) {
    const bool on_engine = launch_early_ && !capture_.captured();
    if constexpr (Flat::algorithm == flat_algorithm::backend_allreduce)
      return flat_.launch(comm_, static_cast<T*>(data), count, options_.op, on_engine, capture_.on());
    else
      return flat_.launch(comm_, static_cast<T*>(data), count, options_.op, on_engine);
  }
  // Every bucket of the step ended: waited for, or, captured, left to the graph (its host side
  // settles; the device is not asked). The first failure, if any.
  std::exception_ptr end_flights() {
    std::exception_ptr failure;
    for (auto& f : flights_) {
      try {
        if (capture_.captured())
          capture_.release(f);
        else
          f.wait();
      } catch (...) {
        if (!failure) failure = std::current_exception();
      }
      f.reset();
    }
    return failure;
  }
  // A step's first call: is it being captured into a CUDA graph, and can it be (step_capture.hpp)?
  // `call` names the adapter's ready() or finish(), spelled once at construction: building it at
  // every step's first call cost an allocation per step.
  void begin_step(const std::string& call) { capture_.begin(call, planning_); }
  template <class T>
  flight<B> through_shared_memory(void* data, std::size_t count, std::size_t b) {
    return shared_.launch(static_cast<T*>(data), count, options_.op, launch_early_, landing_of(b), in_place_[b] != 0,
                          registered_[b]);
  }
  // Buckets of one gradient in the trainer's own memory (a vector), larger than the one-round
  // path takes, are made shared where they lie and reduced in place too (registered_range.hpp).
  // Collective, after the ranks agreed on the plan (they register the same buckets in order).
  bool own_memory(std::size_t b) const {
    const auto& spec = plan_.buckets()[b];
    return route_ == route::shared_memory && options_.share_own_memory && spec.last - spec.first == 1 && !in_place_[b] &&
           shared_.in_place_gains(spec.count * size_of(spec.type));
  }
  void register_own() {
    registered_.assign(plan_.buckets().size(), nullptr);
    renewals_.assign(plan_.buckets().size(), 0);
    for (std::size_t b = 0; b < plan_.buckets().size(); ++b)
      if (own_memory(b)) register_bucket(b);
  }
  void register_bucket(std::size_t b) {
    const auto& spec = plan_.buckets()[b];
    visit_dtype(spec.type, [&](auto element) {
      using T = decltype(element);
      registered_[b] = shared_.register_range(static_cast<T*>(pointers_[spec.first]), spec.count);
    });
  }
  // A registered bucket whose step went through the slots (a rank's gradient was freed and
  // reallocated, or is another vector now: the same verdict on every rank) is registered again
  // where it lies now, a few times; one that keeps moving stays on the slots.
  void renew_registrations() {
    static constexpr int renewals = 3;
    for (std::size_t b = 0; b < registered_.size(); ++b) {
      if (!registered_[b] || !shared_.fell_back(registered_[b])) continue;
      shared_.unregister(std::exchange(registered_[b], nullptr));
      if (++renewals_[b] <= renewals) register_bucket(b);
    }
  }
  // Which buckets the shared-memory route reduces where they lie: one gradient in
  // gradient_memory(), as this first step handed it over, and larger than the one-round path
  // takes. Part of the plan the ranks agree on.
  void find_in_place() {
    const auto& buckets = plan_.buckets();
    in_place_.assign(buckets.size(), 0);
    if (route_ != route::shared_memory) return;
    for (std::size_t b = 0; b < buckets.size(); ++b) {
      const std::size_t bytes = buckets[b].count * size_of(buckets[b].type);
      in_place_[b] = buckets[b].last - buckets[b].first == 1 && shared_.in_place_gains(bytes) &&
                     shared_.holds(pointers_[buckets[b].first], bytes);
    }
  }
  // On the shared-memory route, buckets that fuse several gradients (above the one-round path)
  // are staged in shared memory and reduced there, instead of being copied through the
  // segment's slots as well. Collective (every rank formed the same plan). Where /dev/shm has no
  // room for them, they stage in ordinary memory, as on the other routes.
  void stage_in_shared_memory() {
    const auto& buckets = plan_.buckets();
    staged_at_.assign(buckets.size(), nullptr);
    if (route_ != route::shared_memory) return;
    std::vector<std::size_t> at(buckets.size(), 0);
    std::size_t bytes = 0;
    const auto fused = [&](std::size_t b) {
      return buckets[b].last - buckets[b].first > 1 && shared_.in_place_gains(buckets[b].count * size_of(buckets[b].type));
    };
    for (std::size_t b = 0; b < buckets.size(); ++b)
      if (fused(b)) {
        at[b] = bytes;
        bytes += round_up(buckets[b].count * size_of(buckets[b].type));  // buckets on their own lines
      }
    if (bytes == 0) return;
    span<std::byte> memory;
    try {
      memory = shared_.allocate(bytes);
    } catch (const error&) {
      return;  // every rank failed alike (the window's setup is collective)
    }
    for (std::size_t b = 0; b < buckets.size(); ++b)
      if (fused(b)) {
        staged_at_[b] = memory.data() + at[b];
        in_place_[b] = 1;
      }
  }
  // On the shared-memory route a staged bucket lands in its gradients where it finishes.
  std::function<void()> landing_of(std::size_t b) {
    if (!staged(b)) return {};
    return [this, b] { land(b); };
  }
  // signature_check::through's route for the carrier: the last bucket with the step's check in its
  // round (host_shared::carries), on the trainer's thread in finish(). Every rank takes it for the
  // same bucket, fixed with the plan.
  struct carrier_route {
    sync_core& core;
    void agree(span<std::int64_t> check) {
      const std::size_t b = core.carrier_;
      const auto& spec = core.plan_.buckets()[b];
      void* data = core.stage(b);
      visit_dtype(spec.type, [&](auto element) {
        core.shared_.reduce_carrying(static_cast<decltype(element)*>(data), spec.count, core.options_.op, check,
                                     core.landing_of(b), core.in_place_[b] != 0);
      });
    }
  };
  template <class T>
  flight<B> through_tiers(void* data, std::size_t count, std::size_t) {
    // The flat route runs across the host leaders only, as a sum: the tiers average once, after it.
    T* d = static_cast<T*>(data);
    const bool crosses = tiers_.leader() && tiers_.leaders().size() > 1 && count > 0;
    auto across = flat_.cross(tiers_.leaders(), crosses, d, count, options_.op == op::avg ? op::sum : options_.op);
    return tiers_.launch(d, count, options_.op, comm_.size(), std::move(across));
  }

  void choose_launchers() {
    launchers_.clear();
    for (const auto& spec : plan_.buckets())
      visit_dtype(spec.type, [&](auto element) {
        using T = decltype(element);
        launchers_.push_back(route_ == route::hierarchical    ? &sync_core::through_tiers<T>
                             : route_ == route::shared_memory ? &sync_core::through_shared_memory<T>
                                                              : &sync_core::through_flat<T>);
      });
    carrier_ = no_carrier;
    const auto& buckets = plan_.buckets();
    if (route_ != route::shared_memory || buckets.empty()) return;
    const auto& last = buckets.back();
    if (!shared_.carries(last.count * size_of(last.type), signature_check<typename control_channel<B>::backend>::words,
                         in_place_.back() != 0))
      return;
    carrier_ = buckets.size() - 1;
  }

  // The step's check goes through the segment where buckets do, else on the control communicator.
  template <class Check>
  void start_check(Check& step_check, const fingerprint& f) {
    if (route_ == route::shared_memory)
      step_check.through(shared_, control_, f, !misuse_.empty());
    else
      step_check.start(control_, f, !misuse_.empty());
  }

  void misuse(std::string cause) {
    if (misuse_.empty()) misuse_ = std::move(cause);
  }

  // Launches the buckets that are full, in order; the carrier waits for finish() and the check.
  void launch_full() {
    const auto& buckets = plan_.buckets();
    while (next_ < buckets.size() && next_ != carrier_ && arrived_[next_] == buckets[next_].last - buckets[next_].first)
      launch_bucket(next_++);
  }

  void launch_bucket(std::size_t b) {
    void* data = stage(b);
    flights_[b] = (this->*launchers_[b])(data, plan_.buckets()[b].count, b);
  }
  // Bucket b is ready: where its data lies for the route (fused into staging, or its one gradient).
  void* stage(std::size_t b) {
    trace::instant(trace::names::bucket_ready, "sync", static_cast<std::int64_t>(b), "bucket");
    const auto& spec = plan_.buckets()[b];
    if (!staged(b)) return pointers_[spec.first];  // a bucket of one gradient is reduced where it lies
    const std::size_t width = size_of(spec.type);
    std::byte* fused = staged_at_[b];
    if (!fused) {
      staging_[b].resize(spec.count * width);
      fused = staging_[b].data();
    }
    for (std::size_t i = spec.first; i < spec.last; ++i) {
      const auto& g = plan_.gradients()[i];
      if (pointers_[i]) B::copy(fused + g.offset * width, pointers_[i], g.count * width, capture_.on());
    }
    return fused;
  }

  // Whether bucket b goes through staging this step (else: one gradient, reduced where it lies).
  bool staged(std::size_t b) const {
    const auto& spec = plan_.buckets()[b];
    return !(spec.last - spec.first == 1 && pointers_[spec.first]);
  }
  // Copies staged bucket b's average back into its gradients. Touches only bucket b's entries of
  // pointers_ and staging_, which stay put until finish() has waited for every bucket: a route may
  // call it on the thread that finishes the bucket while the trainer hands over later gradients.
  void land(std::size_t b) {
    const auto& spec = plan_.buckets()[b];
    const std::size_t width = size_of(spec.type);
    const std::byte* fused = staged_at_[b] ? staged_at_[b] : staging_[b].data();
    for (std::size_t i = spec.first; i < spec.last; ++i) {
      const auto& g = plan_.gradients()[i];
      if (pointers_[i]) B::copy(pointers_[i], fused + g.offset * width, g.count * width, capture_.on());
    }
  }
  void copy_out() {
    if (route_ == route::shared_memory) return;  // landed as each bucket finished
    for (std::size_t b = 0; b < plan_.buckets().size(); ++b)
      if (staged(b)) land(b);
  }

  void end_step() {
    if (planning_) {
      pointers_.clear();
    } else {
      std::fill(pointers_.begin(), pointers_.end(), nullptr);
      if (pointers_.size() != plan_.gradients().size()) pointers_.assign(plan_.gradients().size(), nullptr);
      std::fill(arrived_.begin(), arrived_.end(), 0);
    }
    next_ = 0;
    step_hash_ = fingerprint();
    sequence_ = {};
    misuse_.clear();
  }

  // A captured step's buckets are released, not waited for: their events mark the graph.
  void drain() noexcept { static_cast<void>(end_flights()); }

  typename B::communicator comm_;  // the buckets' traffic; the tiers and the segment are made on it
  sync_options options_;
  host_tiers<B> tiers_;
  // The signature exchange, kept apart from bucket traffic.
  typename control_channel<B>::backend::communicator control_;
  std::string who_;
  std::string step_calls_[2];  // "<who>: ready", "<who>: finish" (begin_step)
  bool launch_early_;
  Flat flat_;
  host_shared<B> shared_;
  route route_ = route::flat;
  std::vector<launcher> launchers_;  // per bucket
  static constexpr std::size_t no_carrier = static_cast<std::size_t>(-1);
  std::size_t carrier_ = no_carrier;  // the bucket that carries the step's check, if one can
  bucket_plan plan_;
  bool planning_ = true;
  std::unordered_set<int> planned_;
  std::vector<void*> pointers_;  // per plan gradient: where this step's gradient lies
  std::vector<std::size_t> arrived_;  // per bucket: gradients handed over this step
  // Per bucket fusing several gradients, in the backend's memory (device memory for nccl and
  // staged, where B::copy is a stream-ordered device copy).
  std::vector<typename B::template buffer<std::byte>> staging_;
  // Per bucket: where it stages in shared memory instead (stage_in_shared_memory), or null.
  std::vector<std::byte*> staged_at_;
  // Per bucket: reduced where it lies in shared memory (find_in_place, stage_in_shared_memory).
  std::vector<char> in_place_;
  // Per bucket: its registration (register_own), or null; and how often it was renewed.
  std::vector<const void*> registered_;
  std::vector<int> renewals_;
  std::deque<typename B::template buffer<std::byte>> owned_;  // gradient_memory() off the shared-memory route
  std::vector<flight<B>> flights_;
  step_capture<B> capture_;  // the trainer's stream, and whether this step is captured
  std::size_t next_ = 0;  // the next bucket to launch: buckets launch in index order only
  fingerprint step_hash_;
  first_handed sequence_;
  std::string misuse_;
  std::int64_t carry_ = 0;    // carry(): rides in the next step's check
  std::int64_t carried_ = 0;  // the last check's highest carry, until carried() takes it
};

}  // namespace flexcomm::detail
