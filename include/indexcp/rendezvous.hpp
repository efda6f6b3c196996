// indexcp: how the processes of one TP group find each other on one host (plain C++, no CUDA).
//
// A multi-process group (one process per GPU, started by `indexcp launch` or by an engine) needs
// each process's rank, the world size, its CUDA device, and a way to share small blobs before any
// communicator exists: the 128-byte ncclUniqueId that rank 0 creates. indexcp shares them through
// a DIRECTORY on the local file system (the rendezvous directory), which needs no network port,
// no MPI and no server:
//
//   - a rank publishes a blob under a key by writing `<key>.rank<r>` to a temporary file in the
//     directory and renaming it into place (rename is atomic: a reader sees the whole file or
//     nothing);
//   - a reader polls for the file until it appears, or until the timeout (default 60 s,
//     INDEXCP_NCCL_TIMEOUT_S) passes, and then fails with an Error naming the rank it waited for;
//   - every file starts with a header line that names the run id, the world size, the rank and
//     the key; a file whose run id or world size differs is STALE (left by another launch) and is
//     ignored, so a directory reused by a later launch with another run id cannot hand out an old
//     unique id. `indexcp launch` creates a fresh directory per launch (and a fresh run id) and
//     removes it at the end.
//
// Environment of a rank (set by `indexcp launch`, or by hand):
//   INDEXCP_WORLD       world size W (1..64); unset: not part of a launched group
//   INDEXCP_RANK        this process's rank, 0..W-1
//   INDEXCP_RENDEZVOUS  the rendezvous directory (required when W > 1; created when missing)
//   INDEXCP_RUN_ID      optional run id ([A-Za-z0-9._-], at most 64 characters)
//   INDEXCP_DEVICE      CUDA device ordinal of this rank; else LOCAL_RANK; else the rank
//   INDEXCP_NCCL_TIMEOUT_S  timeout of every blocking wait in seconds (default 60, > 0)
//   INDEXCP_REPORT_DIR  where a rank may write its report rank<r>.json (set by the launcher)
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace indexcp {

/// The default timeout of rendezvous and communicator waits, in seconds.
constexpr double kDefaultGroupTimeoutS = 60.0;

/// Where this process sits in a multi-process group.
struct RankEnv {
  int rank = 0;
  int world = 1;
  int device = 0;               ///< CUDA device ordinal (INDEXCP_DEVICE, LOCAL_RANK, or the rank)
  std::string rendezvous_dir;   ///< empty only when world == 1
  std::string run_id;           ///< may be empty
  double timeout_s = kDefaultGroupTimeoutS;
};

/// INDEXCP_NCCL_TIMEOUT_S in seconds, or kDefaultGroupTimeoutS when unset. Error
/// (kInvalidArgument) naming the variable when it is not a number in (0, 604800].
double group_timeout_from_env();

/// The CUDA device of this process: INDEXCP_DEVICE, else LOCAL_RANK, else `fallback`. Error
/// (kInvalidArgument) naming the variable when it is not an integer in 0..1023.
int device_from_env(int fallback);

/// The group this process belongs to, from the variables above; std::nullopt when INDEXCP_WORLD is
/// unset. Error (kInvalidArgument) naming the variable when one is malformed or out of range
/// (INDEXCP_RANK missing or outside 0..W-1, INDEXCP_RENDEZVOUS missing with W > 1, ...).
std::optional<RankEnv> rank_env_from_env();

/// Creates a fresh, private (0700) directory `<parent>/<prefix>XXXXXX` (parent: $TMPDIR or /tmp
/// when empty) and returns its path. Error (kIo) naming the parent on failure.
std::string make_unique_dir(const std::string& prefix = "indexcp-", const std::string& parent = "");

/// A fresh run id: "<pid>-<microseconds>-<random hex>".
std::string make_run_id();

/// Blob exchange through a rendezvous directory (see the top of this header). Every rank of the
/// group constructs one with the same directory, run id and world. Keys are [A-Za-z0-9._-]+.
/// Waits poll with a short sleep and fail after `timeout_s` with Error (kRuntime) naming the key,
/// the rank waited for, the directory and INDEXCP_NCCL_TIMEOUT_S. Thread-compatible (one object
/// per rank; ranks may be threads of one process).
class FileRendezvous {
 public:
  /// Error (kInvalidArgument) naming the argument: world in 1..64, rank in 0..world-1, a
  /// non-empty dir, a valid run id, timeout_s in (0, 604800]. Creates `dir` when missing (Error kIo
  /// naming it when that fails).
  FileRendezvous(std::string dir, int rank, int world, std::string run_id = "",
                 double timeout_s = kDefaultGroupTimeoutS);
  /// From a RankEnv (rendezvous_dir, rank, world, run_id, timeout_s).
  explicit FileRendezvous(const RankEnv& env);

  int rank() const { return rank_; }
  int world() const { return world_; }
  const std::string& dir() const { return dir_; }

  /// Writes this rank's blob for `key` (atomically). A rank publishes a key at most once per run.
  void publish(const std::string& key, const std::string& blob) const;
  /// Waits for rank `from`'s blob of `key` and returns it (stale files are ignored).
  std::string wait_for(const std::string& key, int from) const;
  /// Rank `root` publishes `blob`; every rank returns root's blob (the root returns its own).
  std::string broadcast(const std::string& key, const std::string& blob, int root = 0) const;
  /// Every rank publishes its blob; every rank returns all W blobs in rank order. Also a barrier.
  std::vector<std::string> all_gather(const std::string& key, const std::string& blob) const;

  /// The file that holds rank r's blob of `key` (for tests and diagnostics).
  std::string path_of(const std::string& key, int r) const;

 private:
  std::string dir_, run_id_;
  int rank_ = 0, world_ = 1;
  double timeout_s_ = kDefaultGroupTimeoutS;
};

}  // namespace indexcp
