#!/usr/bin/env bash
# Install what the test suite needs (idempotent), then run it. .ci/run calls exactly this.
# Extra arguments go to pytest, e.g. `bash tools/run-tests.sh tests/protocol -x`.
set -euo pipefail
cd "$(dirname "$0")/.."

# Mooncake's transfer engine links against the RDMA user-space libraries even for TCP.
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1' || ! ldconfig -p | grep -q 'librdmacm.so.1'; then
    if [ "$(id -u)" = 0 ]; then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 librdmacm1) >/dev/null
    else
        echo "warning: libibverbs1/librdmacm1 missing; mooncake tests need them (apt-get install libibverbs1 librdmacm1)" >&2
    fi
fi

# vLLM 0.32 on a CPU torch first (idempotent: a quick import check when installed), so
# that nixl's unpinned torch requirement below is already met by the CPU build.
bash tools/install-vllm.sh
python -m pip install -q --disable-pip-version-check -e '.[test]'

# UCX probes InfiniBand at import and segfaults at exit on hosts without it.
export UCX_MODULES="${UCX_MODULES:-^ib}"

python -m ruff check .
python -m ruff format --check .
python -m mypy rd2h_protocol rd2h_runtime rd2h_vllm
python -m rd2h_protocol.spec --check
exec python -m pytest "$@"
