#!/usr/bin/env bash
# Submit the whole pipeline to Slurm, each step after the previous one succeeded:
#   1. regenerate.sbatch  tokenize + regenerate, once (every slice reads its output)
#   2. extract.sbatch     an array of SLICES tasks: `make extract SHARD=i/SLICES` each
#   3. train.sbatch       finalize + prepare on the first node, then `make train` on NODES
#                         nodes joined by torchrun's rendezvous
# Run from the checkout:
#   EXP=kimi-cluster DRAFTLINE_IMAGE=/shared/draftline-gpu.sqsh DRAFTLINE_SHARED=/shared/draftline \
#     SLICES=8 NODES=2 deploy/slurm/submit.sh
# A failed slice leaves the train job pending (dependency never satisfied): rerun that task
# (`sbatch --array=<i> deploy/slurm/extract.sbatch`, it resumes), then submit train.sbatch.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/common.sh"
SLICES=${SLICES:-4}
NODES=${NODES:-2}
export DRAFTLINE_SLURM="$here"
regenerate=$(sbatch --parsable "$here/regenerate.sbatch")
extract=$(sbatch --parsable --dependency="afterok:$regenerate" --array="0-$((SLICES - 1))" \
  "$here/extract.sbatch")
train=$(sbatch --parsable --dependency="afterok:$extract" --nodes="$NODES" "$here/train.sbatch")
echo "submitted: regenerate $regenerate, extract $extract (${SLICES} slices), train $train (${NODES} nodes)"
