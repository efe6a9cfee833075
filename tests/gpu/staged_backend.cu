// The staged backend on device buffers: every operation, element type and op against the host
// reference, with FLEXCOMM_STAGE_CHUNK small (set by Meson) so that transfers are pipelined in
// chunks; and the CUDA-aware variant, refused by name where MPI cannot take device pointers.
#define BOOST_TEST_MODULE gpu_staged_backend
#include "gpu_fixture.hpp"

#include <flexcomm/backend/staged.hpp>

using backend = flexcomm::staged;

#include "device_buffer.hpp"
#include "../backend_cases.hpp"

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
