#include "conformance.h"

#include <condition_variable>
#include <thread>

#include "strata/base/status.h"

namespace strata::testing {
namespace {

class Host final : public Memory {
 public:
  bool host() const override { return true; }
  void* Allocate(size_t) override { return nullptr; }
  void Free(void*) override {}
  void Upload(void*, const void*, size_t) override {}
  void Download(void*, const void*, size_t) override {}
};

// Threads meet here before their roots go away.
class Latch {
 public:
  explicit Latch(int n) : left_(n) {}
  void ArriveAndWait() {
    std::unique_lock<std::mutex> lock(mu_);
    if (--left_ == 0) cv_.notify_all();
    cv_.wait(lock, [this] { return left_ == 0; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int left_;
};

}  // namespace

Memory& HostMemory() {
  static Host* host = new Host();  // stateless
  return *host;
}

Tensor::Tensor(Memory& memory, DataType dtype, size_t count)
    : memory_(memory), host_(dtype, count) {
  if (!memory_.host()) device_ = memory_.Allocate(count * DataTypeSize(dtype) + 1);
}

Tensor::~Tensor() {
  if (device_ != nullptr) memory_.Free(device_);
}

Buffer Tensor::slice(size_t offset, size_t n) {
  if (device_ == nullptr) return host_.slice(offset, n);
  return Buffer{static_cast<char*>(device_) + offset * DataTypeSize(host_.dtype()), n,
                host_.dtype()};
}

void Tensor::Upload() {
  if (device_ != nullptr) {
    memory_.Upload(device_, host_.data(), host_.count() * DataTypeSize(host_.dtype()));
  }
}

void Tensor::Download() {
  if (device_ != nullptr) {
    memory_.Download(host_.data(), device_, host_.count() * DataTypeSize(host_.dtype()));
  }
}

ThreadEnv::ThreadEnv(int size, RootFactory make_root, Memory& memory, size_t large)
    : size_(size), make_root_(std::move(make_root)), memory_(memory), large_(large) {}

void ThreadEnv::OnEveryRank(const std::function<void(Communicator& world)>& body) {
  Latch done(size_);
  std::vector<std::thread> threads;
  for (int r = 0; r < size_; ++r) {
    threads.emplace_back([&, r] {
      if (on_thread) on_thread(r);
      std::unique_ptr<Communicator> root = make_root_(r);
      EXPECT_NE(root, nullptr) << "rank " << r << " has no root communicator";
      if (root != nullptr) body(*root);
      done.ArriveAndWait();
    });
  }
  for (std::thread& t : threads) t.join();
}

std::string EnvName(const ::testing::TestParamInfo<EnvFactory>& info) { return info.param.name; }

void PrintTo(const EnvFactory& factory, std::ostream* os) { *os << factory.name; }

void Conformance::SetUp() {
  if (GetParam().unavailable) {
    const std::string why = GetParam().unavailable();
    if (!why.empty()) GTEST_SKIP() << why;
  }
  env_ = GetParam().make();
  ASSERT_NE(env_, nullptr);
}

void Conformance::TearDown() {
  if (env_ != nullptr) env_->AfterTest(HasFailure());
}

void RecordingSink::OnScheduled(const observe::OpRecord& record) {
  std::lock_guard<std::mutex> lock(mu_);
  calls_.push_back(Call{Call::kScheduled, record});
}

void RecordingSink::OnStarted(const observe::OpRecord& record) {
  std::lock_guard<std::mutex> lock(mu_);
  calls_.push_back(Call{Call::kStarted, record});
}

void RecordingSink::OnCompleted(const observe::OpRecord& record) {
  std::lock_guard<std::mutex> lock(mu_);
  calls_.push_back(Call{Call::kCompleted, record});
}

void RecordingSink::OnWaited(const observe::CommRecord& comm, observe::OpKind kind, int64_t ns) {
  std::lock_guard<std::mutex> lock(mu_);
  waits_.push_back({comm.name, kind, ns});
}

std::vector<RecordingSink::Waited> RecordingSink::waits() const {
  std::lock_guard<std::mutex> lock(mu_);
  return waits_;
}

std::vector<RecordingSink::Call> RecordingSink::calls() const {
  std::lock_guard<std::mutex> lock(mu_);
  return calls_;
}

std::vector<observe::OpRecord> RecordingSink::records() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<observe::OpRecord> out;
  for (const Call& c : calls_) {
    bool found = false;
    for (observe::OpRecord& r : out) {
      if (r.comm == c.record.comm && r.op_id == c.record.op_id) {
        r = c.record;
        found = true;
      }
    }
    if (!found) out.push_back(c.record);
  }
  return out;
}

}  // namespace strata::testing
