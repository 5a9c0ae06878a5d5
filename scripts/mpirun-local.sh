#!/usr/bin/env bash
# mpirun with the flags a single shared machine needs: root allowed, oversubscription,
# no core binding, yielding instead of busy-polling when idle, shared-memory transport.
# Used by the tests; `tandem launch` passes the same flags.
set -euo pipefail
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
exec mpirun --oversubscribe --bind-to none \
  --mca mpi_yield_when_idle 1 --mca btl self,vader --mca btl_vader_single_copy_mechanism none \
  -x OMP_NUM_THREADS=1 "$@"
