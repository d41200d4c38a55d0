// Compiled by the layer tests (tests/cpp/CMakeLists.txt) against one layer's headers only: it
// builds where the engine's layer (io) is visible and must fail to build from util, below it.
#include "tensortier/io/engine.hpp"
