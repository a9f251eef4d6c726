#include "strata/version.h"

namespace strata {

BuildInfo GetBuildInfo() {
  BuildInfo info{};
  info.version = STRATA_VERSION_STRING;
#ifdef STRATA_HAVE_CUDA
  info.cuda = true;
#endif
#ifdef STRATA_HAVE_NCCL
  info.nccl = true;
#endif
#ifdef STRATA_HAVE_MPI
  info.mpi = true;
#endif
#ifdef STRATA_HAVE_ULFM
  info.ulfm = true;
#endif
#ifdef STRATA_HAVE_GLOO
  info.gloo = true;
#endif
  return info;
}

}  // namespace strata
