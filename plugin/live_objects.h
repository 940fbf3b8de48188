// The extension objects that exist (EP groups, PP groups, Engram tables), by address: an entry
// point handed a destroyed or never-created one refuses it with a clear error instead of reading
// freed memory, and a second destroy is refused instead of freeing twice. A later object may reuse
// a freed address; a stale pointer to it then reaches that object, as with any C handle.
#pragma once

#include <mutex>
#include <unordered_set>

#include "plugin/check.h"

namespace unifab {

template <typename T>
class LiveObjects {
 public:
  static void add(const T* object) {
    std::lock_guard<std::mutex> lock(mutex());
    objects().insert(object);
  }
  // False if `object` was not live.
  static bool remove(const T* object) {
    std::lock_guard<std::mutex> lock(mutex());
    return objects().erase(object) != 0;
  }
  static bool contains(const T* object) {
    std::lock_guard<std::mutex> lock(mutex());
    return objects().count(object) != 0;
  }

 private:
  // Never destroyed, so that an object destroyed by another static's destructor at exit still
  // finds the set.
  static std::mutex& mutex() {
    static auto* m = new std::mutex;
    return *m;
  }
  static std::unordered_set<const T*>& objects() {
    static auto* set = new std::unordered_set<const T*>;
    return *set;
  }
};

// unifabInvalidArgument unless `object` is non-NULL and live; `what` names it in the message
// ("group", "table"), `entryPoint` the call.
template <typename T>
Result requireLive(const T* object, const char* entryPoint, const char* what) {
  if (object == nullptr) return UF_ERROR(unifabInvalidArgument, kExt, "%s: %s=NULL", entryPoint, what);
  if (!LiveObjects<T>::contains(object)) {
    return UF_ERROR(unifabInvalidArgument, kExt, "%s: %s=%p was destroyed or never created", entryPoint, what,
                    static_cast<const void*>(object));
  }
  return unifabSuccess;
}

// Destroys a live `object` (NULL: nothing to do); a destroyed or never-created one is refused.
template <typename T>
Result destroyLive(T* object, const char* entryPoint, const char* what) {
  if (object == nullptr) return unifabSuccess;
  if (!LiveObjects<T>::remove(object)) {
    return UF_ERROR(unifabInvalidArgument, kExt, "%s: %s=%p was destroyed already or never created", entryPoint, what,
                    static_cast<const void*>(object));
  }
  delete object;
  return unifabSuccess;
}

}  // namespace unifab
