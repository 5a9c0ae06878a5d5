#!/usr/bin/python3
"""Validates manifests written by `tandem k8s` the way a cluster would, offline.

usage: k8s_validate.py --crd CRD.yaml FILE [--expect KEY=VALUE ...]
       k8s_validate.py --crd CRD.yaml FILE --negative-controls

Each document of FILE (YAML, several separated by ---, or JSON, one object or a v1 List) is
checked:
  MPIJob   against the CRD's openAPIV3Schema (jsonschema), then what the API server does beyond
           it: unknown fields rejected (kubectl --validate=strict), list-map keys unique; then the
           MPI Operator's own admission rules (pkg/apis/kubeflow/validation); then Kubernetes pod
           rules (DNS-1123 names, volumes that mounts refer to, labels); then Tandem's contract
           (mpirun -n = workers x slots, one GPU per rank, --device cuda iff GPUs, every -x
           variable defined on the launcher, /dev/shm memory-backed, checkpoints on the claim).
  PersistentVolumeClaim  name, ReadWriteMany, a storage request.
--expect checks flags were honoured: name, namespace, workers, slots, gpus (per worker), ranks,
strategy, tp, pp (the training flags, 1 when absent), resume (1: --resume), pvc, image, pools (number of node-affinity terms), tolerations, claim (1: the claim is
emitted). --negative-controls breaks a valid MPIJob in several ways and exits non-zero unless
every broken copy is rejected (so this validator can fail). Exit 0 when everything holds.
"""
import argparse
import copy
import json
import re
import sys

import jsonschema
import yaml

DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_PART = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")


def load_documents(path):
    with open(path) as f:
        text = f.read()
    if text.lstrip().startswith("{"):
        doc = json.loads(text)
        return doc["items"] if doc.get("kind") == "List" else [doc]
    return [d for d in yaml.safe_load_all(text) if d is not None]


def schema_of(crd_path):
    with open(crd_path) as f:
        crd = yaml.safe_load(f)
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def strict_fields(node, schema, path, errors):
    """Unknown fields (which the API server would prune or, strict, reject) and list-map keys."""
    if isinstance(node, dict) and schema.get("type") == "object":
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        if props is not None:
            for key, value in node.items():
                if key in props:
                    strict_fields(value, props[key], f"{path}.{key}", errors)
                elif not schema.get("x-kubernetes-preserve-unknown-fields"):
                    errors.append(f"{path}: unknown field '{key}'")
        elif isinstance(extra, dict):
            for key, value in node.items():
                strict_fields(value, extra, f"{path}.{key}", errors)
    elif isinstance(node, list) and schema.get("type") == "array":
        items = schema.get("items", {})
        for i, item in enumerate(node):
            strict_fields(item, items, f"{path}[{i}]", errors)
        if schema.get("x-kubernetes-list-type") == "map":
            keys = schema.get("x-kubernetes-list-map-keys", [])
            seen = [tuple(item.get(k) for k in keys) for item in node]
            if len(seen) != len(set(seen)):
                errors.append(f"{path}: duplicate {'/'.join(keys)} in a list keyed by it")
        if schema.get("x-kubernetes-list-type") == "set":
            dumped = [json.dumps(x, sort_keys=True) for x in node]
            if len(dumped) != len(set(dumped)):
                errors.append(f"{path}: duplicate items in a set")


def check_labels(labels, path, errors):
    for key, value in (labels or {}).items():
        prefix, _, name = key.rpartition("/")
        if (prefix and not DNS1123_SUBDOMAIN.match(prefix)) or not name or len(name) > 63 or not LABEL_PART.match(name):
            errors.append(f"{path}: invalid label key '{key}'")
        if not isinstance(value, str) or len(value) > 63 or not LABEL_PART.match(value):
            errors.append(f"{path}: invalid label value '{value}' for '{key}'")


def check_pod(spec, path, errors):
    """What the API server checks on a pod that the CRD schema does not."""
    volumes = {}
    for v in spec.get("volumes", []):
        if not DNS1123_LABEL.match(v.get("name", "")):
            errors.append(f"{path}.volumes: name '{v.get('name')}' is not a DNS-1123 label")
        volumes[v.get("name")] = v
    containers = spec.get("containers", [])
    for c in containers:
        cpath = f"{path}.containers[{c.get('name')}]"
        if not DNS1123_LABEL.match(c.get("name", "")):
            errors.append(f"{cpath}: name is not a DNS-1123 label")
        if not c.get("image"):
            errors.append(f"{cpath}: no image")
        mounts = [m.get("mountPath") for m in c.get("volumeMounts", [])]
        if len(mounts) != len(set(mounts)):
            errors.append(f"{cpath}: a mountPath is used twice")
        for m in c.get("volumeMounts", []):
            if m.get("name") not in volumes:
                errors.append(f"{cpath}: volumeMount '{m.get('name')}' names no volume of the pod")
        for e in c.get("env", []):
            if not ENV_NAME.match(e.get("name", "")):
                errors.append(f"{cpath}: invalid env name '{e.get('name')}'")
            if "value" in e and not isinstance(e["value"], str):
                errors.append(f"{cpath}: env '{e.get('name')}' value must be a string, got {e['value']!r}")
        res = c.get("resources", {})
        for key, value in res.get("requests", {}).items():
            limit = res.get("limits", {}).get(key)
            if key == "nvidia.com/gpu" and limit is not None and str(limit) != str(value):
                errors.append(f"{cpath}: nvidia.com/gpu request {value} differs from its limit {limit}")
    if len({c.get("name") for c in containers}) != len(containers):
        errors.append(f"{path}: two containers share a name")
    for key, value in (spec.get("nodeSelector") or {}).items():
        check_labels({key: value}, f"{path}.nodeSelector", errors)


def check_operator_rules(job, errors):
    """kubeflow/mpi-operator pkg/apis/kubeflow/validation: what the operator refuses."""
    name = job["metadata"].get("name", "")
    spec = job.get("spec", {})
    specs = spec.get("mpiReplicaSpecs", {})
    worker = specs.get("Worker")
    replicas = worker.get("replicas", 1) if worker else 1
    for host in (f"{name}-worker-{max(replicas, 1) - 1}", f"{name}-launcher"):
        if len(host) > 63 or not DNS1123_LABEL.match(host):
            errors.append(f"metadata.name: pod host name '{host}' would not be a DNS-1123 label")
    if not re.match(r"^[a-z]", name):
        errors.append("metadata.name: must start with a letter (the operator's Service '<name>-worker' is a DNS-1035 label)")
    if not DNS1123_LABEL.match(job["metadata"].get("namespace", "default")):
        errors.append("metadata.namespace: not a DNS-1123 label")
    if spec.get("slotsPerWorker") is None or spec["slotsPerWorker"] < 0:
        errors.append("spec.slotsPerWorker: required, non-negative")
    if spec.get("runPolicy", {}).get("cleanPodPolicy") not in ("None", "Running", "All"):
        errors.append("spec.runPolicy.cleanPodPolicy: must be None, Running or All")
    for key in ("backoffLimit", "ttlSecondsAfterFinished", "activeDeadlineSeconds"):
        if spec.get("runPolicy", {}).get(key, 0) < 0:
            errors.append(f"spec.runPolicy.{key}: must be non-negative")
    if not spec.get("sshAuthMountPath", "/root/.ssh"):
        errors.append("spec.sshAuthMountPath: must not be empty")
    if spec.get("mpiImplementation", "OpenMPI") not in ("OpenMPI", "Intel", "MPICH"):
        errors.append("spec.mpiImplementation: unsupported")
    launcher = specs.get("Launcher")
    if not launcher:
        errors.append("spec.mpiReplicaSpecs.Launcher: required")
    elif launcher.get("replicas") != 1:
        errors.append("spec.mpiReplicaSpecs.Launcher.replicas: must be 1")
    if worker is not None and (worker.get("replicas") is None or worker["replicas"] < 1):
        errors.append("spec.mpiReplicaSpecs.Worker.replicas: must be at least 1")
    for role, rs in specs.items():
        if rs.get("restartPolicy", "Never") not in ("Never", "OnFailure", "ExitCode"):
            errors.append(f"spec.mpiReplicaSpecs.{role}.restartPolicy: must be Never, OnFailure or ExitCode")
        if not rs.get("template", {}).get("spec", {}).get("containers"):
            errors.append(f"spec.mpiReplicaSpecs.{role}: no container")


def flag_value(cmd, flag):
    return cmd[cmd.index(flag) + 1] if flag in cmd and cmd.index(flag) + 1 < len(cmd) else None


def check_tandem(job, errors):
    """Tandem's contract between the launcher command and the worker pods."""
    spec = job["spec"]
    launcher = spec["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]
    worker_rs = spec["mpiReplicaSpecs"]["Worker"]
    worker = worker_rs["template"]["spec"]
    lc, wc = launcher["containers"][0], worker["containers"][0]
    cmd = lc.get("command", []) + lc.get("args", [])
    slots, workers = spec.get("slotsPerWorker", 1), worker_rs.get("replicas", 1)
    if not cmd or cmd[0] != "mpirun":
        errors.append("launcher: the command must start with mpirun")
        return
    if flag_value(cmd, "-n") != str(workers * slots):
        errors.append(f"launcher: mpirun -n {flag_value(cmd, '-n')} is not workers x slots = {workers * slots}")
    if "train" not in cmd:
        errors.append("launcher: the command does not run 'tandem train'")
    env_names = {e["name"] for e in lc.get("env", [])}
    forwarded = {cmd[i + 1] for i, a in enumerate(cmd[:-1]) if a == "-x"}
    if forwarded - env_names:
        errors.append(f"launcher: mpirun -x {sorted(forwarded - env_names)} not defined in the launcher's env")
    if env_names - forwarded:
        errors.append(f"launcher: env {sorted(env_names - forwarded)} set but not forwarded to the ranks (-x)")
    gpus = wc.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
    device = flag_value(cmd, "--device")
    if (gpus is not None) != (device == "cuda"):
        errors.append(f"workers: nvidia.com/gpu limit {gpus} but the ranks run --device {device}")
    if gpus is not None and int(gpus) != slots:
        errors.append(f"workers: {gpus} GPUs per worker for {slots} ranks per worker (must be one GPU per rank)")
    if "nvidia.com/gpu" in str(lc.get("resources", {})):
        errors.append("launcher: requests GPUs, but it runs no rank")
    shm = [v for v in worker.get("volumes", []) if v.get("emptyDir", {}).get("medium") == "Memory"]
    if not shm or not any(m["mountPath"] == "/dev/shm" and m["name"] == shm[0]["name"] for m in wc.get("volumeMounts", [])):
        errors.append("workers: no memory-backed emptyDir at /dev/shm")
    if wc.get("command") and wc["command"][0] != "/usr/sbin/sshd":
        errors.append("workers: must run sshd (the launcher starts the ranks over ssh)")
    ckpt = flag_value(cmd, "--checkpoint-dir")
    if ckpt is not None:
        if "--resume" not in cmd:
            errors.append("launcher: checkpoints without --resume: a restarted launcher would start from step 0")
        for role, pod, c in (("launcher", launcher, lc), ("workers", worker, wc)):
            claims = {v["name"] for v in pod.get("volumes", []) if "persistentVolumeClaim" in v}
            if not any(m["mountPath"] == ckpt and m["name"] in claims for m in c.get("volumeMounts", [])):
                errors.append(f"{role}: --checkpoint-dir {ckpt} is not a mounted PersistentVolumeClaim")


def check_claim(doc, errors):
    if not DNS1123_SUBDOMAIN.match(doc["metadata"].get("name", "")):
        errors.append("PersistentVolumeClaim: name is not a DNS-1123 subdomain")
    if "ReadWriteMany" not in doc["spec"].get("accessModes", []):
        errors.append("PersistentVolumeClaim: needs ReadWriteMany (every worker node writes its shards)")
    storage = doc["spec"].get("resources", {}).get("requests", {}).get("storage", "")
    if not re.match(r"^[0-9.]+([KMGTPE]i?)?$", str(storage)):
        errors.append(f"PersistentVolumeClaim: storage request '{storage}' is not a quantity")


def validate_job(job, schema):
    errors = []
    validator = jsonschema.Draft7Validator(schema)
    for e in sorted(validator.iter_errors(job), key=lambda e: list(e.path)):
        errors.append(f"schema: {'.'.join(str(p) for p in e.path)}: {e.message}")
    strict_fields(job, schema, "MPIJob", errors)
    if errors:
        return errors  # the rest assumes the shape is right
    check_labels(job["metadata"].get("labels"), "metadata.labels", errors)
    check_operator_rules(job, errors)
    for role, rs in job["spec"]["mpiReplicaSpecs"].items():
        check_labels(rs["template"].get("metadata", {}).get("labels"), f"{role}.template.metadata.labels", errors)
        check_pod(rs["template"]["spec"], f"{role}.template.spec", errors)
    if not errors:
        check_tandem(job, errors)
    return errors


def check_expectations(docs, expect, errors):
    jobs = [d for d in docs if d.get("kind") == "MPIJob"]
    claims = [d for d in docs if d.get("kind") == "PersistentVolumeClaim"]
    job = jobs[0]
    spec = job["spec"]
    worker_rs = spec["mpiReplicaSpecs"]["Worker"]
    wspec = worker_rs["template"]["spec"]
    cmd = spec["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["command"]
    gpus = wspec["containers"][0].get("resources", {}).get("limits", {}).get("nvidia.com/gpu", "0")
    vols = [v for v in wspec.get("volumes", []) if "persistentVolumeClaim" in v]
    terms = wspec.get("affinity", {}).get("nodeAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution", {})
    actual = {
        "name": job["metadata"]["name"],
        "namespace": job["metadata"]["namespace"],
        "workers": str(worker_rs["replicas"]),
        "slots": str(spec["slotsPerWorker"]),
        "gpus": str(gpus),
        "ranks": flag_value(cmd, "-n"),
        "strategy": flag_value(cmd, "--strategy"),
        "tp": flag_value(cmd, "--tp") or "1",
        "pp": flag_value(cmd, "--pp") or "1",
        "resume": str(int("--resume" in cmd)),
        "pvc": vols[0]["persistentVolumeClaim"]["claimName"] if vols else "",
        "image": wspec["containers"][0]["image"],
        "pools": str(len(terms.get("nodeSelectorTerms", []))),
        "tolerations": str(len(wspec.get("tolerations", []))),
        "claim": str(len(claims)),
    }
    for item in expect:
        key, _, want = item.partition("=")
        if key not in actual:
            errors.append(f"--expect: unknown key '{key}'")
        elif actual[key] != want:
            errors.append(f"expected {key}={want}, the manifest has {actual[key]}")


def mutations():
    """Broken copies of a valid MPIJob, each of which the validator must reject."""
    def launcher(j):
        return j["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]

    def worker(j):
        return j["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]

    def set_(f):
        def apply(j):
            f(j)
            return j
        return apply

    return [
        ("replicas not an integer", set_(lambda j: j["spec"]["mpiReplicaSpecs"]["Worker"].update(replicas="two"))),
        ("misspelt field", set_(lambda j: j["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"].update(nodeSelecter={"a": "b"}))),
        ("bad quantity", set_(lambda j: worker(j).setdefault("resources", {}).setdefault("limits", {}).update(memory="lots"))),
        ("two launchers", set_(lambda j: j["spec"]["mpiReplicaSpecs"]["Launcher"].update(replicas=2))),
        ("no workers", set_(lambda j: j["spec"]["mpiReplicaSpecs"]["Worker"].update(replicas=0))),
        ("bad clean policy", set_(lambda j: j["spec"]["runPolicy"].update(cleanPodPolicy="Sometimes"))),
        ("upper-case name", set_(lambda j: j["metadata"].update(name="Tandem"))),
        ("name too long", set_(lambda j: j["metadata"].update(name="a" * 60))),
        ("duplicate env", set_(lambda j: launcher(j)["env"].append(dict(launcher(j)["env"][0])))),
        ("mount without volume", set_(lambda j: worker(j)["volumeMounts"].append({"name": "nothing", "mountPath": "/x"}))),
        ("env value not a string", set_(lambda j: launcher(j)["env"].append({"name": "N", "value": 8}))),
        ("rank count off", set_(lambda j: launcher(j)["command"].__setitem__(launcher(j)["command"].index("-n") + 1, "999"))),
        ("unforwarded env", set_(lambda j: launcher(j)["env"].append({"name": "LOST", "value": "1"}))),
        ("GPU device without GPUs", set_(lambda j: (worker(j)["resources"].pop("limits", None),
                                                   launcher(j)["command"].__setitem__(launcher(j)["command"].index("--device") + 1, "cuda")))),
        ("no /dev/shm", set_(lambda j: worker(j).update(volumeMounts=[m for m in worker(j)["volumeMounts"] if m["mountPath"] != "/dev/shm"]))),
        ("checkpoints not on the claim", set_(lambda j: launcher(j)["command"].__setitem__(launcher(j)["command"].index("--checkpoint-dir") + 1, "/elsewhere"))),
    ]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--crd", required=True)
    ap.add_argument("file")
    ap.add_argument("--expect", action="append", default=[])
    ap.add_argument("--negative-controls", action="store_true")
    args = ap.parse_args()
    schema = schema_of(args.crd)
    docs = load_documents(args.file)
    errors = []
    kinds = [d.get("kind") for d in docs]
    if kinds.count("MPIJob") != 1:
        errors.append(f"expected exactly one MPIJob, found kinds {kinds}")
    for d in docs:
        if d.get("kind") == "MPIJob":
            if d.get("apiVersion") != "kubeflow.org/v2beta1":
                errors.append(f"MPIJob apiVersion {d.get('apiVersion')}, expected kubeflow.org/v2beta1")
            errors += validate_job(d, schema)
        elif d.get("kind") == "PersistentVolumeClaim":
            check_claim(d, errors)
        else:
            errors.append(f"unexpected document kind {d.get('kind')}")
    if not errors and args.expect:
        check_expectations(docs, args.expect, errors)
    if errors:
        for e in errors:
            print(f"INVALID {args.file}: {e}")
        return 1
    if args.negative_controls:
        job = next(d for d in docs if d.get("kind") == "MPIJob")
        accepted = []
        for what, mutate in mutations():
            broken = mutate(copy.deepcopy(job))  # needs a GPU-less manifest with a claim
            try:
                found = validate_job(broken, schema)
            except (KeyError, ValueError, TypeError, IndexError, AttributeError) as e:
                print(f"VALIDATOR CRASHED on '{what}': {e!r}")
                return 1
            if found:
                print(f"rejected as it must be: {what}: {found[0]}")
            else:
                accepted.append(what)
        for what in accepted:
            print(f"NEGATIVE CONTROL ACCEPTED (validator too weak): {what}")
        if accepted:
            return 1
    print(f"valid: {args.file} ({', '.join(kinds)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
