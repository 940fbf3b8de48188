// Geometry of flagged lines (kernels/common/flagged_lines.cuh), for the host code that sizes
// windows holding them as well as for the kernels.
#pragma once

#include "kernels/common/host_device.h"

namespace unifab::kernels {

constexpr int kLineBytes = 128;
constexpr int kLinePieces = 8;           // 16-byte pieces, one a lane of eight
constexpr int kLinePayloadBytes = 112;  // seven pieces; the eighth holds the flag in its upper half

// Lines that carry `payloadBytes` bytes of payload.
UNIFAB_HOST_DEVICE constexpr int linesFor(int payloadBytes) { return (payloadBytes + kLinePayloadBytes - 1) / kLinePayloadBytes; }

}  // namespace unifab::kernels
