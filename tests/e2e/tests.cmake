# End-to-end tests of `tandem launch` and `tandem selftest`, run as a user runs them. Each
# test goes through tests/e2e/expect_run.sh, which checks the exit status, the time taken
# (a hang fails there, before the ctest TIMEOUT) and lines of stdout/stderr.
# (A regular expression here may not contain ";", a list separator to CMake: use "." instead.)
set(_e2e ${CMAKE_CURRENT_SOURCE_DIR}/e2e)
set(_expect ${_e2e}/expect_run.sh)
set(_tandem $<TARGET_FILE:tandem_cli>)

function(tandem_e2e_test name timeout)
  add_test(NAME ${name} COMMAND ${_expect} ${ARGN})
  set_tests_properties(${name} PROPERTIES TIMEOUT ${timeout} PROCESSORS 2
                       ENVIRONMENT "TANDEM_SOURCE_DIR=${CMAKE_SOURCE_DIR}")
endfunction()

if(TANDEM_HAVE_MPI)
  # Output lines carry their rank, on stdout and on stderr.
  tandem_e2e_test(e2e_launch_prefixes_output 60 --exit 0 --within 30
    --stdout "^\\[rank 0\\] hello from rank 0$" --stdout "^\\[rank 1\\] hello from rank 1$"
    --stderr "^\\[rank 0\\] note from rank 0$" --stderr "^\\[rank 1\\] note from rank 1$"
    -- ${_tandem} launch -n 2 -- ${_e2e}/worker.sh hello)

  # One rank fails: the launcher stops the others (which would sleep 60 s), names the rank,
  # and exits with the rank's code (128 + signal when killed).
  tandem_e2e_test(e2e_launch_rank_exits_3 60 --exit 3 --within 10
    --stderr "tandem launch: rank 1 exited with code 3. the other ranks were stopped"
    -- ${_tandem} launch -n 2 -- ${_e2e}/worker.sh exit3)
  tandem_e2e_test(e2e_launch_rank_killed 60 --exit 137 --within 10
    --stderr "tandem launch: rank 1 was killed by signal 9"
    -- ${_tandem} launch -n 3 -- ${_e2e}/worker.sh kill)

  # The same for MPI programs, in the middle of a run of allreduces whose peers then wait
  # (with a 120 s timeout: mpirun, not the timeout, has to end them).
  if(TARGET tandem_dist_tests)
    set(_dist $<TARGET_FILE:tandem_dist_tests> --gtest_also_run_disabled_tests)
    tandem_e2e_test(e2e_launch_mpi_rank_exits_3 90 --exit 3 --within 30
      --stderr "tandem launch: rank 1 exited with code 3" --no-stdout "NOT STOPPED"
      -- ${_tandem} launch -n 3 -- ${_dist} --gtest_filter=EarlyExit.DISABLED_RankExitsWithCode3)
    tandem_e2e_test(e2e_launch_mpi_rank_killed 90 --exit 137 --within 30
      --stderr "tandem launch: rank 1 was killed by signal 9" --no-stdout "NOT STOPPED"
      -- ${_tandem} launch -n 2 -- ${_dist} --gtest_filter=EarlyExit.DISABLED_RankIsKilled)
  endif()

  # Every collective against the local reference, on 2 and 4 workers.
  foreach(np 2 4)
    tandem_e2e_test(e2e_selftest_np${np} 180 --exit 0 --within 150
      --stdout "selftest: all collectives agree with the reference" --no-stdout "FAILED"
      -- ${_tandem} selftest -n ${np})
  endforeach()
endif()

# Bad input: a clear message and a non-zero exit, without starting anything.
tandem_e2e_test(e2e_launch_rejects_zero_workers 30 --exit nonzero --within 10
  --stderr "-n must be at least 1 \\(got 0\\)" -- ${_tandem} launch -n 0 -- true)
tandem_e2e_test(e2e_launch_rejects_missing_program 30 --exit nonzero --within 10
  --stderr "no program given. usage: tandem launch -n N -- PROGRAM" -- ${_tandem} launch -n 2)
tandem_e2e_test(e2e_launch_rejects_empty_program 30 --exit nonzero --within 10
  --stderr "no program given" -- ${_tandem} launch -n 2 --)
tandem_e2e_test(e2e_launch_rejects_unknown_flag 30 --exit nonzero --within 10
  --stderr "--bogus" -- ${_tandem} launch --bogus -n 2 -- true)
tandem_e2e_test(e2e_launch_rejects_missing_hostfile 30 --exit nonzero --within 10
  --stderr "hostfile.*/nonexistent/hostfile" --stderr "[Dd]oes not exist|cannot be read"
  -- ${_tandem} launch --hostfile /nonexistent/hostfile -n 2 -- true)
if(TANDEM_HAVE_MPI)
  tandem_e2e_test(e2e_launch_rejects_missing_executable 30 --exit nonzero --within 20
    --stderr "/nonexistent/program" -- ${_tandem} launch -n 2 -- /nonexistent/program)
endif()
