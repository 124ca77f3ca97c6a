"""tools/bench_pipeline.py's bubble part without ranks: its rendezvous simulation of each schedule (the
executor's blocking transfer batches, transfers free) against the formulas it prints."""
from __future__ import annotations

import importlib.util
import pathlib

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[2] / "tools" / "bench_pipeline.py"
_spec = importlib.util.spec_from_file_location("bench_pipeline", _PATH)
bench_pipeline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_pipeline)


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (4, 16), (8, 16), (8, 32)])
def test_simulated_bubbles_against_the_formulas(pp, m):
    for name, v in (("1f1b", 1), ("zb-h1", 1)):  # (interleaved's simulation is above its formula at some pp, m)
        assert bench_pipeline.simulate_bubble(name, pp, m, v) == pytest.approx(bench_pipeline.formula(name, pp, m, v))
    # DualPipeV: the published (pp-1)(F&B + B - 3W) at F = B = W, F&B = F + B, is its F&B pairs' clock as one
    # unit; megalite runs a pair's F then B, and on the executor's blocking batches never stalls: half of it
    published = bench_pipeline.formula("dualpipev", pp, m, 2)
    assert published == pytest.approx((pp - 1) / (3 * m + pp - 1))
    assert bench_pipeline.dualpipev_unit_bubble(pp, m) == pytest.approx(published)
    assert bench_pipeline.simulate_bubble("dualpipev", pp, m, 2) == pytest.approx((pp - 1) / (6 * m + pp - 1))
