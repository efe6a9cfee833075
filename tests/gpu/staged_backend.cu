// The staged backend on device buffers: every operation, element type and op against the host
// reference, with FLEXCOMM_STAGE_CHUNK small (set by Meson) so that transfers are pipelined in
// chunks; and the CUDA-aware variant, refused by name where MPI cannot take device pointers.
#define BOOST_TEST_MODULE gpu_staged_backend
#include "gpu_fixture.hpp"

#include <flexcomm/backend/staged.hpp>

using backend = flexcomm::staged;

#include "device_buffer.hpp"
#include "../backend_cases.hpp"

// Several chunked operations in flight at once, waited for in reverse: transfers still begin in
// call order on every rank, so nothing is matched with the wrong operation.
BOOST_AUTO_TEST_CASE(many_operations_in_flight_waited_out_of_order) {
  const int rank = world().rank(), size = world().size();
  const std::size_t n = 3001;  // 12 kB of floats: dozens of chunks each
  std::vector<std::unique_ptr<test_buffer<float>>> bufs;
  std::vector<backend::request> requests;
  for (int k = 0; k < 4; ++k) {
    bufs.push_back(std::make_unique<test_buffer<float>>(data<float>(rank + k, n)));
    requests.push_back(backend::iallreduce(comm(), bufs.back()->span(), fc::op::max));
  }
  for (int k = 3; k >= 0; --k) requests[static_cast<std::size_t>(k)].wait();
  bool ok = true;
  for (int k = 0; k < 4; ++k) {
    std::vector<float> want = data<float>(k, n);
    for (int r = 1; r < size; ++r) {
      const auto other = data<float>(r + k, n);
      fc::combine(fc::op::max, want.data(), other.data(), n);
    }
    ok = ok && same(bufs[static_cast<std::size_t>(k)]->host(), want, n);
  }
  BOOST_TEST(fc::testing::all_ranks(ok));
}

// The receive buffer keeps what a shorter message does not cover, as MPI's would.
BOOST_AUTO_TEST_CASE(a_shorter_message_leaves_the_rest_of_the_buffer) {
  const int rank = world().rank(), size = world().size();
  test_buffer<int> send(std::vector<int>(10, rank)), recv(std::vector<int>(20, -7));
  auto r = backend::irecv(comm(), recv.span(), (rank + size - 1) % size, 3);
  auto s = backend::isend(comm(), send.cspan(), (rank + 1) % size, 3);
  r.wait();
  s.wait();
  const auto got = recv.host();
  bool ok = true;
  for (std::size_t i = 0; i < 20; ++i) ok = ok && got[i] == (i < 10 ? (rank + size - 1) % size : -7);
  BOOST_TEST(fc::testing::all_ranks(ok));
}

BOOST_AUTO_TEST_CASE(cuda_aware_mpi_is_refused_by_name_or_works) {
  if (!fc::mpi_is_cuda_aware()) {
    BOOST_CHECK_EXCEPTION(fc::cuda_aware_mpi::communicator(world(), "direct"), fc::error,
                          [](const fc::error& e) { return std::string(e.cause()).find("not CUDA-aware") != std::string::npos; });
    return;
  }
  fc::cuda_aware_mpi::communicator direct(world(), "direct");
  const int size = world().size();
  for (fc::op o : all_ops) {
    test_buffer<double> x(data<double>(world().rank(), 1001));
    test_buffer<fc::half> h(data<fc::half>(world().rank(), 1001));
    fc::cuda_aware_mpi::iallreduce(direct, x.span(), o).wait();
    fc::cuda_aware_mpi::iallreduce(direct, h.span(), o).wait();  // 16-bit floats are staged
    BOOST_TEST(fc::testing::all_ranks(same(x.host(), expected<double>(o, size, 1001), 1001, o) &&
                                      same(h.host(), expected<fc::half>(o, size, 1001), 1001, o)),
               "op=" << fc::name_of(o));
  }
}
