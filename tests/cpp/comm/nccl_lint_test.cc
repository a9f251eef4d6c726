// The NCCL lint: one test per variable the issue names (checked against
// NCCL's docs and source, see nccl_tuning/nccl_vars.tsv), the precedence of
// NCCL's configuration sources, nccl.conf syntax as NCCL reads it, value
// coercion, version awareness and contradictions with the machine.
#include "strata/comm/nccl_lint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "comm/nccl_tuning/nccl_lint_internal.h"
#include "strata/comm/nccl_settings.h"

namespace strata {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;

constexpr NcclVersion k2289{2, 28, 9};

// Lints `env` as the process environment (no files) for `version`.
LintReport Lint(std::map<std::string, std::string> env, NcclVersion version = k2289,
                const Topology* topology = nullptr) {
  CollectOptions c;
  c.environment = std::move(env);
  c.read_conf_files = false;
  c.nccl_version = version;
  absl::StatusOr<EffectiveSettings> s = CollectNcclSettings(c);
  EXPECT_TRUE(s.ok()) << s.status();
  LintOptions o;
  o.nccl_version = version;
  o.topology = topology;
  return LintNcclSettings(*s, o);
}

// The finding with `rule` for `name`, or nullptr.
const Finding* Find(const LintReport& r, const std::string& name, const std::string& rule) {
  for (const Finding& f : r.findings) {
    if (f.name == name && f.rule == rule) return &f;
  }
  return nullptr;
}

std::string Rules(const LintReport& r) {
  std::string out;
  for (const Finding& f : r.findings) out += f.Describe() + "\n";
  return out;
}

// ---- the variables of the guide -----------------------------------

TEST(NcclLintGuide, SocketTimeoutDoesNotExist) {
  LintReport r = Lint({{"NCCL_SOCKET_TIMEOUT", "600"}});
  const Finding* f = Find(r, "NCCL_SOCKET_TIMEOUT", "unknown-name");
  ASSERT_NE(f, nullptr) << Rules(r);
  EXPECT_EQ(f->severity, Severity::kError);
  EXPECT_THAT(f->fix, HasSubstr("NCCL_SOCKET_RETRY_CNT"));
  EXPECT_EQ(FindNcclVariable("NCCL_SOCKET_TIMEOUT"), nullptr);
}

TEST(NcclLintGuide, BuffersPerChannelDoesNotExist) {
  LintReport r = Lint({{"NCCL_BUFFERS_PER_CHANNEL", "4"}});
  const Finding* f = Find(r, "NCCL_BUFFERS_PER_CHANNEL", "unknown-name");
  ASSERT_NE(f, nullptr) << Rules(r);
  EXPECT_EQ(f->severity, Severity::kError);
  EXPECT_THAT(f->fix, HasSubstr("NCCL_BUFFSIZE"));
}

TEST(NcclLintGuide, TreeThresholdWasRemovedIn25) {
  LintReport r = Lint({{"NCCL_TREE_THRESHOLD", "0"}});
  const Finding* f = Find(r, "NCCL_TREE_THRESHOLD", "removed");
  ASSERT_NE(f, nullptr) << Rules(r);
  EXPECT_EQ(f->severity, Severity::kError);
  EXPECT_THAT(f->message, HasSubstr("removed in NCCL 2.5"));
  // NCCL 2.4 still read it: no finding about the name there.
  EXPECT_EQ(Find(Lint({{"NCCL_TREE_THRESHOLD", "0"}}, {2, 4, 8}), "NCCL_TREE_THRESHOLD", "removed"),
            nullptr);
}

TEST(NcclLintGuide, MinNringsIsADeprecatedAlias) {
  LintReport r = Lint({{"NCCL_MIN_NRINGS", "4"}});
  const Finding* f = Find(r, "NCCL_MIN_NRINGS", "deprecated");
  ASSERT_NE(f, nullptr) << Rules(r);
  EXPECT_EQ(f->severity, Severity::kWarning);
  EXPECT_THAT(f->message, HasSubstr("old alias"));
  EXPECT_THAT(f->fix, HasSubstr("NCCL_MIN_NCHANNELS"));
  // With the new name also set, NCCL ignores the alias, and the lint says so.
  LintReport both = Lint({{"NCCL_MIN_NRINGS", "4"}, {"NCCL_MIN_NCHANNELS", "8"}});
  EXPECT_THAT(Find(both, "NCCL_MIN_NRINGS", "deprecated")->message,
              HasSubstr("ignored because NCCL_MIN_NCHANNELS is also set"));
}

TEST(NcclLintGuide, MaxNchannelsIsDeprecatedSince217NotAnAlias) {
  // The issue calls it a deprecated alias; NCCL's docs say it is the current
  // name of NCCL_MAX_NRINGS, itself deprecated in 2.17 for NCCL_MAX_CTAS.
  LintReport r = Lint({{"NCCL_MAX_NCHANNELS", "16"}});
  const Finding* f = Find(r, "NCCL_MAX_NCHANNELS", "deprecated");
  ASSERT_NE(f, nullptr) << Rules(r);
  EXPECT_THAT(f->message, HasSubstr("since NCCL 2.17"));
  EXPECT_THAT(f->fix, HasSubstr("NCCL_MAX_CTAS"));
  EXPECT_EQ(
      Find(Lint({{"NCCL_MAX_NCHANNELS", "16"}}, {2, 16, 5}), "NCCL_MAX_NCHANNELS", "deprecated"),
      nullptr);
}

TEST(NcclLintGuide, NthreadsEightIsSilentlyReplaced) {
  LintReport r = Lint({{"NCCL_NTHREADS", "8"}});
  const Finding* f = Find(r, "NCCL_NTHREADS", "out-of-range");
  ASSERT_NE(f, nullptr) << Rules(r);
  EXPECT_EQ(f->severity, Severity::kError);
  EXPECT_THAT(f->message, HasSubstr("not a multiple of 32 in 64..512"));
  EXPECT_THAT(f->message, HasSubstr("silently replaces it with 512"));
  // What getNthreads() does for each case (src/graph/tuning.cc).
  EXPECT_THAT(Find(Lint({{"NCCL_NTHREADS", "32"}}), "NCCL_NTHREADS", "out-of-range")->message,
              HasSubstr("replaces it with 64"));
  EXPECT_THAT(Find(Lint({{"NCCL_NTHREADS", "1024"}}), "NCCL_NTHREADS", "out-of-range")->message,
              HasSubstr("replaces it with 512"));
  EXPECT_EQ(Find(Lint({{"NCCL_NTHREADS", "256"}}), "NCCL_NTHREADS", "out-of-range"), nullptr);
  EXPECT_EQ(Find(Lint({{"NCCL_NTHREADS", "96"}}), "NCCL_NTHREADS", "out-of-range"), nullptr);
}

TEST(NcclLintGuide, IbRetryCountIsAThreeBitField) {
  LintReport r = Lint({{"NCCL_IB_RETRY_CNT", "13"}});
  const Finding* f = Find(r, "NCCL_IB_RETRY_CNT", "out-of-range");
  ASSERT_NE(f, nullptr) << Rules(r);
  EXPECT_EQ(f->severity, Severity::kError);
  EXPECT_THAT(f->message, HasSubstr("0..7"));
  EXPECT_THAT(f->message, HasSubstr("3-bit"));
  EXPECT_EQ(Find(Lint({{"NCCL_IB_RETRY_CNT", "7"}}), "NCCL_IB_RETRY_CNT", "out-of-range"), nullptr);
}

TEST(NcclLintGuide, AsyncErrorHandlingIsPyTorchs) {
  LintReport r = Lint({{"NCCL_ASYNC_ERROR_HANDLING", "1"}});
  const Finding* f = Find(r, "NCCL_ASYNC_ERROR_HANDLING", "other-tool");
  ASSERT_NE(f, nullptr) << Rules(r);
  EXPECT_EQ(f->severity, Severity::kWarning);
  EXPECT_THAT(f->fix, HasSubstr("TORCH_NCCL_ASYNC_ERROR_HANDLING=1"));
  EXPECT_EQ(Find(r, "NCCL_ASYNC_ERROR_HANDLING", "unknown-name"), nullptr);
}

TEST(NcclLintGuide, AlgoAndProtoAreDebuggingSwitches) {
  LintReport r = Lint({{"NCCL_ALGO", "Ring"}, {"NCCL_PROTO", "Simple"}});
  for (const char* name : {"NCCL_ALGO", "NCCL_PROTO"}) {
    const Finding* f = Find(r, name, "debug-setting");
    ASSERT_NE(f, nullptr) << name << "\n" << Rules(r);
    EXPECT_EQ(f->severity, Severity::kWarning);
    EXPECT_THAT(f->message, HasSubstr("costs bandwidth or latency"));
  }
  EXPECT_EQ(r.errors(), 0) << Rules(r);
  // Tokens are checked, by version.
  LintReport bad = Lint({{"NCCL_ALGO", "ring,fastest"}});
  EXPECT_THAT(Find(bad, "NCCL_ALGO", "bad-value")->message, HasSubstr("'fastest'"));
  LintReport pat = Lint({{"NCCL_ALGO", "PAT"}}, {2, 21, 5});
  EXPECT_THAT(Find(pat, "NCCL_ALGO", "bad-value")->message, HasSubstr("not in NCCL 2.21.5"));
  LintReport per_func = Lint({{"NCCL_PROTO", "allreduce:^LL128"}}, {2, 23, 4});
  EXPECT_THAT(Find(per_func, "NCCL_PROTO", "bad-value")->message, HasSubstr("needs NCCL 2.24"));
  EXPECT_EQ(Find(Lint({{"NCCL_PROTO", "allreduce:^LL128"}}), "NCCL_PROTO", "bad-value"), nullptr);
}

TEST(NcclLintGuide, IbGidIndexShouldNotBeSetSince221) {
  LintReport r = Lint({{"NCCL_IB_GID_INDEX", "3"}});
  const Finding* f = Find(r, "NCCL_IB_GID_INDEX", "pinned-gid");
  ASSERT_NE(f, nullptr) << Rules(r);
  EXPECT_EQ(f->severity, Severity::kWarning);
  EXPECT_THAT(f->message, HasSubstr("since NCCL 2.21"));
  // Before 2.21 NCCL used index 0 unless told: setting it was the way.
  EXPECT_EQ(Find(Lint({{"NCCL_IB_GID_INDEX", "3"}}, {2, 20, 5}), "NCCL_IB_GID_INDEX", "pinned-gid"),
            nullptr);
}

TEST(NcclLintGuide, TheWholeGuideAtOnce) {
  LintReport r = Lint({{"NCCL_SOCKET_TIMEOUT", "600"},
                       {"NCCL_BUFFERS_PER_CHANNEL", "4"},
                       {"NCCL_TREE_THRESHOLD", "0"},
                       {"NCCL_MIN_NRINGS", "4"},
                       {"NCCL_MAX_NCHANNELS", "16"},
                       {"NCCL_NTHREADS", "8"},
                       {"NCCL_IB_RETRY_CNT", "13"},
                       {"NCCL_ASYNC_ERROR_HANDLING", "1"},
                       {"NCCL_ALGO", "Ring"},
                       {"NCCL_PROTO", "Simple"},
                       {"NCCL_IB_GID_INDEX", "3"}});
  EXPECT_EQ(r.errors(), 5) << Rules(r);
  EXPECT_EQ(r.warnings(), 9) << Rules(r);  // two each for MIN_NRINGS and MAX_NCHANNELS
  // Errors first, then warnings.
  for (size_t i = 1; i < r.findings.size(); ++i) {
    EXPECT_GE(r.findings[i - 1].severity, r.findings[i].severity) << Rules(r);
  }
}

// ---- values NCCL reads differently from how they look ---------------------

TEST(NcclLintValues, StrtollSemantics) {
  EXPECT_EQ(nccl_tuning_internal::ParseLikeStrtoll("0x10").value, 16);
  EXPECT_TRUE(nccl_tuning_internal::ParseLikeStrtoll("010").octal);
  EXPECT_EQ(nccl_tuning_internal::ParseLikeStrtoll("010").value, 8);
  EXPECT_FALSE(nccl_tuning_internal::ParseLikeStrtoll("abc").digits);
  EXPECT_EQ(nccl_tuning_internal::ParseLikeStrtoll("4MB").rest, "MB");
  EXPECT_TRUE(nccl_tuning_internal::ParseLikeStrtoll("99999999999999999999").overflow);

  LintReport r = Lint({{"NCCL_BUFFSIZE", "4MB"},
                       {"NCCL_IB_TIMEOUT", "020"},
                       {"NCCL_SOCKET_NTHREADS", "four"},
                       {"NCCL_IB_SL", "99999999999999999999"}});
  EXPECT_THAT(Find(r, "NCCL_BUFFSIZE", "trailing-text")->message,
              HasSubstr("leading number of '4MB', 4"));
  EXPECT_THAT(Find(r, "NCCL_IB_TIMEOUT", "octal")->message, HasSubstr("octal: 16"));
  EXPECT_THAT(Find(r, "NCCL_SOCKET_NTHREADS", "not-a-number")->message,
              HasSubstr("reads it as 0 without a warning, which is outside 1..16"));
  EXPECT_THAT(Find(r, "NCCL_IB_SL", "out-of-range")->message, HasSubstr("does not fit in 64 bits"));
}

TEST(NcclLintValues, EnumsLevelsAndProducts) {
  LintReport r = Lint({{"NCCL_DEBUG", "verbose"},
                       {"NCCL_P2P_LEVEL", "NODE"},
                       {"NCCL_NET_GDR_LEVEL", "phb"},
                       {"NCCL_SOCKET_FAMILY", "AF_INET4"},
                       {"NCCL_SOCKET_NTHREADS", "16"},
                       {"NCCL_NSOCKS_PERTHREAD", "8"},
                       {"NCCL_CGA_CLUSTER_SIZE", "16"}});
  EXPECT_THAT(Find(r, "NCCL_DEBUG", "bad-value")->message, HasSubstr("logs nothing"));
  EXPECT_THAT(Find(r, "NCCL_P2P_LEVEL", "bad-value")->message, HasSubstr("nvidia-smi's word"));
  EXPECT_THAT(Find(r, "NCCL_NET_GDR_LEVEL", "bad-value")->fix, HasSubstr("write PHB"));
  EXPECT_NE(Find(r, "NCCL_SOCKET_FAMILY", "bad-value"), nullptr);
  EXPECT_THAT(Find(r, "NCCL_NSOCKS_PERTHREAD", "out-of-range")->message,
              HasSubstr("= 128 exceeds 64; NCCL cuts NCCL_NSOCKS_PERTHREAD to 4"));
  EXPECT_THAT(Find(r, "NCCL_CGA_CLUSTER_SIZE", "out-of-range")->message, HasSubstr("cut to 8"));
  EXPECT_NE(Find(Lint({{"NCCL_P2P_LEVEL", "3"}}), "NCCL_P2P_LEVEL", "legacy-integer"), nullptr);
  EXPECT_NE(Find(Lint({{"NCCL_DEBUG", "INFO"}}), "NCCL_DEBUG", "verbose-logging"), nullptr);
  // The CTA limit was 32 before 2.25.
  EXPECT_NE(Find(Lint({{"NCCL_MAX_CTAS", "48"}}, {2, 24, 3}), "NCCL_MAX_CTAS", "out-of-range"),
            nullptr);
  EXPECT_EQ(Find(Lint({{"NCCL_MAX_CTAS", "48"}}), "NCCL_MAX_CTAS", "out-of-range"), nullptr);
}

TEST(NcclLintValues, IbTimeoutFailureDetection) {
  EXPECT_EQ(IbFailureDetectionTime(20, 7), absl::Microseconds(4.096 * 1048576 * 8));
  EXPECT_EQ(IbFailureDetectionTime(0, 7), absl::InfiniteDuration());
  EXPECT_EQ(IbFailureDetectionTime(32, 7), absl::InfiniteDuration());
  LintReport slow = Lint({{"NCCL_IB_TIMEOUT", "23"}});
  const Finding* f = Find(slow, "NCCL_IB_TIMEOUT", "slow-failure-detection");
  ASSERT_NE(f, nullptr) << Rules(slow);
  // 4.096 us * 2^23 = 34.36 s per attempt, 8 attempts = 274.9 s.
  EXPECT_THAT(f->message, HasSubstr("4m34.8s"));
  EXPECT_THAT(f->message, HasSubstr("8 attempts"));
  LintReport fewer = Lint({{"NCCL_IB_TIMEOUT", "22"}, {"NCCL_IB_RETRY_CNT", "1"}});
  EXPECT_NE(Find(fewer, "NCCL_IB_TIMEOUT", "failure-detection"), nullptr) << Rules(fewer);
  EXPECT_NE(Find(Lint({{"NCCL_IB_TIMEOUT", "0"}}), "NCCL_IB_TIMEOUT", "infinite-timeout"), nullptr);
}

// ---- version awareness ----------------------------------------------------

TEST(NcclLintVersions, TooNewAndTheDoublePrefixBug) {
  LintReport r = Lint({{"NCCL_IB_ADDR_FAMILY", "AF_INET"}}, {2, 19, 4});
  EXPECT_THAT(Find(r, "NCCL_IB_ADDR_FAMILY", "too-new")->message,
              HasSubstr("first appears in NCCL 2.21"));
  // NCCL 2.14.3-2.16.2 read NCCL_NCCL_ALLOC_P2P_NET_LL_BUFFERS by mistake.
  LintReport bug = Lint({{"NCCL_ALLOC_P2P_NET_LL_BUFFERS", "1"}}, {2, 15, 5});
  EXPECT_THAT(Find(bug, "NCCL_ALLOC_P2P_NET_LL_BUFFERS", "too-new")->message,
              HasSubstr("NCCL_NCCL_ALLOC_P2P_NET_LL_BUFFERS"));
  EXPECT_EQ(Find(Lint({{"NCCL_ALLOC_P2P_NET_LL_BUFFERS", "1"}}), "NCCL_ALLOC_P2P_NET_LL_BUFFERS",
                 "too-new"),
            nullptr);
}

TEST(NcclLintVersions, ParseVersions) {
  EXPECT_EQ(*NcclVersion::Parse("2.28.9"), (NcclVersion{2, 28, 9}));
  EXPECT_EQ(*NcclVersion::Parse("22809"), (NcclVersion{2, 28, 9}));
  EXPECT_EQ(NcclVersion::FromCode(2708), (NcclVersion{2, 7, 8}));  // pre-2.9 code
  EXPECT_EQ(*NcclVersion::Parse("2.21"), (NcclVersion{2, 21, 0}));
  EXPECT_THAT(NcclVersion::Parse("latest").status().message(), HasSubstr("'latest'"));
  EXPECT_FALSE(NcclVersion::Parse("3.0.0").ok());
}

TEST(NcclLintNames, SuggestionsAndInternalKnobs) {
  LintReport r = Lint({{"NCCL_IB_TIMOUT", "20"}, {"NCCL_SOCKET_IFNAMES", "eth0"}});
  EXPECT_THAT(Find(r, "NCCL_IB_TIMOUT", "unknown-name")->fix, HasSubstr("NCCL_IB_TIMEOUT"));
  EXPECT_THAT(Find(r, "NCCL_SOCKET_IFNAMES", "unknown-name")->fix, HasSubstr("NCCL_SOCKET_IFNAME"));
  LintReport internal = Lint({{"NCCL_PROXY_APPEND_BATCH_SIZE", "16"}});
  EXPECT_EQ(Find(internal, "NCCL_PROXY_APPEND_BATCH_SIZE", "undocumented")->severity,
            Severity::kInfo);
}

TEST(NcclLintNames, EveryTableRowIsSane) {
  std::set<std::string> names;
  for (const NcclVarInfo& v : NcclVariables()) {
    EXPECT_TRUE(names.insert(v.name).second) << "duplicate " << v.name;
    EXPECT_EQ(std::string(v.name).rfind("NCCL_", 0), 0u) << v.name;
    EXPECT_GT(v.introduced, 0) << v.name;
    EXPECT_TRUE(v.removed == 0 || v.removed > v.introduced) << v.name;
    EXPECT_NE(std::string(v.source), "") << v.name;
    EXPECT_NE(std::string(v.description), "") << v.name;
    if (*v.replacement) EXPECT_NE(FindNcclVariable(v.replacement), nullptr) << v.replacement;
  }
  EXPECT_GT(names.size(), 250u);
}

// ---- configuration files and precedence -----------------------------------

class NcclConfFiles : public testing::Test {
 protected:
  void SetUp() override {
    // One directory per test and process: ctest runs the tests of this
    // fixture in parallel, each in its own process.
    const testing::TestInfo* info = testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::path(testing::TempDir()) /
           ("strata_nccl_conf_" + std::string(info->name()) + "_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "home");
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string Write(const std::string& rel, const std::string& text) {
    std::ofstream(dir_ / rel) << text;
    return (dir_ / rel).string();
  }
  EffectiveSettings Collect(std::map<std::string, std::string> env, NcclVersion v = k2289) {
    CollectOptions c;
    c.environment = std::move(env);
    c.home_dir = (dir_ / "home").string();
    c.system_conf = (dir_ / "etc.conf").string();
    c.nccl_version = v;
    absl::StatusOr<EffectiveSettings> s = CollectNcclSettings(c);
    EXPECT_TRUE(s.ok()) << s.status();
    return *s;
  }
  fs::path dir_;
};

TEST_F(NcclConfFiles, EnvironmentThenUserFileThenSystemFile) {
  Write("home/.nccl.conf", "NCCL_IB_HCA=mlx5_1\nNCCL_DEBUG=INFO\n");
  Write("etc.conf", "NCCL_IB_HCA=mlx5_2\nNCCL_DEBUG=WARN\nNCCL_SOCKET_IFNAME=eth0\n");
  EffectiveSettings s = Collect({{"NCCL_IB_HCA", "mlx5_0"}});
  EXPECT_EQ(*s.Get("NCCL_IB_HCA"), "mlx5_0");       // environment
  EXPECT_EQ(*s.Get("NCCL_DEBUG"), "INFO");          // ~/.nccl.conf before /etc
  EXPECT_EQ(*s.Get("NCCL_SOCKET_IFNAME"), "eth0");  // /etc when nobody else sets it
  EXPECT_EQ(s.Find("NCCL_DEBUG")->source, SettingSource::kUserConf);
  LintOptions o;
  o.nccl_version = k2289;
  LintReport r = LintNcclSettings(s, o);
  int shadowed = 0;
  for (const Finding& f : r.findings) shadowed += f.rule == "shadowed";
  EXPECT_EQ(shadowed, 3) << Rules(r);  // two IB_HCA lines, /etc's DEBUG
}

TEST_F(NcclConfFiles, ConfFileReplacesTheHomeFileSince223) {
  Write("home/.nccl.conf", "NCCL_DEBUG=INFO\n");
  std::string custom = Write("custom.conf", "NCCL_DEBUG=WARN\n");
  EffectiveSettings s = Collect({{"NCCL_CONF_FILE", custom}});
  EXPECT_EQ(*s.Get("NCCL_DEBUG"), "WARN");
  EXPECT_EQ(s.Find("NCCL_DEBUG")->source, SettingSource::kConfFile);
  // Before 2.23 NCCL_CONF_FILE means nothing and ~/.nccl.conf is read.
  EffectiveSettings old = Collect({{"NCCL_CONF_FILE", custom}}, {2, 22, 3});
  EXPECT_EQ(*old.Get("NCCL_DEBUG"), "INFO");
  LintOptions o;
  o.nccl_version = {2, 22, 3};
  EXPECT_NE(Find(LintNcclSettings(old, o), "NCCL_CONF_FILE", "too-new"), nullptr);
  // A missing NCCL_CONF_FILE is skipped silently by NCCL; the lint says so.
  EffectiveSettings missing = Collect({{"NCCL_CONF_FILE", (dir_ / "nope.conf").string()}});
  o.nccl_version = k2289;
  EXPECT_NE(Find(LintNcclSettings(missing, o), "NCCL_CONF_FILE", "conf-file-missing"), nullptr);
  EXPECT_FALSE(missing.Get("NCCL_DEBUG").has_value());  // and ~/.nccl.conf is not read
}

TEST_F(NcclConfFiles, LinesNcclReadsDifferently) {
  Write("etc.conf",
        "NCCL_DEBUG = WARN\n"
        "export NCCL_IB_HCA=mlx5_0\n"
        "NCCL_SOCKET_IFNAME=\"eth0\"\n"
        "NCCL_NET_GDR_LEVEL=PHB # keep GDR local\n"
        "  # NCCL_ALGO=Ring\n"
        "just words\n"
        "NCCL_BUFFSIZE=4194304\n"
        "NCCL_BUFFSIZE=8388608\n"
        "NCCL_IB_TC=106\r\n"
        "NCCL_CONF_FILE=/other.conf\n"
        "TORCH_NCCL_BLOCKING_WAIT=1\n"
        "OMP_NUM_THREADS=4\n");
  EffectiveSettings s = Collect({});
  EXPECT_EQ(*s.Get("NCCL_SOCKET_IFNAME"), "\"eth0\"");  // quotes kept, as NCCL keeps them
  EXPECT_EQ(*s.Get("NCCL_BUFFSIZE"), "4194304");        // the first line wins
  EXPECT_TRUE(s.Get("NCCL_DEBUG ").has_value());        // the name keeps its space
  LintOptions o;
  o.nccl_version = {2, 28, 9};
  LintReport r = LintNcclSettings(s, o);
  auto rule = [&](const std::string& name) {
    for (const Finding& f : r.findings) {
      if (f.rule == name) return &f;
    }
    return static_cast<const Finding*>(nullptr);
  };
  for (const char* expected :
       {"space-in-name", "export-prefix", "quoted-value", "inline-comment", "indented-comment",
        "no-equals", "duplicate", "crlf", "conf-file-in-file", "other-tool", "not-nccl"}) {
    EXPECT_NE(rule(expected), nullptr) << expected << "\n" << Rules(r);
  }
  EXPECT_EQ(rule("crlf")->severity, Severity::kError);  // 2.28 keeps the '\r'
  o.nccl_version = {2, 30, 7};
  LintReport r230 = LintNcclSettings(s, o);
  for (const Finding& f : r230.findings) {
    if (f.rule == "crlf") EXPECT_EQ(f.severity, Severity::kInfo);
  }
  // The mangled names are reported once, not also as unknown variables.
  EXPECT_EQ(Find(r, "NCCL_DEBUG ", "unknown-name"), nullptr);
}

TEST_F(NcclConfFiles, ExtraFilesAndEnvScripts) {
  std::string script = Write("job.sh",
                             "# job settings\nexport NCCL_IB_HCA='=mlx5_0,mlx5_1'\n"
                             "export NCCL_DEBUG=\"WARN\"  # quiet\nNCCL_NTHREADS=8\n");
  CollectOptions c;
  c.environment = std::map<std::string, std::string>{};
  c.read_conf_files = false;
  c.extra_files = {script};
  absl::StatusOr<EffectiveSettings> s = CollectNcclSettings(c);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(*s->Get("NCCL_IB_HCA"), "=mlx5_0,mlx5_1");  // shell quotes removed
  EXPECT_EQ(*s->Get("NCCL_DEBUG"), "WARN");
  EXPECT_EQ(s->Find("NCCL_NTHREADS")->origin, script + ":4");
  c.extra_files = {(dir_ / "missing.sh").string()};
  absl::StatusOr<EffectiveSettings> missing = CollectNcclSettings(c);
  EXPECT_TRUE(absl::IsNotFound(missing.status()));
  EXPECT_THAT(missing.status().message(), HasSubstr("missing.sh"));
  absl::StatusOr<ParsedConf> bad = ParseEnvFile("export NCCL_DEBUG='WARN\n", "x.sh");
  EXPECT_THAT(bad.status().message(), HasSubstr("x.sh:1: unterminated single quote"));
}

// ---- contradictions with the machine --------------------------------------

Topology IbMachine(NicKind kind) {
  Topology t;
  for (int i = 0; i < 2; ++i) {
    Nic n;
    n.name = "mlx5_" + std::to_string(i);
    n.kind = kind;
    n.netdevs = {"ibp" + std::to_string(i)};
    n.gid_types = {"IB/RoCE v1", "RoCE v2", "", "RoCE v2"};
    t.nics.push_back(n);
  }
  Nic ten;
  ten.name = "mlx5_10";
  ten.kind = kind;
  t.nics.push_back(ten);
  return t;
}

TEST(NcclLintTopology, InfiniBandContradictions) {
  Topology ib = IbMachine(NicKind::kInfiniBand);
  LintReport r = Lint({{"NCCL_IB_DISABLE", "1"},
                       {"NCCL_IB_GID_INDEX", "3"},
                       {"NCCL_IB_ROCE_VERSION_NUM", "2"},
                       {"NCCL_IB_HCA", "mlx5_1,mlx5_9"},
                       {"NCCL_SOCKET_IFNAME", "eth"}},
                      k2289, &ib);
  EXPECT_EQ(Find(r, "NCCL_IB_DISABLE", "ib-disabled")->severity, Severity::kError);
  EXPECT_THAT(Find(r, "NCCL_IB_GID_INDEX", "roce-only")->message, HasSubstr("ignores it"));
  EXPECT_NE(Find(r, "NCCL_IB_ROCE_VERSION_NUM", "roce-only"), nullptr);
  EXPECT_EQ(Find(r, "NCCL_IB_GID_INDEX", "pinned-gid"), nullptr);  // covered by roce-only
  EXPECT_THAT(Find(r, "NCCL_IB_HCA", "prefix-match")->message, HasSubstr("mlx5_1, mlx5_10"));
  EXPECT_THAT(Find(r, "NCCL_IB_HCA", "no-such-hca")->message, HasSubstr("'mlx5_9'"));
  EXPECT_NE(Find(r, "NCCL_SOCKET_IFNAME", "no-such-interface"), nullptr);
}

TEST(NcclLintTopology, RoceGidAndTcpMachines) {
  Topology roce = IbMachine(NicKind::kRoce);
  LintReport unused = Lint({{"NCCL_IB_GID_INDEX", "2"}}, k2289, &roce);
  EXPECT_THAT(Find(unused, "NCCL_IB_GID_INDEX", "bad-gid")->message, HasSubstr("unused"));
  LintReport v1 = Lint({{"NCCL_IB_GID_INDEX", "0"}}, {2, 20, 5}, &roce);
  EXPECT_THAT(Find(v1, "NCCL_IB_GID_INDEX", "bad-gid")->message, HasSubstr("IB/RoCE v1"));
  Topology tcp;
  LintReport none = Lint({{"NCCL_IB_TIMEOUT", "20"}, {"NCCL_NET", "IB"}}, k2289, &tcp);
  EXPECT_EQ(Find(none, "NCCL_IB_TIMEOUT", "no-rdma")->severity, Severity::kInfo);
  EXPECT_EQ(Find(none, "NCCL_NET", "no-rdma")->severity, Severity::kError);
}

}  // namespace
}  // namespace strata
