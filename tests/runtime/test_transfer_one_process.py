"""Several engines of one backend in ONE process: a Prefill and a Decode engine (two TP
ranks each, so four backends) in this process move real bytes, checked at the destination.

Each backend that allows it is listed here; MemFabric binds one engine per process (its
docstring says why) and is refused with a clear error instead (test_transfer_memfabric.py).
"""

from __future__ import annotations

import pytest

from rd2h_runtime.testing.engines import DecodeEngine, DecodeSpec, PrefillEngine, PrefillSpec
from rd2h_runtime.testing.synthetic import RequestSpec, SyntheticModel
from tests.runtime.e2e_harness import assert_clean, wait_until

pytestmark = pytest.mark.timeout(60)

MODEL = SyntheticModel(num_layers=4)
WAIT_S = 20.0


@pytest.mark.parametrize("backend", ["loopback", "cma", "nixl", "mooncake"])
def test_prefill_and_decode_engines_share_one_process(backend: str) -> None:
    decode = DecodeEngine(DecodeSpec(MODEL, d_tp=2, backend=backend))
    try:
        prefill = PrefillEngine(PrefillSpec(MODEL, p_tp=2, backend=backend))
        try:
            requests = [RequestSpec(f"{backend}-{i}", 90 + 70 * i) for i in range(3)]
            ids = [r.ext_id for r in requests]
            decode.add(requests)
            prefill.add(requests, decode.target())
            assert prefill.run(WAIT_S) == []
            finished = prefill.wait(ids, WAIT_S)
            assert all(f is not None and f[0].ok for per in finished.values() for f in per)
            results = decode.wait(ids, WAIT_S)
            for ext, res in results.items():
                assert res.ok, f"{ext}: {res}"
                assert res.mismatches == (), f"{ext} landed wrong bytes: {res.mismatches}"
            assert decode.release(ids)
            prefill.release(ids)
            assert wait_until(lambda: all(prefill.state()["idle"]), WAIT_S)
            assert_clean(prefill.state())
            assert_clean(decode.state())
        finally:
            prefill.close()
    finally:
        decode.close()
