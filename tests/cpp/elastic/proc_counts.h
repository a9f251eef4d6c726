// What a leak test counts in this process: the entries of a /proc/self
// directory ("task" for threads, "fd" for descriptors; the count includes
// "." and ".." and, for "fd", the directory's own descriptor, alike before
// and after).
#pragma once

#include <dirent.h>

#include <string>

namespace strata::elastic::testing {

inline int CountEntries(const std::string& dir) {
  int n = 0;
  if (DIR* d = opendir(dir.c_str())) {
    while (readdir(d) != nullptr) ++n;
    closedir(d);
  }
  return n;
}

}  // namespace strata::elastic::testing
