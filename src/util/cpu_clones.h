#pragma once

// Internal: LOCKSTEP_CPU_CLONES, put before a function whose loop vectorises,
// has GCC compile it once for each x86-64 level (v4: AVX512, v3: AVX2, and
// the baseline the build targets) and the loader pick the one this CPU runs,
// as ATen's kernels do by their own dispatch. Use it only where every clone
// computes the same bits: loops of exact integer steps and of IEEE
// operations that every level rounds alike. A multiply followed by an add
// may become one fused instruction at v3 and v4, rounded once where the
// baseline rounds twice: the same bits only where the product is exact, or
// in a file compiled with -ffp-contract=off (src/ddp/powersgd_kernels.cpp).
// Elsewhere (another compiler or architecture) the function is compiled once,
// and so it is under ThreadSanitizer: the loader runs a clone's resolver
// before TSan's runtime is ready, and the program crashed before main.

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__) && \
    !defined(__SANITIZE_THREAD__)
#define LOCKSTEP_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define LOCKSTEP_CPU_CLONES
#endif
