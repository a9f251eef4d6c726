// The registry of strata's STRATA_* settings: every type's spellings, bad
// values rejected by name (never replaced by a default), empty as unset,
// defaults and sources in the listing, and the registry's own rows.
#include "strata/base/settings.h"

#include <map>
#include <set>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "base/bool_setting.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace strata {
namespace {

using ::testing::HasSubstr;

Settings Read(const std::map<std::string, std::string>& env) {
  absl::StatusOr<Settings> s = Settings::FromMap(env);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *s : Settings();
}

std::string ErrorOf(const std::map<std::string, std::string>& env) {
  absl::StatusOr<Settings> s = Settings::FromMap(env);
  EXPECT_FALSE(s.ok()) << "accepted";
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << s.status();
  return std::string(s.status().message());
}

TEST(Settings, UnsetVariablesGiveTheDefaults) {
  const Settings s = Read({});
  const Settings defaults;
  EXPECT_EQ(s.launcher, "");
  EXPECT_EQ(s.store, "");
  EXPECT_EQ(s.oversubscribed, std::nullopt);
  EXPECT_TRUE(s.nccl_profile);
  EXPECT_TRUE(s.gloo_deepbind);
  EXPECT_TRUE(s.gloo_cma);
  EXPECT_TRUE(s.from_environment.empty());
  for (const SettingValue& v : s.List()) {
    EXPECT_FALSE(v.from_environment) << v.info.name;
    EXPECT_EQ(v.value, v.default_value) << v.info.name;
  }
  EXPECT_EQ(s.List().size(), defaults.List().size());
}

TEST(Settings, BooleansTakeZeroOneTrueFalse) {
  for (const auto& [text, want] : std::map<std::string, bool>{
           {"0", false}, {"1", true}, {"true", true}, {"False", false}, {"TRUE", true}}) {
    EXPECT_EQ(Read({{"STRATA_GLOO_CMA", text}}).gloo_cma, want) << text;
    EXPECT_EQ(Read({{"STRATA_OVERSUBSCRIBED", text}}).oversubscribed, std::optional<bool>(want))
        << text;
  }
  EXPECT_FALSE(Read({{"STRATA_NCCL_PROFILE", "0"}}).nccl_profile);
  EXPECT_FALSE(Read({{"STRATA_GLOO_DEEPBIND", "false"}}).gloo_deepbind);
  // Exhaustively over short spellings: only the four words (any case) pass.
  for (const char* text : {"yes", "no", "on", "off", "2", "-1", "01", " 1", "1 ", "t", "f"}) {
    EXPECT_EQ(settings_internal::ParseBool(text), std::nullopt) << text;
  }
}

TEST(Settings, ABadValueIsRejectedByNameNeverReplacedByTheDefault) {
  EXPECT_EQ(ErrorOf({{"STRATA_GLOO_CMA", "maybe"}}),
            "STRATA_GLOO_CMA='maybe' is not a boolean (0/1/true/false); see docs/launch.md");
  EXPECT_THAT(ErrorOf({{"STRATA_OVERSUBSCRIBED", "yes"}}),
              HasSubstr("STRATA_OVERSUBSCRIBED='yes' is not a boolean (0/1/true/false)"));
  EXPECT_THAT(ErrorOf({{"STRATA_NCCL_PROFILE", "off"}}), HasSubstr("see docs/topology.md"));
  EXPECT_EQ(ErrorOf({{"STRATA_LAUNCHER", "pbs"}}),
            "STRATA_LAUNCHER='pbs' is not one of none, mpirun, torchrun, slurm; see "
            "docs/launch.md");
  // One bad variable fails the whole reading, whatever the others say.
  EXPECT_THAT(ErrorOf({{"STRATA_STORE", "file:/tmp/x"}, {"STRATA_GLOO_DEEPBIND", "2"}}),
              HasSubstr("STRATA_GLOO_DEEPBIND='2'"));
}

TEST(Settings, ChoicesIgnoreCaseAndTextIsKeptAsGiven) {
  EXPECT_EQ(Read({{"STRATA_LAUNCHER", "TorchRun"}}).launcher, "torchrun");
  EXPECT_EQ(Read({{"STRATA_LAUNCHER", "none"}}).launcher, "none");
  const Settings s = Read({{"STRATA_STORE", "file:/shared/Dir"},
                           {"STRATA_NCCL_LIBRARY", "/opt/nccl/lib/libnccl.so.2"},
                           {"STRATA_GLOO_PLUGIN", "/opt/strata/libstrata_gloo.so"}});
  EXPECT_EQ(s.store, "file:/shared/Dir");
  EXPECT_EQ(s.nccl_library, "/opt/nccl/lib/libnccl.so.2");
  EXPECT_EQ(s.gloo_plugin, "/opt/strata/libstrata_gloo.so");
}

TEST(Settings, AnEmptyValueCountsAsUnset) {
  const Settings s =
      Read({{"STRATA_GLOO_CMA", ""}, {"STRATA_LAUNCHER", ""}, {"STRATA_OVERSUBSCRIBED", ""}});
  EXPECT_TRUE(s.gloo_cma);
  EXPECT_EQ(s.launcher, "");
  EXPECT_EQ(s.oversubscribed, std::nullopt);
  EXPECT_TRUE(s.from_environment.empty());
}

TEST(Settings, TheListingSaysValueDefaultAndSource) {
  const Settings s = Read({{"STRATA_GLOO_CMA", "false"}, {"STRATA_STORE", "file:/d"}});
  std::map<std::string, SettingValue> by_name;
  for (const SettingValue& v : s.List()) by_name[v.info.name] = v;
  EXPECT_EQ(by_name["STRATA_GLOO_CMA"].value, "0");  // as the registry spells it
  EXPECT_EQ(by_name["STRATA_GLOO_CMA"].default_value, "1");
  EXPECT_TRUE(by_name["STRATA_GLOO_CMA"].from_environment);
  EXPECT_EQ(by_name["STRATA_GLOO_CMA"].Describe(), "STRATA_GLOO_CMA=0 (environment)");
  EXPECT_EQ(by_name["STRATA_STORE"].Describe(), "STRATA_STORE=file:/d (environment)");
  EXPECT_EQ(by_name["STRATA_OVERSUBSCRIBED"].Describe(), "STRATA_OVERSUBSCRIBED unset (default)");
  EXPECT_EQ(s.from_environment.at("STRATA_GLOO_CMA"), "false");  // the text as given
}

TEST(Settings, FromEnvironmentReadsThisProcess) {
  ASSERT_EQ(setenv("STRATA_GLOO_CMA", "0", 1), 0);
  absl::StatusOr<Settings> off = Settings::FromEnvironment();
  ASSERT_EQ(setenv("STRATA_GLOO_CMA", "sometimes", 1), 0);
  absl::StatusOr<Settings> bad = Settings::FromEnvironment();
  unsetenv("STRATA_GLOO_CMA");
  absl::StatusOr<Settings> unset = Settings::FromEnvironment();
  ASSERT_TRUE(off.ok()) << off.status();
  EXPECT_FALSE(off->gloo_cma);
  EXPECT_THAT(bad.status().message(), HasSubstr("STRATA_GLOO_CMA='sometimes'"));
  ASSERT_TRUE(unset.ok()) << unset.status();
  EXPECT_TRUE(unset->gloo_cma);  // a later snapshot sees the change: nothing is cached
}

TEST(Settings, EveryRowIsComplete) {
  std::set<std::string> names;
  for (const SettingInfo& info : SettingRegistry()) {
    const std::string name = info.name;
    EXPECT_TRUE(names.insert(name).second) << "listed twice: " << name;
    EXPECT_TRUE(absl::StartsWith(name, "STRATA_")) << name;
    EXPECT_NE(std::string(info.meaning), "") << name;
    EXPECT_TRUE(absl::StartsWith(info.doc, "docs/") && absl::EndsWith(info.doc, ".md")) << name;
    EXPECT_EQ(info.type == SettingType::kChoice, std::string(info.choices) != "") << name;
    // Each row has its own field: setting it alone changes one listed value
    // (a boolean to the opposite of its default).
    std::string default_value;
    for (const SettingValue& v : Read({}).List()) {
      if (std::string(v.info.name) == name) default_value = v.default_value;
    }
    const std::string text = info.type == SettingType::kBool ? (default_value == "1" ? "0" : "1")
                             : info.type == SettingType::kChoice ? "none"
                                                                 : "/x";
    int changed = 0;
    for (const SettingValue& v : Read({{name, text}}).List()) changed += v.value != v.default_value;
    EXPECT_EQ(changed, 1) << name;
  }
  EXPECT_GE(names.size(), 8u);
}

}  // namespace
}  // namespace strata
