// strata-ckpt: inspect, verify and convert strata checkpoints.
//
//   strata-ckpt inspect <path> [--step N] [--all-shards]
//   strata-ckpt verify  <path> [--step N]
//   strata-ckpt convert <path> <out.safetensors> [--step N] [--no-verify]
//
// <path> is a checkpoint root (holding `latest`; --step picks another step),
// a step directory (holding manifest.json), or for inspect also a single
// .safetensors file. Exit status: 0 when all is well, 1 on any problem
// (reported on stderr), 2 on a usage error.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "ckpt_tool.h"
#include "strata/checkpoint/loader.h"
#include "strata/checkpoint/safetensors.h"

namespace strata::ckpt_tool {
namespace {

constexpr char kUsage[] =
    "usage:\n"
    "  strata-ckpt inspect <path> [--step N] [--all-shards]\n"
    "  strata-ckpt verify  <path> [--step N]\n"
    "  strata-ckpt convert <path> <out.safetensors> [--step N] [--no-verify]\n"
    "<path>: a checkpoint root (holding 'latest'), a step directory, or (inspect)\n"
    "a .safetensors file. Exit status 0: all is well; 1: a problem; 2: usage.\n";

int Usage(const std::string& why) {
  std::fprintf(stderr, "strata-ckpt: %s\n%s", why.c_str(), kUsage);
  return 2;
}

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "strata-ckpt: error: %s\n", std::string(s.message()).c_str());
  return 1;
}

struct Args {
  std::string command;
  std::vector<std::string> positional;
  int64_t step = -1;
  bool all_shards = false;
  bool verify = true;
};

// Parses argv; returns a usage message on failure.
std::string ParseArgs(int argc, char** argv, Args* a) {
  if (argc < 2) return "missing command";
  a->command = argv[1];
  if (a->command == "-h" || a->command == "--help" || a->command == "help") return "help";
  for (int i = 2; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--step") {
      if (i + 1 >= argc || !absl::SimpleAtoi(argv[i + 1], &a->step) || a->step < 0) {
        return "--step needs a non-negative integer";
      }
      ++i;
    } else if (arg == "--all-shards") {
      a->all_shards = true;
    } else if (arg == "--no-verify") {
      a->verify = false;
    } else if (arg == "-h" || arg == "--help") {
      return "help";
    } else if (absl::StartsWith(arg, "--")) {
      return absl::StrCat("unknown option ", arg);
    } else {
      a->positional.push_back(arg);
    }
  }
  return "";
}

int Inspect(const Args& a) {
  if (a.positional.size() != 1) return Usage("inspect takes one path");
  const std::string& path = a.positional[0];
  if (absl::EndsWith(path, ".safetensors")) {
    absl::StatusOr<SafetensorsFile> f = SafetensorsFile::Open(path);
    if (!f.ok()) return Fail(f.status());
    std::fputs(DescribeSafetensors(*f).c_str(), stdout);
    return 0;
  }
  absl::StatusOr<std::unique_ptr<CheckpointReader>> r = OpenCheckpoint(path, a.step, true);
  if (!r.ok()) return Fail(r.status());
  std::fputs(DescribeCheckpoint(**r, a.all_shards).c_str(), stdout);
  return 0;
}

int Verify(const Args& a) {
  if (a.positional.size() != 1) return Usage("verify takes one path");
  absl::StatusOr<std::unique_ptr<CheckpointReader>> r =
      OpenCheckpoint(a.positional[0], a.step, true);
  if (!r.ok()) return Fail(r.status());
  const VerifyReport v = VerifyCheckpoint((*r)->step_directory(), (*r)->manifest());
  for (const absl::Status& p : v.problems) {
    std::fprintf(stderr, "strata-ckpt: problem: %s\n", std::string(p.message()).c_str());
  }
  if (!v.ok()) {
    std::fprintf(stderr, "strata-ckpt: %s: %zu problem(s) found\n", (*r)->step_directory().c_str(),
                 v.problems.size());
    return 1;
  }
  std::printf("OK %s: %d files, %s checked (%s)\n", (*r)->step_directory().c_str(), v.files_checked,
              HumanBytes(v.bytes_checked).c_str(),
              ChecksumAlgorithmName((*r)->manifest().checksum));
  return 0;
}

int Convert(const Args& a) {
  if (a.positional.size() != 2) return Usage("convert takes a checkpoint path and an output file");
  absl::StatusOr<std::unique_ptr<CheckpointReader>> r =
      OpenCheckpoint(a.positional[0], a.step, a.verify);
  if (!r.ok()) return Fail(r.status());
  absl::StatusOr<uint64_t> bytes = ConvertToSafetensors(**r, a.positional[1]);
  if (!bytes.ok()) return Fail(bytes.status());
  std::printf("wrote %s: %zu tensors, %s (step %lld%s)\n", a.positional[1].c_str(),
              (*r)->manifest().tensors.size(), HumanBytes(*bytes).c_str(),
              static_cast<long long>((*r)->step()), a.verify ? ", verified" : "");
  return 0;
}

}  // namespace
}  // namespace strata::ckpt_tool

int main(int argc, char** argv) {
  using namespace strata::ckpt_tool;
  Args a;
  const std::string err = ParseArgs(argc, argv, &a);
  if (err == "help") {
    std::fputs(kUsage, stdout);
    return 0;
  }
  if (!err.empty()) return Usage(err);
  if (a.command == "inspect") return Inspect(a);
  if (a.command == "verify") return Verify(a);
  if (a.command == "convert") return Convert(a);
  return Usage(absl::StrCat("unknown command '", a.command, "'"));
}
