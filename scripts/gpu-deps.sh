#!/usr/bin/env bash
# Gathers, on a Debian machine with paratrain's set-up done (scripts/setup.sh), what a GPU machine
# with only a CUDA PyTorch lacks: gloo's headers, GoogleTest's sources, zlib's headers, the image
# libraries (TurboJPEG, libpng, libwebp) and the Fashion-MNIST files. They go to ${1:-.gpu-deps} (ignored by git) for scripts/gpu-check.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.gpu-deps}"
rm -rf "$out"
mkdir -p "$out/include" "$out/fashion-mnist"
cp -r /usr/include/gloo "$out/include/"
cp /usr/include/zlib.h /usr/include/zconf.h "$out/include/"
cp -r /usr/include/nlohmann "$out/include/"  # header only: checkpoint manifests, metrics
cp -r /usr/include/CLI "$out/include/"        # header only: the CLI's command lines
# The image libraries (headers and shared objects; they need only libc, libm and zlib).
# (-L: Debian's png.h, pngconf.h and pnglibconf.h are links into libpng16/)
cp -rL /usr/include/turbojpeg.h /usr/include/png.h /usr/include/pngconf.h \
  /usr/include/pnglibconf.h /usr/include/webp "$out/include/"
mkdir -p "$out/lib"
cp /usr/include/sqlite3.h "$out/include/"  # paratrain tune's SQLite studies
for lib in libturbojpeg.so libpng16.so libwebp.so libsharpyuv.so libsqlite3.so; do
  for f in /usr/lib/x86_64-linux-gnu/$lib*; do
    [ -e "$f" ] && cp -a "$f" "$out/lib/"
  done
done
ln -sf libpng16.so "$out/lib/libpng.so"
cp -r /usr/src/googletest "$out/googletest"
cp /usr/share/datasets/fashion-mnist/*.gz "$out/fashion-mnist/"
du -sh "$out"
