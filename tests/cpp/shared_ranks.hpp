// Forked ranks for the shared-tensor suites: each test forks its ranks (bounded by alarm()), which
// rendezvous through the built-in Unix-socket store.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <iostream>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tensortier/util/error.hpp"
#include "tensortier/shared/shared_store.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {

// Throws with `what` unless `ok`: checks inside forked ranks report through the exit status.
inline void Check(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error("check failed: " + what);
}

inline std::string UniqueJob() {
  static std::atomic<int> n{0};
  return StrCat("test.", ::getpid(), ".", n++);
}

// Forks `world` ranks running `body(rank, store)`; returns each rank's exit status (0: body
// returned, 1: it threw, 128+N: killed by signal N). Every rank is killed after 60 s.
inline std::vector<int> RunRanks(
    int world, const std::function<void(int, std::shared_ptr<Store>)>& body,
    std::chrono::milliseconds store_timeout = std::chrono::seconds(20)) {
  std::string job = UniqueJob();
  std::vector<pid_t> pids;
  for (int rank = 0; rank < world; ++rank) {
    pid_t pid = ::fork();
    if (pid == 0) {
      ::alarm(60);
      int status = 0;
      try {
        auto store = std::make_shared<UnixSocketStore>(job, rank == 0, store_timeout);
        body(rank, store);
        // Rank 0 serves the store: it leaves last (a rank that died is waited for briefly).
        store->Set(StrCat("exit/", rank), "");
        if (rank == 0) {
          for (int r = 1; r < world; ++r) {
            try {
              store->Get(StrCat("exit/", r), std::chrono::seconds(3));
            } catch (const IoError&) {
              break;
            }
          }
        }
      } catch (const std::exception& e) {
        std::cerr << "rank " << rank << ": " << e.what() << "\n";
        status = 1;
      }
      std::cerr.flush();
      ::_exit(status);
    }
    pids.push_back(pid);
  }
  std::vector<int> statuses;
  for (pid_t pid : pids) {
    int st = 0;
    ::waitpid(pid, &st, 0);
    statuses.push_back(WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st));
  }
  return statuses;
}

inline void ExpectAllZero(const std::vector<int>& statuses) {
  for (size_t r = 0; r < statuses.size(); ++r) EXPECT_EQ(statuses[r], 0) << "rank " << r;
}

}  // namespace tensortier
