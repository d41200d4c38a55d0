#include "tensortier/transfer/device_jobs.hpp"

#include <unistd.h>

#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>

#include "tensortier/util/thread_group.hpp"

namespace tensortier {

struct DeviceJob::State {
  std::mutex mu;
  std::condition_variable over_cv;
  bool over = false;               // guarded by mu
  TransferResult result;           // guarded by mu; set before `over`
  std::exception_ptr error;        // guarded by mu; set before `over`
  std::function<TransferResult()> work;  // run once, by one thread, then released

  void Finish(TransferResult r, std::exception_ptr e) {
    std::lock_guard lock(mu);
    result = std::move(r);
    error = std::move(e);
    over = true;
    over_cv.notify_all();
  }
};

DeviceJob::DeviceJob() : state_(std::make_shared<State>()) { state_->over = true; }

DeviceJob::DeviceJob(TransferResult result) : DeviceJob() {
  state_->result = std::move(result);
}

bool DeviceJob::done() const {
  std::lock_guard lock(state_->mu);
  return state_->over;
}

bool DeviceJob::WaitFor(std::chrono::milliseconds timeout) const {
  std::unique_lock lock(state_->mu);
  return state_->over_cv.wait_for(lock, timeout, [&] { return state_->over; });
}

TransferResult DeviceJob::Wait() const {
  std::unique_lock lock(state_->mu);
  state_->over_cv.wait(lock, [&] { return state_->over; });
  if (state_->error) std::rethrow_exception(state_->error);
  return state_->result;
}

struct DeviceJobQueue::Impl {
  std::mutex mu;
  std::condition_variable work_cv;
  std::deque<std::shared_ptr<DeviceJob::State>> queued;  // guarded by mu
  bool stopping = false;                                 // guarded by mu
  std::mutex start_mu;  // held while the threads start (their stop takes mu)
  std::unique_ptr<ThreadGroup> threads;  // guarded by start_mu; made by the first Submit

  // A thread's loop: runs jobs until stopping and nothing is left.
  void Run() {
    for (;;) {
      std::shared_ptr<DeviceJob::State> job;
      {
        std::unique_lock lock(mu);
        work_cv.wait(lock, [&] { return stopping || !queued.empty(); });
        if (queued.empty()) return;
        job = std::move(queued.front());
        queued.pop_front();
      }
      std::function<TransferResult()> work = std::move(job->work);
      TransferResult result;
      std::exception_ptr error;
      try {
        result = work();
      } catch (...) {
        error = std::current_exception();
      }
      work = nullptr;  // what the job held goes before anyone sees it over
      job->Finish(std::move(result), std::move(error));
    }
  }
};

DeviceJobQueue::DeviceJobQueue(unsigned threads, std::string what)
    : threads_(threads), what_(std::move(what)), impl_(std::make_unique<Impl>()) {
  if (threads == 0) throw std::invalid_argument("a device job queue needs at least one thread");
}

DeviceJobQueue::~DeviceJobQueue() {
  if (maker_.Forked()) {
    // A child made by fork(): the threads were not copied, and the locks they held stay held.
    // Everything is left in place (as the engine does).
    impl_.release();  // NOLINT(bugprone-unused-return-value)
    return;
  }
  std::lock_guard start(impl_->start_mu);
  impl_->threads.reset();  // runs what is queued (the threads leave once it is empty), then joins
}

DeviceJob DeviceJobQueue::Submit(std::function<TransferResult()> work) {
  auto state = std::make_shared<DeviceJob::State>();
  state->work = std::move(work);
  {
    std::lock_guard start(impl_->start_mu);
    if (!impl_->threads) {
      Impl* impl = impl_.get();
      impl_->threads = std::make_unique<ThreadGroup>(
          threads_, what_, [impl] { impl->Run(); },
          [impl] {
            std::lock_guard lock(impl->mu);
            impl->stopping = true;
            impl->work_cv.notify_all();
          });
    }
  }
  std::lock_guard lock(impl_->mu);
  impl_->queued.push_back(state);
  impl_->work_cv.notify_one();
  return DeviceJob(std::move(state));
}

}  // namespace tensortier
