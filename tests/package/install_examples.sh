#!/usr/bin/env bash
# Installs this build into a fresh prefix and builds the out-of-tree examples against it, as a
# user of the installed package does: checks what was installed, that the installed `tandem`
# loads its libraries from the prefix, and that nothing installed points into the build tree.
# examples/resnet_engine is configured with the Tandem prefix alone (LibTorch found through the
# Torch_DIR that TandemConfig.cmake recorded), examples/custom_loop_ddp with LibTorch's prefix
# named as well (torch.utils.cmake_prefix_path).
#
# install_examples.sh BUILD_DIR WORK_DIR SOURCE_DIR TORCH_PREFIX CMAKE GENERATOR CXX [CCACHE]
set -euo pipefail
build=$1 work=$2 source=$3 torch_prefix=$4 cmake=$5 generator=$6 cxx=$7 ccache=${8:-}
prefix=$work/prefix

fail() { echo "FAIL: $*" >&2; exit 1; }

rm -rf "$work"
mkdir -p "$work"
"$cmake" --install "$build" --prefix "$prefix" > "$work/install.log"

for f in bin/tandem include/tandem/engine.h include/tandem/backends.h include/tandem/progress.h \
         lib/cmake/Tandem/TandemConfig.cmake lib/cmake/Tandem/TandemConfigVersion.cmake \
         lib/cmake/Tandem/TandemTargets.cmake; do
  [[ -e $prefix/$f ]] || fail "$f was not installed (see $work/install.log)"
done
for lib in libtandem libtandem_apps; do
  compgen -G "$prefix/lib/$lib.so*" > /dev/null || fail "lib/$lib.so was not installed"
done
# The installed program and libraries resolve Tandem from the prefix, never from the build.
ldd "$prefix/bin/tandem" > "$work/ldd.txt"
! grep -q "not found" "$work/ldd.txt" || { cat "$work/ldd.txt"; fail "bin/tandem has unresolved libraries"; }
for lib in libtandem libtandem_apps; do
  path=$(awk -v l="$lib.so" 'index($1, l) == 1 && $2 == "=>" { print $3 }' "$work/ldd.txt")
  [[ -n $path && $(realpath "$path") == "$(realpath "$prefix")"/lib/* ]] ||
    { cat "$work/ldd.txt"; fail "bin/tandem loads $lib from '$path', not from $prefix/lib"; }
done
"$prefix/bin/tandem" --help > /dev/null || fail "the installed tandem does not run"
if grep -l -e "$build" -e "$source/include" -e "$source/src" "$prefix"/lib/cmake/Tandem/*.cmake; then
  fail "the installed CMake files above name the build or source tree"
fi

launcher=()
[[ -n $ccache ]] && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER="$ccache")
configure() {  # NAME PREFIX_PATH
  "$cmake" -S "$source/examples/$1" -B "$work/$1" -G "$generator" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_PREFIX_PATH="$2" "${launcher[@]}" > "$work/$1-configure.log" 2>&1 ||
    { cat "$work/$1-configure.log"; fail "configuring examples/$1 against the installed package"; }
}
configure resnet_engine "$prefix"
configure custom_loop_ddp "$prefix;$torch_prefix"
configure plugin "$prefix"
for ex in resnet_engine custom_loop_ddp plugin; do
  start=$(date +%s)
  "$cmake" --build "$work/$ex" > "$work/$ex-build.log" 2>&1 || { cat "$work/$ex-build.log"; fail "building examples/$ex"; }
  if grep -q "warning:" "$work/$ex-build.log"; then cat "$work/$ex-build.log"; fail "examples/$ex builds with warnings"; fi
  echo "examples/$ex built in $(( $(date +%s) - start )) s"
done
echo "installed into $prefix and built the three examples"
