"""TR-DPO's reference update (`algorithm.sync_ref_model`) against TRL 1.16's own `SyncRefModelCallback`."""

from __future__ import annotations

import copy

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is the oracle of these tests: install polo's dev extras (trl==1.16.0)")

from conftest import tiny_llama  # noqa: E402
from polo import core  # noqa: E402


@pytest.mark.parametrize("alpha", [0.6, 0.25, 1.0])
def test_the_reference_mix_is_trls_sync_target_model(alpha):
    from trl.trainer.callbacks import SyncRefModelCallback

    policy, reference = tiny_llama(seed=1), tiny_llama(seed=2)
    theirs = copy.deepcopy(reference)
    SyncRefModelCallback._sync_target_model(policy, theirs, alpha)  # TRL's, without its DeepSpeed gather
    core.mix_into_reference(reference.parameters(), policy.parameters(), alpha)
    for (name, ours), (_, expected) in zip(reference.named_parameters(), theirs.named_parameters(), strict=True):
        assert torch.equal(ours, expected), name
    assert not torch.equal(next(reference.parameters()), next(tiny_llama(seed=2).parameters()))
