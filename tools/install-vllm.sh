#!/usr/bin/env bash
# Install vLLM for CPU-only use by tests/vllm (idempotent; exits non-zero with a reason).
#
# Why not `pip install vllm`: vLLM's wheel pins a CUDA torch plus GPU kernels (flashinfer,
# tilelang, cutlass-dsl, ...) that add gigabytes and are never used on a CPU host, and the
# torchvision/torchaudio/torchcodec builds it pulls fail to import next to a CPU torch. So:
#   1. torch, pinned to vLLM's own pin (an unpinned torch pulls a multi-GB CUDA build);
#      the CPU build is preferred: a local +cpu wheel (pip's find-links), or the index
#      named by RD2H_TORCH_INDEX_URL;
#   2. vLLM's runtime requirements read from the wheel's own metadata, minus torch* and the
#      GPU-only packages listed in EXCLUDE below, with torch held at the installed version;
#   3. vLLM and xgrammar without dependencies;
#   4. a smoke import of what the tests use (config, scheduler, KV connector V1 API).
# Settings (environment): RD2H_VLLM_VERSION, RD2H_TORCH_VERSION, RD2H_XGRAMMAR_VERSION,
# RD2H_WHEEL_DIR (download cache), RD2H_TORCH_INDEX_URL (force an index for torch).
set -euo pipefail

VLLM_VERSION="${RD2H_VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${RD2H_TORCH_VERSION:-2.13.0}"
XGRAMMAR_VERSION="${RD2H_XGRAMMAR_VERSION:-0.2.8}"
WHEEL_DIR="${RD2H_WHEEL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/rd2h/wheels}"
PY="${PYTHON:-python}"
PIP=(pip_quiet install --disable-pip-version-check --root-user-action=ignore -q)

# pip with -q still warns about every missing local mirror folder; keep real errors only.
pip_quiet() {
    "$PY" -m pip "$@" 2> >(grep -vE "is ignored: it is neither a file nor a directory" >&2)
}

die() {
    echo "install-vllm: FAILED: $*" >&2
    exit 1
}

# Everything tests/vllm imports; success here means there is nothing to do.
smoke_test() {
    "$PY" - "$VLLM_VERSION" "$TORCH_VERSION" <<'EOF'
import sys
from importlib.metadata import version

want_vllm, want_torch = sys.argv[1], sys.argv[2]
if version("vllm") != want_vllm:
    sys.exit(f"vllm {version('vllm')} installed, want {want_vllm}")
if version("torch").split("+")[0] != want_torch:
    sys.exit(f"torch {version('torch')} installed, want {want_torch}")
import vllm.config  # noqa: F401
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: F401
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats  # noqa: F401
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401
EOF
}

if smoke_test >/dev/null 2>&1; then
    echo "install-vllm: vllm ${VLLM_VERSION} (torch ${TORCH_VERSION}) already installed and importable"
    exit 0
fi

start=$(date +%s)

# 1. torch. Prefer a CPU build: pip picks a local 2.13.0+cpu wheel over PyPI's 2.13.0 when
# one is on its find-links; RD2H_TORCH_INDEX_URL names another index (e.g. PyTorch's CPU
# wheels) on hosts without one. No host is probed: CI reaches the package registries only.
torch_args=("torch==${TORCH_VERSION}")
if [ -n "${RD2H_TORCH_INDEX_URL:-}" ]; then
    torch_args+=(--extra-index-url "$RD2H_TORCH_INDEX_URL")
fi
echo "install-vllm: installing ${torch_args[*]}"
"${PIP[@]}" "${torch_args[@]}" || die "could not install torch==${TORCH_VERSION}"
installed_torch=$("$PY" -c 'from importlib.metadata import version; print(version("torch"))')

# 2. vLLM's wheel (downloaded once, reused by step 3) and its runtime requirements.
mkdir -p "$WHEEL_DIR"
wheel=$(find "$WHEEL_DIR" -maxdepth 1 -name "vllm-${VLLM_VERSION}-*.whl" | head -n 1)
if [ -z "$wheel" ]; then
    echo "install-vllm: downloading the vllm ${VLLM_VERSION} wheel into $WHEEL_DIR"
    pip_quiet download --disable-pip-version-check -q --no-deps -d "$WHEEL_DIR" \
        "vllm==${VLLM_VERSION}" || die "could not download vllm==${VLLM_VERSION}"
    wheel=$(find "$WHEEL_DIR" -maxdepth 1 -name "vllm-${VLLM_VERSION}-*.whl" | head -n 1)
fi
[ -n "$wheel" ] || die "no vllm-${VLLM_VERSION} wheel in $WHEEL_DIR after download"

workdir=$(mktemp -d)
trap 'rm -rf "$workdir"' EXIT
"$PY" - "$wheel" >"$workdir/requirements.txt" <<'EOF' || die "could not read requirements from $wheel"
import re
import sys
import zipfile
from email.parser import Parser

from packaging.requirements import Requirement

# GPU-only kernels/codecs, torch and its companions (held separately), and xgrammar (its
# declared deps would re-resolve torch; installed with --no-deps in step 3). apache-tvm-ffi
# stays: xgrammar imports it (CPU code).
EXCLUDE = {
    "torch", "torchaudio", "torchvision", "torchcodec", "pynvvideocodec",
    "flashinfer-python", "tilelang", "nvidia-cudnn-frontend", "nvtx",
    "fastsafetensors", "instanttensor", "nvidia-cutlass-dsl", "quack-kernels",
    "tokenspeed-mla", "humming-kernels", "xgrammar",
}
with zipfile.ZipFile(sys.argv[1]) as wheel:
    name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    meta = Parser().parsestr(wheel.read(name).decode())
for line in meta.get_all("Requires-Dist") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # an optional extra, or another platform
    if re.sub(r"[-_.]+", "-", req.name).lower() in EXCLUDE:
        continue
    req.marker = None
    print(req)
EOF
echo "torch==${installed_torch}" >"$workdir/constraints.txt"
echo "install-vllm: installing $(wc -l <"$workdir/requirements.txt") runtime requirements of vllm"
"${PIP[@]}" -r "$workdir/requirements.txt" -c "$workdir/constraints.txt" \
    || die "could not install vLLM's runtime requirements (see pip's message above)"

# 3. vLLM itself and xgrammar, without their GPU dependency pins.
echo "install-vllm: installing vllm ${VLLM_VERSION} --no-deps (pip then lists the GPU-only" \
    "requirements it skipped as conflicts: expected)"
"${PIP[@]}" --no-deps "$wheel" "xgrammar==${XGRAMMAR_VERSION}" \
    || die "could not install vllm ${VLLM_VERSION} / xgrammar ${XGRAMMAR_VERSION}"

# torch companions left from an earlier full install do not import next to this torch and
# break transformers' optional imports: remove the ones that fail.
for pkg in torchvision torchaudio torchcodec; do
    if "$PY" -m pip show -q "$pkg" >/dev/null 2>&1 && ! "$PY" -c "import $pkg" >/dev/null 2>&1; then
        echo "install-vllm: removing $pkg (does not import next to torch ${installed_torch})"
        "$PY" -m pip uninstall -y -q "$pkg" || die "could not uninstall $pkg"
    fi
done

# 4. Prove it.
smoke_test || die "vllm ${VLLM_VERSION} is installed but does not import (see the error above)"
echo "install-vllm: vllm ${VLLM_VERSION} with torch ${installed_torch} ready in $(($(date +%s) - start)) s"
