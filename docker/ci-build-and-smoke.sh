#!/usr/bin/env bash
# CI: build the cpu and gpu images on this machine, then run `make smoke` in the cpu one as the
# image's non-root user, with runs/ in a tmpfs (every run starts from nothing) and no network.
# For machines that reach package mirrors but no image registry. Idempotent, run as root:
#   - installs docker.io, debootstrap and distro-info when missing (Debian's docker client
#     speaks BuildKit without the buildx plugin; debootstrap asks distro-info which Ubuntu
#     releases are current);
#   - starts dockerd when none answers (overlay2, no bridge, no iptables: builds and runs use
#     the host's network);
#   - makes the base images with docker/make-base-image.sh when their tags are missing: Debian
#     bookworm for the cpu image (debian:bookworm-slim's release) and Ubuntu noble for the gpu
#     image, standing in for nvidia/cuda:*-devel-ubuntu24.04 (same Ubuntu and Python 3.12, no
#     CUDA toolkit: nvcc and /usr/local/cuda are missing, so the image builds, installs the
#     exact GPU lock and applies both patch queues to the CUDA wheel, but is no image to run on
#     a GPU; torch and vLLM bring their CUDA runtime as wheels, FlashInfer's JIT needs nvcc);
#   - builds with `make image-cpu` and `make image`; uv's downloads go to BuildKit's cache mount,
#     shared by both, as long as dockerd's builder GC keeps it (its default size limit can drop
#     it once both stacks' layers are cached: a lock change then downloads that lock again).
# CA_BUNDLE (default: the system bundle) is handed to pip and uv as a build secret, for
# TLS-intercepting proxies; BASE_IMAGE, GPU_BASE_IMAGE and IMAGE override the tags used;
# BUILD_GPU=0 skips the gpu image. On 2 cores: base images about 1 (noble) and 4 (bookworm)
# minutes, cold builds 4 (cpu) and 7 (gpu: apt 1, uv 4, layer export 1.5), warm ones (source or
# patch queue changed) under a minute each, and `make smoke` about 15 (it trains the tiny
# target, regenerates its replies, trains and gates the draft, writes the report).
set -euo pipefail
cd "$(dirname "$0")/.."

BASE_IMAGE=${BASE_IMAGE:-draftline-base:bookworm}
GPU_BASE_IMAGE=${GPU_BASE_IMAGE:-draftline-base:noble}
BUILD_GPU=${BUILD_GPU:-1}
IMAGE=${IMAGE:-draftline}
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
DOCKERD_LOG=${DOCKERD_LOG:-/var/log/draftline-dockerd.log}
start=$(date +%s)
step() { echo "== $* ($(( $(date +%s) - start )) s)"; }

missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v debootstrap >/dev/null || missing+=(debootstrap)
command -v ubuntu-distro-info >/dev/null || missing+=(distro-info)
if [ ${#missing[@]} -gt 0 ]; then
  step "apt-get install ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# A docker CLI from elsewhere on PATH may insist on buildx for BuildKit; Debian's does not.
DOCKER=${DOCKER:-$( [ -x /usr/bin/docker ] && echo /usr/bin/docker || command -v docker )}
export DOCKER

if ! "$DOCKER" info >/dev/null 2>&1; then
  step "starting dockerd (log: $DOCKERD_LOG)"
  nohup dockerd --storage-driver=overlay2 --bridge=none --iptables=false >>"$DOCKERD_LOG" 2>&1 &
  for _ in $(seq 60); do "$DOCKER" info >/dev/null 2>&1 && break; sleep 1; done
  "$DOCKER" info >/dev/null 2>&1 || { tail -n 20 "$DOCKERD_LOG" >&2; exit 1; }
fi

base_image() {  # SUITE TAG
  if ! "$DOCKER" image inspect "$2" >/dev/null 2>&1; then
    step "base image $2"
    docker/make-base-image.sh "$1" "$2"
  fi
}

build() {  # STACK MAKE-TARGET BUILD-ARGS
  local stack=$1 target=$2 build_args="--network host $3" previous current build_start
  [ -s "$CA_BUNDLE" ] && build_args+=" --secret id=ca_bundle,src=$CA_BUNDLE"
  step "make $target"
  build_start=$(date +%s)
  previous=$("$DOCKER" image inspect --format '{{.Id}}' "$IMAGE:$stack" 2>/dev/null || true)
  make --no-print-directory "$target" DOCKER="$DOCKER" IMAGE="$IMAGE" DOCKER_BUILD_ARGS="$build_args"
  echo "image $IMAGE:$stack built in $(( $(date +%s) - build_start )) s," \
    "$(( $("$DOCKER" image inspect --format '{{.Size}}' "$IMAGE:$stack") / 1000000 )) MB"
  # The previous build's image, untagged by this one (kept if a container still uses it).
  current=$("$DOCKER" image inspect --format '{{.Id}}' "$IMAGE:$stack")
  if [ -n "$previous" ] && [ "$previous" != "$current" ]; then
    "$DOCKER" image rm "$previous" >/dev/null 2>&1 || true
  fi
}

base_image bookworm "$BASE_IMAGE"
build cpu image-cpu "--build-arg CPU_BASE_IMAGE=$BASE_IMAGE"
if [ "$BUILD_GPU" != 0 ]; then
  base_image noble "$GPU_BASE_IMAGE"
  build gpu image "--build-arg GPU_BASE_IMAGE=$GPU_BASE_IMAGE"
  # What the build proved, from the image itself: both queues applied to the CUDA wheel.
  "$DOCKER" run --rm --network none "$IMAGE:gpu" python -m draftline.patchq status --package vllm
  "$DOCKER" image inspect --format \
    'labels: vllm={{index .Config.Labels "draftline.vllm"}} torch={{index .Config.Labels "draftline.torch"}} vllm_patches={{index .Config.Labels "draftline.vllm_patches"}}' \
    "$IMAGE:gpu"
fi
# Every lock change leaves a venv layer in BuildKit's cache (about 9 GB cpu, 11 GB gpu): keep
# the most recently used BUILD_CACHE_KEEP and drop the rest.
"$DOCKER" builder prune --force --keep-storage "${BUILD_CACHE_KEEP:-30GB}" >/dev/null

step "make smoke in $IMAGE:cpu"
smoke_start=$(date +%s)
uid=$("$DOCKER" image inspect --format '{{.Config.User}}' "$IMAGE:cpu")
"$DOCKER" run --rm --network none --shm-size 2g \
  --tmpfs "/app/runs:rw,uid=$uid,gid=$uid" \
  "$IMAGE:cpu" make smoke
echo "make smoke in the container: $(( $(date +%s) - smoke_start )) s"
step "done"
