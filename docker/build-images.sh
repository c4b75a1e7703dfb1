#!/usr/bin/env bash
# Build the rehearsal image from nothing: no base image, no registry. The root filesystem is the
# two binaries, exactly the shared libraries `ldd` lists for them, the dynamic loader, and an
# empty /tmp; the image is `FROM scratch`.
#
#   docker/build-images.sh [BIN_DIR]      (default: target/debug)
#
# MF_IMAGE names the image (default modelforge-rehearsal:local). Debug info is stripped from the
# copies (symbols stay, so a panic's backtrace still names functions) unless MF_STRIP=0.
set -euo pipefail
cd "$(dirname "$0")/.."

bin_dir=${1:-target/debug}
image=${MF_IMAGE:-modelforge-rehearsal:local}
bins=(modelforge modelforge-agent)

for b in "${bins[@]}"; do
  [ -x "$bin_dir/$b" ] || { echo "build-images: $bin_dir/$b missing (cargo build --workspace --bins)" >&2; exit 2; }
done

ctx=$(mktemp -d "${TMPDIR:-/tmp}/mf-image.XXXXXX")
trap 'rm -rf "$ctx"' EXIT
root=$ctx/rootfs
mkdir -p "$root/usr/local/bin" "$root/tmp" "$root/data" "$root/state"
chmod 1777 "$root/tmp"

for b in "${bins[@]}"; do
  if [ "${MF_STRIP:-1}" != 0 ] && command -v strip >/dev/null 2>&1; then
    strip --strip-debug -o "$root/usr/local/bin/$b" "$bin_dir/$b"
  else
    cp "$bin_dir/$b" "$root/usr/local/bin/$b"
  fi
  # Every library ldd resolves, at the path it resolves to, plus the loader (the line without
  # "=>"); linux-vdso is the kernel's and has no file.
  ldd "$bin_dir/$b" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}'
done | sort -u | while read -r lib; do
  mkdir -p "$root$(dirname "$lib")"
  cp -L "$lib" "$root$lib"
done

cat > "$ctx/Dockerfile" <<'DOCKERFILE'
FROM scratch
COPY rootfs/ /
ENV PATH=/usr/local/bin
ENTRYPOINT []
DOCKERFILE

echo "build-images: $image from $bin_dir ($(du -sh "$root" | cut -f1)):"
(cd "$root" && find . -type f | sort | sed 's/^\./   /')
docker build -q -t "$image" "$ctx" >/dev/null
echo "build-images: built $image ($(docker image inspect -f '{{.Size}}' "$image") bytes)"
