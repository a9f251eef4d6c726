// How strata's boolean settings are spelled (internal, header-only): shared
// by the settings registry (settings.cc) and the Gloo plugin, which cannot
// link libstrata and reads STRATA_GLOO_CMA itself (gloo_plugin.cc says why).
#pragma once

#include <cctype>
#include <optional>
#include <string_view>

namespace strata::settings_internal {

// "1" and "true" are true, "0" and "false" false (the words in any case);
// anything else is nullopt.
inline std::optional<bool> ParseBool(std::string_view text) {
  if (text == "1") return true;
  if (text == "0") return false;
  auto is = [text](std::string_view word) {
    if (text.size() != word.size()) return false;
    for (size_t i = 0; i < text.size(); ++i) {
      if (std::tolower(static_cast<unsigned char>(text[i])) != word[i]) return false;
    }
    return true;
  };
  if (is("true")) return true;
  if (is("false")) return false;
  return std::nullopt;
}

}  // namespace strata::settings_internal
