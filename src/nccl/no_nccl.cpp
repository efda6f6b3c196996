// indexcp::nccl without NCCL (CPU-only builds, or CUDA builds where CMake found no NCCL): every
// entry point throws Error (kUnsupported); built_with_nccl() is false. `indexcp launch` and the
// rendezvous (rendezvous.cpp) work without NCCL.
#include "indexcp/error.hpp"
#include "indexcp/nccl.hpp"

namespace indexcp::nccl {

namespace {
[[noreturn]] void unsupported(const char* what) {
  throw Error(ErrorCode::kUnsupported,
              std::string(what) + ": indexcp was built without NCCL (it needs the CUDA backend and NCCL at build "
                                  "time: CMake INDEXCP_CUDA and INDEXCP_NCCL)");
}
}  // namespace

struct NcclCommunicator::Impl {};

bool built_with_nccl() { return false; }
std::string version() { unsupported("nccl::version"); }
UniqueId make_unique_id() { unsupported("nccl::make_unique_id"); }

NcclCommunicator::NcclCommunicator(const UniqueId&, const Options&) { unsupported("NcclCommunicator"); }
NcclCommunicator::~NcclCommunicator() = default;
int NcclCommunicator::rank() const { return 0; }
int NcclCommunicator::world() const { return 1; }
void NcclCommunicator::all_gather(const void*, void*, std::size_t, void*) { unsupported("NcclCommunicator::all_gather"); }
void NcclCommunicator::all_to_all(const void*, void*, std::size_t, void*) { unsupported("NcclCommunicator::all_to_all"); }
std::size_t NcclCommunicator::bytes_sent() const { return 0; }
void NcclCommunicator::synchronize(void*) { unsupported("NcclCommunicator::synchronize"); }
void NcclCommunicator::finalize() {}
void NcclCommunicator::abort() {}
bool NcclCommunicator::aborted() const { return false; }
int NcclCommunicator::device() const { return 0; }
double NcclCommunicator::timeout_s() const { return 0.0; }

std::unique_ptr<NcclCommunicator> make_single_rank(int, double) { unsupported("nccl::make_single_rank"); }
std::unique_ptr<NcclCommunicator> make_communicator(const RankEnv&) { unsupported("nccl::make_communicator"); }
std::unique_ptr<NcclCommunicator> make_communicator_from_env() { unsupported("nccl::make_communicator_from_env"); }

}  // namespace indexcp::nccl
