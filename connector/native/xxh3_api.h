/* What the native helpers share: the export marker (the library is built with
 * -fvisibility=hidden, so xxHash's own symbols stay private) and xxh3-64's streaming update,
 * through xxHash's x86 dispatcher where there is one (xxh3.c). */
#ifndef TIERD_XXH3_API_H
#define TIERD_XXH3_API_H

#define XXH_STATIC_LINKING_ONLY
#include "xxhash/xxhash.h"

#define TIERD_API __attribute__((visibility("default")))

#if defined(__x86_64__) || defined(__i386__)
#define XXH_DISPATCH_DISABLE_REPLACE
#include "xxhash/xxh_x86dispatch.h"
#define TIERD_XXH3_64_UPDATE XXH3_64bits_update_dispatch
#else
#define TIERD_XXH3_64_UPDATE XXH3_64bits_update
#endif

#endif
