/* Links the installed libnccl-unifab.so and checks the library answers with the header's version,
 * and that every versioned struct's initialiser is valid C and fills in the struct's size. */
#include <stdio.h>

#include "unifab/unifab.h"

int main(void) {
  int version = 0;
  if (unifabGetVersion(&version) != unifabSuccess || version != UNIFAB_VERSION_CODE) {
    fprintf(stderr, "unifab version mismatch: library %d, header %d\n", version, UNIFAB_VERSION_CODE);
    return 1;
  }
  unifabEpConfig_t epConfig = UNIFAB_EP_CONFIG_INIT;
  unifabEpDispatchArgs_t dispatchArgs = UNIFAB_EP_DISPATCH_ARGS_INIT;
  unifabEpDispatchResult_t dispatchResult = UNIFAB_EP_DISPATCH_RESULT_INIT;
  unifabEpCombineArgs_t combineArgs = UNIFAB_EP_COMBINE_ARGS_INIT;
  unifabEpLowLatencyDispatchArgs_t llDispatchArgs = UNIFAB_EP_LL_DISPATCH_ARGS_INIT;
  unifabEpLowLatencyDispatchResult_t llDispatchResult = UNIFAB_EP_LL_DISPATCH_RESULT_INIT;
  unifabEpLowLatencyCombineArgs_t llCombineArgs = UNIFAB_EP_LL_COMBINE_ARGS_INIT;
  unifabPpConfig_t ppConfig = UNIFAB_PP_CONFIG_INIT;
  unifabEngramConfig_t engramConfig = UNIFAB_ENGRAM_CONFIG_INIT;
  unifabEngramFetchArgs_t fetchArgs = UNIFAB_ENGRAM_FETCH_ARGS_INIT;
  const struct {
    const char* name;
    size_t size, expected;
  } sizes[] = {
      {"unifabEpConfig_t", epConfig.size, sizeof(epConfig)},
      {"unifabEpDispatchArgs_t", dispatchArgs.size, sizeof(dispatchArgs)},
      {"unifabEpDispatchResult_t", dispatchResult.size, sizeof(dispatchResult)},
      {"unifabEpCombineArgs_t", combineArgs.size, sizeof(combineArgs)},
      {"unifabEpLowLatencyDispatchArgs_t", llDispatchArgs.size, sizeof(llDispatchArgs)},
      {"unifabEpLowLatencyDispatchResult_t", llDispatchResult.size, sizeof(llDispatchResult)},
      {"unifabEpLowLatencyCombineArgs_t", llCombineArgs.size, sizeof(llCombineArgs)},
      {"unifabPpConfig_t", ppConfig.size, sizeof(ppConfig)},
      {"unifabEngramConfig_t", engramConfig.size, sizeof(engramConfig)},
      {"unifabEngramFetchArgs_t", fetchArgs.size, sizeof(fetchArgs)},
  };
  for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); ++i) {
    if (sizes[i].size != sizes[i].expected) {
      fprintf(stderr, "%s's initialiser sets size %zu, not %zu\n", sizes[i].name, sizes[i].size, sizes[i].expected);
      return 1;
    }
  }
  printf("unifab %d.%d.%d installed and linked\n", version / 10000, version / 100 % 100, version % 100);
  return 0;
}
