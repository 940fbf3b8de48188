// Rule file overriding the cost model (UNIFAB_TUNER_CONFIG). The format is the one of NCCL's
// example tuner, so existing files work unchanged: one rule per line,
//   collective,min_bytes,max_bytes,algorithm,protocol,channels,nNodes,nRanks[,numPipeOps[,regBuff]]
// collective: broadcast|reduce|allgather|reducescatter|allreduce; algorithm: tree|ring|
// collnet_direct|collnet_chain|nvls|nvls_tree|pat; protocol: ll|ll128|simple; sizes accept K/M/G
// suffixes; -1 means "any" for nNodes/nRanks/numPipeOps/regBuff and "keep NCCL's" for channels
// (else 1..64); a max_bytes past INT64_MAX (NCCL's examples write 2^64 - 1) means no limit.
// '#' starts a comment. The first rule that matches a call decides it. A malformed line is
// reported (file and line) and skipped; it never stops NCCL.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace unifab::tuner {

struct Rule {
  int collective = 0;
  int64_t minBytes = 0;
  int64_t maxBytes = 0;
  int algorithm = 0;
  int protocol = 0;
  int channels = -1;
  int nNodes = -1;
  int nRanks = -1;
  int numPipeOps = -1;
  int regBuff = -1;
  int line = 0;  // in the file, for logs

  bool matches(int collectiveType, size_t bytes, int nodes, int ranks, int pipeOps, int registered) const;
};

// Parses one line; false with `*error` set when the line is malformed. Blank and comment-only
// lines return true with *isRule false.
bool parseRuleLine(const std::string& line, Rule* rule, bool* isRule, std::string* error);

// Reads every valid rule of `path`; WARNs about each malformed line and about an unreadable file.
std::vector<Rule> loadRules(const std::string& path);

}  // namespace unifab::tuner
