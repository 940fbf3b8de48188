// Routes unifab's logger into a vector for the duration of a test, so tests can assert that a
// bad input produced a warning.
#pragma once

#include <cstdarg>
#include <cstdio>
#include <mutex>
#include <string>
#include <vector>

#include "plugin/log.h"

namespace unifab::test {

class LogCapture {
 public:
  LogCapture() {
    lines().clear();
    logSetNcclLogger(&LogCapture::record);
  }
  ~LogCapture() { logSetNcclLogger(nullptr); }
  LogCapture(const LogCapture&) = delete;
  LogCapture& operator=(const LogCapture&) = delete;

  std::vector<std::string> warnings() const {
    std::lock_guard<std::mutex> lock(mutex());
    std::vector<std::string> result;
    for (const auto& entry : lines()) {
      if (entry.first == static_cast<int>(LogLevel::kWarn)) result.push_back(entry.second);
    }
    return result;
  }
  // Lines logged at `level` that contain `fragment`.
  int count(LogLevel level, const std::string& fragment) const {
    std::lock_guard<std::mutex> lock(mutex());
    int n = 0;
    for (const auto& entry : lines()) {
      if (entry.first == static_cast<int>(level) && entry.second.find(fragment) != std::string::npos) ++n;
    }
    return n;
  }
  bool warned(const std::string& fragment) const { return count(LogLevel::kWarn, fragment) > 0; }

 private:
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  static std::vector<std::pair<int, std::string>>& lines() {
    static std::vector<std::pair<int, std::string>> l;
    return l;
  }
  static void record(int level, unsigned long, const char*, int, const char* fmt, ...) {
    char text[2048];
    va_list args;
    va_start(args, fmt);
    vsnprintf(text, sizeof(text), fmt, args);
    va_end(args);
    std::lock_guard<std::mutex> lock(mutex());
    lines().emplace_back(level, text);
  }
};

}  // namespace unifab::test
