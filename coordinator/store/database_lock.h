// One coordinator per database (issue #27): a coordinator holds an exclusive lock on its
// SQLite file for its whole life, and a second one refuses to start, naming the holder.
// Two coordinators on one file would each schedule only the jobs they admitted and hand the
// same output to two jobs.
//
// The lock is flock(2) on the database file itself, through a descriptor of its own:
// independent of SQLite's POSIX record locks on the same file (Linux keeps the two kinds
// apart), released by the kernel when the process dies however it dies, and visible in
// /proc/locks, which names the holder's pid.
//
// Also refuses what would start healthy and fail every write: a database that cannot be
// written (the file or, for SQLite's write-ahead log, its directory).
//
// Thread-safety: a DatabaseLock is a handle; moving it is not thread-safe.
#ifndef LATHE_COORDINATOR_STORE_DATABASE_LOCK_H_
#define LATHE_COORDINATOR_STORE_DATABASE_LOCK_H_

#include <string>

#include "absl/status/statusor.h"

namespace lathe {

class DatabaseLock {
 public:
  // Creates `path` when missing (empty: SQLite makes it a new database) and locks it.
  // FAILED_PRECONDITION naming the path and the holder's pid when another process (or
  // another lock in this one) holds it; PERMISSION_DENIED naming the path when the file or
  // its directory is not writable; INTERNAL for other errors. `created_empty` tells whether
  // the file was missing or empty, that is whether the store will start a new database.
  static absl::StatusOr<DatabaseLock> Acquire(const std::string& path, bool* created_empty);

  DatabaseLock(DatabaseLock&& other) noexcept;
  DatabaseLock& operator=(DatabaseLock&& other) noexcept;
  DatabaseLock(const DatabaseLock&) = delete;
  DatabaseLock& operator=(const DatabaseLock&) = delete;
  ~DatabaseLock();

 private:
  explicit DatabaseLock(int fd) : fd_(fd) {}
  int fd_ = -1;
};

}  // namespace lathe

#endif  // LATHE_COORDINATOR_STORE_DATABASE_LOCK_H_
