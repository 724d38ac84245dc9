#!/usr/bin/env bash
# Install rd2h from this checkout (editable) into the active Python, with the extras named
# as arguments (default: nixl, what `rd2h demo` needs):
#   bash tools/install.sh              # rd2h[nixl]
#   bash tools/install.sh test         # rd2h[test] (tools/run-tests.sh does this)
#   bash tools/install.sh proxy nixl   # rd2h[proxy,nixl]
#
# Why not only `pip install -e '.[nixl]'`: nixl's wheels require torch, and the torch pip
# picks by default on Linux is the CUDA build with its CUDA libraries (about 5.9 GB in a
# venv), useless on a host without an NVIDIA GPU. So on Linux without one, and only where
# torch is not installed yet, this installs torch's CPU build first (the version vLLM 0.32
# pins, so tools/install-vllm.sh keeps it); nixl's requirement is then met. With an NVIDIA
# GPU, or torch already installed, pip resolves torch as it always does.
#
# Settings (environment): PYTHON (default: python, else python3); RD2H_TORCH=auto (default),
# cpu (CPU build even with a GPU) or default (leave torch to pip); RD2H_TORCH_VERSION
# (2.13.0); RD2H_TORCH_INDEX_URL: an extra index holding torch's +cpu builds (PyTorch's
# CPU wheel index), for hosts whose pip does not already find them (pip's find-links or
# index settings). Without one, this warns and lets pip pick its default torch.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-$(command -v python || command -v python3 || echo python3)}"
TORCH_MODE="${RD2H_TORCH:-auto}"
TORCH_VERSION="${RD2H_TORCH_VERSION:-2.13.0}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

# pip with -q still warns about every local index folder lacking a package; keep the rest.
pip_quiet() {
    "$PY" -m pip "$@" 2> >(grep -vE "is ignored: it is neither a file nor a directory" >&2)
}

die() {
    echo "install: FAILED: $*" >&2
    exit 1
}

"$PY" -m pip --version >/dev/null 2>&1 \
    || die "no pip for $PY (create a virtual environment: python3 -m venv .venv && . .venv/bin/activate)"

extras=$(IFS=,; echo "${*:-nixl}")
target="."
[ -n "$extras" ] && target=".[${extras}]"

has_nvidia_gpu() {
    compgen -G '/dev/nvidia[0-9]*' >/dev/null || compgen -G '/proc/driver/nvidia/gpus/*' >/dev/null
}

want_cpu_torch() {
    case "$TORCH_MODE" in
        cpu) return 0 ;;
        default) return 1 ;;
        auto) [ "$(uname -s)" = Linux ] && ! has_nvidia_gpu ;;
        *) die "RD2H_TORCH=$TORCH_MODE: use auto, cpu or default" ;;
    esac
}

start=$(date +%s)
if want_cpu_torch && ! "$PY" -m pip show -q torch >/dev/null 2>&1; then
    torch_args=("torch==${TORCH_VERSION}+cpu")
    [ -n "${RD2H_TORCH_INDEX_URL:-}" ] && torch_args+=(--extra-index-url "$RD2H_TORCH_INDEX_URL")
    reason="no NVIDIA GPU here"
    [ "$TORCH_MODE" = cpu ] && reason="RD2H_TORCH=cpu"
    echo "install: ${reason}: installing torch's CPU build (${TORCH_VERSION}+cpu) first"
    if ! pip_quiet install -q "${torch_args[@]}"; then
        echo "install: WARNING: no CPU build torch==${TORCH_VERSION}+cpu found; set" \
            "RD2H_TORCH_INDEX_URL to PyTorch's CPU wheel index to get one. Going on with" \
            "pip's default torch (a CUDA build of several GB)." >&2
    fi
fi

echo "install: pip install -e '${target}'"
pip_quiet install -q -e "$target" || die "pip install -e '${target}' (see pip's message above)"
torch_version=$("$PY" -c 'from importlib.metadata import version; print(version("torch"))' \
    2>/dev/null || echo none)
echo "install: rd2h${extras:+[$extras]} installed in $(($(date +%s) - start)) s (torch ${torch_version})"
