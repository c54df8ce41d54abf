# lockstep-train --export-mnist, then lockstep-train --data on those files.
file(REMOVE_RECURSE "${DIR}")
file(MAKE_DIRECTORY "${DIR}")
execute_process(COMMAND "${TRAIN}" --export-mnist "${DIR}" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "export failed: ${rc}")
endif()
execute_process(COMMAND "${TRAIN}" --data "${DIR}" --train-samples 3000 --test-samples 1000 --batch-size 64 --epochs 1
    --out "${DIR}/out"
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${err}${out}")
file(REMOVE_RECURSE "${DIR}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "training on MNIST files failed: ${rc}")
endif()
