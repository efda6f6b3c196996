// NcclCommunicator (include/indexcp/nccl.hpp): non-blocking NCCL communicators with a polling
// watchdog. Host code only (NCCL launches its own kernels); built when CMake finds NCCL.
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>

#include "indexcp/error.hpp"
#include "indexcp/nccl.hpp"

namespace indexcp::nccl {

static_assert(sizeof(ncclUniqueId) == sizeof(UniqueId), "ncclUniqueId is not 128 bytes");

namespace {

using Clock = std::chrono::steady_clock;

std::string seconds(double t) {
  char b[32];
  std::snprintf(b, sizeof b, "%g", t);
  return b;
}

// Poll interval: spin-yield for the first ~50 us (a collective's enqueue or a short kernel), then
// sleep, growing to 2 ms (the watchdog's resolution is far below any sensible timeout).
class Backoff {
 public:
  void pause() {
    if (n_++ < 64) {
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(sleep_);
    sleep_ = std::min(sleep_ * 2, std::chrono::microseconds(2000));
  }

 private:
  int n_ = 0;
  std::chrono::microseconds sleep_{20};
};

}  // namespace

struct NcclCommunicator::Impl {
  ncclComm_t comm = nullptr;
  int rank = 0, world = 1, device = 0;
  double timeout_s = kDefaultGroupTimeoutS;
  std::atomic<std::size_t> sent{0};
  std::mutex mu;  // serializes every NCCL call on `comm` (abort() may come from another thread)
  std::atomic<bool> aborted{false};
  bool finalized = false;
  int uncaught = 0;  // std::uncaught_exceptions() when constructed

  std::string who() const { return "NCCL rank " + std::to_string(rank) + " of " + std::to_string(world); }

  std::string describe(ncclResult_t r) const {
    std::string s = ncclGetErrorString(r);
    const char* last = ncclGetLastError(comm);
    if (last && *last) s += " (" + std::string(last) + ")";
    return s;
  }

  // Callers hold `mu`.
  void abort_locked() {
    if (comm) {
      ncclCommAbort(comm);  // also frees the communicator; its kernels on the GPU return
      comm = nullptr;
    }
    aborted = true;
  }
  [[noreturn]] void fail_locked(const std::string& msg) {
    abort_locked();
    throw Error(ErrorCode::kRuntime, msg + "; communicator aborted");
  }
  void check_usable_locked(const char* what) const {
    if (aborted)
      throw Error(ErrorCode::kRuntime, who() + ": " + what + " on an aborted communicator (a rank failed earlier)");
    if (finalized || !comm) throw Error(ErrorCode::kRuntime, who() + ": " + what + " after finalize()");
  }

  // Polls until the communicator leaves ncclInProgress: success returns; an error or the timeout
  // aborts and throws. `what` names the operation in the messages.
  void wait_ready(const std::string& what) {
    const auto t0 = Clock::now();
    Backoff backoff;
    for (;;) {
      {
        std::lock_guard<std::mutex> lk(mu);
        if (aborted) throw Error(ErrorCode::kRuntime, who() + ": aborted while waiting for " + what);
        ncclResult_t st = ncclInProgress;
        const ncclResult_t q = ncclCommGetAsyncError(comm, &st);
        if (q != ncclSuccess) st = q;
        if (st == ncclSuccess) return;
        if (st != ncclInProgress) fail_locked(who() + ": " + what + " failed: " + describe(st));
        if (std::chrono::duration<double>(Clock::now() - t0).count() >= timeout_s)
          fail_locked(who() + ": " + what + " did not complete within " + seconds(timeout_s) +
                      " s (did a peer rank die or stop answering? INDEXCP_NCCL_TIMEOUT_S sets the timeout)");
      }
      backoff.pause();
    }
  }

  // The result of an NCCL call made under `mu` (released by the caller before this).
  void settle(ncclResult_t r, const std::string& what) {
    if (r == ncclSuccess) return;
    if (r == ncclInProgress) return wait_ready(what);
    std::lock_guard<std::mutex> lk(mu);
    fail_locked(who() + ": " + what + " failed: " + describe(r));
  }
};

// ---------------------------------------------------------------------------------------------

bool built_with_nccl() { return true; }

std::string version() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) throw Error(ErrorCode::kRuntime, "NCCL: ncclGetVersion failed");
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
}

UniqueId make_unique_id() {
  ncclUniqueId id;
  const ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess)
    throw Error(ErrorCode::kRuntime, std::string("NCCL: ncclGetUniqueId failed: ") + ncclGetErrorString(r) +
                                         " (NCCL_SOCKET_IFNAME chooses the bootstrap interface)");
  UniqueId out;
  std::memcpy(out.bytes, id.internal, sizeof out.bytes);
  return out;
}

NcclCommunicator::NcclCommunicator(const UniqueId& id, const Options& o) : impl_(std::make_unique<Impl>()) {
  require(o.world >= 1 && o.world <= 64, "world = " + std::to_string(o.world) + " must be in 1..64");
  require(o.rank >= 0 && o.rank < o.world,
          "rank = " + std::to_string(o.rank) + " must be in 0..world-1 = " + std::to_string(o.world - 1));
  require(o.timeout_s > 0.0 && o.timeout_s <= 604800.0,
          "timeout_s = " + seconds(o.timeout_s) + " must be a number of seconds in (0, 604800]");
  int n = 0;
  const cudaError_t ce = cudaGetDeviceCount(&n);
  if (ce != cudaSuccess) {
    cudaGetLastError();
    throw Error(ErrorCode::kRuntime, std::string("CUDA: no usable device for the NCCL communicator: ") +
                                         cudaGetErrorString(ce));
  }
  require(o.device >= 0 && o.device < n, "device = " + std::to_string(o.device) + " is not a visible CUDA device (" +
                                             std::to_string(n) + " visible; INDEXCP_DEVICE / LOCAL_RANK)");
  Impl& m = *impl_;
  m.rank = o.rank;
  m.world = o.world;
  m.device = o.device;
  m.timeout_s = o.timeout_s;
  m.uncaught = std::uncaught_exceptions();
  const cudaError_t se = cudaSetDevice(o.device);
  if (se != cudaSuccess)
    throw Error(ErrorCode::kRuntime, "CUDA: cudaSetDevice(" + std::to_string(o.device) + ") failed: " + cudaGetErrorString(se));
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;  // every call may answer ncclInProgress: the watchdog polls
  ncclUniqueId nid;
  std::memcpy(nid.internal, id.bytes, sizeof nid.internal);
  ncclResult_t r;
  {
    std::lock_guard<std::mutex> lk(m.mu);
    r = ncclCommInitRankConfig(&m.comm, o.world, nid, o.rank, &cfg);
  }
  m.settle(r, "ncclCommInitRankConfig (joining a group of " + std::to_string(o.world) + " ranks)");
}

NcclCommunicator::~NcclCommunicator() {
  if (!impl_) return;
  if (std::uncaught_exceptions() > impl_->uncaught) {  // an error path: do not wait for the peers
    abort();
    return;
  }
  try {
    finalize();  // aborts itself when it fails
  } catch (...) {
  }
}

int NcclCommunicator::rank() const { return impl_->rank; }
int NcclCommunicator::world() const { return impl_->world; }
std::size_t NcclCommunicator::bytes_sent() const { return impl_->sent.load(); }
int NcclCommunicator::device() const { return impl_->device; }
double NcclCommunicator::timeout_s() const { return impl_->timeout_s; }
bool NcclCommunicator::aborted() const { return impl_->aborted.load(); }

void NcclCommunicator::all_gather(const void* send, void* recv, std::size_t bytes, void* stream) {
  Impl& m = *impl_;
  ncclResult_t r;
  {
    std::lock_guard<std::mutex> lk(m.mu);
    m.check_usable_locked("all_gather");
    if (bytes == 0) return;  // every rank passes the same bytes: every rank skips
    require(send != nullptr && recv != nullptr, "all_gather: send or recv is null");
    r = ncclAllGather(send, recv, bytes, ncclUint8, m.comm, static_cast<cudaStream_t>(stream));
  }
  m.settle(r, "ncclAllGather of " + std::to_string(bytes) + " bytes");
  m.sent += bytes;
}

void NcclCommunicator::all_to_all(const void* send, void* recv, std::size_t bytes, void* stream) {
  Impl& m = *impl_;
  ncclResult_t r = ncclSuccess;
  {
    std::lock_guard<std::mutex> lk(m.mu);
    m.check_usable_locked("all_to_all");
    if (bytes == 0) return;
    require(send != nullptr && recv != nullptr, "all_to_all: send or recv is null");
    const cudaStream_t st = static_cast<cudaStream_t>(stream);
    const char* s = static_cast<const char*>(send);
    char* d = static_cast<char*>(recv);
    r = ncclGroupStart();
    for (int p = 0; p < m.world && (r == ncclSuccess || r == ncclInProgress); ++p) {
      r = ncclSend(s + static_cast<std::size_t>(p) * bytes, bytes, ncclUint8, p, m.comm, st);
      if (r == ncclSuccess || r == ncclInProgress)
        r = ncclRecv(d + static_cast<std::size_t>(p) * bytes, bytes, ncclUint8, p, m.comm, st);
    }
    const ncclResult_t e = ncclGroupEnd();  // always close the group
    if (r == ncclSuccess || r == ncclInProgress) r = e;
  }
  m.settle(r, "all_to_all (ncclSend/ncclRecv) of " + std::to_string(bytes) + " bytes per rank");
  m.sent += bytes * static_cast<std::size_t>(m.world);
}

void NcclCommunicator::synchronize(void* stream) {
  Impl& m = *impl_;
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  const auto t0 = Clock::now();
  Backoff backoff;
  for (;;) {
    const cudaError_t e = cudaStreamQuery(st);
    {
      std::lock_guard<std::mutex> lk(m.mu);
      if (m.aborted) throw Error(ErrorCode::kRuntime, m.who() + ": aborted while waiting for the stream");
      if (e != cudaSuccess && e != cudaErrorNotReady) {
        cudaGetLastError();
        m.fail_locked(m.who() + ": CUDA error while waiting for the stream: " + cudaGetErrorName(e) + " (" +
                      cudaGetErrorString(e) + ")");
      }
      if (m.comm) {
        ncclResult_t as = ncclSuccess;
        const ncclResult_t q = ncclCommGetAsyncError(m.comm, &as);
        if (q != ncclSuccess) as = q;
        if (as != ncclSuccess && as != ncclInProgress)
          m.fail_locked(m.who() + ": asynchronous NCCL error while waiting for the stream: " + m.describe(as));
      }
      if (e == cudaSuccess) return;
      if (std::chrono::duration<double>(Clock::now() - t0).count() >= m.timeout_s) {
        if (!m.comm)  // finalized: nothing left to abort
          throw Error(ErrorCode::kRuntime,
                      m.who() + ": the stream did not complete within " + seconds(m.timeout_s) + " s");
        m.fail_locked(m.who() + ": the work on the stream did not complete within " + seconds(m.timeout_s) +
                      " s (a collective waits for a peer rank that died or stopped answering? "
                      "INDEXCP_NCCL_TIMEOUT_S sets the timeout)");
      }
    }
    backoff.pause();
  }
}

void NcclCommunicator::finalize() {
  Impl& m = *impl_;
  ncclResult_t r;
  {
    std::lock_guard<std::mutex> lk(m.mu);
    if (m.aborted || m.finalized || !m.comm) return;
    r = ncclCommFinalize(m.comm);
  }
  m.settle(r, "ncclCommFinalize");
  std::lock_guard<std::mutex> lk(m.mu);
  if (m.comm) ncclCommDestroy(m.comm);
  m.comm = nullptr;
  m.finalized = true;
}

void NcclCommunicator::abort() {
  std::lock_guard<std::mutex> lk(impl_->mu);
  if (impl_->finalized) return;
  impl_->abort_locked();
}

// ---------------------------------------------------------------------------------------------

std::unique_ptr<NcclCommunicator> make_single_rank(int device, double timeout_s) {
  Options o;
  o.rank = 0;
  o.world = 1;
  o.device = device;
  o.timeout_s = timeout_s;
  return std::make_unique<NcclCommunicator>(make_unique_id(), o);
}

std::unique_ptr<NcclCommunicator> make_communicator(const RankEnv& env) {
  if (env.world == 1) return make_single_rank(env.device, env.timeout_s);
  // One key per communicator this process creates: every rank creates its communicators in the
  // same order, so the n-th communicator of each rank meets the others' n-th.
  static std::atomic<int> generation{0};
  const std::string key = "nccl-unique-id-" + std::to_string(generation++);
  FileRendezvous rdv(env);
  std::string blob;
  if (env.rank == 0) {
    const UniqueId id = make_unique_id();
    blob.assign(reinterpret_cast<const char*>(id.bytes), sizeof id.bytes);
  }
  blob = rdv.broadcast(key, blob, 0);
  if (blob.size() != sizeof(UniqueId::bytes))
    throw Error(ErrorCode::kRuntime, "rendezvous: rank 0's \"" + key + "\" in \"" + env.rendezvous_dir + "\" holds " +
                                         std::to_string(blob.size()) + " bytes, not the 128 of an ncclUniqueId");
  UniqueId id;
  std::memcpy(id.bytes, blob.data(), sizeof id.bytes);
  Options o;
  o.rank = env.rank;
  o.world = env.world;
  o.device = env.device;
  o.timeout_s = env.timeout_s;
  return std::make_unique<NcclCommunicator>(id, o);
}

std::unique_ptr<NcclCommunicator> make_communicator_from_env() {
  if (auto env = rank_env_from_env()) return make_communicator(*env);
  RankEnv e;
  e.device = device_from_env(0);
  e.timeout_s = group_timeout_from_env();
  return make_communicator(e);
}

}  // namespace indexcp::nccl
