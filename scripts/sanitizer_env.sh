# Sourced by scripts/config.sh for LOCKSTEP_SANITIZE builds: the sanitizers'
# run-time options, exported so that every process a test starts (DDP ranks,
# lockstep-run, lockstep-train, ranks under mpirun or torchrun) has them.
# Suppressions cover reports inside the uninstrumented libraries only; each
# entry in tests/sanitizers/*.supp says why it is not lockstep's.
supp=$PWD/tests/sanitizers
case "$LOCKSTEP_SANITIZE" in
  address)
    # The benchmarks are not tests, and are not built.
    torch_cmake_args+=(-DLOCKSTEP_BUILD_BENCH=OFF)
    export ASAN_OPTIONS=detect_leaks=1:strict_init_order=1:detect_stack_use_after_return=1:check_initialization_order=1
    export LSAN_OPTIONS=suppressions=$supp/lsan.supp:print_suppressions=0
    export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:suppressions=$supp/ubsan.supp
    ;;
  thread)
    # CI runs the thread tests under TSan (docs/testing.md, "Sanitizers"):
    # neither the trainer, the process tests nor the benchmarks are built.
    torch_cmake_args+=(-DLOCKSTEP_BUILD_BENCH=OFF -DLOCKSTEP_BUILD_EXAMPLES=OFF)
    # LibTorch is not instrumented: TSan would take its atomics for missing
    # synchronisation. ignore_noninstrumented_modules leaves its calls out
    # (docs/testing.md, "Sanitizers", says what that costs).
    export TSAN_OPTIONS=suppressions=$supp/tsan.supp:ignore_noninstrumented_modules=1:second_deadlock_stack=1
    ;;
esac
