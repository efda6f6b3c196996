// Stand-ins for the CUDA backend entry points when the library is built without CUDA.
#include "indexcp/error.hpp"
#include "indexcp/tp_group.hpp"

namespace indexcp {

bool cuda_available() { return false; }
bool built_with_cuda() { return false; }

std::unique_ptr<TpIndexer> make_cuda_tp_indexer(const ResolvedConfig&, int64_t) {
  throw Error(ErrorCode::kUnsupported,
              "--backend cuda: this build of indexcp has no CUDA backend (configure with -DINDEXCP_CUDA=ON on a machine with nvcc)");
}

std::unique_ptr<TpIndexer> make_cuda_rank_indexer(const ResolvedConfig& c, int64_t n, Communicator&) {
  return make_cuda_tp_indexer(c, n);  // throws: no CUDA backend
}

}  // namespace indexcp
