// The job queue of asynchronous device transfers (device_jobs.hpp): jobs run on the queue's
// threads, at most that many at once, their results and errors reach every wait, and the queue
// runs what it was given before it goes.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

#include "tensortier/transfer/device_jobs.hpp"

namespace tensortier {
namespace {

using namespace std::chrono_literals;

TransferResult Bytes(uint64_t n) {
  TransferResult r;
  r.bytes = n;
  r.path = "bounce";
  return r;
}

TEST(DeviceJobQueueTest, JobsRunOnTheQueuesThreadsAndReturnTheirResults) {
  DeviceJobQueue queue(2, "test threads");
  const std::thread::id caller = std::this_thread::get_id();
  std::vector<DeviceJob> jobs;
  std::atomic<int> on_caller{0};
  for (uint64_t i = 0; i < 20; ++i) {
    jobs.push_back(queue.Submit([i, caller, &on_caller] {
      if (std::this_thread::get_id() == caller) ++on_caller;
      return Bytes(i);
    }));
  }
  for (uint64_t i = 0; i < 20; ++i) {
    EXPECT_EQ(jobs[i].Wait().bytes, i);
    EXPECT_TRUE(jobs[i].done());
    EXPECT_EQ(jobs[i].Wait().path, "bounce");  // as often as asked
  }
  EXPECT_EQ(on_caller.load(), 0);
  EXPECT_EQ(queue.threads(), 2u);
}

TEST(DeviceJobQueueTest, AJobsErrorIsThrownByEveryWaitAndTheQueueGoesOn) {
  DeviceJobQueue queue(1, "test threads");
  DeviceJob failed =
      queue.Submit([]() -> TransferResult { throw std::runtime_error("copy failed"); });
  DeviceJob next = queue.Submit([] { return Bytes(7); });
  for (int i = 0; i < 2; ++i) {
    try {
      failed.Wait();
      ADD_FAILURE() << "no error";
    } catch (const std::runtime_error& e) {
      EXPECT_STREQ(e.what(), "copy failed");
    }
  }
  EXPECT_EQ(next.Wait().bytes, 7u);
}

TEST(DeviceJobQueueTest, AtMostThreadsJobsRunAtOnce) {
  DeviceJobQueue queue(3, "test threads");
  std::atomic<int> running{0}, most{0};
  std::vector<DeviceJob> jobs;
  for (int i = 0; i < 12; ++i) {
    jobs.push_back(queue.Submit([&] {
      int now = ++running;
      int seen = most.load();
      while (now > seen && !most.compare_exchange_weak(seen, now)) {
      }
      // Held until another job runs too (or a second passes): the queue lets them overlap.
      const auto give_up = std::chrono::steady_clock::now() + 1s;
      while (most.load() < 2 && std::chrono::steady_clock::now() < give_up) {
        std::this_thread::sleep_for(1ms);
      }
      std::this_thread::sleep_for(2ms);
      --running;
      return Bytes(1);
    }));
  }
  for (const DeviceJob& j : jobs) j.Wait();
  EXPECT_LE(most.load(), 3);
  EXPECT_GE(most.load(), 2);  // they do run at once
}

TEST(DeviceJobQueueTest, WaitForTimesOutWhileTheJobRuns) {
  DeviceJobQueue queue(1, "test threads");
  std::atomic<bool> release{false};
  DeviceJob job = queue.Submit([&] {
    while (!release) std::this_thread::sleep_for(1ms);
    return Bytes(3);
  });
  EXPECT_FALSE(job.WaitFor(20ms));
  EXPECT_FALSE(job.done());
  release = true;
  EXPECT_TRUE(job.WaitFor(10s));
  EXPECT_EQ(job.Wait().bytes, 3u);
}

TEST(DeviceJobQueueTest, DestructionRunsEveryQueuedJobFirst) {
  std::atomic<int> ran{0};
  std::vector<DeviceJob> jobs;
  {
    DeviceJobQueue queue(1, "test threads");
    for (int i = 0; i < 10; ++i) {
      jobs.push_back(queue.Submit([&] {
        std::this_thread::sleep_for(1ms);
        ++ran;
        return Bytes(1);
      }));
    }
  }
  EXPECT_EQ(ran.load(), 10);
  for (const DeviceJob& j : jobs) EXPECT_TRUE(j.done());
}

TEST(DeviceJobQueueTest, AJobWithoutWorkIsDoneAndAQueueNeedsAThread) {
  DeviceJob none;
  EXPECT_TRUE(none.done());
  EXPECT_EQ(none.Wait().bytes, 0u);
  EXPECT_THROW(DeviceJobQueue(0, "test threads"), std::invalid_argument);
}

}  // namespace
}  // namespace tensortier
