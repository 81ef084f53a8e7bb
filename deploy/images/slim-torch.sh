#!/bin/sh
# Removes from an installed torch what no fedmeta service runs (an image build step):
#
#   slim-torch.sh SITE_PACKAGES STRIP_LIBRARIES TORCH_VARIANT
#
# Always: the C++ headers and test data (145 MB: extension builds and torch's own tests only), the
# C++ test programs and protoc (about 50 MB). STRIP_LIBRARIES (the Dockerfile's build argument):
#   auto  strip the static symbol tables of torch's libraries (strip --strip-unneeded, as Debian
#         strips its packages; the dynamic symbols stay, so loading and linking are unchanged;
#         89 MB for the cpu variant), with the base's strip or binutils installed by apt here (the
#         build stage, never an image); where neither works, go on unstripped with a WARNING line.
#         Only the cpu variant: stripping was measured and tested for it alone.
#   1     the same for any variant, and stop where strip cannot be had
#   0     no stripping
set -eu
site=$1 mode=$2 variant=$3
rm -rf "$site/torch/include" "$site/torch/test"
rm -f "$site"/torch/bin/test_* "$site"/torch/bin/*Test "$site"/torch/bin/protoc*
case "$mode" in
  0) echo "STRIP_LIBRARIES=0: torch's libraries keep their symbol tables"; exit 0 ;;
  auto)
    if [ "$variant" != cpu ]; then
      echo "STRIP_LIBRARIES=auto: the $variant variant keeps its symbol tables (stripping is tested for cpu only; 1 strips it)"
      exit 0
    fi ;;
  1) ;;
  *) echo "fedmeta image: STRIP_LIBRARIES must be auto, 1 or 0, got '$mode' (FEDMETA_STRIP_LIBRARIES)" >&2; exit 1 ;;
esac
if ! command -v strip >/dev/null; then
  (apt-get update -qq && apt-get install -y -qq --no-install-recommends binutils >/dev/null) || true
fi
if command -v strip >/dev/null; then
  strip --strip-unneeded "$site"/torch/lib/*.so*
  echo "STRIP_LIBRARIES=$mode: torch's libraries stripped"
elif [ "$mode" = 1 ]; then
  echo "fedmeta image: STRIP_LIBRARIES=1 needs strip (binutils), which apt could not install: use a base image with binutils, reach a Debian mirror, or build with FEDMETA_STRIP_LIBRARIES=auto" >&2
  exit 1
else
  echo "WARNING: STRIP_LIBRARIES=auto: no strip (binutils) and apt could not install it: torch's libraries keep their symbol tables, 89 MB more (the images are then over 1 GB)"
fi
