// An IOHandle operation (operation.hpp): host pieces through the engine and device pieces as jobs,
// merged in the caller's order; its error is delivered once. And the offloader's backend names
// (offloader.hpp): the engine's and TensorNVMe's.
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "tensortier/io/backend.hpp"
#include "tensortier/io/engine.hpp"
#include "tensortier/io/file.hpp"
#include "tensortier/offload/offloader.hpp"
#include "tensortier/transfer/device_jobs.hpp"
#include "tensortier/transfer/operation.hpp"
#include "test_util.hpp"

namespace tensortier {
namespace {

TransferResult Moved(uint64_t bytes, std::string path, std::string gds_reason = "") {
  TransferResult r;
  r.bytes = bytes;
  r.path = std::move(path);
  r.gds_reason = std::move(gds_reason);
  return r;
}

TEST(OperationTest, MergesHostAndDevicePiecesInTheCallersOrder) {
  testing::TempDir dir;
  Engine engine(testing::SmallEngineOptions(BackendKind::kThreads));
  File file = File::Open(dir.File("f"), OpenMode::kWrite, /*direct=*/false);
  std::vector<char> a(100, 'a');
  std::vector<char> b(300, 'b');
  std::vector<IoDesc> descs = {{file, a.data(), 0, a.size()}, {file, b.data(), 100, b.size()}};
  Future host = engine.Submit(IoOp::kWrite, descs);
  // Pieces: device (7), host (100), device (9), host (300).
  Operation op(host, {DeviceJob(Moved(7, "gds")), DeviceJob(Moved(9, "bounce", "no nvidia-fs"))},
               {true, false, true, false});
  const OperationResult r = op.Wait();
  EXPECT_TRUE(op.done());
  EXPECT_EQ(r.segment_bytes, (std::vector<uint64_t>{7, 100, 9, 300}));
  EXPECT_EQ(r.bytes, 416u);
  EXPECT_TRUE(r.host);
  ASSERT_EQ(r.device.size(), 2u);
  EXPECT_EQ(r.device[1].gds_reason, "no nvidia-fs");
  EXPECT_FALSE(op.HasUndeliveredError());
}

TEST(OperationTest, WithoutHostPiecesThereIsNoHostPart) {
  Operation op(Future(), {DeviceJob(Moved(4096, "gds"))}, {true});
  const OperationResult r = op.Wait();
  EXPECT_FALSE(r.host);
  EXPECT_EQ(r.segment_bytes, std::vector<uint64_t>{4096});
}

TEST(OperationTest, AnErrorIsDeliveredOnce) {
  DeviceJobQueue queue(1, "test threads");
  DeviceJob failing = queue.Submit([]() -> TransferResult { throw std::runtime_error("copy"); });
  Operation op(Future(), {DeviceJob(Moved(1, "bounce")), failing}, {true, true});
  EXPECT_TRUE(op.WaitFor(std::chrono::seconds(10)));
  EXPECT_TRUE(op.HasUndeliveredError());
  std::exception_ptr taken = op.TakeUndeliveredError();
  ASSERT_TRUE(taken);
  EXPECT_FALSE(op.TakeUndeliveredError());  // given once
  op.ReturnError();                         // its taker could not raise it
  EXPECT_TRUE(op.HasUndeliveredError());
  EXPECT_THROW(op.Wait(), std::runtime_error);  // Wait() delivers it
  EXPECT_FALSE(op.TakeUndeliveredError());
  EXPECT_THROW(op.Wait(), std::runtime_error);  // and throws it again when asked again
}

TEST(OffloadBackendNameTest, TakesTheEnginesNamesAndTensorNvmes) {
  EXPECT_EQ(OffloadBackendName("auto"), "auto");
  EXPECT_EQ(OffloadBackendName("io_uring"), "io_uring");
  EXPECT_EQ(OffloadBackendName("uring"), "io_uring");
  EXPECT_EQ(OffloadBackendName("aio"), "libaio");
  EXPECT_EQ(OffloadBackendName("pthread"), "threads");
  try {
    OffloadBackendName("spdk");
    FAIL() << "spdk taken";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(),
                 "backend 'spdk' is not one of aio, auto, io_uring, libaio, pthread, threads, "
                 "uring");
  }
}

}  // namespace
}  // namespace tensortier
