// NCCL settings from the environment and NCCL's configuration files, merged
// with NCCL's precedence (see strata/comm/nccl_settings.h for the rules and
// where they were checked).
#include "strata/comm/nccl_settings.h"

#include <pwd.h>
#include <unistd.h>

#include <cstdlib>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "comm/topology/text_util.h"
#include "strata/base/status.h"

extern char** environ;

namespace strata {
namespace {

// NCCL copies names and values into 1024-byte buffers (src/misc/param.cc).
constexpr size_t kNcclConfField = 1023;

void Note(ParsedConf* out, const std::string& origin, absl::string_view line, std::string problem) {
  out->notes.push_back({origin, std::string(line), std::move(problem)});
}

bool ValidName(absl::string_view name) {
  if (name.empty() || absl::ascii_isdigit(static_cast<unsigned char>(name[0]))) return false;
  for (char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '_') return false;
  }
  return true;
}

}  // namespace

std::string NcclVersion::ToString() const { return absl::StrCat(major, ".", minor, ".", patch); }

NcclVersion NcclVersion::FromCode(int code) {
  // NCCL_VERSION_CODE: X*10000+Y*100+Z since 2.9, X*1000+Y*100+Z before.
  if (code >= 10000) return NcclVersion{code / 10000, (code % 10000) / 100, code % 100};
  return NcclVersion{code / 1000, (code % 1000) / 100, code % 100};
}

absl::StatusOr<NcclVersion> NcclVersion::Parse(absl::string_view text) {
  text = absl::StripAsciiWhitespace(text);
  std::vector<absl::string_view> parts = absl::StrSplit(text, '.');
  int v[3] = {0, 0, 0};
  bool ok = !parts.empty() && parts.size() <= 3;
  for (size_t i = 0; ok && i < parts.size(); ++i) {
    ok = absl::SimpleAtoi(parts[i], &v[i]) && v[i] >= 0 && v[i] < 100000;
  }
  if (ok && parts.size() == 1 && v[0] >= 1000) return FromCode(v[0]);
  if (!ok || parts.size() == 1 || v[0] != 2 || v[1] > 99 || v[2] > 99) {
    return absl::InvalidArgumentError(
        absl::StrCat("NCCL version '", text,
                     "' is not of the form 2.MINOR[.PATCH] or a version code like 22809"));
  }
  return NcclVersion{v[0], v[1], v[2]};
}

NcclVersion NewestKnownNcclVersion() { return NcclVersion{2, 30, 7}; }

const char* SettingSourceName(SettingSource source) {
  switch (source) {
    case SettingSource::kEnvironment:
      return "environment";
    case SettingSource::kConfFile:
      return "NCCL_CONF_FILE";
    case SettingSource::kUserConf:
      return "~/.nccl.conf";
    case SettingSource::kSystemConf:
      return "/etc/nccl.conf";
    case SettingSource::kCommandLine:
      return "file";
  }
  return "unknown";
}

std::string Setting::Describe() const { return absl::StrCat(name, "=", value, " (", origin, ")"); }

ParsedConf ParseNcclConf(absl::string_view text, const std::string& path, SettingSource source) {
  ParsedConf out;
  std::vector<absl::string_view> lines = absl::StrSplit(text, '\n');
  if (!lines.empty() && lines.back().empty()) lines.pop_back();
  for (size_t i = 0; i < lines.size(); ++i) {
    absl::string_view line = lines[i];
    std::string origin = absl::StrCat(path, ":", i + 1);
    if (!line.empty() && line.back() == '\r') {
      Note(&out, origin, line, "crlf");
      line.remove_suffix(1);  // NCCL 2.30+ drops it; the lint flags older versions
    }
    if (line.empty() || line[0] == '#') continue;
    size_t eq = line.find('=');
    if (eq == absl::string_view::npos) {
      if (!absl::StripAsciiWhitespace(line).empty()) Note(&out, origin, line, "no-equals");
      continue;
    }
    Setting s;
    s.name = std::string(line.substr(0, std::min(eq, kNcclConfField)));
    s.value = std::string(line.substr(eq + 1, kNcclConfField));
    s.source = source;
    s.origin = origin;
    s.line = std::string(line);
    if (eq > kNcclConfField || line.size() - eq - 1 > kNcclConfField)
      Note(&out, origin, line, "too-long");
    absl::string_view trimmed = absl::StripAsciiWhitespace(s.name);
    if (absl::StartsWith(trimmed, "#")) {
      Note(&out, origin, line, "indented-comment");
    } else if (absl::StartsWith(trimmed, "export ")) {
      Note(&out, origin, line, "export-prefix");
    } else if (trimmed != s.name) {
      Note(&out, origin, line, "space-in-name");
    } else if (!ValidName(s.name)) {
      Note(&out, origin, line, "bad-name");
    }
    if (s.value.size() >= 2 && (s.value.front() == '"' || s.value.front() == '\'')) {
      Note(&out, origin, line, "quoted-value");
    } else if (s.value != absl::StripAsciiWhitespace(s.value)) {
      Note(&out, origin, line, "space-around-value");
    }
    if (absl::StrContains(s.value, " #")) Note(&out, origin, line, "inline-comment");
    out.settings.push_back(std::move(s));
  }
  std::set<std::string> seen;
  for (Setting& s : out.settings) {
    if (!seen.insert(s.name).second) {
      s.effective = false;
      Note(&out, s.origin, s.line, "duplicate");
    }
  }
  return out;
}

absl::StatusOr<ParsedConf> ParseEnvFile(absl::string_view text, const std::string& path) {
  ParsedConf out;
  std::vector<absl::string_view> lines = topology_internal::Lines(text);
  for (size_t i = 0; i < lines.size(); ++i) {
    std::string origin = absl::StrCat(path, ":", i + 1);
    absl::string_view line = absl::StripAsciiWhitespace(lines[i]);
    if (line.empty() || line[0] == '#') continue;
    if (absl::ConsumePrefix(&line, "export")) {
      if (line.empty() || !absl::ascii_isspace(static_cast<unsigned char>(line[0]))) {
        Note(&out, origin, lines[i], "no-equals");
        continue;
      }
      line = absl::StripLeadingAsciiWhitespace(line);
    }
    size_t eq = line.find('=');
    if (eq == absl::string_view::npos || !ValidName(line.substr(0, eq))) {
      Note(&out, origin, lines[i], "no-equals");
      continue;
    }
    Setting s;
    s.name = std::string(line.substr(0, eq));
    s.source = SettingSource::kCommandLine;
    s.origin = origin;
    s.line = std::string(lines[i]);
    // The value as a shell would see it: quotes removed, unquoted text ends
    // at whitespace (a comment may follow).
    absl::string_view rest = line.substr(eq + 1);
    std::string value;
    size_t p = 0;
    while (p < rest.size() && !absl::ascii_isspace(static_cast<unsigned char>(rest[p]))) {
      char c = rest[p];
      if (c == '\'' || c == '"') {
        size_t end = rest.find(c, p + 1);
        while (c == '"' && end != absl::string_view::npos && rest[end - 1] == '\\') {
          end = rest.find(c, end + 1);
        }
        if (end == absl::string_view::npos) {
          return absl::InvalidArgumentError(absl::StrCat(origin, ": unterminated ",
                                                         c == '"' ? "double" : "single",
                                                         " quote in '", lines[i], "'"));
        }
        std::string quoted(rest.substr(p + 1, end - p - 1));
        if (c == '"') quoted = absl::StrReplaceAll(quoted, {{"\\\"", "\""}, {"\\\\", "\\"}});
        value += quoted;
        p = end + 1;
      } else if (c == '\\' && p + 1 < rest.size()) {
        value.push_back(rest[p + 1]);
        p += 2;
      } else {
        value.push_back(c);
        ++p;
      }
    }
    s.value = std::move(value);
    out.settings.push_back(std::move(s));
  }
  std::set<std::string> seen;
  // In a shell the last assignment wins.
  for (auto it = out.settings.rbegin(); it != out.settings.rend(); ++it) {
    if (!seen.insert(it->name).second) {
      it->effective = false;
      Note(&out, it->origin, it->line, "overridden-later");
    }
  }
  return out;
}

std::optional<std::string> EffectiveSettings::Get(absl::string_view name) const {
  const Setting* s = Find(name);
  if (s == nullptr) return std::nullopt;
  return s->value;
}

const Setting* EffectiveSettings::Find(absl::string_view name) const {
  for (const Setting& s : settings) {
    if (s.effective && s.name == name) return &s;
  }
  return nullptr;
}

std::map<std::string, std::string> EffectiveSettings::EffectiveNccl() const {
  std::map<std::string, std::string> out;
  for (const Setting& s : settings) {
    if (s.effective && s.source != SettingSource::kCommandLine &&
        absl::StartsWith(s.name, "NCCL_")) {
      out[s.name] = s.value;
    }
  }
  return out;
}

absl::StatusOr<EffectiveSettings> CollectNcclSettings(const CollectOptions& options) {
  EffectiveSettings out;
  out.nccl_version = options.nccl_version;
  std::map<std::string, std::string> env;
  if (options.environment) {
    env = *options.environment;
  } else {
    for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
      absl::string_view kv(*e);
      size_t eq = kv.find('=');
      if (eq != absl::string_view::npos)
        env[std::string(kv.substr(0, eq))] = std::string(kv.substr(eq + 1));
    }
  }
  for (const auto& [name, value] : env) {
    if (!absl::StartsWith(name, "NCCL_")) continue;
    Setting s;
    s.name = name;
    s.value = value;
    s.source = SettingSource::kEnvironment;
    s.origin = "environment";
    out.settings.push_back(std::move(s));
  }

  auto add_file = [&](const std::string& path, SettingSource source) -> absl::Status {
    absl::StatusOr<std::string> text = topology_internal::ReadFile(path);
    if (!text.ok()) {
      // NCCL skips files it cannot open without a word; so do we, but say so.
      if (source == SettingSource::kCommandLine) return text.status();
      out.files.emplace_back(path, absl::IsNotFound(text.status())
                                       ? "not found"
                                       : std::string(text.status().message()));
      return absl::OkStatus();
    }
    out.files.emplace_back(path, "read");
    ParsedConf conf;
    bool env_format = source == SettingSource::kCommandLine && !absl::EndsWith(path, ".conf") &&
                      (absl::StartsWith(*text, "export ") || absl::StrContains(*text, "\nexport "));
    if (env_format) {
      STRATA_ASSIGN_OR_RETURN(conf, ParseEnvFile(*text, path));
    } else {
      conf = ParseNcclConf(*text, path, source);
    }
    for (Setting& s : conf.settings) out.settings.push_back(std::move(s));
    for (ConfLineNote& n : conf.notes) out.notes.push_back(std::move(n));
    return absl::OkStatus();
  };

  if (options.read_conf_files) {
    const NcclVersion& v = options.nccl_version;
    auto conf_file = env.find("NCCL_CONF_FILE");
    if (v >= NcclVersion{2, 23, 0} && conf_file != env.end() && !conf_file->second.empty()) {
      STRATA_RETURN_IF_ERROR(add_file(conf_file->second, SettingSource::kConfFile));
    } else {
      std::string home = options.home_dir;
      if (home.empty()) {
        if (v >= NcclVersion{2, 30, 0}) {
          auto h = env.find("HOME");
          if (h != env.end()) home = h->second;
        } else if (struct passwd* pw = getpwuid(getuid()); pw != nullptr && pw->pw_dir) {
          home = pw->pw_dir;
        }
      }
      if (!home.empty())
        STRATA_RETURN_IF_ERROR(add_file(home + "/.nccl.conf", SettingSource::kUserConf));
    }
    STRATA_RETURN_IF_ERROR(add_file(options.system_conf, SettingSource::kSystemConf));
  }
  for (const std::string& f : options.extra_files) {
    STRATA_RETURN_IF_ERROR_CTX(add_file(f, SettingSource::kCommandLine), "linting ", f);
  }
  // Precedence is the order above: a name set earlier shadows later ones.
  std::set<std::string> seen;
  for (Setting& s : out.settings) {
    if (!s.effective) continue;  // a duplicate within its own file
    if (!seen.insert(s.name).second) s.effective = false;
  }
  return out;
}

}  // namespace strata
