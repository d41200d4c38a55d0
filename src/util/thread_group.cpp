#include "tensortier/util/thread_group.hpp"

#include <system_error>
#include <utility>

#include "tensortier/util/error.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {

ThreadGroup::ThreadGroup(unsigned count, std::string_view what, std::function<void()> body,
                         std::function<void()> stop)
    : stop_(std::move(stop)) {
  threads_.reserve(count);
  try {
    for (unsigned i = 0; i < count; ++i) threads_.emplace_back(body);
  } catch (const std::system_error& e) {  // no thread to be had: stop those started, then say so
    Stop();
    ThrowSystemError(e.code().value(), StrCat("start ", count, " ", what));
  } catch (...) {
    Stop();
    throw;
  }
}

void ThreadGroup::Stop() {
  if (threads_.empty()) return;
  stop_();
  for (std::thread& t : threads_) t.join();
  threads_.clear();
}

}  // namespace tensortier
