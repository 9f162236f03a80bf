// doctest's implementation, for executables that bring their own main().
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
