// unifab-bench tune-sweep: every algorithm x protocol x channel count NCCL accepts for a
// collective, forced one at a time, next to NCCL's default choice and unifab's tuner, each a run
// of `unifab-bench coll` over all local GPUs. Two ways to force (--force):
//  - tuner (default): through unifab's tuner, a one-rule UNIFAB_TUNER_CONFIG file per
//    configuration, with the most swept channels built at init (NCCL_MIN_NCHANNELS): exactly the
//    choices a tuner has, from the same initialisation as "tuner+b", the fair bar for it;
//  - env: NCCL_ALGO, NCCL_PROTO and NCCL_MIN/MAX_NCHANNELS with no tuner plugin, which also
//    changes what NCCL sets up at init (an LL-only communicator allocates no other buffers), so
//    its times can be out of any tuner's reach. The default and the tuner also run with the largest swept channel count
// built at init (NCCL_MIN_NCHANNELS): a tuner cannot use more channels than NCCL built, so that is
// the setup in which every forced configuration is within its reach. The whole list runs --reps
// times, interleaved (these shared machines drift from minute to minute), and each
// configuration's time per size is the median over the repetitions. Writes one CSV per
// configuration and repetition and a summary: per size, the best forced configuration, and how
// far the tuner and NCCL's default are from it. With --net unifab every rank is a node of its own
// (per-rank NCCL_HOSTID), so NCCL and the tuner see the network the traffic crosses. With
// --log-tuning, one more (untimed) run of the tuner and of NCCL's default logs NCCL_DEBUG_SUBSYS=
// TUNING, and the choices each logged (unifab's tuner: once per size range) close the op's table.
#include <cuda_runtime.h>
#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "tests/bench/bench_common.h"
#include "tests/common/device_data.h"
#include "tests/common/rank_launcher.h"
#include "tests/common/test_util.h"

namespace unifab::bench {
namespace {

struct Config {
  std::string label;                     // file-name safe
  std::vector<std::string> environment;  // NAME=VALUE
  bool forced;                           // one of the swept configurations
  std::string algorithm, protocol;       // what a forced configuration names (NCCL_ALGO spelling)
  int channels = 0;                      // what a forced configuration names; 0 = NCCL's or the tuner's
};

std::vector<std::string> split(const std::string& text) {
  std::vector<std::string> items;
  for (const std::string& item : test::commaItems(text)) {
    if (!item.empty()) items.push_back(item);
  }
  return items;
}

// The algorithms NCCL can run for `op` without NVLink SHARP or CollNet (both unavailable here).
std::vector<std::string> algorithmsFor(const std::string& op) {
  if (op == "all_reduce") return {"Ring", "Tree"};
  if (op == "broadcast") return {"Ring"};
  return {"Ring", "PAT"};  // PAT only where NCCL accepts it (one GPU per node): a refused run is skipped
}

// The rule file's names (tuner/rules.h) for the sweep's op and NCCL_ALGO/NCCL_PROTO spellings.
std::string ruleName(std::string name) {
  name.erase(std::remove(name.begin(), name.end(), '_'), name.end());
  std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return name;
}

// time_us per size from a `coll` CSV (bytes -> microseconds); empty when the run failed.
std::map<size_t, double> readTimes(const std::string& path) {
  std::map<size_t, double> times;
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);  // header
  while (std::getline(in, line)) {
    std::vector<std::string> fields;
    std::stringstream row(line);
    for (std::string field; std::getline(row, field, ',');) fields.push_back(field);
    if (fields.size() < 9 || std::strtoull(fields[8].c_str(), nullptr, 10) != 0) continue;  // wrong results
    times[std::strtoull(fields[3].c_str(), nullptr, 10)] = std::strtod(fields[4].c_str(), nullptr);
  }
  return times;
}

// Where a logging run's NCCL_DEBUG_FILE goes (NCCL appends ".<host>.<pid>"): `kind` is "tuning"
// for --log-tuning's untimed run, "check" for the first timed repetition.
std::string logPrefix(const std::string& out, const std::string& op, const std::string& net, const std::string& label,
                      const char* kind) {
  return out + "/" + op + "." + net + "." + label + "." + kind;
}

// Calls `visit` with the path of every log NCCL wrote under `prefix` (one file per rank).
template <typename Visit>
void forEachLogFile(const std::string& prefix, Visit visit) {
  const std::string directory = prefix.substr(0, prefix.rfind('/') + 1);
  const std::string stem = prefix.substr(directory.size());
  std::vector<std::string> paths;
  if (DIR* dir = opendir(directory.c_str())) {
    for (dirent* entry = readdir(dir); entry != nullptr; entry = readdir(dir)) {
      const std::string name = entry->d_name;
      if (name.compare(0, stem.size(), stem) == 0) paths.push_back(directory + name);
    }
    closedir(dir);
  }
  for (const std::string& path : paths) visit(path);
}

// Calls `visit` with every line of the logs under `prefix`, the files in directory order.
template <typename Visit>
void forEachLogLine(const std::string& prefix, Visit visit) {
  forEachLogFile(prefix, [&](const std::string& path) {
    std::ifstream in(path);
    for (std::string line; std::getline(in, line);) visit(line);
  });
}

// The choices a --log-tuning run logged: unifab's tuner's lines ("-> algorithm/protocol by ..."),
// and any per-call choice NCCL itself logs at INFO, each distinct line once (the ranks' alike).
void printTuningChoices(const std::string& prefix, const char* label) {
  std::vector<std::string> seen;  // in the order logged (sizes grow)
  forEachLogLine(prefix, [&](const std::string& line) {
    const bool unifab = line.find(" bytes (first call in ") != std::string::npos;
    const bool nccl = line.find("Bytes -> Algo") != std::string::npos || line.find("Best tuning") != std::string::npos;
    if (!unifab && !nccl) return;
    const size_t info = line.find("INFO ");
    std::string text = info == std::string::npos ? line : line.substr(info + 5);
    const size_t comm = text.find("comm 0x"), colon = text.find(": ", comm == std::string::npos ? 0 : comm);
    if (comm != std::string::npos && colon != std::string::npos) text.erase(comm, colon + 2 - comm);  // ranks alike
    if (std::find(seen.begin(), seen.end(), text) == seen.end()) seen.push_back(text);
  });
  constexpr size_t kMaxLines = 60;
  printf("# %s, NCCL_DEBUG_SUBSYS=TUNING (%zu distinct choice lines%s):\n", label, seen.size(),
         seen.size() > kMaxLines ? ", the first 60" : "");
  for (size_t i = 0; i < seen.size() && i < kMaxLines; ++i) printf("#   %s\n", seen[i].c_str());
}

// NCCL's name of a collective in its per-call TUNING line ("AllGather: 4 Bytes -> Algo ...").
std::string ncclCallName(const std::string& op) {
  if (op == "all_reduce") return "AllReduce";
  if (op == "all_gather") return "AllGather";
  if (op == "reduce_scatter") return "ReduceScatter";
  if (op == "broadcast") return "Broadcast";
  return op;
}

// NCCL's per-call choices for `op` in the TUNING logs under `prefix`: NCCL's byte count of the
// call -> "ALGO PROTO channel{Lo..Hi}={a..b}" (the first call of each size; they repeat).
std::map<size_t, std::string> ncclChoices(const std::string& prefix, const std::string& op) {
  std::map<size_t, std::string> choices;
  const std::string call = ncclCallName(op) + ": ";
  forEachLogLine(prefix, [&](const std::string& line) {
    const size_t at = line.find(call);
    if (at == std::string::npos) return;
    const size_t algo = line.find("-> Algo ", at);
    if (algo == std::string::npos) return;
    const size_t bytes = std::strtoull(line.c_str() + at + call.size(), nullptr, 10);
    choices.emplace(bytes, line.substr(algo + 8));
  });
  return choices;
}

// The channels a logged choice ("RING proto LL channel{Lo..Hi}={0..23}") runs on: Hi + 1, or 0.
int channelsOf(const std::string& choice) {
  const size_t range = choice.find("}={");
  if (range == std::string::npos) return 0;
  const size_t dots = choice.find("..", range);
  return dots == std::string::npos ? 0 : atoi(choice.c_str() + dots + 2) + 1;
}

// Whether a logged choice ("RING proto LL channel{...}") is `algorithm` with `protocol`. A rule
// naming an entry NCCL ruled out is skipped by the tuner, which then decides by its model: such a
// run must not count as the configuration it is named after.
bool runsAs(const std::string& choice, const std::string& algorithm, const std::string& protocol) {
  auto upper = [](std::string text) {
    std::transform(text.begin(), text.end(), text.begin(), [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
    return text;
  };
  std::istringstream fields(choice);
  std::string ranAlgorithm, word, ranProtocol;
  fields >> ranAlgorithm >> word >> ranProtocol;
  return upper(ranAlgorithm) == upper(algorithm) && upper(ranProtocol) == upper(protocol);
}

}  // namespace

int runTuneSweep(Args& args, const char* self) {
  const std::vector<std::string> ops = split(args.value("--ops", "all_reduce,all_gather,reduce_scatter,broadcast"));
  const std::vector<std::string> channels = split(args.value("--channels", "2,4,8,16,32"));
  const std::vector<std::string> protocols = split(args.value("--protocols", "LL,LL128,Simple"));
  const std::string minBytes = args.value("--min", "8");
  const std::string maxBytes = args.value("--max", "1G");
  const std::string factor = args.value("--factor", "4");
  const std::string iters = args.value("--iters", "20");
  const std::string warmup = args.value("--warmup", "3");
  const int reps = std::max(1, atoi(args.value("--reps", "3").c_str()));
  const std::string net = args.value("--net", "nvlink");
  const std::string out = args.value("--out", "tune-sweep");
  const std::string force = args.value("--force", "tuner");
  const int nRanks = atoi(args.value("--nranks", "0").c_str());
  const bool logTuning = args.flag("--log-tuning");
  // Analyse a finished sweep's CSVs and logs in --out again, running nothing (no GPU needed).
  const bool fromLogs = args.flag("--from-logs");
  // How a configuration's repetitions (fresh processes, each a median of its samples) reduce to
  // one time per size: the median, or the fastest. On the shared GPU machines whole processes land
  // in a slow mode, 15-25 % behind the fast one at every size (eighth run, docs/benchmarks/
  // tuner.md); when two of three repetitions do, the median is the slow mode and compares a
  // configuration's interference, not the configuration. min keeps each one's fast mode.
  const std::string repStat = args.value("--rep-stat", "median");
  // The acceptance check as a pass/fail: exit 3 when the like-for-like gap exceeds this (percent).
  const double maxGap = atof(args.value("--max-gap", "-1").c_str());
  // And when the tuner, choosing otherwise than NCCL's default, is slower than it by more (percent).
  const double maxSlowdown = atof(args.value("--max-slowdown", "-1").c_str());
  // A port speed for unifab's sockets where sysfs has none (loopback): NCCL's default and the
  // tuner both rate the network by it, so it should be what the link carries.
  const std::string socketSpeedMbps = args.value("--socket-speed-mbps", "");
  // Passed to every `coll` run: NCCL's host enqueue, the same for every configuration, lands in
  // one of two per-process modes ~3 us apart and would drown the small sizes' differences.
  const std::string spinUs = args.value("--spin-us", "50");
  // Passed to every `coll` run: up to this many calls per timed sample at small sizes, captured in
  // one CUDA graph, so the ranks' per-process arrival skew (~1 us, the rest of the small sizes'
  // noise) spreads over them and the host's enqueue (slower than a small call) stays out. Not
  // across nodes: there NCCL reaches its proxy through a host callback per captured collective and
  // replay, which a graph would time instead of the call (single calls by default).
  const std::string batch = args.value("--batch", net == "nvlink" ? "20" : "1");
  if (!args.leftovers().empty()) {
    fprintf(stderr, "unifab-bench tune-sweep: unknown argument '%s'\n", args.leftovers()[0].c_str());
    return 2;
  }
  if (repStat != "median" && repStat != "min") {
    fprintf(stderr, "unifab-bench tune-sweep: --rep-stat is median or min, not '%s'\n", repStat.c_str());
    return 2;
  }
  if (force != "tuner" && force != "env") {
    fprintf(stderr, "unifab-bench tune-sweep: --force is tuner (a rule file per configuration) or env (NCCL_ALGO/PROTO)\n");
    return 2;
  }
  const std::string library = unifabLibraryPath();
  if (library.empty()) {
    fprintf(stderr, "unifab-bench tune-sweep: cannot locate libnccl-unifab.so\n");
    return 1;
  }
  std::vector<std::string> netEnvironment;
  if (net == "unifab") {
    netEnvironment = {"NCCL_NET_PLUGIN=" + library, "NCCL_NET=unifab", "NCCL_P2P_DISABLE=1", "NCCL_SHM_DISABLE=1",
                      "NCCL_HOSTID=unifab-sweep-host-%r"};
    if (!socketSpeedMbps.empty()) netEnvironment.push_back("UNIFAB_SOCKET_SPEED_MBPS=" + socketSpeedMbps);
  } else if (net != "nvlink") {
    fprintf(stderr, "unifab-bench tune-sweep: --net is nvlink or unifab (NET forced over unifab's transport)\n");
    return 2;
  }
  mkdir(out.c_str(), 0755);
  // A second analysis of the same folder by the fastest repetition keeps the median's summary.
  const std::string summaryPath = out + (repStat == "min" ? "/summary-min.csv" : "/summary.csv");
  FILE* summary = fopen(summaryPath.c_str(), "w");
  if (summary == nullptr) {
    fprintf(stderr, "unifab-bench tune-sweep: cannot write %s\n", summaryPath.c_str());
    return 1;
  }
  fprintf(summary, "op,net,bytes,best_config,best_us,tuner_us,tuner_gap_pct,default_us,default_gap_pct,"
                   "tuner_built_us,tuner_built_gap_pct,default_built_us,default_built_gap_pct,"
                   "best_at_default_build,best_at_default_build_us,tuner_gap_at_default_build_pct\n");
  std::string mostChannels = channels.empty() ? "" : channels.front();
  for (const std::string& c : channels) {
    if (atoi(c.c_str()) > atoi(mostChannels.c_str())) mostChannels = c;
  }
  int failedRuns = 0, notApplied = 0;
  double worstTunerGap = 0, worstTunerBuiltGap = 0, worstTunerVsDefault = 0, worstBuiltVsDefaultBuilt = 0;
  double worstAlikeVsDefault = 0;  // sizes where NCCL ran the tuner's calls as the default's
  double worstBestAlikeNoise = 0;  // sizes where NCCL ran the tuner's calls as the best forced one's
  // The same at NCCL's default build: the tuner at the default initialisation against the best
  // forced configuration on no more channels than NCCL built by default (what users get).
  double worstDefaultBuildGap = 0, worstDefaultBuildNoise = 0;
  int defaultBuildChannels = 0;
  int comparedSizes = 0;  // sizes with the tuner (channels built) and a forced configuration measured
  std::string beatsDefault;         // "op bytes: -x%" where the tuner chose otherwise and was faster
  int gpus = nRanks;
  if (fromLogs && gpus <= 0) {
    fprintf(stderr, "unifab-bench tune-sweep: --from-logs needs --nranks (the sweep's rank count)\n");
    fclose(summary);
    return 2;
  }
  if (gpus <= 0 && (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus < 1)) {
    fprintf(stderr, "unifab-bench tune-sweep: no CUDA device\n");
    fclose(summary);
    return 1;
  }
  // One rank's collectives move nothing between GPUs: there is nothing for the tuner to choose, so
  // an acceptance run (--max-gap) on one GPU is skipped (test::kSkipExitCode), not passed or failed.
  if (maxGap >= 0 && gpus < 2) {
    printf("# skipped: the acceptance check needs two or more ranks (%d GPU found)\n", gpus);
    fclose(summary);
    return test::kSkipExitCode;
  }
  for (const std::string& op : ops) {
    std::vector<Config> configs;
    configs.push_back({"default", {"NCCL_TUNER_PLUGIN=none"}, false, "", ""});
    configs.push_back({"unifab-tuner", {"NCCL_TUNER_PLUGIN=" + library}, false, "", ""});
    if (!mostChannels.empty()) {
      configs.push_back({"default-built" + mostChannels, {"NCCL_TUNER_PLUGIN=none", "NCCL_MIN_NCHANNELS=" + mostChannels},
                         false, "", ""});
      configs.push_back({"unifab-tuner-built" + mostChannels,
                         {"NCCL_TUNER_PLUGIN=" + library, "NCCL_MIN_NCHANNELS=" + mostChannels}, false, "", ""});
    }
    for (const std::string& algo : algorithmsFor(op)) {
      if (force == "tuner" && algo == "PAT" && net == "nvlink") {
        // NCCL rules PAT out with several GPUs per node, and the tuner then falls back to its model
        // (the rule is skipped), so the run would not be the configuration it is named after.
        printf("# %s: PAT is not forced through the tuner on one node (NCCL rules it out)\n", op.c_str());
        continue;
      }
      for (const std::string& proto : protocols) {
        for (const std::string& c : channels) {
          const std::string label = algo + "-" + proto + "-" + c;
          if (force == "env") {
            configs.push_back({label,
                               {"NCCL_TUNER_PLUGIN=none", "NCCL_ALGO=" + algo, "NCCL_PROTO=" + proto,
                                "NCCL_MIN_NCHANNELS=" + c, "NCCL_MAX_NCHANNELS=" + c},
                               true, algo, proto, atoi(c.c_str())});
            continue;
          }
          const std::string rules = out + "/" + op + "." + label + ".rules";
          FILE* file = fopen(rules.c_str(), "w");
          if (file == nullptr) {
            fprintf(stderr, "unifab-bench tune-sweep: cannot write %s\n", rules.c_str());
            fclose(summary);
            return 1;
          }
          fprintf(file, "%s,0,%s,%s,%s,%s,-1,-1\n", ruleName(op).c_str(), "1024G", ruleName(algo).c_str(),
                  ruleName(proto).c_str(), c.c_str());
          fclose(file);
          configs.push_back({label,
                             {"NCCL_TUNER_PLUGIN=" + library, "UNIFAB_TUNER_CONFIG=" + rules,
                              "NCCL_MIN_NCHANNELS=" + mostChannels},
                             true, algo, proto, atoi(c.c_str())});
        }
      }
    }
    std::map<std::string, std::map<size_t, std::vector<double>>> samples;  // label -> bytes -> one per rep
    // One run of `coll` in fresh processes; false when NCCL refused or failed the configuration.
    // Repetition 0 is the untimed --log-tuning run.
    auto runOnce = [&](const Config& config, int rep) {
      const std::string csv = out + "/" + op + "." + net + "." + config.label + ".rep" + std::to_string(rep) + ".csv";
      if (fromLogs) {
        const std::map<size_t, double> times = readTimes(csv);
        if (rep > 0) {
          for (const auto& [bytes, us] : times) samples[config.label][bytes].push_back(us);
        }
        return !times.empty();
      }
      test::LaunchOptions launch;
      launch.nRanks = gpus;
      launch.timeoutSeconds = 600;
      const char* nvls = getenv("NCCL_NVLS_ENABLE");
      launch.environment.push_back(std::string("NCCL_NVLS_ENABLE=") + (nvls != nullptr ? nvls : "0"));
      for (const char* variable : {"NCCL_SOCKET_IFNAME", "UNIFAB_SOCKET_IFNAME"}) {
        if (getenv(variable) == nullptr) launch.environment.push_back(std::string(variable) + "=lo");
      }
      launch.environment.insert(launch.environment.end(), netEnvironment.begin(), netEnvironment.end());
      launch.environment.insert(launch.environment.end(), config.environment.begin(), config.environment.end());
      // Repetition 1 logs NCCL's per-call choices, every configuration alike (the spin hides the
      // logging's host time), to check that forced ones ran what they name. Logs of an earlier
      // sweep into the same folder go first: their choices would mix with these.
      if (rep <= 1) {
        const std::string prefix = logPrefix(out, op, net, config.label, rep == 0 ? "tuning" : "check");
        forEachLogFile(prefix, [](const std::string& path) { remove(path.c_str()); });
        launch.environment.insert(launch.environment.end(), {"NCCL_DEBUG=INFO", "NCCL_DEBUG_SUBSYS=TUNING",
                                                             "NCCL_DEBUG_FILE=" + prefix + ".%h.%p"});
      }
      const std::vector<std::string> argv = {self, "coll", "--op", op, "--min", minBytes, "--max", maxBytes,
                                             "--factor", factor, "--iters", iters, "--warmup", warmup, "--csv", csv,
                                             "--spin-us", spinUs, "--batch", batch};
      remove(csv.c_str());
      if (test::launchRanks(launch, argv) != 0) return false;
      if (rep > 0) {
        for (const auto& [bytes, us] : readTimes(csv)) samples[config.label][bytes].push_back(us);
      }
      return true;
    };
    if (logTuning) {
      for (const Config& config : configs) {
        if (!config.forced) runOnce(config, 0);
      }
    }
    for (int rep = 1; rep <= reps; ++rep) {
      for (const Config& config : configs) {
        if (!runOnce(config, rep)) {
          ++failedRuns;
          printf("# %s %s (repetition %d): NCCL refused or failed this configuration; skipped\n", op.c_str(),
                 config.label.c_str(), rep);
        }
      }
    }
    // NCCL logs a call's count argument in bytes (per rank for all-gather and reduce-scatter),
    // the sweep the larger buffer: the buffers `coll` made for that size say which.
    test::Collective collective = test::Collective::kAllReduce;
    test::collectiveByName(op.c_str(), &collective);
    auto ncclBytes = [&](size_t bytes) {
      size_t sendCount = 0, recvCount = 0;
      test::bufferCounts(collective, bytes, gpus, &sendCount, &recvCount);
      return test::ncclCallCount(collective, sendCount, recvCount) * sizeof(float);
    };
    // What NCCL ran for every configuration's calls, from repetition 1's logs.
    std::map<std::string, std::map<size_t, std::string>> choices;  // label -> NCCL bytes -> choice
    for (const Config& config : configs) {
      choices[config.label] = ncclChoices(logPrefix(out, op, net, config.label, "check"), op);
    }
    for (const Config& config : configs) {
      if (!config.forced || samples.count(config.label) == 0) continue;
      const std::map<size_t, std::string>& ran = choices[config.label];
      if (ran.empty()) {
        printf("# %s %s: NCCL logged no choice (repetition 1 failed, or this NCCL logs none); kept as named\n",
               op.c_str(), config.label.c_str());
        continue;
      }
      std::string dropped;
      for (auto it = samples[config.label].begin(); it != samples[config.label].end();) {
        auto choice = ran.find(ncclBytes(it->first));
        if (choice == ran.end() || runsAs(choice->second, config.algorithm, config.protocol)) {
          ++it;
          continue;
        }
        dropped += " " + std::to_string(it->first) + " (" + choice->second.substr(0, choice->second.find(" channel")) + ")";
        it = samples[config.label].erase(it);
        ++notApplied;
      }
      if (!dropped.empty()) {
        printf("# %s %s: NCCL ran something else at%s: the entry is ruled out there; those sizes left out\n",
               op.c_str(), config.label.c_str(), dropped.c_str());
      }
    }
    std::map<std::string, std::map<size_t, double>> results;  // --rep-stat over the repetitions
    for (auto& [label, bySize] : samples) {
      for (auto& [bytes, times] : bySize) {
        std::sort(times.begin(), times.end());
        const size_t n = times.size();
        results[label][bytes] = repStat == "min"  ? times.front()
                                : n % 2 == 1      ? times[n / 2]
                                                  : 0.5 * (times[n / 2 - 1] + times[n / 2]);
      }
    }
    printf("# %s over %s: best forced configuration per size, and unifab's tuner and NCCL's default against it\n",
           op.c_str(), net.c_str());
    printf("# (%s over %d repetitions; \"built\": %s channels built at init; configurations forced %s)\n",
           repStat == "min" ? "fastest" : "median", reps,
           mostChannels.c_str(), force == "tuner" ? "through the tuner with them built" : "by NCCL_ALGO/NCCL_PROTO");
    printf("# (same: whether NCCL ran the tuner's and the default's calls alike, at the default initialisation and\n"
           "#  with channels built, then tuner+b's and the best's; '=' alike, so a difference in time is noise,\n"
           "#  '*' not, '?' not logged; best@default: the fastest forced configuration on no more channels than\n"
           "#  NCCL's default built, with the tuner at the default initialisation against it and '=' as above)\n");
    printf("# %12s %-20s %10s %10s %8s %10s %8s %10s %8s %10s %8s %5s %-16s %8s %8s %s\n", "bytes", "best", "best(us)",
           "tuner(us)", "gap", "default", "gap", "tuner+b", "gap", "default+b", "gap", "same", "best@default",
           "(us)", "tuner", "=");
    auto alike = [&](const std::string& a, const std::string& b, size_t bytes) {
      auto first = choices[a].find(ncclBytes(bytes)), second = choices[b].find(ncclBytes(bytes));
      if (first == choices[a].end() || second == choices[b].end()) return '?';
      return first->second == second->second ? '=' : '*';
    };
    const std::map<size_t, double>& tuner = results["unifab-tuner"];
    const std::map<size_t, double>& fallback = results["default"];
    const std::map<size_t, double>& tunerBuilt = results["unifab-tuner-built" + mostChannels];
    const std::map<size_t, double>& fallbackBuilt = results["default-built" + mostChannels];
    auto timeAt = [](const std::map<size_t, double>& times, size_t bytes) {
      auto it = times.find(bytes);
      return it == times.end() ? 0.0 : it->second;
    };
    // NCCL's default build: the most channels the default's logged calls ran on.
    int opDefaultChannels = 0;
    for (const auto& [ncclBytesLogged, choice] : choices["default"]) {
      opDefaultChannels = std::max(opDefaultChannels, channelsOf(choice));
    }
    defaultBuildChannels = std::max(defaultBuildChannels, opDefaultChannels);
    // The fastest forced configuration at `bytes` on at most `maxChannels`: label and time.
    auto fastestForced = [&](size_t bytes, int maxChannels, std::string* label, double* us) {
      label->clear();
      *us = 0;
      for (const Config& config : configs) {
        if (!config.forced || config.channels > maxChannels) continue;
        auto it = results[config.label].find(bytes);
        if (it == results[config.label].end()) continue;
        if (label->empty() || it->second < *us) {
          *label = config.label;
          *us = it->second;
        }
      }
    };
    for (const auto& [bytes, tunerUs] : tuner) {
      std::string best, bestAtDefault;
      double bestUs = 0, bestAtDefaultUs = 0;
      fastestForced(bytes, std::numeric_limits<int>::max(), &best, &bestUs);
      fastestForced(bytes, opDefaultChannels, &bestAtDefault, &bestAtDefaultUs);
      const double defaultUs = timeAt(fallback, bytes);
      const double tunerBuiltUs = timeAt(tunerBuilt, bytes), defaultBuiltUs = timeAt(fallbackBuilt, bytes);
      if (best.empty()) continue;
      auto gapOf = [&](double us) { return us > 0 ? 100 * (us / bestUs - 1) : 0.0; };
      const double tunerGap = gapOf(tunerUs);
      const double defaultGap = gapOf(defaultUs);
      // The acceptance rule: within 5 %, or within 1 us below 64 KiB.
      const bool smallEnough = bytes < (size_t{64} << 10) && tunerUs - bestUs <= 1.0;
      if (!smallEnough) worstTunerGap = std::max(worstTunerGap, tunerGap);
      const bool builtSmallEnough = bytes < (size_t{64} << 10) && tunerBuiltUs - bestUs <= 1.0;
      const char same = alike("unifab-tuner", "default", bytes);
      const char sameBuilt = alike("unifab-tuner-built" + mostChannels, "default-built" + mostChannels, bytes);
      // Where NCCL ran the tuner's call exactly as the best forced one (algorithm, protocol and
      // channels), the tuner chose the best and the gap is run-to-run noise: tracked apart, shown.
      const char sameAsBest = alike("unifab-tuner-built" + mostChannels, best, bytes);
      if (tunerBuiltUs > 0) ++comparedSizes;
      if (tunerBuiltUs > 0 && !builtSmallEnough) {
        double& worst = sameAsBest == '=' ? worstBestAlikeNoise : worstTunerBuiltGap;
        worst = std::max(worst, gapOf(tunerBuiltUs));
      }
      // Where NCCL ran both alike the difference is noise, not the tuner's; tracked apart.
      if (defaultUs > 0) {
        double& worst = same == '=' ? worstAlikeVsDefault : worstTunerVsDefault;
        worst = std::max(worst, 100 * (tunerUs / defaultUs - 1));
        if (same == '*' && tunerUs < 0.95 * defaultUs) {
          char gain[96];
          snprintf(gain, sizeof(gain), "%s%s %zu B %.0f%% faster", beatsDefault.empty() ? "" : ", ", op.c_str(), bytes,
                   100 * (1 - tunerUs / defaultUs));
          beatsDefault += gain;
        }
      }
      if (defaultBuiltUs > 0 && tunerBuiltUs > 0) {
        double& worst = sameBuilt == '=' ? worstAlikeVsDefault : worstBuiltVsDefaultBuilt;
        worst = std::max(worst, 100 * (tunerBuiltUs / defaultBuiltUs - 1));
      }
      // At the default build, the tuner as users run it against what it could have chosen there.
      double defaultBuildGap = 0;
      char sameAsBestAtDefault = '?';
      if (!bestAtDefault.empty()) {
        defaultBuildGap = 100 * (tunerUs / bestAtDefaultUs - 1);
        sameAsBestAtDefault = alike("unifab-tuner", bestAtDefault, bytes);
        if (!(bytes < (size_t{64} << 10) && tunerUs - bestAtDefaultUs <= 1.0)) {
          double& worst = sameAsBestAtDefault == '=' ? worstDefaultBuildNoise : worstDefaultBuildGap;
          worst = std::max(worst, defaultBuildGap);
        }
      }
      printf("  %12zu %-20s %10.1f %10.1f %7.1f%% %10.1f %7.1f%% %10.1f %7.1f%% %10.1f %7.1f%%   %c%c%c %-16s %8.1f "
             "%7.1f%% %c\n",
             bytes, best.c_str(), bestUs, tunerUs, tunerGap, defaultUs, defaultGap, tunerBuiltUs, gapOf(tunerBuiltUs),
             defaultBuiltUs, gapOf(defaultBuiltUs), same, sameBuilt, sameAsBest,
             bestAtDefault.empty() ? "-" : bestAtDefault.c_str(), bestAtDefaultUs, defaultBuildGap, sameAsBestAtDefault);
      fprintf(summary, "%s,%s,%zu,%s,%.2f,%.2f,%.2f,%.2f,%.2f,%.2f,%.2f,%.2f,%.2f,%s,%.2f,%.2f\n", op.c_str(),
              net.c_str(), bytes, best.c_str(), bestUs, tunerUs, tunerGap, defaultUs, defaultGap, tunerBuiltUs,
              gapOf(tunerBuiltUs), defaultBuiltUs, gapOf(defaultBuiltUs), bestAtDefault.c_str(), bestAtDefaultUs,
              defaultBuildGap);
    }
    if (logTuning) {
      for (const char* label : {"unifab-tuner", "default"}) {
        printTuningChoices(logPrefix(out, op, net, label, "tuning"), label);
      }
    }
  }
  fclose(summary);
  // Like with like: the forced configurations run with the most channels built, as tuner+b does;
  // at NCCL's default initialisation fewer may be built, which no tuner can raise.
  printf("# acceptance, same initialisation (%s channels built): worst gap of unifab's tuner to the best forced "
         "configuration (sizes >= 64 KiB, or > 1 us below) where NCCL ran another choice: %.1f%% (where it ran the "
         "best's very choice, noise: up to %.1f%%)\n",
         mostChannels.c_str(), worstTunerBuiltGap, worstBestAlikeNoise);
  printf("# acceptance at NCCL's default build (%d channels): worst gap of unifab's tuner (default initialisation) to "
         "the best forced configuration on at most that many channels (sizes >= 64 KiB, or > 1 us below) where NCCL "
         "ran another choice: %.1f%% (where it ran that one's very choice, noise: up to %.1f%%)\n",
         defaultBuildChannels, worstDefaultBuildGap, worstDefaultBuildNoise);
  printf("# worst slowdown of unifab's tuner against NCCL's default where they chose differently: %.1f%% with %s "
         "channels built, %.1f%% at the default initialisation (where NCCL ran both alike, noise: up to %.1f%%)\n",
         worstBuiltVsDefaultBuilt, mostChannels.c_str(), worstTunerVsDefault, worstAlikeVsDefault);
  printf("# at the default initialisation, unifab's tuner against the forced configurations (%s channels built): "
         "%.1f%%; %d configuration runs refused, %d configuration sizes NCCL did not run as named\n",
         mostChannels.c_str(), worstTunerGap, failedRuns, notApplied);
  printf("# where unifab's tuner chose otherwise than NCCL's default and beat it by more than 5%% (default "
         "initialisation): %s\n", beatsDefault.empty() ? "nowhere" : beatsDefault.c_str());
  if (maxGap >= 0 && comparedSizes == 0) {
    printf("# FAIL: no size had both the tuner and a forced configuration measured: nothing to accept\n");
    return 3;
  }
  if (maxGap >= 0 && worstTunerBuiltGap > maxGap) {
    printf("# FAIL: unifab's tuner is %.1f%% behind the best forced configuration, more than --max-gap %.1f%%\n",
           worstTunerBuiltGap, maxGap);
    return 3;
  }
  if (maxGap >= 0 && worstDefaultBuildGap > maxGap) {
    printf("# FAIL: at NCCL's default build unifab's tuner is %.1f%% behind the best forced configuration on at most "
           "%d channels, more than --max-gap %.1f%%\n",
           worstDefaultBuildGap, defaultBuildChannels, maxGap);
    return 3;
  }
  if (maxSlowdown >= 0 && std::max(worstTunerVsDefault, worstBuiltVsDefaultBuilt) > maxSlowdown) {
    printf("# FAIL: where unifab's tuner chose otherwise than NCCL's default it was %.1f%% slower, more than "
           "--max-slowdown %.1f%%\n",
           std::max(worstTunerVsDefault, worstBuiltVsDefaultBuilt), maxSlowdown);
    return 3;
  }
  // Noise this large between calls NCCL ran alike is no noise: something the choice does not show
  // (the tuner's own host time, a slow process) and the run cannot vouch for the tuner.
  if (maxGap >= 0 && worstBestAlikeNoise > 2 * maxGap) {
    printf("# FAIL: where NCCL ran the tuner's call as the best's, the tuner was still %.1f%% behind, more than "
           "twice --max-gap %.1f%%\n",
           worstBestAlikeNoise, maxGap);
    return 3;
  }
  return 0;
}

}  // namespace unifab::bench
