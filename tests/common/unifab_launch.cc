// unifab-launch: run a program once per rank (one process per GPU), e.g.
//   unifab-launch -n 2 [-t SECONDS] [-e NAME=VALUE%r]... -- program args...
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "tests/common/rank_launcher.h"

int main(int argc, char** argv) {
  unifab::test::LaunchOptions options;
  std::vector<std::string> command;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--") {
      for (++i; i < argc; ++i) command.emplace_back(argv[i]);
      break;
    }
    if ((arg == "-n" || arg == "-t" || arg == "-e") && i + 1 < argc) {
      const char* value = argv[++i];
      if (arg == "-n") options.nRanks = atoi(value);
      if (arg == "-t") options.timeoutSeconds = atof(value);
      if (arg == "-e") options.environment.emplace_back(value);
      continue;
    }
    fprintf(stderr, "usage: unifab-launch -n RANKS [-t SECONDS] [-e NAME=VALUE]... -- PROGRAM [ARGS...]\n"
                    "  %%r in a VALUE is replaced by the rank\n");
    return 2;
  }
  if (command.empty() || options.nRanks < 1) {
    fprintf(stderr, "unifab-launch: need at least one rank and a program after --\n");
    return 2;
  }
  return unifab::test::launchRanks(options, command);
}
