/* The plain-MPI reproduction of MPICH 4.0.2's finalize hang over UCX's TCP transport (see
 * docs/reliability.md, "Shutdown"): no flexcomm at all. Initialises with MPI_THREAD_MULTIPLE
 * (PLAIN_SINGLE=1: single-threaded), a few allreduces on a duplicate of MPI_COMM_WORLD, an
 * MPI_Barrier when PLAIN_BARRIER=1, then MPI_Finalize.
 *   tests/cluster/run.sh --repeat 40 --limit 10 --no-stacks -- build/tests/plain_finalize */
#include <mpi.h>
#include <cstdlib>

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
  MPI_Finalize();
  return 0;
}
