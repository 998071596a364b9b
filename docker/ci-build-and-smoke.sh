#!/usr/bin/env bash
# CI: build the cpu image on this machine and run `make smoke` inside it, as the image's
# non-root user, with runs/ in a tmpfs (every run starts from nothing) and no network.
# For machines that reach package mirrors but no image registry. Idempotent, run as root:
#   - installs docker.io and debootstrap when missing (Debian's docker client speaks BuildKit
#     without the buildx plugin);
#   - starts dockerd when none answers (overlay2, no bridge, no iptables: builds and runs use
#     the host's network);
#   - makes the bookworm base image with docker/make-base-image.sh when its tag is missing;
#   - builds with `make image-cpu`; uv's downloads persist in BuildKit's cache mount, so a warm
#     rebuild after a lock change downloads nothing.
# CA_BUNDLE (default: the system bundle) is handed to pip and uv as a build secret, for
# TLS-intercepting proxies; BASE_IMAGE and IMAGE override the tags used. On 2 cores: base
# image about 1 minute, cold build 2.5, and `make smoke` about 15 (it trains the tiny target,
# regenerates its replies, trains and gates the draft, writes the report).
set -euo pipefail
cd "$(dirname "$0")/.."

BASE_IMAGE=${BASE_IMAGE:-draftline-base:bookworm}
IMAGE=${IMAGE:-draftline}
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
DOCKERD_LOG=${DOCKERD_LOG:-/var/log/draftline-dockerd.log}
start=$(date +%s)
step() { echo "== $* ($(( $(date +%s) - start )) s)"; }

missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v debootstrap >/dev/null || missing+=(debootstrap)
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

if ! "$DOCKER" image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  step "base image $BASE_IMAGE"
  docker/make-base-image.sh bookworm "$BASE_IMAGE"
fi

step "make image-cpu"
build_args="--network host --build-arg CPU_BASE_IMAGE=$BASE_IMAGE"
[ -s "$CA_BUNDLE" ] && build_args+=" --secret id=ca_bundle,src=$CA_BUNDLE"
build_start=$(date +%s)
previous=$("$DOCKER" image inspect --format '{{.Id}}' "$IMAGE:cpu" 2>/dev/null || true)
make --no-print-directory image-cpu DOCKER="$DOCKER" IMAGE="$IMAGE" DOCKER_BUILD_ARGS="$build_args"
echo "image $IMAGE:cpu built in $(( $(date +%s) - build_start )) s," \
  "$(( $("$DOCKER" image inspect --format '{{.Size}}' "$IMAGE:cpu") / 1000000 )) MB"
# The previous build's image, untagged by this one (kept if a container still uses it).
current=$("$DOCKER" image inspect --format '{{.Id}}' "$IMAGE:cpu")
if [ -n "$previous" ] && [ "$previous" != "$current" ]; then
  "$DOCKER" image rm "$previous" >/dev/null 2>&1 || true
fi
# Every lock change leaves a ~8 GB venv layer in BuildKit's cache: keep the most recently used
# BUILD_CACHE_KEEP (uv's download cache mount is about 10 GB of it) and drop the rest.
"$DOCKER" builder prune --force --keep-storage "${BUILD_CACHE_KEEP:-30GB}" >/dev/null

step "make smoke in $IMAGE:cpu"
smoke_start=$(date +%s)
uid=$("$DOCKER" image inspect --format '{{.Config.User}}' "$IMAGE:cpu")
"$DOCKER" run --rm --network none --shm-size 2g \
  --tmpfs "/app/runs:rw,uid=$uid,gid=$uid" \
  "$IMAGE:cpu" make smoke
echo "make smoke in the container: $(( $(date +%s) - smoke_start )) s"
step "done"
