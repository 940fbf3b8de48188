/* Links the installed libnccl-unifab.so and checks the library answers with the header's version. */
#include <stdio.h>

#include "unifab/unifab.h"

int main(void) {
  int version = 0;
  if (unifabGetVersion(&version) != unifabSuccess || version != UNIFAB_VERSION_CODE) {
    fprintf(stderr, "unifab version mismatch: library %d, header %d\n", version, UNIFAB_VERSION_CODE);
    return 1;
  }
  printf("unifab %d.%d.%d installed and linked\n", version / 10000, version / 100 % 100, version % 100);
  return 0;
}
