// Minimal structured logging to stderr: one line per event, key=value or JSON.
#pragma once

#include <cstdio>
#include <string>

namespace hetero {

inline void log_line(const std::string& component, const std::string& text) {
  std::fprintf(stderr, "[%s] %s\n", component.c_str(), text.c_str());
}

}  // namespace hetero
