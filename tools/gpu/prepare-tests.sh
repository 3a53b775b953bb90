#!/usr/bin/env bash
# Builds .gpu/w4: the wheels the serve, generation and shutdown tests need on the GPU machine
# beyond what the GPU runtime's own preparation (outside this repository) puts in .gpu/w1 and
# .gpu/w2, and install.sh.
# Versions are those of the project's .venv (run `make setup` first), for CPython 3.12 on x86-64.
# Run it after prepare.sh (which rebuilds all of .gpu/), and again when a test dependency changes.
#
# On the GPU machine (docs/serve.md, "Serve tests on a GPU"): w2 (55 MB), w4 and the tree pass the
# 64 MiB one call carries, so w4 rides with w1 and waits in /root:
#   call one, carrying .gpu/w1 and .gpu/w4:
#     cp .gpu/w1/* /root/ && rm -rf /root/w4 && cp -r .gpu/w4 /root/w4
#   call two, carrying .gpu/w2:
#     bash .gpu/w2/install.sh && bash /root/w4/install.sh && export PYTHONPATH=/tmp/site:$PWD && make test-gpu PART=A
#   call three: export PYTHONPATH=/tmp/site:$PWD && make test-gpu PART=B
# install.sh puts the wheels into /tmp/site beside w2's, so one PYTHONPATH serves both.
#
# Two sets of wheels:
#   whl/    always installed: the test tools (pytest at .venv's version, not the image's) and what
#           the anthropic SDK needs that neither the image nor w2 has
#   maybe/  libraries the image has at a version we cannot see from here (anyio, idna, h11, jinja2,
#           ...): installed only where the image's copy is missing or older than .venv's, so that
#           torch and transformers keep theirs wherever it is new enough
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
pip=.venv/bin/pip
[ -x "$pip" ] || { echo "no .venv here: run 'make setup' first" >&2; exit 2; }
mkdir -p .git/info
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude

# pytest 9 needs pluggy, iniconfig, packaging, pygments; hypothesis needs sortedcontainers (and no
# longer attrs); anthropic needs httpx2 (with httpcore2, truststore), docstring-parser and
# opentelemetry-api, besides pydantic, jiter, sniffio, distro and typing-extensions, which are in w2.
always="pytest pluggy iniconfig pytest-timeout hypothesis sortedcontainers anthropic docstring-parser
httpx2 httpcore2 truststore opentelemetry-api"
# In the image (KINDS.md's package list), version unknown: anyio>=4.10, idna>=3.18 and h11>=0.16
# are what httpx2 and httpcore2 ask for; the rest are pytest's and mlx-lm's.
maybe="anyio idna h11 packaging pygments jinja2 markupsafe"

freeze=$("$pip" freeze 2>/dev/null | tr 'A-Z_' 'a-z-')
pin() {
  local v
  v=$(printf '%s\n' "$freeze" | sed -n "s/^${1}==//p" | head -1)
  [ -n "$v" ] || { echo "$1 is not in .venv: run 'make setup'" >&2; exit 2; }
  echo "$1==$v"
}
download() {  # the same flags as prepare.sh: CPython 3.12, manylinux x86-64
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$@"
}
always_pins=() maybe_pins=()
for name in $always; do always_pins+=("$(pin "$name")"); done
for name in $maybe; do maybe_pins+=("$(pin "$name")"); done

rm -rf .gpu/w4 && mkdir -p .gpu/w4/whl .gpu/w4/maybe
download .gpu/w4/whl "${always_pins[@]}"
download .gpu/w4/maybe "${maybe_pins[@]}"

cat > .gpu/w4/install.sh <<'SH'
#!/usr/bin/env bash
# Installs the test wheels into /tmp/site (after .gpu/w2/install.sh): whl/ always, each of maybe/
# only where the image's python3 lacks that package or has an older version.
set -e
here=$(dirname "$0")
need=$(PYTHONPATH=/tmp/site python3 - "$here"/maybe/*.whl <<'PY'
import importlib.metadata as md
import os
import re
import sys

def key(v):
    return tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0]))

for path in sys.argv[1:]:
    name, version = os.path.basename(path).split("-")[:2]
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        have = None
    take = have is None or key(have) < key(version)
    what = "installing .venv's" if take else "keeping the one found"
    print(f"  {name}: found {have}, .venv has {version}: {what}", file=sys.stderr)
    if take:
        print(path)
PY
)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  "$here"/whl/*.whl $need
PYTHONPATH=/tmp/site python3 -c "import pytest, pytest_timeout, anthropic, openai, mlx_lm; print('pytest', pytest.__version__, 'anthropic', anthropic.__version__)"
SH
chmod +x .gpu/w4/install.sh
ls .gpu/w4/whl .gpu/w4/maybe
du -sh .gpu/w4
