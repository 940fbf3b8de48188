// The unifabPp* C entry points: argument plumbing onto collectives/pp, exceptions kept inside.
#include "collectives/pp/pp_group.h"
#include "plugin/boundary.h"
#include "plugin/live_objects.h"

using unifab::LogComponent;
using unifab::guarded;
using unifab::LiveObjects;
using unifab::requireLive;

extern "C" {

UNIFAB_API unifabResult_t unifabPpCreate(ncclComm_t comm, const unifabPpConfig_t* config, unifabPpGroup_t* group) {
  return guarded(LogComponent::kExt, "unifabPpCreate", [&] {
    // A NULL config or group still takes part in the ranks' agreement (create refuses it there).
    if (group != nullptr) *group = nullptr;
    UF_CHECK(unifabPpGroup::create(comm, config, group));
    LiveObjects<unifabPpGroup>::add(*group);
    return unifabSuccess;
  });
}

UNIFAB_API unifabResult_t unifabPpDestroy(unifabPpGroup_t group) {
  return guarded(LogComponent::kExt, "unifabPpDestroy", [&] { return unifab::destroyLive(group, "unifabPpDestroy", "group"); });
}

UNIFAB_API unifabResult_t unifabPpSend(unifabPpGroup_t group, const void* data, size_t bytes, int peer,
                                       cudaStream_t stream) {
  return guarded(LogComponent::kExt, "unifabPpSend", [&] {
    UF_CHECK(requireLive(group, "unifabPpSend", "group"));
    return group->send(data, bytes, peer, stream);
  });
}

UNIFAB_API unifabResult_t unifabPpRecv(unifabPpGroup_t group, void* data, size_t bytes, int peer, cudaStream_t stream) {
  return guarded(LogComponent::kExt, "unifabPpRecv", [&] {
    UF_CHECK(requireLive(group, "unifabPpRecv", "group"));
    return group->recv(data, bytes, peer, stream);
  });
}

UNIFAB_API unifabResult_t unifabPpGetAsyncError(unifabPpGroup_t group) {
  return guarded(LogComponent::kExt, "unifabPpGetAsyncError", [&] {
    UF_CHECK(requireLive(group, "unifabPpGetAsyncError", "group"));
    return group->asyncError();
  });
}

}  // extern "C"
