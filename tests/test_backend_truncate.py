"""Backend.truncate (route repair): forgetting positions and computing them again gives the same
logits, on llama.cpp and torch; truncating past what a session holds is refused."""

from __future__ import annotations

import numpy as np
import pytest

from workers.errors import BadInput

PROMPT = np.array([1, 504, 3575, 282, 4649, 314, 7042, 28, 284, 260, 3575, 282], dtype=np.int32)


def llama(path):
    from workers.llama_cpp_full import LlamaCppFullBackend

    return LlamaCppFullBackend(path, n_ctx=256, max_sessions=2, n_threads=1, benchmark=False)


def torch_backend(path):
    pytest.importorskip("torch")
    from workers.torch_backend import TorchBackend

    return TorchBackend(path, 0, 30, selfbench=False)


@pytest.mark.parametrize("make", [llama, torch_backend], ids=["llama-cpp", "torch"])
def test_truncate_then_recompute_gives_the_same_logits(make, smollm2_path):
    b = make(smollm2_path)
    try:
        b.open_session("s", 64)
        b.prefill("s", 0, PROMPT[:8])
        first = [b.decode_step("s", 8 + i, PROMPT[8 + i : 9 + i]) for i in range(4)]
        b.truncate("s", 9)
        assert b.session_position("s") == 9
        again = [b.decode_step("s", 9 + i, PROMPT[9 + i : 10 + i]) for i in range(3)]
        for a, c in zip(first[1:], again):
            np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-4)
        with pytest.raises(BadInput):
            b.truncate("s", 13)  # it holds 12 positions
    finally:
        b.close()
