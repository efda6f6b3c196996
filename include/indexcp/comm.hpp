// indexcp: the Communicator interface through which ranks exchange candidates and FP8 rows
// (spec/indexer.md section 5), and its in-process implementation (W ranks as W threads).
#pragma once

#include <cstddef>
#include <exception>
#include <functional>
#include <memory>
#include <vector>

namespace indexcp {

/// A group of `world()` ranks exchanging byte buffers. Collective calls must be made by every
/// rank of the group in the same order with the same `bytes`; send and recv must not overlap.
/// The in-process groups (InProcessGroup, cuda::DeviceGroup) check it: a collective whose ranks
/// pass different byte counts or make different calls throws Error (kInvalidArgument) on every
/// rank, naming the call and two ranks' sizes, and copies nothing; NCCL cannot check it (a
/// mismatch there is undefined), which is why the plans size every exchange for their limits and
/// sign it (plan.hpp). A rank that fails before a collective must abort the group (run_ranks
/// does this), or its peers wait forever. `stream` is a cudaStream_t for
/// device communicators (nullptr on the CPU). Failures throw indexcp::Error (kRuntime), also
/// when the group was aborted while a call waited.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world() const = 0;
  /// send: `bytes`; recv: world * bytes; rank p's buffer lands at recv + p * bytes.
  virtual void all_gather(const void* send, void* recv, std::size_t bytes, void* stream) = 0;
  /// send: world * bytes, block p goes to rank p; recv: world * bytes, block p came from rank p.
  virtual void all_to_all(const void* send, void* recv, std::size_t bytes, void* stream) = 0;
  /// Bytes this rank has sent through the communicator so far (for the payload-size tests).
  virtual std::size_t bytes_sent() const = 0;
  /// Waits until the work enqueued on `stream` so far has completed, with this communicator's
  /// failure detection. A communicator whose collectives can hang when a peer dies (NCCL) bounds
  /// the wait by its timeout, aborts itself and throws Error (kRuntime). The default does nothing:
  /// the host communicators finish each collective before returning, and the in-process device
  /// group cannot hang on a dead peer. The CUDA backend's functions that synchronize their stream
  /// after a collective call this first.
  virtual void synchronize(void* stream) { (void)stream; }
};

/// W ranks in one process, one thread each, exchanging host buffers. Blocking synchronization
/// (mutex + condition variable), no spinning. abort() wakes every waiting rank with an Error.
class InProcessGroup {
 public:
  /// world in 1..64, else Error naming world.
  explicit InProcessGroup(int world);
  /// Aborts the group and waits until no rank is inside a collective before freeing it: a rank
  /// still waiting gets Error("communicator aborted"). A rank must not start a collective on a
  /// group being destroyed.
  ~InProcessGroup();
  InProcessGroup(const InProcessGroup&) = delete;
  InProcessGroup& operator=(const InProcessGroup&) = delete;

  int world() const;
  /// The communicator of rank r (0 <= r < world).
  Communicator& comm(int r);
  /// Makes every pending and future collective throw Error("communicator aborted"); a rank
  /// already copying inside a collective finishes it first. An aborted group cannot be reused.
  void abort();
  /// Rank r's thread returned without an error and makes no further collective calls: a
  /// collective another rank waits in, or enters later, throws Error naming both ranks instead
  /// of waiting forever (run_ranks calls it).
  void depart(int r);

  struct State;

 private:
  std::unique_ptr<State> state_;
};

/// After W rank threads ended: rethrows the first rank's own error, preferring it over the
/// "communicator aborted" errors it caused on the other ranks; returns when there is none.
void rethrow_rank_errors(const std::vector<std::exception_ptr>& errors);

/// Runs fn(rank, comm) on `world` threads of a fresh InProcessGroup and waits for all. If any
/// rank throws, the group is aborted (so no rank hangs) and the first exception is rethrown; a
/// rank that returns while another still waits in a collective (fewer calls) ends that wait with
/// an Error naming both ranks (depart).
void run_ranks(int world, const std::function<void(int rank, Communicator& comm)>& fn);

}  // namespace indexcp
