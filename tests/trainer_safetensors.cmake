# lockstep-train's model.safetensors in Python, and back (SafetensorsPython.Trainer*):
#  1. a short run on Fashion-MNIST writes model.safetensors beside model.pt;
#  2. examples/python/evaluate.py prints the same test accuracy, to the
#     printed digit, as the trainer's last line;
#  3. --init-from that file starts a second run from those weights (one step
#     at a learning rate of 1e-12: the accuracy stays near the first run's,
#     far above a fresh model's chance);
#  4. --init-from a file that is not safetensors of this CNN is refused,
#     naming the flag.
# Arguments: TRAIN, PYTHON, EVALUATE, DIR.
file(REMOVE_RECURSE "${DIR}")
set(common --train-samples 2000 --test-samples 1000 --batch-size 64 --replicas 2)

function(train out_var)
  execute_process(COMMAND "${TRAIN}" ${common} ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message("${out}${err}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "lockstep-train ${ARGN} failed: ${rc}")
  endif()
  string(REGEX MATCHALL "test accuracy [0-9.]+%" lines "${out}")
  list(GET lines -1 last)
  string(REGEX REPLACE "test accuracy ([0-9.]+)%" "\\1" accuracy "${last}")
  set(${out_var} "${accuracy}" PARENT_SCOPE)
endfunction()

train(first --epochs 1 --out "${DIR}/first")
if(NOT EXISTS "${DIR}/first/model.safetensors")
  message(FATAL_ERROR "the run wrote no model.safetensors beside model.pt")
endif()

execute_process(COMMAND "${PYTHON}" "${EVALUATE}" "${DIR}/first/model.safetensors" --test-samples 1000
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}${err}")
string(REGEX MATCH "test accuracy ([0-9.]+)%" found "${out}")
if(NOT rc EQUAL 0 OR NOT found OR NOT CMAKE_MATCH_1 STREQUAL first)
  message(FATAL_ERROR "evaluate.py gave '${CMAKE_MATCH_1}%', the trainer ${first}% (rc ${rc})")
endif()

train(second --epochs 1 --train-samples 64 --lr 1e-12 --warmup-steps 0 --init-from "${DIR}/first/model.safetensors"
  --out "${DIR}/second")
string(REGEX REPLACE "\\..*" "" first_whole "${first}")
string(REGEX REPLACE "\\..*" "" second_whole "${second}")
math(EXPR floor "${first_whole} - 10")
if(second_whole LESS 30 OR second_whole LESS floor)
  message(FATAL_ERROR "a run --init-from the first run's model reached ${second}%, not about its ${first}%")
endif()

execute_process(COMMAND "${TRAIN}" ${common} --epochs 1 --init-from "${DIR}/first/metrics.jsonl" --out "${DIR}/bad"
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}${err}")
if(rc EQUAL 0 OR NOT err MATCHES "lockstep-train: --init-from .*metrics.jsonl")
  message(FATAL_ERROR "--init-from a file that is not safetensors was not refused naming the flag (rc ${rc})")
endif()
file(REMOVE_RECURSE "${DIR}")
