#include "tuner/rules.h"

#include <strings.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdlib>
#include <fstream>

#include "plugin/log.h"
#include "plugin/params.h"
#include "tuner/cost_model.h"

namespace unifab::tuner {
namespace {

std::string trim(const std::string& text) {
  size_t begin = text.find_first_not_of(" \t\r\n");
  if (begin == std::string::npos) return std::string();
  size_t end = text.find_last_not_of(" \t\r\n");
  return text.substr(begin, end - begin + 1);
}

int lookupName(const std::string& field, int count, const char* (*name)(int)) {
  for (int i = 0; i < count; ++i) {
    if (strcasecmp(field.c_str(), name(i)) == 0) return i;
  }
  return -1;
}

}  // namespace

bool Rule::matches(int collectiveType, size_t bytes, int nodes, int ranks, int pipeOps, int registered) const {
  return collective == collectiveType && static_cast<int64_t>(bytes) >= minBytes &&
         static_cast<int64_t>(bytes) <= maxBytes && (nNodes == -1 || nNodes == nodes) &&
         (nRanks == -1 || nRanks == ranks) && (numPipeOps == -1 || numPipeOps == pipeOps) &&
         (regBuff == -1 || regBuff == registered);
}

bool parseRuleLine(const std::string& rawLine, Rule* rule, bool* isRule, std::string* error) {
  *isRule = false;
  std::string line = trim(rawLine.substr(0, rawLine.find('#')));
  if (line.empty()) return true;
  std::vector<std::string> fields;
  size_t pos = 0;
  while (true) {
    size_t comma = line.find(',', pos);
    fields.push_back(trim(line.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos)));
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  if (fields.size() < 8 || fields.size() > 10) {
    *error = "expected 8 to 10 comma-separated fields, found " + std::to_string(fields.size());
    return false;
  }
  Rule parsed;
  parsed.collective = lookupName(fields[0], kNumCollectives, collectiveName);
  if (parsed.collective < 0) {
    *error = "unknown collective '" + fields[0] + "' (broadcast, reduce, allgather, reducescatter, allreduce)";
    return false;
  }
  // NCCL's example rule files bound the last range with 2^64 - 1: any decimal past INT64_MAX is "no limit".
  auto beyondInt64 = [](const std::string& text) {
    if (text.empty() || text.find_first_not_of("0123456789") != std::string::npos) return false;
    errno = 0;
    const unsigned long long value = strtoull(text.c_str(), nullptr, 10);
    return errno == ERANGE || value > static_cast<unsigned long long>(INT64_MAX);
  };
  const bool minValid = parseSize(fields[1].c_str(), 0, INT64_MAX, &parsed.minBytes);
  bool maxValid = parseSize(fields[2].c_str(), 0, INT64_MAX, &parsed.maxBytes);
  if (!maxValid && beyondInt64(fields[2])) {
    parsed.maxBytes = INT64_MAX;
    maxValid = true;
  }
  if (!minValid || !maxValid || parsed.minBytes > parsed.maxBytes) {
    *error = "min_bytes/max_bytes '" + fields[1] + "'/'" + fields[2] +
             "' must be sizes (K/M/G suffixes) from 0 to 2^63 - 1 with min <= max";
    return false;
  }
  parsed.algorithm = lookupName(fields[3], kNumAlgorithms, algorithmName);
  if (parsed.algorithm < 0) {
    *error = "unknown algorithm '" + fields[3] + "'";
    return false;
  }
  parsed.protocol = lookupName(fields[4], kNumProtocols, protocolName);
  if (parsed.protocol < 0) {
    *error = "unknown protocol '" + fields[4] + "' (ll, ll128, simple)";
    return false;
  }
  struct IntField {
    const char* name;
    int* target;
    int lowest;  // smallest value besides -1
    int highest;
  };
  const IntField intFields[] = {{"channels", &parsed.channels, 1, kNcclMaxChannels},
                                {"nNodes", &parsed.nNodes, 1, 1 << 24},
                                {"nRanks", &parsed.nRanks, 1, 1 << 24},
                                {"numPipeOps", &parsed.numPipeOps, 1, 1 << 24},
                                {"regBuff", &parsed.regBuff, 0, 1}};
  for (size_t i = 5; i < fields.size(); ++i) {
    const IntField& spec = intFields[i - 5];
    int64_t value = 0;
    bool valid = parseInt64(fields[i].c_str(), -1, spec.highest, &value) && (value == -1 || value >= spec.lowest);
    if (!valid) {
      *error = std::string(spec.name) + " '" + fields[i] + "' must be -1 or in " + std::to_string(spec.lowest) +
               ".." + std::to_string(spec.highest);
      return false;
    }
    *spec.target = static_cast<int>(value);
  }
  *rule = parsed;
  *isRule = true;
  return true;
}

std::vector<Rule> loadRules(const std::string& path) {
  std::vector<Rule> rules;
  // A directory opens as a stream that reads nothing, and a FIFO would block NCCL's init.
  struct stat info {};
  if (stat(path.c_str(), &info) != 0 || !S_ISREG(info.st_mode)) {
    UF_WARN(kTuner, "UNIFAB_TUNER_CONFIG=%s is not a readable regular file; using the cost model only", path.c_str());
    return rules;
  }
  std::ifstream file(path);
  if (!file) {
    UF_WARN(kTuner, "UNIFAB_TUNER_CONFIG=%s cannot be read; using the cost model only", path.c_str());
    return rules;
  }
  constexpr size_t kMaxLineBytes = 1024;  // a rule is ~60 characters; this is not a rule file
  std::string line;
  int number = 0;
  while (std::getline(file, line)) {
    ++number;
    if (line.size() > kMaxLineBytes) {
      UF_WARN(kTuner, "%s:%d: a line of %zu bytes, more than %zu; the rest of the file is ignored", path.c_str(),
              number, line.size(), kMaxLineBytes);
      break;
    }
    Rule rule;
    bool isRule = false;
    std::string error;
    if (!parseRuleLine(line, &rule, &isRule, &error)) {
      UF_WARN(kTuner, "%s:%d: %s; line ignored", path.c_str(), number, error.c_str());
      continue;
    }
    if (!isRule) continue;
    rule.line = number;
    rules.push_back(rule);
  }
  if (file.bad()) UF_WARN(kTuner, "UNIFAB_TUNER_CONFIG=%s: reading failed after line %d", path.c_str(), number);
  if (rules.empty()) {
    UF_WARN(kTuner, "UNIFAB_TUNER_CONFIG=%s holds no valid rule; using the cost model only", path.c_str());
  } else {
    UF_INFO(kTuner, kLogInit, "loaded %zu rule(s) from %s", rules.size(), path.c_str());
  }
  return rules;
}

}  // namespace unifab::tuner
