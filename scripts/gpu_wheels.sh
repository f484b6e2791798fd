#!/usr/bin/env bash
# Fills .whl/ with the cp312 x86_64 wheels the GPU check (scripts/gpu_check.sh) installs on a bare GPU machine:
# what raytrain's step path imports there and the machine lacks (docs/BENCHMARKS.md, "GPU check (issue 44)").
# Run here, once, before a device call that carries `.whl`; it needs this machine's registry access (pip), the
# repo's .venv (its versions are the ones the wheels pin) and, optionally, a Python 3.12 to import them with.
#
# The GPU machine's image has Python 3.12, torch 2.11 (CUDA), transformers, numpy, pyyaml, pyarrow, psutil, tqdm,
# packaging, einops, msgpack, py-cpuinfo, ninja (.library/device/KINDS.md); it lacks DeepSpeed (no wheel on the
# registry: built here with its ops left to JIT, DS_BUILD_OPS=0), hjson, pydantic and pydantic's own needs. Ray is
# not carried: its cp312 wheel (79 MB) is over the 64 MiB a device call carries, so the check runs without Ray.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
DEST="$ROOT/.whl"
LIMIT_MIB=64  # the most a device call carries: the working tree and the carried wheels together
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# pip's warnings about this machine's own local mirrors (file:// indexes that lack a project) are noise here.
quiet_pip() { "$PY" -m pip "$@" 2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2); }
TARGET=(--python-version 3.12 --implementation cp --abi cp312 "${PLATFORMS[@]}" --only-binary=:all:)

exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")" "$DEST"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"

version() {  # the version installed in .venv (the one the tests run with), else the fallback given
  "$PY" -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: print(sys.argv[2])" "$1" "$2"
}
# DeepSpeed: raytrain's pin (pyproject.toml), not the venv's.
DS_VERSION="$(sed -n 's/^ *"deepspeed==\([^"]*\)".*/\1/p' pyproject.toml)"
[ -n "$DS_VERSION" ] || { echo "gpu_wheels: no deepspeed==X pin in pyproject.toml" >&2; exit 1; }
# typing-extensions too: pydantic wants a newer one than the image may have.
BINARY=("pydantic==$(version pydantic 2.14.4)" "pydantic-core==$(version pydantic_core 2.50.5)"
        "annotated-types==$(version annotated-types 0.8.0)" "typing-inspection==$(version typing-inspection 0.4.5)"
        "typing-extensions==$(version typing_extensions 4.16.0)" "hjson==$(version hjson 3.1.0)")
WANT=("${BINARY[@]}" "deepspeed==$DS_VERSION")

# One version of each project in .whl: a stale one (an older pin) would stop the device's install.
"$PY" - "$DEST" "${WANT[@]}" <<'EOF'
import os, re, sys
dest, want = sys.argv[1], dict(w.split("==") for w in sys.argv[2:])
norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()
want = {norm(k): v for k, v in want.items()}
for f in sorted(os.listdir(dest)):
    if f.endswith(".whl"):
        name, ver = f.split("-")[:2]
        if want.get(norm(name)) != ver:
            os.remove(os.path.join(dest, f))
            print(f"gpu_wheels: removed {f} (not in the set: {' '.join(f'{k}=={v}' for k, v in want.items())})")
EOF

echo "gpu_wheels: downloading ${BINARY[*]}"
quiet_pip download -q --no-deps "${TARGET[@]}" -d "$DEST" "${BINARY[@]}"

if ! ls "$DEST"/deepspeed-"$DS_VERSION"-*.whl >/dev/null 2>&1; then
  echo "gpu_wheels: building deepspeed==$DS_VERSION (DS_BUILD_OPS=0: ops compile at first use, as in the venv)"
  DS_BUILD_OPS=0 quiet_pip wheel -q --no-deps --no-build-isolation -w "$DEST" "deepspeed==$DS_VERSION"
fi
ds_whl="$(ls "$DEST"/deepspeed-"$DS_VERSION"-*.whl)"
case "$(basename "$ds_whl")" in
  *-py3-none-any.whl) ;;
  *) echo "gpu_wheels: $ds_whl is not a pure-Python wheel (ops were built?): it may not load on the GPU machine" >&2
     exit 1 ;;
esac

# Sizes: the wheels, and what a device call carries with them (tracked + untracked-not-ignored files).
echo "gpu_wheels: wheels in .whl/"
ls -l "$DEST"/*.whl | awk '{printf "  %10d  %s\n", $5, $NF}' | sed "s#$DEST/##"
wheel_bytes="$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)"
tree_bytes="$( (git ls-files -z; git ls-files -z -o --exclude-standard) | xargs -0 -r du -cb 2>/dev/null \
  | awk '$2 == "total" {s += $1} END {print s + 0}')"
total=$((wheel_bytes + tree_bytes))
printf 'gpu_wheels: wheels %.1f MiB + tree %.1f MiB = %.1f MiB of the %d MiB a device call carries\n' \
  "$(echo "$wheel_bytes / 1048576" | bc -l)" "$(echo "$tree_bytes / 1048576" | bc -l)" \
  "$(echo "$total / 1048576" | bc -l)" "$LIMIT_MIB"
if [ "$total" -gt $((LIMIT_MIB * 1048576 * 9 / 10)) ]; then
  echo "gpu_wheels: over 90 % of the $LIMIT_MIB MiB limit" >&2
  exit 1
fi

# 1. pip, for cp312 on manylinux x86_64, from .whl alone: every pinned wheel resolves, into an empty target.
empty="$(mktemp -d)"
trap 'rm -rf "$empty"' EXIT
quiet_pip install --dry-run --no-index --no-deps --find-links "$DEST" "${TARGET[@]}" --target "$empty/site" \
  --report "$empty/report.json" -q "${WANT[@]}"
"$PY" - "$empty/report.json" "${#WANT[@]}" <<'EOF'
import json, sys
got = [i["metadata"]["name"] + "==" + i["metadata"]["version"] for i in json.load(open(sys.argv[1]))["install"]]
assert len(got) == int(sys.argv[2]), got
print("gpu_wheels: pip --dry-run (cp312, manylinux x86_64, --no-index): would install " + " ".join(sorted(got)))
EOF

# 2. Every requirement of every wheel (markers evaluated for CPython 3.12 on Linux x86_64) is met by a wheel in
# .whl or by a package the GPU machine's image already has (.library/device/KINDS.md, 2026-11-17).
"$PY" - "$DEST" <<'EOF'
import email.parser, os, re, sys, zipfile
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

IMAGE = """accelerate einops filelock fsspec huggingface-hub jinja2 msgpack networkx ninja numpy nvidia-ml-py packaging
psutil py-cpuinfo pyarrow pyyaml regex requests safetensors sympy tokenizers torch tqdm transformers typing-extensions
""".split()
env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "platform_system": "Linux",
       "platform_machine": "x86_64", "implementation_name": "cpython", "platform_python_implementation": "CPython",
       "os_name": "posix", "extra": ""}
dest = sys.argv[1]
wheels = {}
for f in sorted(os.listdir(dest)):
    if f.endswith(".whl"):
        with zipfile.ZipFile(os.path.join(dest, f)) as z:
            meta = email.parser.Parser().parsestr(
                z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode())
        wheels[canonicalize_name(meta["Name"])] = (Version(meta["Version"]), meta.get_all("Requires-Dist") or [])
unmet = []
for name, (_, reqs) in wheels.items():
    for text in reqs:
        r = Requirement(text)
        if r.marker is not None and not r.marker.evaluate(env):
            continue
        dep = canonicalize_name(r.name)
        if dep in wheels:
            if not r.specifier.contains(wheels[dep][0], prereleases=True):
                unmet.append(f"{name}: {text} (carried: {wheels[dep][0]})")
        elif dep not in IMAGE:
            unmet.append(f"{name}: {text} (neither carried nor in the image)")
if unmet:
    sys.exit("gpu_wheels: unmet requirements:\n  " + "\n  ".join(unmet))
print(f"gpu_wheels: every requirement of the {len(wheels)} wheels is carried or in the image")
EOF

# 3. Where this machine has a CPython 3.12: install the set into an empty target for real and import what can be
# imported without torch (pydantic's compiled core is the one binary; DeepSpeed needs torch, absent here for 3.12).
PY312="${PY312:-}"
if [ -z "$PY312" ]; then
  for c in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
    if "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then PY312="$c"; break; fi
  done
fi
if [ -n "$PY312" ]; then
  "$PY312" -m pip install -q --root-user-action=ignore --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$empty/site312" \
    "$DEST"/*.whl
  PYTHONPATH="$empty/site312" "$PY312" -c '
import hjson, pydantic, pydantic_core, typing_extensions
class M(pydantic.BaseModel):
    x: int
assert M(x="3").x == 3
print(f"gpu_wheels: installed into an empty target with {__import__("sys").version.split()[0]}: pydantic "
      f"{pydantic.VERSION} (core {pydantic_core.__version__}) validates; hjson imports")'
else
  echo "gpu_wheels: no Python 3.12 here: the wheels were checked by pip's dry run only"
fi
echo "gpu_wheels: ready; carry '.whl' in the device call and run ./scripts/gpu_check.sh"
