// The unifabEp* C entry points: argument plumbing onto collectives/ep, exceptions kept inside.
#include "collectives/ep/ep_group.h"
#include "plugin/boundary.h"
#include "plugin/live_objects.h"

using unifab::LogComponent;
using unifab::guarded;
using unifab::LiveObjects;
using unifab::requireLive;

extern "C" {

UNIFAB_API unifabResult_t unifabEpBufferSize(const unifabEpConfig_t* config, int nRanks, size_t* bytes) {
  return guarded(LogComponent::kExt, "unifabEpBufferSize", [&] {
    if (config == nullptr || bytes == nullptr) {
      return UF_ERROR(unifabInvalidArgument, kExt, "unifabEpBufferSize: config and bytes must not be NULL");
    }
    return unifabEpGroup::windowBytes(*config, nRanks, bytes);
  });
}

UNIFAB_API unifabResult_t unifabEpCreate(ncclComm_t comm, const unifabEpConfig_t* config, unifabEpGroup_t* group) {
  return guarded(LogComponent::kExt, "unifabEpCreate", [&] {
    // A NULL config or group still takes part in the ranks' agreement (create refuses it there),
    // so that the other ranks are not left waiting in NCCL.
    if (group != nullptr) *group = nullptr;
    UF_CHECK(unifabEpGroup::create(comm, config, group));
    LiveObjects<unifabEpGroup>::add(*group);
    return unifabSuccess;
  });
}

UNIFAB_API unifabResult_t unifabEpDestroy(unifabEpGroup_t group) {
  return guarded(LogComponent::kExt, "unifabEpDestroy", [&] { return unifab::destroyLive(group, "unifabEpDestroy", "group"); });
}

UNIFAB_API unifabResult_t unifabEpDispatch(unifabEpGroup_t group, const unifabEpDispatchArgs_t* args,
                                           cudaStream_t stream, unifabEpHandle_t* handle,
                                           unifabEpDispatchResult_t* result) {
  return guarded(LogComponent::kExt, "unifabEpDispatch", [&] {
    if (group == nullptr || args == nullptr || handle == nullptr || result == nullptr) {
      return UF_ERROR(unifabInvalidArgument, kExt, "unifabEpDispatch: group, args, handle and result must not be NULL");
    }
    UF_CHECK(requireLive(group, "unifabEpDispatch", "group"));
    return group->dispatch(*args, stream, handle, result);
  });
}

UNIFAB_API unifabResult_t unifabEpCombine(unifabEpGroup_t group, unifabEpHandle_t handle,
                                          const unifabEpCombineArgs_t* args, cudaStream_t stream) {
  return guarded(LogComponent::kExt, "unifabEpCombine", [&] {
    if (group == nullptr || args == nullptr) {
      return UF_ERROR(unifabInvalidArgument, kExt, "unifabEpCombine: group and args must not be NULL");
    }
    UF_CHECK(requireLive(group, "unifabEpCombine", "group"));
    return group->combine(handle, *args, stream);
  });
}

UNIFAB_API unifabResult_t unifabEpCombineInputBuffer(unifabEpGroup_t group, void** buffer, int* maxRows) {
  return guarded(LogComponent::kExt, "unifabEpCombineInputBuffer", [&] {
    if (group == nullptr || buffer == nullptr) {
      return UF_ERROR(unifabInvalidArgument, kExt, "unifabEpCombineInputBuffer: group and buffer must not be NULL");
    }
    UF_CHECK(requireLive(group, "unifabEpCombineInputBuffer", "group"));
    return group->combineInputBuffer(buffer, maxRows);
  });
}

UNIFAB_API unifabResult_t unifabEpLowLatencyDispatch(unifabEpGroup_t group, const unifabEpLowLatencyDispatchArgs_t* args,
                                                     cudaStream_t stream, unifabEpHandle_t* handle,
                                                     unifabEpLowLatencyDispatchResult_t* result) {
  return guarded(LogComponent::kExt, "unifabEpLowLatencyDispatch", [&] {
    if (group == nullptr || args == nullptr || handle == nullptr) {
      return UF_ERROR(unifabInvalidArgument, kExt, "unifabEpLowLatencyDispatch: group, args and handle must not be NULL");
    }
    UF_CHECK(requireLive(group, "unifabEpLowLatencyDispatch", "group"));
    return group->lowLatencyDispatch(*args, stream, handle, result);
  });
}

UNIFAB_API unifabResult_t unifabEpLowLatencyCombine(unifabEpGroup_t group, unifabEpHandle_t handle,
                                                    const unifabEpLowLatencyCombineArgs_t* args, cudaStream_t stream) {
  return guarded(LogComponent::kExt, "unifabEpLowLatencyCombine", [&] {
    if (group == nullptr || args == nullptr) {
      return UF_ERROR(unifabInvalidArgument, kExt, "unifabEpLowLatencyCombine: group and args must not be NULL");
    }
    UF_CHECK(requireLive(group, "unifabEpLowLatencyCombine", "group"));
    return group->lowLatencyCombine(handle, *args, stream);
  });
}

UNIFAB_API unifabResult_t unifabEpHandleDestroy(unifabEpHandle_t handle) {
  return guarded(LogComponent::kExt, "unifabEpHandleDestroy", [&] { return unifabEpGroup::destroyHandle(handle); });
}

UNIFAB_API unifabResult_t unifabEpGetAsyncError(unifabEpGroup_t group) {
  return guarded(LogComponent::kExt, "unifabEpGetAsyncError", [&] {
    UF_CHECK(requireLive(group, "unifabEpGetAsyncError", "group"));
    return group->asyncError();
  });
}

}  // extern "C"
