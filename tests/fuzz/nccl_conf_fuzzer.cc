// The nccl.conf and env-script parsers on arbitrary text, and the lint over
// what they produce: no crash, no hang; every setting comes from a line of
// the input and every finding has a rule and a message.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "strata/comm/nccl_lint.h"
#include "strata/comm/nccl_settings.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string text(reinterpret_cast<const char*>(data), size);
  size_t lines = 1;
  for (char c : text) lines += c == '\n';
  strata::EffectiveSettings all;
  strata::ParsedConf conf =
      strata::ParseNcclConf(text, "fuzz.conf", strata::SettingSource::kSystemConf);
  if (conf.settings.size() > lines) std::abort();
  all.settings = conf.settings;
  all.notes = conf.notes;
  absl::StatusOr<strata::ParsedConf> env = strata::ParseEnvFile(text, "fuzz.sh");
  if (env.ok()) {
    if (env->settings.size() > lines) std::abort();
    all.settings.insert(all.settings.end(), env->settings.begin(), env->settings.end());
  }
  for (const strata::NcclVersion& v :
       {strata::NcclVersion{2, 18, 6}, strata::NcclVersion{2, 30, 7}}) {
    strata::LintOptions options;
    options.nccl_version = v;
    strata::LintReport report = strata::LintNcclSettings(all, options);
    for (const strata::Finding& f : report.findings) {
      if (f.rule.empty() || f.message.empty()) std::abort();
    }
  }
  return 0;
}
