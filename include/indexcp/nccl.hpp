// indexcp: the Communicator on NCCL, one process per GPU (spec/indexer.md section 5 across real
// processes). Built with the CUDA backend when NCCL is found (CMake option INDEXCP_NCCL, AUTO);
// otherwise every entry point below throws Error (kUnsupported) "built without NCCL" and
// built_with_nccl() is false. This header includes neither CUDA nor NCCL headers.
//
// Collectives move DEVICE buffers on the caller's CUDA stream (the `stream` argument of
// Communicator, a cudaStream_t): all_gather is ncclAllGather, all_to_all is a grouped
// ncclSend/ncclRecv to every rank (itself included). They never synchronize the host with the
// GPU, so a decode step that calls them can be captured in a CUDA graph.
//
// Failure detection (the watchdog): communicators are NON-BLOCKING (ncclConfig_t.blocking = 0).
// Every wait of this class - the end of ncclCommInitRankConfig, the host-side completion of each
// collective's enqueue (NCCL may answer ncclInProgress, e.g. while it connects to a peer), stream
// completion in synchronize(), and ncclCommFinalize - polls ncclCommGetAsyncError (and
// cudaStreamQuery) with a short sleep and gives up after timeout_s (default 60 s,
// INDEXCP_NCCL_TIMEOUT_S). On an NCCL error or timeout the communicator calls ncclCommAbort
// (which also makes its kernels still on the GPU return) and throws Error (kRuntime) naming the
// rank, the operation and the cause; every later call throws Error (kRuntime) "aborted".
// A kernel of a collective whose peer died is only interrupted by a wait of THIS communicator:
// callers synchronize through synchronize(stream) (the CUDA backend's prefill functions do), not
// through cudaStreamSynchronize, which could block forever.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "indexcp/comm.hpp"
#include "indexcp/rendezvous.hpp"

namespace indexcp::nccl {

/// True when the library was built with NCCL.
bool built_with_nccl();
/// "2.28.9": the version of the NCCL library loaded at run time. Error (kUnsupported) without NCCL.
std::string version();

/// The 128 bytes of an ncclUniqueId.
struct UniqueId {
  unsigned char bytes[128] = {};
};
/// ncclGetUniqueId: created once (by rank 0) and shared with every rank before they join.
UniqueId make_unique_id();

/// One rank's part of a group.
struct Options {
  int rank = 0;
  int world = 1;     ///< 1..64
  int device = 0;    ///< CUDA device ordinal; the constructor makes it the current device
  double timeout_s = kDefaultGroupTimeoutS;  ///< every blocking wait, (0, 604800]
};

class NcclCommunicator final : public Communicator {
 public:
  /// Joins the group described by `id`: cudaSetDevice(o.device), ncclCommInitRankConfig with a
  /// non-blocking config, then waits (watchdog) until all o.world ranks have joined. Errors:
  /// kInvalidArgument naming rank / world / device / timeout_s; kRuntime (after ncclCommAbort)
  /// when NCCL fails or the group is not complete within o.timeout_s.
  NcclCommunicator(const UniqueId& id, const Options& o);
  /// Clean shutdown (finalize()) when not aborted; ncclCommAbort instead while an exception
  /// propagates (an error path) or when finalize fails. Never throws.
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override;
  int world() const override;
  /// ncclAllGather of `bytes` per rank on `stream`. bytes_sent() grows by `bytes`.
  void all_gather(const void* send, void* recv, std::size_t bytes, void* stream) override;
  /// Grouped ncclSend/ncclRecv of `bytes` to and from every rank. bytes_sent() grows by world * bytes.
  void all_to_all(const void* send, void* recv, std::size_t bytes, void* stream) override;
  /// Counted as the in-process communicators count: the send size of each call.
  std::size_t bytes_sent() const override;
  /// Waits (watchdog) until the work enqueued on `stream` has completed: polls cudaStreamQuery and
  /// ncclCommGetAsyncError; on an error or after timeout_s, aborts and throws Error (kRuntime).
  void synchronize(void* stream) override;

  /// ncclCommFinalize (flushes this rank's operations; completes when the peers have theirs)
  /// under the watchdog, then ncclCommDestroy. Error (kRuntime) after aborting on failure.
  /// Idempotent; no collective may follow.
  void finalize();
  /// ncclCommAbort now. Thread-safe: a wait in progress on another thread then throws
  /// Error (kRuntime) "aborted". Idempotent; no collective may follow.
  void abort();
  bool aborted() const;
  int device() const;
  double timeout_s() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

/// A group of one: this process alone on `device` (no rendezvous). For single-GPU runs and tests.
std::unique_ptr<NcclCommunicator> make_single_rank(int device = 0, double timeout_s = kDefaultGroupTimeoutS);

/// Rank 0 creates the unique id and publishes it through the rendezvous directory of `env`
/// (key "nccl-unique-id"); the other ranks wait for it (env.timeout_s); then every rank joins.
/// World 1 needs no directory.
std::unique_ptr<NcclCommunicator> make_communicator(const RankEnv& env);

/// make_communicator(rank_env_from_env()) under `indexcp launch`; without INDEXCP_WORLD a group
/// of one on INDEXCP_DEVICE / LOCAL_RANK / device 0 with INDEXCP_NCCL_TIMEOUT_S.
std::unique_ptr<NcclCommunicator> make_communicator_from_env();

}  // namespace indexcp::nccl
