// The helper as one translation unit: each .cpp file parses torch's autograd headers on its
// own (~14 s a file on a 2-core machine), so built as four units the first use took 110 s
// against 47 s for one. The files stay split by stage (module.cpp's overview); this is what
// the loader compiles.
#include "collect.cpp"
#include "trace.cpp"
#include "calls.cpp"
#include "module.cpp"
