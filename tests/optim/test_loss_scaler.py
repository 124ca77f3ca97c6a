"""DynamicLossScaler: backoff on overflow, growth after a clean interval, hysteresis, bounds, state."""
import pytest
import torch

from megalite.optim.loss_scaler import DynamicLossScaler


def test_backoff_growth_and_bounds():
    s = DynamicLossScaler(initial_scale=1024.0, growth_interval=3, backoff_factor=0.5, growth_factor=2.0,
                          min_scale=256.0, max_scale=4096.0)
    assert float(s.scale_loss(torch.tensor(2.0))) == 2048.0
    s.update(found_inf=True)
    assert s.scale == 512.0
    for _ in range(2):
        s.update(found_inf=False)
    assert s.scale == 512.0, "growth needs growth_interval clean steps in a row"
    s.update(found_inf=True)  # resets the clean run
    assert s.scale == 256.0
    s.update(found_inf=True)
    assert s.scale == 256.0, "never below min_scale"
    for _ in range(3):
        s.update(found_inf=False)
    assert s.scale == 512.0
    for _ in range(9):
        s.update(found_inf=False)
    assert s.scale == 4096.0, "never above max_scale"


def test_hysteresis_tolerates_overflows_until_exhausted_and_resets_on_growth():
    s = DynamicLossScaler(initial_scale=64.0, growth_interval=2, hysteresis=2)
    s.update(True)
    assert s.scale == 64.0, "first overflow is tolerated"
    s.update(True)
    assert s.scale == 32.0
    s.update(True)
    assert s.scale == 16.0, "hysteresis stays exhausted until the scale grows"
    s.update(False)
    s.update(False)
    assert s.scale == 32.0
    s.update(True)
    assert s.scale == 32.0, "growth restored the hysteresis"


def test_state_round_trip_and_bad_arguments():
    a = DynamicLossScaler(initial_scale=8.0, growth_interval=5, hysteresis=3)
    a.update(True)
    a.update(False)
    b = DynamicLossScaler()
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    for kwargs, needle in (({"initial_scale": 0}, "initial-loss-scale"), ({"backoff_factor": 1.5}, "backoff"),
                           ({"growth_interval": 0}, "growth interval"), ({"hysteresis": 0}, "hysteresis")):
        with pytest.raises(ValueError, match=needle):
            DynamicLossScaler(**kwargs)
