"""The benchmarks' fake batch carries every field of the batch contract with its dtype: after the corrections
added `env_ids` and `staleness`, the benchmarks' hand-written batch lacked them and every GPU row failed with a
KeyError inside the step."""

from __future__ import annotations

import numpy as np

from primejax.contracts.batch import FIELDS
from tools.bench_trainer import _fake_batch


def test_fake_batch_has_every_contract_field():
    batch = _fake_batch(2, 16, 64, "rl")
    assert list(batch) == list(FIELDS)
    for name, dtype in FIELDS.items():
        assert np.dtype(batch[name].dtype) == dtype and batch[name].shape == (2, 16), name
