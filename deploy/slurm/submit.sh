#!/usr/bin/env bash
# Submit the pipeline to Slurm, each job after the previous one succeeded (afterok):
#   1. regenerate.sbatch  tokenize + regenerate, once (every slice reads its output)
#   2. extract.sbatch     an array of SLICES tasks: `make extract SHARD=i/SLICES` each
#   3. train.sbatch       finalize + prepare on the first node, then `make train` on NODES
#                         nodes joined by torchrun's rendezvous
# A job that fails (or is cancelled) cancels the jobs after it (--kill-on-invalid-dep) rather
# than leaving them pending for ever; its traceback is in its output file
# (draftline-<step>-<job id>.out, in the directory you submitted from). Resubmit from there:
#   deploy/slurm/submit.sh                 the whole chain (finished steps are no-ops for Make)
#   deploy/slurm/submit.sh extract 1,3     slices 1 and 3 of SLICES (each resumes), then train
#   deploy/slurm/submit.sh train           finalize, prepare and train
# The variables of common.sh say where and how, e.g. for Kimi-K2.5 on 8-GPU nodes:
#   EXP=kimi-cluster DRAFTLINE_IMAGE=/shared/draftline-gpu.sqsh DRAFTLINE_SHARED=/shared/draftline \
#     SLICES=8 NODES=2 deploy/slurm/submit.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/common.sh"
export DRAFTLINE_SLURM="$here"

usage="usage: deploy/slurm/submit.sh [regenerate | extract [TASKS] | train]"
first=${1:-regenerate}
case $first in
  regenerate | train) (( $# <= 1 )) || fail "$usage" ;;
  extract) (( $# <= 2 )) || fail "$usage" ;;
  *) fail "$usage" ;;
esac
tasks=${2:-0-$((SLICES - 1))}

options=(--parsable --kill-on-invalid-dep=yes)
[ -z "$PARTITION" ] || options+=(--partition="$PARTITION")
[ -z "$ACCOUNT" ] || options+=(--account="$ACCOUNT")
(( GPUS_PER_NODE == 0 )) || options+=(--gpus-per-node="$GPUS_PER_NODE")

after=()  # the dependency on the job submitted before, once there is one
if [ "$first" = regenerate ]; then
  regenerate=$(sbatch "${options[@]}" "$here/regenerate.sbatch")
  echo "regenerate: job $regenerate"
  after=(--dependency="afterok:$regenerate")
fi
if [ "$first" != train ]; then
  extract=$(sbatch "${options[@]}" "${after[@]}" --array="$tasks" "$here/extract.sbatch")
  echo "extract: job $extract, tasks $tasks of slices 0-$((SLICES - 1))${after:+ (${after[*]})}"
  after=(--dependency="afterok:$extract")
fi
train=$(sbatch "${options[@]}" "${after[@]}" --nodes="$NODES" "$here/train.sbatch")
echo "train: job $train, $NODES nodes x $TRAIN_PROCS processes${after:+ (${after[*]})}"
