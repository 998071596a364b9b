# Sourced by submit.sh and by every sbatch script of deploy/slurm: what differs between
# clusters, each a variable with the flagship's default (docs/scaling.md lists them). submit.sh
# exports them, so every job runs with the values it was submitted with.
#   EXP                the experiment (required). With the container runtime its file is
#                      $DRAFTLINE_SHARED/$EXP.yaml, mounted as conf/experiment/$EXP.yaml. For
#                      Kimi-K2.5, e.g. EXP=kimi-cluster:
#                        # @package _global_
#                        defaults: [kimi-k2.5]        # conf/experiment/kimi-k2.5.yaml
#                        exp: kimi-cluster            # = EXP: Make and the stages use runs/$EXP
#                        model: {path: models/Kimi-K2.5}
#                        data: {path: /data/conversations.jsonl}
#   OVERRIDES          Hydra overrides every step passes (Make's OVERRIDES; all steps must agree
#                      or each re-stamps the others' stages) [none]
#   DRAFTLINE_RUNTIME  pyxis: every step runs in DRAFTLINE_IMAGE through pyxis/enroot, on
#                      DRAFTLINE_SHARED; none: every step runs in DRAFTLINE_CHECKOUT with its .venv
#                      [pyxis]
#   DRAFTLINE_IMAGE    (pyxis) the image `make image` built, as pyxis takes it: a squashfs file
#                      from `enroot import dockerd://draftline:gpu`, or registry#draftline:gpu
#   DRAFTLINE_SHARED   (pyxis) a directory every node mounts (NFS, Lustre, ...) holding runs/
#                      (the run directory: stage outputs, written), models/ and data/ (read-only)
#                      and $EXP.yaml
#   DRAFTLINE_CHECKOUT (none) a checkout every node sees at the same path, `make setup` done;
#                      its runs/ is the run directory (a link to shared storage)
#                      [the checkout this file is in]
#   PARTITION, ACCOUNT sbatch --partition / --account [the cluster's defaults]
#   GPUS_PER_NODE      --gpus-per-node of every job, 0 for none; training runs one process per
#                      GPU [8]
#   DRAFTLINE_STACK    gpu, or cpu: one training process per node whatever GPUS_PER_NODE says
#                      (gloo on the CPU; a test cluster with the CPU stack) [gpu]
#   SLICES, NODES      extraction array tasks (`make extract SHARD=i/SLICES`), training nodes [4, 2]
#   REPLICAS           vLLM engines per extraction node (extract.replicas): 8 for a target that
#                      fits one GPU (Llama-3.1-8B), 1 for one engine over 8 GPUs (Kimi-K2.5) [1]
#   RENDEZVOUS_PORT    torchrun's c10d rendezvous port on the first training node [29500]
set -euo pipefail

fail() {
  echo "deploy/slurm: $*" >&2
  exit 2
}
whole() {  # NAME VALUE: VALUE must be a whole number
  [[ $2 =~ ^[0-9]+$ ]] || fail "$1=$2 must be a whole number"
}

: "${EXP:?set EXP to your experiment (docs/scaling.md, Slurm)}"
OVERRIDES=${OVERRIDES:-}
DRAFTLINE_RUNTIME=${DRAFTLINE_RUNTIME:-pyxis}
PARTITION=${PARTITION:-}
ACCOUNT=${ACCOUNT:-}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
DRAFTLINE_STACK=${DRAFTLINE_STACK:-gpu}
SLICES=${SLICES:-4}
NODES=${NODES:-2}
REPLICAS=${REPLICAS:-1}
RENDEZVOUS_PORT=${RENDEZVOUS_PORT:-29500}
for name in GPUS_PER_NODE SLICES NODES REPLICAS RENDEZVOUS_PORT; do
  whole "$name" "${!name}"
done
(( SLICES >= 1 && NODES >= 1 && REPLICAS >= 1 )) || fail "SLICES, NODES and REPLICAS must be at least 1"

case $DRAFTLINE_STACK in
  gpu)
    (( GPUS_PER_NODE >= 1 )) || fail "GPUS_PER_NODE=0 trains on no GPU: set DRAFTLINE_STACK=cpu"
    TRAIN_PROCS=$GPUS_PER_NODE ;;
  cpu) TRAIN_PROCS=1 ;;
  *) fail "DRAFTLINE_STACK=$DRAFTLINE_STACK: give gpu or cpu" ;;
esac

# RUNTIME: the srun options that put a step where it runs Make on the shared run directory.
case $DRAFTLINE_RUNTIME in
  pyxis)
    : "${DRAFTLINE_IMAGE:?set DRAFTLINE_IMAGE to the GPU image (a squashfs file or registry#draftline:gpu)}"
    : "${DRAFTLINE_SHARED:?set DRAFTLINE_SHARED to the shared directory with runs/, models/, data/ and \$EXP.yaml}"
    RUNTIME=(--container-image="$DRAFTLINE_IMAGE" --container-workdir=/app
      --container-mounts="$DRAFTLINE_SHARED/runs:/app/runs,$DRAFTLINE_SHARED/models:/app/models:ro,$DRAFTLINE_SHARED/data:/data:ro,$DRAFTLINE_SHARED/$EXP.yaml:/app/conf/experiment/$EXP.yaml:ro") ;;
  none)
    DRAFTLINE_CHECKOUT=${DRAFTLINE_CHECKOUT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
    # Without .venv every node's first `make` would build it at once in the same checkout.
    compgen -G "$DRAFTLINE_CHECKOUT/.venv/.setup-*" >/dev/null \
      || fail "DRAFTLINE_CHECKOUT=$DRAFTLINE_CHECKOUT has no .venv: run 'make setup' there first"
    export DRAFTLINE_CHECKOUT
    RUNTIME=(--chdir="$DRAFTLINE_CHECKOUT") ;;
  *) fail "DRAFTLINE_RUNTIME=$DRAFTLINE_RUNTIME: give pyxis or none" ;;
esac
export EXP OVERRIDES DRAFTLINE_RUNTIME PARTITION ACCOUNT GPUS_PER_NODE DRAFTLINE_STACK SLICES \
  NODES REPLICAS RENDEZVOUS_PORT
