// Which MPI library flexcomm is built against (MPICH or Open MPI), and the few things flexcomm
// does differently for each: every implementation-specific line of the backends over MPI lives
// here (the MPI backend's, and staged's question whether MPI reads device memory).
#pragma once

#include <mpi.h>
#if defined(OPEN_MPI) && OPEN_MPI
#include <mpi-ext.h>  // Open MPI declares its extensions (MPIX_CUDA_AWARE_SUPPORT) apart from mpi.h
#endif

#include <chrono>
#include <cstdlib>

namespace flexcomm::mpi_implementation {

enum class library { mpich, open_mpi, other };

#if defined(OPEN_MPI) && OPEN_MPI
inline constexpr library built_against = library::open_mpi;
inline constexpr const char* name = "Open MPI";
#elif defined(MPICH)
inline constexpr library built_against = library::mpich;
inline constexpr const char* name = "MPICH";
#else
inline constexpr library built_against = library::other;
inline constexpr const char* name = "MPI";
#endif

// How long MPI_Finalize may take by default once the shutdown barrier has proved every rank done
// (FLEXCOMM_FINALIZE_TIMEOUT; backend/mpi/environment.hpp explains the two values).
inline constexpr std::chrono::milliseconds default_finalize_timeout{built_against == library::open_mpi ? 10000 : 500};

// Environment defaults set before MPI_Init (a value the user set wins). UCX, the transport of
// Debian's MPICH and one of Open MPI's, stops progressing a TCP interface as soon as this process
// has closed its last endpoint on it, while a peer may still be closing its own endpoint to us:
// inside MPI_Finalize that peer then waits for ever (UCX issue 8738; MPICH 4.0.2 also holds every
// rank in a PMI barrier there). Keeping progress on ends the hang (docs/reliability.md).
inline void prepare_init() { setenv("UCX_ADAPTIVE_PROGRESS", "n", 0); }

// The socket on which Hydra (MPICH's launcher) speaks PMI-1 to this process, or -1. flexcomm's
// finalize guard enters Hydra's PMI barrier on behalf of a rank whose MPI_Finalize hangs;
// Open MPI's launcher speaks PMIx, which has no such line protocol: there the rank just leaves.
inline int launcher_pmi_fd() {
  if (built_against != library::mpich) return -1;
  const char* text = std::getenv("PMI_FD");
  return text && *text ? std::atoi(text) : -1;
}

// Whether a message a rank sends to itself, longer than the receive posted for it, is reported
// as truncated. Open MPI 4.1 (ob1 over btl self) delivers the head and reports success; between
// two ranks it reports MPI_ERR_TRUNCATE as MPICH does. Either way nothing is written past the
// receive buffer.
inline constexpr bool reports_truncation_to_self = built_against != library::open_mpi;

// Whether a collective reaches the library only once its consistency check (FLEXCOMM_CHECK) has
// agreed. Open MPI 4.1's nonblocking allreduce writes a mismatched peer's data into this rank's
// buffer before anyone can notice (a rank reducing 1000 doubles against ranks reducing 1000
// floats: 8000 bytes into their 4000-byte buffers), so there the post is deferred into the
// request (mpi/deferred_post.hpp): posting starts only the check, and testing the request makes
// the call once the check agreed, at the cost of one small allreduce of latency. MPICH reports
// such a mismatch as truncation and writes nothing past the buffer: there the check rides beside
// the collective at no latency.
inline constexpr bool defers_collectives = built_against == library::open_mpi;

// Where MPI_Finalize is known to hang, for the guard's message.
inline constexpr const char* finalize_hang_note =
    built_against == library::mpich ? "MPICH 4.0.2 over UCX's TCP transport, see docs/reliability.md"
                                    : "see docs/reliability.md";

// Whether this MPI library reads and writes device memory.
inline bool cuda_aware() {
#if defined(MPIX_GPU_SUPPORT_CUDA)
  int supported = 0;
  return MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &supported) == MPI_SUCCESS && supported != 0;
#elif defined(MPIX_CUDA_AWARE_SUPPORT) && MPIX_CUDA_AWARE_SUPPORT
  return MPIX_Query_cuda_support() == 1;
#else
  return false;
#endif
}

}  // namespace flexcomm::mpi_implementation
