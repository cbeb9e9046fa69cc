#!/usr/bin/env bash
# Build the hpct image without a Docker daemon or a registry, run it, export it.
#
#  1. base: a Debian bookworm root made by debootstrap from this machine's own mirror, with
#     Python 3.11 and venv, committed into buildah's storage as a local image (reused while the
#     suite, packages and mirror stay the same).  HPCT_IMAGE_BASE names another base instead.
#  2. torch: the pinned CPU wheel (the Dockerfile's TORCH_VERSION) for the base's Python,
#     fetched by `pip download` as this machine resolves it, staged in .whl/ of the context.
#  3. build: `buildah bud` of the Dockerfile (chroot isolation, vfs storage: no daemon).
#  4. run: `hpct doctor` and `hpct demo` in a container of the image, as its non-root user.
#  5. export: a docker-archive tarball (`docker load -i`), checked with skopeo when installed.
#
# --gpu: the GPU variant (docs/container.md): PyPI's newest supported torch, the CUDA build
# (hpct.requirements.TORCH_NEWEST), with hpct's drop-in nvidia-nccl-cu13 2.30.7+hpct.<series>
# wheel made from this checkout's NCCL 2.30.7 build (hpct-build build nccl=2.30.7); torch's own
# pin takes it.  No GPU is needed to build it: doctor checks in the image that torch maps
# hpct's libnccl.  Default image localhost/hpct:gpu; no demo, no export unless asked
# (HPCT_IMAGE_SKIP_DEMO=0, HPCT_IMAGE_ARCHIVE).
#
# Environment: HPCT_IMAGE (default localhost/hpct:ci), HPCT_IMAGE_ARCHIVE (default
# build/image/hpct-image.tar), HPCT_IMAGE_BASE, HPCT_DEBIAN_MIRROR, HPCT_BUILDAH_ROOT (a
# separate buildah storage root), HPCT_IMAGE_SKIP_DEMO=1.
set -euo pipefail
cd "$(dirname "$0")/.."
. ci/python.sh

SUITE=bookworm
BASE_PACKAGES=python3,python3-venv,ca-certificates
GPU=0
case "${1:-}" in
  --gpu) GPU=1 ;;
  "") ;;
  *) echo "ci/image.sh: unknown argument '$1'" >&2; echo "  fix: bash ci/image.sh [--gpu]" >&2; exit 2 ;;
esac
if [ "$GPU" = 1 ]; then
  IMAGE=${HPCT_IMAGE:-localhost/hpct:gpu}
  ARCHIVE=${HPCT_IMAGE_ARCHIVE:-}
  HPCT_IMAGE_SKIP_DEMO=${HPCT_IMAGE_SKIP_DEMO:-1}
else
  IMAGE=${HPCT_IMAGE:-localhost/hpct:ci}
  ARCHIVE=${HPCT_IMAGE_ARCHIVE:-build/image/hpct-image.tar}
fi
WORK=build/image
LOG=$WORK/build.log
DEMO_TIMEOUT=600

die() { echo "ci/image.sh: $1" >&2; echo "  fix: $2" >&2; exit 1; }
step() { echo "[$(date +%T)] $*"; }

[ "$(id -u)" = 0 ] || die "building with buildah's vfs storage and chroot isolation needs root" \
  "run it as root (sudo bash ci/image.sh)"
command -v buildah >/dev/null || die "buildah is not installed (it builds the Dockerfile without a daemon)" \
  "apt-get install buildah"
BUILDAH=(buildah --storage-driver vfs)
[ -z "${HPCT_BUILDAH_ROOT:-}" ] || BUILDAH+=(--root "$HPCT_BUILDAH_ROOT")
have_image() { "${BUILDAH[@]}" inspect --type image "$1" >/dev/null 2>&1; }

TORCH_VERSION=$(sed -n 's/^ARG TORCH_VERSION=//p' Dockerfile)
[ -n "$TORCH_VERSION" ] || die "the Dockerfile has no 'ARG TORCH_VERSION=' default" \
  "restore the pin line in the build stage of the Dockerfile"
mkdir -p "$WORK" "$(dirname "${ARCHIVE:-$WORK/x}")"
tmp=$(mktemp -d "$WORK/tmp.XXXXXX")
ctr=""
cleanup() {
  [ -z "$ctr" ] || "${BUILDAH[@]}" rm "$ctr" >/dev/null 2>&1 || true
  rm -rf "$tmp"
}
trap cleanup EXIT

# 1. The base image.
mirror=${HPCT_DEBIAN_MIRROR:-}
if [ -z "${HPCT_IMAGE_BASE:-}" ] && [ -z "$mirror" ]; then
  # The machine's own Debian archive (not the security one), as ci/setup.sh finds it.
  mirror=$(grep -rhs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' | grep -v security | head -n1 || true)
  [ -n "$mirror" ] || mirror=$(grep -hs '^deb ' /etc/apt/sources.list | awk '{print $2}' | head -n1 || true)
  [ -n "$mirror" ] || die "no Debian mirror found in /etc/apt to debootstrap the base from" \
    "set HPCT_DEBIAN_MIRROR=http://deb.debian.org/debian (or HPCT_IMAGE_BASE to an existing image)"
fi
if [ -n "${HPCT_IMAGE_BASE:-}" ]; then
  BASE=$HPCT_IMAGE_BASE
  step "base: $BASE (HPCT_IMAGE_BASE)"
else
  key=$(printf '%s|%s|%s' "$SUITE" "$BASE_PACKAGES" "$mirror" | sha256sum | cut -c1-12)
  BASE=localhost/hpct-base:$SUITE-$key
  if have_image "$BASE"; then
    step "base: $BASE (already built)"
  else
    command -v debootstrap >/dev/null || die "debootstrap is not installed (it makes the Debian base image)" \
      "apt-get install debootstrap (or set HPCT_IMAGE_BASE to an existing image)"
    step "base: debootstrap $SUITE from $mirror (log: $WORK/debootstrap.log)"
    started=$(date +%s)
    if ! debootstrap --variant=minbase --include="$BASE_PACKAGES" "$SUITE" "$tmp/rootfs" "$mirror" \
        >"$WORK/debootstrap.log" 2>&1; then
      tail -n 20 "$WORK/debootstrap.log" >&2
      die "debootstrap $SUITE from $mirror failed (log: $WORK/debootstrap.log)" \
        "check that the mirror is reachable, or set HPCT_DEBIAN_MIRROR"
    fi
    # Package lists and downloaded .debs are the builder's, not the image's.
    rm -rf "$tmp"/rootfs/var/cache/apt/archives/*.deb "$tmp"/rootfs/var/lib/apt/lists/*
    tar -C "$tmp/rootfs" --numeric-owner -cf "$tmp/rootfs.tar" .
    rm -rf "$tmp/rootfs"
    ctr=$("${BUILDAH[@]}" from scratch)
    "${BUILDAH[@]}" add "$ctr" "$tmp/rootfs.tar" / >/dev/null
    "${BUILDAH[@]}" config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
      --env LANG=C.UTF-8 --cmd python3 --os linux --arch amd64 \
      --label "org.opencontainers.image.description=debootstrap $SUITE minbase + $BASE_PACKAGES from $mirror" \
      "$ctr"
    "${BUILDAH[@]}" commit --quiet --rm "$ctr" "$BASE" >/dev/null
    ctr=""
    rm -f "$tmp/rootfs.tar"
    step "base: $BASE built in $(( $(date +%s) - started )) s"
  fi
fi

# 2. The torch wheel for the base's Python (asked of the base when it is local).
pyver=3.11
if have_image "$BASE"; then
  ctr=$("${BUILDAH[@]}" from --quiet "$BASE")
  pyver=$("${BUILDAH[@]}" run --isolation chroot "$ctr" -- python3 -c \
    'import sys; print("%d.%d" % sys.version_info[:2])')
  "${BUILDAH[@]}" rm "$ctr" >/dev/null; ctr=""
fi
abi=cp${pyver/./}
hpct_pick_python
extra=""
pip_for_torch=("$PYTHON" -m pip)
if [ "$GPU" = 1 ]; then
  TORCH_VERSION=$(hpct_torch_newest)
  # The machine's pip configuration may cap torch (a constraint file): this download runs without it.
  pip_for_torch=(env PIP_CONFIG_FILE=/dev/null "$PYTHON" -m pip --isolated)
  # hpct's NCCL: this checkout's build, packaged now; else a prebuilt drop-in wheel put in .whl/
  # (a full build for sm_80 and sm_90 takes hours on 2 cores: make it once, on a larger machine).
  nccl_prefix=third_party/build/nccl-2.30.7/install
  if [ -f "$nccl_prefix/lib/libnccl.so.2" ]; then
    rm -f .whl/nvidia_nccl_cu13-*.whl
    step "nccl: hpct-build wheel nccl=2.30.7 into .whl/"
    "$PYTHON" -m hpct.builder wheel -q nccl=2.30.7 --dist .whl >"$WORK/nccl-wheel.log" 2>&1 \
      || die "packaging the NCCL 2.30.7 build failed (log: $WORK/nccl-wheel.log)" "see the log"
  fi
  prebuilt=$(ls .whl/nvidia_nccl_cu13-2.30.7+hpct.*.whl 2>/dev/null || true)
  [ "$(echo "$prebuilt" | grep -c .)" = 1 ] || die \
    "no NCCL 2.30.7 build in $nccl_prefix and not exactly one drop-in wheel .whl/nvidia_nccl_cu13-2.30.7+hpct.*.whl (found ${prebuilt:-none})" \
    "build it first: hpct-build build nccl=2.30.7 --cuda-arch 80,90 (docs/nccl-build.md; CUDA 13.0), or put one prebuilt wheel (hpct-build wheel nccl=2.30.7) in .whl/"
  nccl_wheel=$(basename "$prebuilt")
  step "nccl: $nccl_wheel"
  extra="nvidia-nccl-cu13==$(echo "$nccl_wheel" | cut -d- -f2)"
fi
step "torch==$TORCH_VERSION for Python $pyver: pip download into .whl/"
if ! "${pip_for_torch[@]}" download --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
    --abi "$abi" --platform manylinux_2_28_x86_64 -d .whl "torch==$TORCH_VERSION" >"$WORK/torch.log" 2>&1; then
  tail -n 5 "$WORK/torch.log" >&2
  die "pip finds no torch==$TORCH_VERSION wheel for Python $pyver ($abi, manylinux x86_64)" \
    "put that wheel in .whl/ or give pip an index that has it (PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu)"
fi
grep -E '^(Saved|File was already downloaded|Processing)' "$WORK/torch.log" || true

# 3. The build.  TORCH_INDEX empty: the staged wheel is the one; pip asks PyPI only for torch's
# dependencies.  The CA bundle pip trusts here (a TLS-inspecting proxy's, say) is lent to the
# build as the secret pip-ca: mounted for the one RUN step that asks for it, never in a layer.
build_args=(--build-arg "BASE=$BASE" --build-arg TORCH_INDEX=)
[ "$GPU" = 0 ] || build_args+=(--build-arg "TORCH_VERSION=$TORCH_VERSION" --build-arg "EXTRA_REQUIREMENTS=$extra")
ca=${HPCT_BUILD_CA:-${PIP_CERT:-$(hpct_pip_cert)}}
if [ -n "$ca" ]; then
  [ -f "$ca" ] || die "the CA bundle $ca (HPCT_BUILD_CA, PIP_CERT or pip's global.cert) does not exist" \
    "point HPCT_BUILD_CA at an existing PEM bundle, or unset it"
  build_args+=(--secret "id=pip-ca,src=$(readlink -f "$ca")")
fi
step "build: buildah bud -t $IMAGE --build-arg BASE=$BASE${ca:+ (pip CA: $ca)} (log: $LOG)"
started=$(date +%s)
if ! "${BUILDAH[@]}" bud --isolation chroot "${build_args[@]}" -t "$IMAGE" -f Dockerfile . >"$LOG" 2>&1; then
  tail -n 30 "$LOG" >&2
  die "the image build failed (full log: $LOG)" "see the log; the last lines are above"
fi
build_s=$(( $(date +%s) - started ))
grep -E '^(STEP|doctor: )' "$LOG" || true
size=$("${BUILDAH[@]}" images --format '{{.Size}}' "$IMAGE" | head -n1)
step "build: $IMAGE built in $build_s s; size $size"

# 4. Run doctor (the node's rows included: here, this machine) and the demo in a container.
ctr=$("${BUILDAH[@]}" from --quiet "$IMAGE")
in_image() { "${BUILDAH[@]}" run --isolation chroot "$ctr" -- "$@"; }
user=$(in_image id -un)
[ "$user" != root ] || die "the image runs as root" "keep 'USER hpct' in the runtime stage of the Dockerfile"
step "run: hpct doctor (as $user)"
in_image hpct doctor
if [ "${HPCT_IMAGE_SKIP_DEMO:-0}" != 1 ]; then
  step "run: hpct demo"
  started=$(date +%s)
  in_image timeout --kill-after=30 "$DEMO_TIMEOUT" hpct demo
  step "run: demo done in $(( $(date +%s) - started )) s"
fi
"${BUILDAH[@]}" rm "$ctr" >/dev/null; ctr=""

# 5. Export for `docker load -i`.
if [ -z "$ARCHIVE" ]; then
  echo "ci/image.sh: image $IMAGE: build ${build_s} s, size $size (not exported: set HPCT_IMAGE_ARCHIVE)"
  exit 0
fi
ref=${IMAGE#localhost/}
step "export: buildah push $IMAGE docker-archive:$ARCHIVE:$ref"
rm -f "$tmp/image.tar"
"${BUILDAH[@]}" push --quiet "$IMAGE" "docker-archive:$tmp/image.tar:$ref"
mv -f "$tmp/image.tar" "$ARCHIVE"
if command -v skopeo >/dev/null; then
  skopeo inspect --format 'export: skopeo reads the archive: {{.Digest}}, {{len .Layers}} layer(s), {{.Os}}/{{.Architecture}}' \
    "docker-archive:$ARCHIVE"
fi
step "export: $ARCHIVE ($(du -h "$ARCHIVE" | cut -f1)); load it with: docker load -i $ARCHIVE"
echo "ci/image.sh: image $IMAGE: build ${build_s} s, size $size, archive $ARCHIVE"
