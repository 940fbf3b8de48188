// The unifabPp* C entry points: argument plumbing onto collectives/pp, exceptions kept inside.
#include "collectives/pp/pp_group.h"
#include "plugin/boundary.h"

using unifab::LogComponent;
using unifab::guarded;

extern "C" {

UNIFAB_API unifabResult_t unifabPpCreate(ncclComm_t comm, const unifabPpConfig_t* config, unifabPpGroup_t* group) {
  return guarded(LogComponent::kExt, "unifabPpCreate", [&] {
    if (config == nullptr || group == nullptr) {
      return UF_ERROR(unifabInvalidArgument, kExt, "unifabPpCreate: config and group must not be NULL");
    }
    *group = nullptr;
    return unifabPpGroup::create(comm, *config, group);
  });
}

UNIFAB_API unifabResult_t unifabPpDestroy(unifabPpGroup_t group) {
  return guarded(LogComponent::kExt, "unifabPpDestroy", [&] {
    delete group;
    return unifabSuccess;
  });
}

UNIFAB_API unifabResult_t unifabPpSend(unifabPpGroup_t group, const void* data, size_t bytes, int peer,
                                       cudaStream_t stream) {
  return guarded(LogComponent::kExt, "unifabPpSend", [&] {
    if (group == nullptr) return UF_ERROR(unifabInvalidArgument, kExt, "unifabPpSend: group=NULL");
    return group->send(data, bytes, peer, stream);
  });
}

UNIFAB_API unifabResult_t unifabPpRecv(unifabPpGroup_t group, void* data, size_t bytes, int peer, cudaStream_t stream) {
  return guarded(LogComponent::kExt, "unifabPpRecv", [&] {
    if (group == nullptr) return UF_ERROR(unifabInvalidArgument, kExt, "unifabPpRecv: group=NULL");
    return group->recv(data, bytes, peer, stream);
  });
}

UNIFAB_API unifabResult_t unifabPpGetAsyncError(unifabPpGroup_t group) {
  return guarded(LogComponent::kExt, "unifabPpGetAsyncError", [&] {
    if (group == nullptr) return UF_ERROR(unifabInvalidArgument, kExt, "unifabPpGetAsyncError: group=NULL");
    return group->asyncError();
  });
}

}  // extern "C"
