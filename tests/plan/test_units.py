"""Human counts and sizes (plan/units.py): the unit follows the number."""
import pytest

from megalite.plan.units import human_bytes, human_count


@pytest.mark.parametrize("n,count,size", [(0, "0", "0 B"), (512, "512", "512 B"), (4100, "4.10K", "4.10 kB"),
                                          (999_600, "1.00M", "1.00 MB"), (469_000, "469K", "469 kB"),
                                          (1.21e9, "1.21B", "1.21 GB"), (70.6e9, "70.6B", "70.6 GB"),
                                          (1.008e12, "1.01T", "1.01 TB")])
def test_counts_and_sizes(n, count, size):
    assert human_count(n) == count and human_bytes(n) == size


def test_a_small_expert_layout_is_not_zero_billion():
    from megalite.config import RunConfig
    from megalite.plan import justify

    cfg = RunConfig.build(model="moe-tiny", ep=2, dp=2).resolved(2, 257)
    line = justify(cfg.gpt_config(), cfg)
    assert "0.00B" not in line and "K parameters per rank" in line and " 0.0 GB" not in line
