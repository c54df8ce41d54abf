# lockstep-train under mpirun (the mpi backend): the trainer answers of
# test_trainer_answers.cpp that depend on the ranks, on MPI's backend too.
#   cmake -DMPIRUN=... -DTRAIN=lockstep-train -DDIR=... -DCASE=last_row|rebatch -P mpi_trainer_answers.cmake
set(ENV{OMP_NUM_THREADS} 1)
file(REMOVE_RECURSE ${DIR})
file(MAKE_DIRECTORY ${DIR})

function(train np out_var code_var)
  execute_process(COMMAND ${MPIRUN} -np ${np} --bind-to none ${TRAIN} ${ARGN}
    RESULT_VARIABLE code OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 240)
  set(${out_var} "${out}${err}" PARENT_SCOPE)
  set(${code_var} ${code} PARENT_SCOPE)
endfunction()

if(CASE STREQUAL "last_row")
  # 1293 = 10 * 129 + 3: one row per rank left over on 3 ranks. It joins the
  # batch before (tests/test_trainer_answers.cpp, TrainerLastBatch).
  train(3 out code --synthetic --train-samples 1293 --test-samples 600 --batch-size 129 --epochs 1
    --warmup-steps 10 --out ${DIR}/out)
  message("${out}")
  if(NOT code EQUAL 0 OR NOT out MATCHES "over 3 ranks \\(mpi\\)" OR NOT out MATCHES "1 epoch\\(s\\), 10 steps")
    message(FATAL_ERROR "mpirun exited ${code}; expected 10 steps over 3 ranks (mpi)")
  endif()
  string(REGEX MATCH "test accuracy ([0-9.]+)%" found "${out}")
  if(NOT found OR CMAKE_MATCH_1 LESS 70)
    message(FATAL_ERROR "test accuracy '${CMAKE_MATCH_1}' is below 70%: the leftover rows threw the model off")
  endif()
elseif(CASE STREQUAL "rebatch")
  # Stopped after step 4 at batch 128 (512 of 1024 samples), resumed at 64:
  # 8 more steps, 12 in all, as the summary says (TrainerResume.AnotherBatchSizeTrainsEachSampleOnce).
  set(args --synthetic --train-samples 1024 --test-samples 256 --epochs 1 --checkpoint ${DIR}/run.ckpt
    --checkpoint-every 4 --out ${DIR}/out)
  set(ENV{LOCKSTEP_FAULT} 0:5)
  train(2 first first_code ${args} --batch-size 128)
  unset(ENV{LOCKSTEP_FAULT})
  if(first_code EQUAL 0 OR NOT first MATCHES "LOCKSTEP_FAULT: rank 0 stops at step 5")
    message(FATAL_ERROR "the first run did not stop at step 5:\n${first}")
  endif()
  train(2 out code ${args} --batch-size 64)
  message("${out}")
  if(NOT code EQUAL 0 OR NOT out MATCHES "at step 4 \\(epoch 1, sample 512 of 1024\\)"
     OR NOT out MATCHES "1 epoch\\(s\\), 8 steps \\(12 in all\\)")
    message(FATAL_ERROR "mpirun exited ${code}; expected a resume at sample 512 and 12 steps in all")
  endif()
else()
  message(FATAL_ERROR "unknown CASE '${CASE}'")
endif()
