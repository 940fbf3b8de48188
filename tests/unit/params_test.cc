#include <gtest/gtest.h>
#include "plugin/params.h"
TEST(Params, Defaults) { EXPECT_EQ(unifab::params().socketNStreams, 4); }
