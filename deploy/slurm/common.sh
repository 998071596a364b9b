# Sourced by the sbatch scripts of deploy/slurm: the experiment, the GPU image and the shared
# storage every step runs against (submit.sh checks them before submitting anything).
#   EXP              the experiment's name; its file is $DRAFTLINE_SHARED/$EXP.yaml, mounted as
#                    conf/experiment/$EXP.yaml in the image. For Kimi-K2.5, e.g. EXP=kimi-cluster:
#                      # @package _global_
#                      defaults: [kimi-k2.5]        # conf/experiment/kimi-k2.5.yaml
#                      exp: kimi-cluster            # = EXP: Make and the stages use runs/$EXP
#                      model: {path: models/Kimi-K2.5}
#                      data: {path: /data/conversations.jsonl}
#   DRAFTLINE_IMAGE  the GPU image (`make image`) as pyxis/enroot takes it, e.g. a squashfs
#                    file made by `enroot import dockerd://draftline:gpu`
#   DRAFTLINE_SHARED a directory every node mounts (NFS, Lustre, ...) holding runs/ (stage
#                    outputs, written), models/ and data/ (read-only) and $EXP.yaml
set -euo pipefail
: "${EXP:?set EXP to your experiment (its file: \$DRAFTLINE_SHARED/\$EXP.yaml)}"
: "${DRAFTLINE_IMAGE:?set DRAFTLINE_IMAGE to the GPU image (a squashfs file or registry#draftline:gpu)}"
: "${DRAFTLINE_SHARED:?set DRAFTLINE_SHARED to the shared directory with runs/, models/, data/ and \$EXP.yaml}"
# Every srun step runs Make inside the image (workdir /app), on the shared run directory.
CONTAINER=(--container-image="$DRAFTLINE_IMAGE" --container-workdir=/app
  --container-mounts="$DRAFTLINE_SHARED/runs:/app/runs,$DRAFTLINE_SHARED/models:/app/models:ro,$DRAFTLINE_SHARED/data:/data:ro,$DRAFTLINE_SHARED/$EXP.yaml:/app/conf/experiment/$EXP.yaml:ro")
