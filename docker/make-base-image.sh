#!/usr/bin/env bash
# Make a Docker base image without a registry: debootstrap a minimal root file system from a
# Debian-format package mirror and `docker import` it. For machines that reach a package mirror
# but no image registry (CI here); the Dockerfile takes its base images as build arguments.
#
#   docker/make-base-image.sh SUITE TAG     e.g. docker/make-base-image.sh bookworm draftline-base:bookworm
#
# MIRROR      package mirror URL. Default: the mirror this host's apt sources use for the host's
#             own Debian suite (so no mirror is named in the repository). Set it for Ubuntu suites.
# COMPONENTS  archive components. Default: main; main,universe for Ubuntu suites, as Ubuntu's
#             own images have it (python3.12-venv is in universe).
# DOCKER      docker client (default: docker).
# Ubuntu suites (e.g. noble, the CUDA images' Ubuntu 24.04) need a debootstrap that knows them
# and the ubuntu-keyring package; on Debian bookworm both come from bookworm-backports.
# About a minute and 90-120 MB for a minbase root file system (bookworm, noble).
set -euo pipefail

suite=${1:?usage: $0 SUITE TAG}
tag=${2:?usage: $0 SUITE TAG}
DOCKER=${DOCKER:-docker}

# The URI of the first enabled apt source that serves the host's own suite (one-line .list and
# deb822 .sources formats); security and -updates entries name other suites and are skipped.
host_mirror() {
  local codename
  codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
  [ -n "$codename" ] || return 0
  {
    cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
      | awk -v s="$codename" '$1 == "deb" { sub(/\[[^]]*\]/, ""); if ($3 == s) print $2 }'
    cat /etc/apt/sources.list.d/*.sources 2>/dev/null \
      | awk -v s="$codename" 'BEGIN { RS = ""; FS = "\n" }
          { uri = ""; ok = 0; deb = 0
            for (i = 1; i <= NF; i++) {
              if ($i ~ /^Types:/ && $i ~ /[ \t]deb([ \t]|$)/) deb = 1
              if ($i ~ /^URIs:/) { split($i, a, /[ \t]+/); uri = a[2] }
              if ($i ~ /^Suites:/) { n = split($i, b, /[ \t]+/); for (j = 2; j <= n; j++) if (b[j] == s) ok = 1 }
              if ($i ~ /^Enabled:[ \t]*no/) ok = 0
            }
            if (deb && ok && uri != "") print uri }'
  } | head -n 1
}

mirror=${MIRROR:-$(host_mirror)}
if [ -z "$mirror" ]; then
  echo "error: no package mirror: set MIRROR (none found in this host's apt sources)" >&2
  exit 1
fi
if [ ! -e "/usr/share/debootstrap/scripts/$suite" ]; then
  echo "error: this debootstrap does not know suite '$suite' (a newer debootstrap does)" >&2
  exit 1
fi

# Ubuntu's suite scripts are all links to one (gutsy); Debian's to another.
script=$(readlink -f "/usr/share/debootstrap/scripts/$suite")
[ "$(basename "$script")" = gutsy ] && default_components=main,universe || default_components=main
components=${COMPONENTS:-$default_components}

root=$(mktemp -d /var/tmp/draftline-rootfs.XXXXXX)
trap 'rm -rf "$root"' EXIT
echo "debootstrap $suite ($components) -> $tag"
debootstrap --variant=minbase --components="$components" "$suite" "$root" "$mirror" >"$root.log" 2>&1 \
  || { tail -n 30 "$root.log" >&2; rm -f "$root.log"; exit 1; }
rm -f "$root.log"
# The image's own apt-get update fetches fresh lists; cached packages are dead weight.
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar --numeric-owner -C "$root" -c . \
  | "$DOCKER" import \
      --change 'CMD ["/bin/bash"]' \
      --change "LABEL org.opencontainers.image.description=\"debootstrap --variant=minbase $suite\"" \
      - "$tag"
