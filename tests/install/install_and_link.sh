#!/usr/bin/env bash
# Embedding, as a user does it: `meson install` into a temporary prefix (DESTDIR), then two
# programs built with `g++ -std=c++20 app.cpp $(pkg-config --cflags --libs loom)` alone and
# run: the README's embedding example, cut from README.md so the README cannot drift from
# what compiles, and embed_train.cpp (data, layers, engine, and two Gloo ranks under the
# installed loomrun). pkg-config is pointed at the staged prefix with --define-variable, the
# way a relocated install is used.
#   install_and_link.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$(realpath "$1")
src=$(realpath "$2")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

meson install -C "$build" --destdir "$work/root" --no-rebuild --quiet
prefix=$(meson introspect "$build" --buildoptions |
         python3 -c 'import json, sys; print(next(o["value"] for o in json.load(sys.stdin) if o["name"] == "prefix"))')
staged="$work/root$prefix"
pc=$(find "$staged" -name loom.pc -print -quit)
[ -n "$pc" ] || { echo "install_and_link: no loom.pc under $staged" >&2; exit 1; }
echo "loom.pc:"; sed 's/^/  /' "$pc"
flags() { PKG_CONFIG_PATH="$(dirname "$pc")" pkg-config --define-variable=prefix="$staged" "$@" loom; }
libs=$(flags --libs)
for word in $libs; do
  n=$(printf '%s\n' $libs | grep -cxF -- "$word")
  [ "$n" -eq 1 ] || { echo "install_and_link: loom.pc's Libs repeats $word ($n times)" >&2; exit 1; }
done
[ -f "$staged/include/loom/engine/ops.h" ] || { echo "install_and_link: no include/loom/engine/ops.h" >&2; exit 1; }

# The README's example: the C++ block after "A C++ program embeds Loom".
python3 - "$src/README.md" "$work/readme_example.cpp" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
at = text.index("A C++ program embeds Loom")
block = re.search(r"```cpp\n(.*?)```", text[at:], re.S)
open(sys.argv[2], "w").write(block.group(1))
PY
cd "$work"
for app in readme_example.cpp "$src/tests/install/embed_train.cpp"; do
  out=$(basename "$app" .cpp)
  echo "g++ -std=c++20 $out.cpp \$(pkg-config --cflags --libs loom)"
  g++ -std=c++20 "$app" $(flags --cflags --libs) -o "$out"
done
./readme_example
"$staged/bin/loomrun" --nproc-per-node 2 ./embed_train | tee embed_train.log
[ "$(grep -c 'embed_train: ok' embed_train.log)" -eq 2 ] || { echo "install_and_link: both ranks must print ok" >&2; exit 1; }
echo "install_and_link: ok"
