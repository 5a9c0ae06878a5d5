#!/usr/bin/env bash
# The launcher command and environment of a `tandem k8s` manifest, executed for real: hosts made
# of network namespaces (tests/netns/netns.sh) named after the pods the MPI Operator would make
# (NAME-launcher, NAME-worker-0, NAME-worker-1), this script playing the operator: it writes the
# hostfile from the manifest's slotsPerWorker and Worker replicas with the pods' DNS names
# (NAME-worker-I.NAME-worker.NAMESPACE.svc, mapped in every host's hosts file), gives the
# launcher the operator's environment, and runs the manifest's command with the manifest's env
# in the launcher host. Only these are substituted (the rest is the manifest verbatim):
#   /opt/tandem/build/tandem (the binary in the image)  -> this build's tandem
#   /ckpt (the ReadWriteMany claim's mount)              -> one scratch directory all hosts see
#   /etc/mpi/hostfile (the operator's ConfigMap)         -> the hostfile written here
#   ssh + sshd on the workers (the operator's Secret)    -> tests/netns/rsh-agent.sh, behind a
#      wrapper that, like DNS, maps the pod's DNS name to its host, and like sshd, starts the
#      remote side with a clean environment (the ranks get only what mpirun -x forwards)
# Then a second manifest (the same job, more steps) is run on the same claim: it resumes from
# the first run's newest checkpoint, as a restarted or updated job does.
# usage: k8s_run.sh TANDEM NET_ID   (exit 77: no network namespaces here; no python3-yaml fails)
set -uo pipefail
tandem=$1
id=$2
here=$(cd "$(dirname "$0")" && pwd)
source "$here/../netns/netns.sh"
py=/usr/bin/python3
netns_available || exit 77
$py -c 'import yaml' 2>/dev/null || { echo "FAIL: $py lacks yaml (apt-get install python3-yaml; scripts/setup.sh does)"; exit 1; }
name=k8srun$id ns=tandem-test
tmp=$(mktemp -d)
trap 'netns_down "$id"; rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

generate() {  # generate FILE MAX_STEPS
  "$tandem" k8s -o "$1" --name "$name" --namespace "$ns" --nodes 2 --slots-per-worker 2 --cpu 2 \
    --image registry.example.com/tandem:test --checkpoint-pvc "$name-ckpt" --checkpoint-every 3 \
    -- --model mlp --batch 64 --max-steps "$2" --no-eval --timeout 60 || fail "tandem k8s failed"
}
generate "$tmp/job1.yaml" 6
generate "$tmp/job2.yaml" 12

# The manifest's launcher as shell arrays: cmd (command + args), env (NAME=VALUE); and the layout.
read_job() {
  $py - "$1" <<'EOF'
import shlex, sys, yaml
job = next(d for d in yaml.safe_load_all(open(sys.argv[1])) if d["kind"] == "MPIJob")
spec = job["spec"]
c = spec["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]
print("cmd=(" + " ".join(shlex.quote(a) for a in c.get("command", []) + c.get("args", [])) + ")")
print("env=(" + " ".join(shlex.quote(f"{e['name']}={e['value']}") for e in c.get("env", [])) + ")")
print(f"slots={spec['slotsPerWorker']} workers={spec['mpiReplicaSpecs']['Worker']['replicas']}")
print(f"job_name={job['metadata']['name']} job_ns={job['metadata']['namespace']}")
EOF
}
eval "$(read_job "$tmp/job1.yaml")" || fail "cannot read the manifest"
[[ "$job_name" == "$name" && "$workers" == 2 && "$slots" == 2 ]] || fail "unexpected layout: $job_name $workers x $slots"

# Hosts named after the pods, and the names the operator's headless Service gives them.
hosts=("$name-launcher")
for ((i = 0; i < workers; i++)); do hosts+=("$name-worker-$i"); done
netns_up "$id" "${hosts[@]}" || fail "netns_up failed"
dns=()
for h in "${hosts[@]}"; do dns+=("$(netns_ip "$id" "$h") $h.$name-worker.$job_ns.svc"); done
for h in "${hosts[@]}"; do printf '%s\n' "${dns[@]}" >>"/etc/netns/$h/hosts"; done
: >"$tmp/hostfile"
for ((i = 0; i < workers; i++)); do echo "$name-worker-$i.$name-worker.$job_ns.svc slots=$slots" >>"$tmp/hostfile"; done
echo "hostfile (as the operator writes /etc/mpi/hostfile):"; sed 's/^/    /' "$tmp/hostfile"

# ssh stand-in: pod DNS name -> host (the first label), clean environment like sshd's.
cat >"$tmp/ssh" <<EOF
#!/usr/bin/env bash
args=()
while [[ \$# -gt 0 && "\$1" == -* ]]; do
  case "\$1" in -o | -p | -l | -i | -F) shift 2 ;; *) shift ;; esac
done
host=\${1%%.*}
shift
echo "\$host" >>"$tmp/agent.log"
exec env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
  "$here/../netns/rsh-agent.sh" "\$host" "\$@"
EOF
chmod +x "$tmp/ssh"
mkdir -p "$tmp/ckpt"

run_launcher() {  # run_launcher MANIFEST LOG
  eval "$(read_job "$1")"
  local c=() a
  for a in "${cmd[@]}"; do
    case "$a" in
      /opt/tandem/build/tandem) c+=("$tandem") ;;
      /ckpt) c+=("$tmp/ckpt") ;;
      *) c+=("$a") ;;
    esac
  done
  echo "launcher env: ${env[*]}"
  echo "launcher command: ${c[*]}"
  # The container's environment: the image's PATH/HOME, the manifest's env, the operator's
  # additions for OpenMPI (pkg/controller/mpi_job_controller.go), the rsh agent in place of ssh.
  timeout 240 bash -c 'source "$1"; shift; netns_exec "$@"' _ "$here/../netns/netns.sh" "$name-launcher" \
    env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root "${env[@]}" \
    K_MPI_JOB_ROLE=launcher OMPI_MCA_orte_keep_fqdn_hostnames=true \
    OMPI_MCA_orte_default_hostfile="$tmp/hostfile" OMPI_MCA_plm_rsh_args="-o ConnectionAttempts=10" \
    OMPI_MCA_orte_set_default_slots="$slots" OMPI_MCA_plm_rsh_agent="$tmp/ssh" \
    "${c[@]}" >"$2" 2>&1
}

check_report() {  # check_report LOG STEPS
  grep -q "== tandem train report ==" "$1" || fail "no report in $1"
  grep -Eq "strategy ddp, 4 worker\(s\)" "$1" || fail "the report does not show 4 workers"
  grep -Eq "^steps +$2 " "$1" || fail "the report does not show $2 steps"
  grep -Eq "peak memory +rank 0 [0-9]+ MiB, rank 1 [0-9]+ MiB, rank 2 [0-9]+ MiB, rank 3 [0-9]+ MiB" "$1" ||
    fail "the report does not list every rank"
}

t0=$(date +%s)
run_launcher "$tmp/job1.yaml" "$tmp/run1.log"
rc=$?
sed 's/^/    /' "$tmp/run1.log" | tail -n 25
[[ $rc -eq 0 ]] || fail "the launcher command exited with $rc"
check_report "$tmp/run1.log" 6
grep -q "no checkpoint in '$tmp/ckpt' yet; starting from step 0" "$tmp/run1.log" || fail "the first run did not start fresh on the claim"
for ((i = 0; i < workers; i++)); do
  grep -qx "$name-worker-$i" "$tmp/agent.log" || fail "mpirun never reached $name-worker-$i through the agent"
done
! grep -q launcher "$tmp/agent.log" || fail "a rank was started on the launcher"
if grep -q "^hosts " "$tmp/run1.log"; then  # the report's placement line, where tandem train prints one
  grep -Eq "^hosts .*$name-worker-0 \(.*\) ranks 0-1, $name-worker-1 \(.*\) ranks 2-3" "$tmp/run1.log" ||
    fail "the report places the ranks elsewhere than 2 per worker pod"
fi
[[ -f "$tmp/ckpt/step-00000006/manifest.json" ]] || fail "no checkpoint at step 6 on the claim: $(ls "$tmp/ckpt")"
echo "ok   run 1: 4 ranks on $(sort -u "$tmp/agent.log" | tr '\n' ' ')trained 6 steps, report printed, checkpoints: $(ls "$tmp/ckpt" | tr '\n' ' ')($(($(date +%s) - t0)) s)"

t0=$(date +%s)
run_launcher "$tmp/job2.yaml" "$tmp/run2.log"
rc=$?
sed 's/^/    /' "$tmp/run2.log" | tail -n 25
[[ $rc -eq 0 ]] || fail "the second launcher command exited with $rc"
grep -q "resuming from $tmp/ckpt/step-00000006 (step 6" "$tmp/run2.log" || fail "the second run did not resume from step 6"
check_report "$tmp/run2.log" 12
echo "ok   run 2: resumed from the claim at step 6 and finished step 12 ($(($(date +%s) - t0)) s)"
