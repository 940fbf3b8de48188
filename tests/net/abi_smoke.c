/* Loads libnccl-unifab.so from C the way NCCL does (dlopen RTLD_NOW|RTLD_LOCAL, by both plugin
 * link names) and exercises the tuner table and the C API; proves the public and ABI headers
 * compile as C. Expects UNIFAB_TUNER_NET_GBPS in the environment so the cost model is active
 * without a net plugin instance. */
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include "unifab/nccl/net_v11.h"
#include "unifab/nccl/tuner_v5.h"
#include "unifab/unifab.h"

static int passed = 0, failed = 0;
#define CHECK(cond)                                                   \
  do {                                                                \
    if (cond) {                                                       \
      ++passed;                                                       \
    } else {                                                          \
      ++failed;                                                       \
      fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
    }                                                                 \
  } while (0)

static void quietLogger(ncclDebugLogLevel level, unsigned long flags, const char* file, int line, const char* fmt, ...) {
  (void)level, (void)flags, (void)file, (void)line, (void)fmt;
}

int main(int argc, char** argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: %s LIBNCCL-NET-UNIFAB.SO LIBNCCL-TUNER-UNIFAB.SO\n", argv[0]);
    return 2;
  }
  void* net = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  void* tunerLib = dlopen(argv[2], RTLD_NOW | RTLD_LOCAL);
  CHECK(net != NULL && tunerLib != NULL);
  if (net == NULL || tunerLib == NULL) return 1;
  CHECK(net == tunerLib); /* one file behind both names: one copy of the library */

  const ncclNet_v11_t* netTable = (const ncclNet_v11_t*)dlsym(net, "ncclNetPlugin_v11");
  const ncclTuner_v5_t* tuner = (const ncclTuner_v5_t*)dlsym(tunerLib, "ncclTunerPlugin_v5");
  CHECK(netTable != NULL && strcmp(netTable->name, "unifab") == 0);
  CHECK(tuner != NULL && strcmp(tuner->name, "unifab") == 0);

  unifabResult_t (*getVersion)(int*) = (unifabResult_t(*)(int*))dlsym(net, "unifabGetVersion");
  const char* (*errorString)(unifabResult_t) = (const char* (*)(unifabResult_t))dlsym(net, "unifabGetErrorString");
  const char* (*lastError)(void) = (const char* (*)(void))dlsym(net, "unifabGetLastError");
  CHECK(getVersion != NULL && errorString != NULL && lastError != NULL);
  if (getVersion != NULL && errorString != NULL && lastError != NULL) {
    int version = 0;
    CHECK(getVersion(&version) == unifabSuccess && version == UNIFAB_VERSION_CODE);
    CHECK(getVersion(NULL) == unifabInvalidArgument);
    CHECK(strstr(lastError(), "version=NULL") != NULL);
    CHECK(strcmp(errorString(unifabInvalidArgument), "invalid argument") == 0);
    CHECK(errorString((unifabResult_t)1234) != NULL);
  }

  if (tuner != NULL) {
    ncclNvlDomainInfo_v5_t nvl = {2, 1, 1};
    ncclTunerConstants_v5_t constants;
    memset(&constants, 0, sizeof(constants));
    for (int a = 0; a < NCCL_NUM_ALGORITHMS_V5; ++a) {
      for (int p = 0; p < NCCL_NUM_PROTOCOLS_V5; ++p) {
        constants.baseLatencies[a][p] = 8.0;
        constants.hwLatencies[NCCL_HW_NET][a][p] = p == NCCL_PROTO_SIMPLE ? 14.0 : 5.0;
      }
    }
    void* context = NULL;
    CHECK(tuner->init(&context, 42, 2, 2, quietLogger, &nvl, &constants) == ncclSuccess && context != NULL);
    float table[NCCL_NUM_ALGORITHMS_V5][NCCL_NUM_PROTOCOLS_V5];
    for (int a = 0; a < NCCL_NUM_ALGORITHMS_V5; ++a)
      for (int p = 0; p < NCCL_NUM_PROTOCOLS_V5; ++p) table[a][p] = (float)NCCL_ALGO_PROTO_IGNORE;
    table[NCCL_ALGO_RING][NCCL_PROTO_LL] = table[NCCL_ALGO_RING][NCCL_PROTO_SIMPLE] = 5000.0f;
    table[NCCL_ALGO_TREE][NCCL_PROTO_LL] = table[NCCL_ALGO_TREE][NCCL_PROTO_SIMPLE] = 4000.0f;
    int channels = 0;
    CHECK(tuner->getCollInfo(context, ncclFuncAllReduce, 64u << 20, 1, (float**)table, NCCL_NUM_ALGORITHMS_V5,
                             NCCL_NUM_PROTOCOLS_V5, 0, &channels) == ncclSuccess);
    /* No unifab socket transport is live here (the network speed comes from UNIFAB_TUNER_NET_GBPS):
       the channel count stays NCCL's. */
    CHECK(channels == 0);
    CHECK(table[NCCL_ALGO_RING][NCCL_PROTO_LL128] == (float)NCCL_ALGO_PROTO_IGNORE);
    CHECK(table[NCCL_ALGO_PAT][NCCL_PROTO_SIMPLE] == (float)NCCL_ALGO_PROTO_IGNORE);
    /* 64 MiB over a 10 GB/s network: about 6.7 ms; the ring with the simple protocol wins. */
    CHECK(table[NCCL_ALGO_RING][NCCL_PROTO_SIMPLE] > 5000.0f && table[NCCL_ALGO_RING][NCCL_PROTO_SIMPLE] < 20000.0f);
    CHECK(table[NCCL_ALGO_RING][NCCL_PROTO_SIMPLE] < table[NCCL_ALGO_TREE][NCCL_PROTO_SIMPLE]);
    CHECK(table[NCCL_ALGO_RING][NCCL_PROTO_SIMPLE] < table[NCCL_ALGO_RING][NCCL_PROTO_LL]);
    /* A null table or context is tolerated: getCollInfo never fails NCCL's collective. */
    CHECK(tuner->getCollInfo(context, ncclFuncAllReduce, 8, 1, NULL, 7, 3, 0, &channels) == ncclSuccess);
    CHECK(tuner->finalize(context) == ncclSuccess);

    /* With unifab's socket transport carrying the network, the model sets the channel count: one
       per 2 MiB of each rank's 64 MiB on the wire. */
    void* netContext = NULL;
    CHECK(netTable != NULL && netTable->init(&netContext, 7, NULL, quietLogger, NULL) == ncclSuccess);
    context = NULL;
    CHECK(tuner->init(&context, 43, 2, 2, quietLogger, &nvl, &constants) == ncclSuccess && context != NULL);
    table[NCCL_ALGO_RING][NCCL_PROTO_LL] = table[NCCL_ALGO_RING][NCCL_PROTO_SIMPLE] = 5000.0f;
    table[NCCL_ALGO_TREE][NCCL_PROTO_LL] = table[NCCL_ALGO_TREE][NCCL_PROTO_SIMPLE] = 4000.0f;
    channels = 0;
    CHECK(tuner->getCollInfo(context, ncclFuncAllReduce, 64u << 20, 1, (float**)table, NCCL_NUM_ALGORITHMS_V5,
                             NCCL_NUM_PROTOCOLS_V5, 0, &channels) == ncclSuccess);
    CHECK(channels == 32);
    CHECK(tuner->finalize(context) == ncclSuccess);
    if (netTable != NULL && netContext != NULL) CHECK(netTable->finalize(netContext) == ncclSuccess);
  }
  dlclose(tunerLib);
  dlclose(net);
  printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
