"""delayed.py: the amax history's shape checks."""

from __future__ import annotations

import pytest
import torch

from minifloat import delayed
from minifloat.recipes import DelayedScaling


@pytest.mark.parametrize("shape", [(3,), (4, 4), (3, 0)])
def test_history_scale_and_record_refuse_a_history_not_3_by_len(shape):
    # a 1-D history's `history[row]` is one entry, taken silently as the row's past amaxes
    history = torch.ones(shape)
    with pytest.raises(ValueError, match=r"history must be \[3, history_len >= 1\]"):
        delayed.history_scale(history, 0, torch.tensor(3.0), "e4m3", DelayedScaling())
    with pytest.raises(ValueError, match=r"history must be \[3, history_len >= 1\]"):
        delayed.record(history, torch.ones(3))


def test_history_scale_and_record_refuse_wrong_amaxes():
    history = torch.zeros(3, 4)
    with pytest.raises(ValueError, match="amax_now must be one amax"):
        delayed.history_scale(history, 0, torch.ones(2), "e4m3", DelayedScaling())
    with pytest.raises(ValueError, match=r"amaxes must be \[3\]"):
        delayed.record(history, torch.ones(2))


def test_history_scale_of_a_valid_history():
    history = torch.zeros(3, 4)
    delayed.record(history, torch.tensor([448.0, 2.0, 3.0]))
    scale = delayed.history_scale(
        history, delayed.INPUT, torch.tensor(1.0), "e4m3", DelayedScaling()
    )
    assert scale.shape == (1, 1) and scale.item() == 1.0
