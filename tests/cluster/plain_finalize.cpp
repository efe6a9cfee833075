/* The plain-MPI reproduction of MPICH 4.0.2's finalize hang over UCX's TCP transport (see
 * docs/reliability.md, "Shutdown"): no flexcomm at all. Initialises with MPI_THREAD_MULTIPLE
 * (PLAIN_SINGLE=1: single-threaded), a few allreduces on a duplicate of MPI_COMM_WORLD, an
 * MPI_Barrier when PLAIN_BARRIER=1, an MPI_Alltoall when PLAIN_ALLTOALL=1, then MPI_Finalize.
 *   tests/cluster/run.sh --repeat 40 --limit 10 --no-stacks -- build/tests/plain_finalize */
#include <mpi.h>
#include <cstdio>
#include <cstdlib>
#include <ctime>

int main(int argc, char** argv) {
  int provided = 0;
  const int level = std::getenv("PLAIN_SINGLE") ? MPI_THREAD_SINGLE : MPI_THREAD_MULTIPLE;
  MPI_Init_thread(&argc, &argv, level, &provided);
  MPI_Comm comm;
  MPI_Comm_dup(MPI_COMM_WORLD, &comm);
  float values[1024] = {0};
  for (int i = 0; i < 20; ++i) MPI_Allreduce(MPI_IN_PLACE, values, 1024, MPI_FLOAT, MPI_SUM, comm);
  MPI_Comm_free(&comm);
  if (std::getenv("PLAIN_BARRIER")) MPI_Barrier(MPI_COMM_WORLD);
  // PLAIN_ALLTOALL=1: a last exchange with every peer, so that every pair has its endpoints both
  // ways before they close.
  if (std::getenv("PLAIN_ALLTOALL")) {
    int size = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    int* out = new int[size]();
    int* in = new int[size]();
    MPI_Alltoall(out, 1, MPI_INT, in, 1, MPI_INT, MPI_COMM_WORLD);
    delete[] out;
    delete[] in;
  }
  // The exit measurement (tests/cluster/run.sh --exit-times), as flexcomm's environment stamps it.
  if (const char* path = std::getenv("FLEXCOMM_TEST_EXIT_STAMP")) {
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    timespec now{};
    clock_gettime(CLOCK_REALTIME, &now);
    if (FILE* f = std::fopen(path, "a")) {
      std::fprintf(f, "%d %lld\n", rank, static_cast<long long>(now.tv_sec) * 1000000000LL + now.tv_nsec);
      std::fclose(f);
    }
  }
  MPI_Finalize();
  return 0;
}
