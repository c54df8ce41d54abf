# Runs one failing MPI scenario under mpirun and checks that the job ends in
# an error, within a bound, with the expected message and no rank left.
#   cmake -DMPIRUN=... -DNP=2 -DWORKER=... -DSCENARIO=stall -DEXPECT=regex -DBOUND=seconds -P mpi_failure.cmake
string(TIMESTAMP start "%s")
execute_process(
  COMMAND ${MPIRUN} -np ${NP} --oversubscribe --bind-to none ${WORKER} ${SCENARIO} mpi-failure-test
  RESULT_VARIABLE code OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 120)
string(TIMESTAMP end "%s")
math(EXPR seconds "${end} - ${start}")
set(all "${out}${err}")
message("${all}")
if(code EQUAL 0)
  message(FATAL_ERROR "mpirun exited 0; expected the job to fail")
endif()
if(NOT all MATCHES "${EXPECT}")
  message(FATAL_ERROR "the output does not say: ${EXPECT}")
endif()
if(seconds GREATER ${BOUND})
  message(FATAL_ERROR "the job took ${seconds} s to end; expected at most ${BOUND} s")
endif()
execute_process(COMMAND pgrep -f "lockstep_ddp_worker ${SCENARIO} mpi-failure-test" RESULT_VARIABLE found OUTPUT_VARIABLE pids)
if(found EQUAL 0)
  message(FATAL_ERROR "ranks still running after mpirun returned: ${pids}")
endif()
message("ended with code ${code} after ${seconds} s, nothing left running")
