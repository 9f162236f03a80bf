#pragma once
/// trainkit::testing for doctest suites: include this instead of <doctest/doctest.h>.
#include "tk/testing.h"

// Debian's LibTorch logs through glog, whose CHECK macros collide with doctest's: doctest wins.
#undef CHECK
#undef CHECK_EQ
#undef CHECK_NE
#undef CHECK_LT
#undef CHECK_LE
#undef CHECK_GT
#undef CHECK_GE
#undef CHECK_NOTNULL
#include <doctest/doctest.h>
