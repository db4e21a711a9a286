// <immintrin.h>, included once for every kernforge header.
//
// gcc 12's intrinsic headers seed their "undefined" vectors with self-initialization
// (`__m512i __Y = __Y;`), which -Wall reports as -Wmaybe-uninitialized wherever an intrinsic is
// inlined (gcc PR 105593, fixed in later releases). The warnings point into the headers, so silencing them
// for the headers' own lines leaves the diagnostic on for kernforge and template code.
#pragma once

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
