// How the ranks of a collective creation come to one answer before any of them commits: a rank
// that refused alone would leave its peers waiting in NCCL, and ranks that sized their windows
// differently would read past each other's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "collectives/common/nccl_runtime.h"

namespace unifab::collectives {

// The element-wise maximum of `values` over every rank of `comm`, in place: an NCCL all-reduce
// on a private stream of the communicator's device, waited for on the host (for setup only).
Result allRanksMax(const NcclRuntime& nccl, ncclComm_t comm, int64_t* values, size_t count);

// Each rank brings whether its own checks passed and the `count` values (named by `names`) that
// must be the same on every rank; every rank gets the same answer: success; unifabInvalidUsage
// naming the first value the ranks disagree on (with its range); or unifabInvalidUsage saying
// another rank refused. A rank whose own checks failed gets unifabInvalidArgument and should
// return its own, already logged, error instead.
Result agreeAcrossRanks(const NcclRuntime& nccl, ncclComm_t comm, const char* operation, bool locallyValid,
                        const int64_t* values = nullptr, const char* const* names = nullptr, size_t count = 0);

// The two halves of agreeAcrossRanks around its all-reduce, apart so that they can be tested
// without NCCL: the words a rank contributes (values, their complements, a refusal flag), and the
// rank's verdict from the element-wise maxima over all ranks' words.
std::vector<int64_t> agreementWords(bool locallyValid, const int64_t* values, size_t count);
Result agreementVerdict(const char* operation, bool locallyValid, const int64_t* values, const char* const* names,
                        size_t count, const std::vector<int64_t>& maxima);

}  // namespace unifab::collectives
