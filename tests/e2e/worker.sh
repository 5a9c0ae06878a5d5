#!/usr/bin/env bash
# A stand-in worker for the launcher tests, started once per rank by `tandem launch`.
#   worker.sh hello   each rank prints one line to stdout and one to stderr, exits 0
#   worker.sh exit3   rank 1 exits with code 3 after 1 s; the others sleep 60 s
#   worker.sh kill    rank 1 kills itself with SIGKILL after 1 s; the others sleep 60 s
# (The 1 s delay: OpenMPI 4.1 reports a worker killed in its first moments only as "1 process
# returned a non-zero exit code", without its rank, about one time in four; a worker that dies
# later is always named. The launcher then says that mpirun did not name the rank.)
set -u
rank="${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-?}}"
case "${1:-}" in
  hello)
    echo "hello from rank $rank"
    echo "note from rank $rank" >&2
    ;;
  exit3)
    if [[ "$rank" == 1 ]]; then sleep 1; echo "rank 1 exits with code 3"; exit 3; fi
    sleep 60
    ;;
  kill)
    if [[ "$rank" == 1 ]]; then sleep 1; echo "rank 1 kills itself"; kill -KILL $$; fi
    sleep 60
    ;;
  *) echo "usage: worker.sh hello|exit3|kill" >&2; exit 2 ;;
esac
