# lockstep-train under mpirun -np 2 (the mpi backend, picked by "auto") ends
# bitwise equal to the same job under lockstep-run (gloo): same ranks, same
# batches, and sums of two numbers are exact in either order.
#   cmake -DMPIRUN=... -DRUN=lockstep-run -DTRAIN=lockstep-train -DDIR=... -P mpi_trainer.cmake
set(args --synthetic --train-samples 2000 --test-samples 500 --epochs 1)
set(ENV{OMP_NUM_THREADS} 1)
file(REMOVE_RECURSE ${DIR}) # a finished run's checkpoint would be resumed, not trained
execute_process(COMMAND ${MPIRUN} -np 2 --bind-to none ${TRAIN} ${args} --out ${DIR}/mpi
  RESULT_VARIABLE mpi_code OUTPUT_VARIABLE mpi_out ERROR_VARIABLE mpi_err TIMEOUT 240)
execute_process(COMMAND ${RUN} --nproc-per-node 2 ${TRAIN} ${args} --out ${DIR}/gloo
  RESULT_VARIABLE gloo_code OUTPUT_VARIABLE gloo_out ERROR_VARIABLE gloo_err TIMEOUT 240)
message("${mpi_out}${mpi_err}")
if(NOT mpi_code EQUAL 0 OR NOT gloo_code EQUAL 0)
  message(FATAL_ERROR "mpirun exited ${mpi_code}, lockstep-run ${gloo_code}:\n${gloo_out}${gloo_err}")
endif()
if(NOT "${mpi_out}${mpi_err}" MATCHES "over 2 ranks \\(mpi\\)")
  message(FATAL_ERROR "under mpirun the trainer did not use the mpi backend")
endif()
string(REGEX MATCH "fnv1a64=[0-9a-f]+" mpi_hash "${mpi_out}")
string(REGEX MATCH "fnv1a64=[0-9a-f]+" gloo_hash "${gloo_out}")
if(mpi_hash STREQUAL "" OR NOT mpi_hash STREQUAL gloo_hash)
  message(FATAL_ERROR "final parameters differ: mpirun ${mpi_hash}, lockstep-run ${gloo_hash}")
endif()
message("both runs end with ${mpi_hash}")
