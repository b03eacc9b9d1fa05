#!/bin/sh
# Build a base image for compose/Dockerfile from Debian's packages, for machines that cannot pull one
# from Docker Hub: a minimal Debian with python3 and its venv module, imported into the local engine.
#
#   compose/base_image.sh [IMAGE]          # default april-base:bookworm (Debian 12, Python 3.11)
#
# Needs root, debootstrap (installed with apt-get where missing) and a running Docker engine. The Debian
# mirror is the one apt is configured with here (DEBIAN_MIRROR overrides it), so the build reaches only
# what apt reaches. About a minute; the image is about 130 MB.
set -eu
image=${1:-april-base:bookworm}
suite=${DEBIAN_SUITE:-bookworm}

mirror=${DEBIAN_MIRROR:-}
if [ -z "$mirror" ]; then
    # deb822 sources (URIs: ...) first, then one-line ones (deb URL SUITE ...); the main archive, not security
    mirror=$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '/^URIs:/ && $2 !~ /security/ {print $2; exit}')
    [ -n "$mirror" ] || mirror=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
        | awk '$1 == "deb" && $2 !~ /security/ {print $2; exit}')
    [ -n "$mirror" ] || mirror=http://deb.debian.org/debian
fi

if [ "$(id -u)" != 0 ]; then
    echo "base_image.sh: debootstrap needs root" >&2
    exit 1
fi
if ! command -v debootstrap >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
fi

root=$(mktemp -d /tmp/april-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
echo "base_image.sh: debootstrap $suite from $mirror"
debootstrap --variant=minbase --include=python3,python3-venv "$suite" "$root" "$mirror" >"$root.log" 2>&1 || {
    tail -n 20 "$root.log" >&2
    echo "base_image.sh: debootstrap failed (log above)" >&2
    exit 1
}
rm -f "$root.log"
# what an image does not need: downloaded packages, package lists (apt-get update fetches them again),
# documentation, manual pages, translations
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* \
    "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/locale/*
tar -C "$root" -c . | docker import --change 'CMD ["/bin/bash"]' - "$image" >/dev/null
echo "base_image.sh: built $image ($(docker image inspect --format '{{.Size}}' "$image" | awk '{printf "%.0f MB", $1 / 1e6}'))"
