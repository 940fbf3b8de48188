// The copy-engine plan of an Engram fetch, apart from CUDA so that it can be tested anywhere: the
// ids become runs of rows adjacent both in one peer's table and in the output, one copy each.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace unifab::collectives::engram {

struct RowRun {
  int peer;          // LSA index of the rank holding the rows
  int64_t firstRow;  // in that rank's rows
  int64_t rows;
  size_t firstOut;   // index of the first output row
};

// Runs of `ids` (global row ids) for a table of `peers` ranks from `firstRank`, `rowsPerRank` rows
// each; false, with the index of the first id outside it in *bad.
inline bool planRuns(const std::vector<int64_t>& ids, int firstRank, int peers, int64_t rowsPerRank,
                     std::vector<RowRun>* runs, size_t* bad) {
  runs->clear();
  const int64_t base = static_cast<int64_t>(firstRank) * rowsPerRank;
  const int64_t rows = static_cast<int64_t>(peers) * rowsPerRank;
  for (size_t i = 0; i < ids.size(); ++i) {
    const int64_t local = ids[i] - base;
    if (local < 0 || local >= rows) {
      *bad = i;
      return false;
    }
    const int peer = static_cast<int>(local / rowsPerRank);
    const int64_t row = local % rowsPerRank;
    if (!runs->empty()) {
      RowRun& last = runs->back();
      if (last.peer == peer && last.firstRow + last.rows == row) {
        ++last.rows;
        continue;
      }
    }
    runs->push_back({peer, row, 1, i});
  }
  return true;
}

}  // namespace unifab::collectives::engram
