// Child process of crash_test.cc: saves `step` into `dir` and, when the
// writer reaches `point`, prints "at <point>" and sleeps until the parent
// kills it with SIGKILL.
//
//   checkpoint_crash_helper <dir> <step> <point>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "strata/checkpoint/checkpointer.h"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s <dir> <step> <point>\n", argv[0]);
    return 2;
  }
  const std::string point = argv[3];
  strata::CheckpointOptions o;
  o.directory = argv[1];
  o.chunk_bytes = 4096;
  o.max_file_bytes = 1 << 20;  // several files
  o.test_hook = [&](absl::string_view p) {
    if (p == point) {
      std::printf("at %s\n", point.c_str());
      std::fflush(stdout);
      for (;;) ::pause();
    }
    return absl::OkStatus();
  };
  auto ckpt = strata::Checkpointer::Create(o);
  if (!ckpt.ok()) return 3;
  const int64_t step = std::atoll(argv[2]);
  std::vector<std::vector<float>> data;
  strata::SaveRequest req;
  req.step = step;
  for (int i = 0; i < 6; ++i) {
    data.emplace_back(300000, static_cast<float>(step * 10 + i));
    req.tensors.push_back({strata::ShardedTensor::Whole("t" + std::to_string(i),
                                                        strata::DataType::kFloat32, {300000}),
                           data.back().data()});
  }
  if (!(*ckpt)->Save(req).ok()) return 4;
  const absl::Status s = (*ckpt)->Wait(absl::Now() + absl::Seconds(120));
  std::printf("done %s\n", s.ToString().c_str());
  return s.ok() ? 0 : 5;
}
