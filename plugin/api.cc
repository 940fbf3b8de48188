// The unifab* C functions common to every extension operation.
#include "plugin/boundary.h"
#include "unifab/unifab.h"

extern "C" {

UNIFAB_API const char* unifabGetErrorString(unifabResult_t result) { return unifab::resultName(result); }

UNIFAB_API const char* unifabGetLastError(void) { return unifab::lastErrorMessage(); }

UNIFAB_API unifabResult_t unifabGetVersion(int* version) {
  if (version == nullptr) return UF_ERROR(unifabInvalidArgument, kExt, "unifabGetVersion: version=NULL");
  *version = UNIFAB_VERSION_CODE;
  return unifabSuccess;
}

}  // extern "C"
