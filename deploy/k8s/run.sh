#!/usr/bin/env bash
# Apply the draftline Jobs in order, each once the previous one completed:
#   storage.yaml (volume, experiment) -> regenerate -> extract (Indexed, one slice per pod)
#   -> prepare (finalize + prepare) -> train (Indexed, one pod per node)
# Edit the experiment (storage.yaml), the slice count and the node count first (their comments say
# which fields must agree). A failed step stops here; fix it, delete that Job and rerun this
# script: finished steps are no-ops (Make finds them up to date), slices resume.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
kubectl apply -f "$here/storage.yaml"
# Until the Job completes; a Job that failed ends the script, naming where its logs are.
wait_for() {
  local state
  while :; do
    state=$(kubectl get "job/$1" -o jsonpath='{.status.conditions[?(@.status=="True")].type}')
    case "$state" in
      *Complete*) return 0 ;;
      *Failed*) echo "job/$1 failed: kubectl logs -l job-name=$1 --prefix" >&2; return 1 ;;
    esac
    sleep 30
  done
}
for step in regenerate extract prepare train; do
  kubectl apply -f "$here/$step-job.yaml"
  wait_for "draftline-$step"
done
