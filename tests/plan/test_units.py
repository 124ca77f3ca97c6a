"""Human counts and sizes (plan/units.py): the unit follows the number."""
import pytest

from megalite.plan.units import human_bytes, human_count


@pytest.mark.parametrize("n,count,size", [(0, "0", "0 B"), (512, "512", "512 B"), (4100, "4.10K", "4.10 kB"),
                                          (999_999, "1.00M", "1.00 MB"), (469_000, "469.00K", "469.00 kB"),
                                          (24.15e9, "24.15B", "24.15 GB"), (70.6e9, "70.60B", "70.60 GB"),
                                          (1.008e12, "1.01T", "1.01 TB")])
def test_counts_and_sizes(n, count, size):
    assert human_count(n) == count and human_bytes(n) == size


def test_a_small_expert_layout_is_not_zero_billion():
    from megalite.config import RunConfig
    from megalite.plan import justify

    cfg = RunConfig.build(model="moe-tiny", ep=2, dp=2).resolved(2, 257)
    line = justify(cfg.gpt_config(), cfg)
    assert "0.00B" not in line and "K parameters per rank" in line and " 0.0 GB" not in line
