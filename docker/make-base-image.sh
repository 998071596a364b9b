#!/usr/bin/env bash
# Make a Docker base image without a registry: debootstrap a minimal root file system from a
# Debian-format package mirror and `docker import` it. For machines that reach a package mirror
# but no image registry (CI here); the Dockerfile takes its base images as build arguments.
#
#   docker/make-base-image.sh SUITE TAG     e.g. docker/make-base-image.sh bookworm draftline-base:bookworm
#                                                docker/make-base-image.sh noble draftline-base:noble
#
# bookworm is the cpu image's base (debian:bookworm-slim's release); noble (Ubuntu 24.04, the
# release of the CUDA devel images, Python 3.12) stands in for the gpu image's CUDA base.
#
# MIRROR      package mirror URL. Default: the mirror of this host's apt sources when the host
#             runs the suite's distribution (Debian or Ubuntu), else debootstrap's own default
#             mirror for the suite (Ubuntu suites: needs distro-info installed); so no mirror is
#             named in the repository.
# COMPONENTS  archive components. Default: main; main,universe for Ubuntu suites, as Ubuntu's
#             own images have it (python3.12-venv is in universe).
# DOCKER      docker client (default: docker).
# Release signatures are always checked. An Ubuntu suite on a Debian host needs a debootstrap
# that knows it and Ubuntu's archive keyring (ubuntu-keyring); when the host lacks either, both are fetched from
# the host mirror's <codename>-backports into a temporary directory (the host's apt sources and
# installed packages are left alone). Ubuntu images get the -updates and -security pockets, as
# Ubuntu's own images have them.
# About a minute and 90-120 MB for a minbase root file system (bookworm, noble).
set -euo pipefail

suite=${1:?usage: $0 SUITE TAG}
tag=${2:?usage: $0 SUITE TAG}
DOCKER=${DOCKER:-docker}

host_id=$(. /etc/os-release && echo "${ID:-}")
host_codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")

# The URI of the first enabled apt source that serves the host's own suite (one-line .list and
# deb822 .sources formats); security and -updates entries name other suites and are skipped.
host_mirror() {
  [ -n "$host_codename" ] || return 0
  {
    cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
      | awk -v s="$host_codename" '$1 == "deb" { sub(/\[[^]]*\]/, ""); if ($3 == s) print $2 }'
    cat /etc/apt/sources.list.d/*.sources 2>/dev/null \
      | awk -v s="$host_codename" 'BEGIN { RS = ""; FS = "\n" }
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

work=$(mktemp -d /var/tmp/draftline-rootfs.XXXXXX)
trap 'rm -rf "$work"' EXIT
root=$work/rootfs
mkdir "$root"

# debootstrap and keyrings: the host's, or newer ones from the host's backports.
debootstrap=debootstrap
scripts=/usr/share/debootstrap/scripts
keyrings=/usr/share/keyrings
if [ ! -e "$scripts/$suite" ] || { [ "$(basename "$(readlink -f "$scripts/$suite")")" = gutsy ] \
    && [ ! -e "$keyrings/ubuntu-archive-keyring.gpg" ]; }; then
  mirror=$(host_mirror)
  if [ "$host_id" != debian ] || [ -z "$mirror" ]; then
    echo "error: this host's debootstrap does not know '$suite' or lacks its keyring:" \
      "install a newer debootstrap (and ubuntu-keyring for Ubuntu suites)" >&2
    exit 1
  fi
  echo "fetching debootstrap and ubuntu-keyring from $host_codename-backports"
  tools=$work/tools
  mkdir -p "$tools/lists/partial" "$tools/debs/partial" "$tools/root"
  echo "deb $mirror $host_codename-backports main" >"$tools/sources.list"
  apt_private=(-o "Dir::Etc::SourceList=$tools/sources.list" -o Dir::Etc::SourceParts=/dev/null
               -o "Dir::State::Lists=$tools/lists" -o "Dir::Cache::Archives=$tools/debs"
               -o Dir::Cache::pkgcache= -o Dir::Cache::srcpkgcache= -o APT::Sandbox::User=root)
  apt-get "${apt_private[@]}" update -qq
  (cd "$tools/debs" && apt-get "${apt_private[@]}" download -qq \
     "debootstrap/$host_codename-backports" "ubuntu-keyring/$host_codename-backports")
  for deb in "$tools"/debs/*.deb; do dpkg-deb -x "$deb" "$tools/root"; done
  export DEBOOTSTRAP_DIR=$tools/root/usr/share/debootstrap
  debootstrap=$tools/root/usr/sbin/debootstrap
  scripts=$DEBOOTSTRAP_DIR/scripts
  keyrings=$tools/root/usr/share/keyrings
  if [ ! -e "$scripts/$suite" ]; then
    echo "error: debootstrap from $host_codename-backports does not know suite '$suite' either" >&2
    exit 1
  fi
fi

# Ubuntu's suite scripts are all links to one (gutsy); Debian's to another.
if [ "$(basename "$(readlink -f "$scripts/$suite")")" = gutsy ]; then
  family=ubuntu components=${COMPONENTS:-main,universe}
  keyring=$keyrings/ubuntu-archive-keyring.gpg
else
  family=debian components=${COMPONENTS:-main}
  keyring=$keyrings/debian-archive-keyring.gpg
fi
[ -e "$keyring" ] || { echo "error: no archive keyring $keyring" >&2; exit 1; }

# An empty mirror argument makes debootstrap use the suite script's default. For Ubuntu that
# default depends on whether the release is still supported, which debootstrap asks
# ubuntu-distro-info (package distro-info); without it, it guesses "unsupported" whenever it
# cannot reach a web service, and picks the archive of retired releases.
mirror=${MIRROR:-}
if [ -z "$mirror" ] && [ "$host_id" = "$family" ]; then mirror=$(host_mirror); fi
if [ -z "$mirror" ] && [ "$family" = ubuntu ] && ! command -v ubuntu-distro-info >/dev/null; then
  echo "error: set MIRROR, or install distro-info so debootstrap picks its default mirror" >&2
  exit 1
fi
mirror_arg=()
[ -z "$mirror" ] || mirror_arg=("$mirror")

echo "debootstrap $suite ($components) -> $tag"
"$debootstrap" --variant=minbase --components="$components" --force-check-gpg \
    --keyring="$keyring" "$suite" "$root" "${mirror_arg[@]}" >"$work/debootstrap.log" 2>&1 \
  || { tail -n 30 "$work/debootstrap.log" >&2; exit 1; }
if [ "$family" = ubuntu ]; then
  # debootstrap wrote one line for the release pocket; add the update pockets to it.
  read -r _ used _ <"$root/etc/apt/sources.list"
  for pocket in updates security; do
    echo "deb $used $suite-$pocket ${components//,/ }" >>"$root/etc/apt/sources.list"
  done
fi
# The image's own apt-get update fetches fresh lists; cached packages are dead weight.
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar --numeric-owner -C "$root" -c . \
  | "$DOCKER" import \
      --change 'CMD ["/bin/bash"]' \
      --change "LABEL org.opencontainers.image.description=\"debootstrap --variant=minbase $suite\"" \
      - "$tag"
