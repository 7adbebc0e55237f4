"""The conductor's prefill prior from the nodes' own start-up measurement:
model.profile.cold_prefill_samples / fit_cold, NodeCapacity.prefill_speed,
and ClusterView taking their mean until its online fit has samples."""
from __future__ import annotations

import json
import time

import pytest

from model.profile import cold_prefill_samples, fit_cold
from mooncaked.node.membership import NodeRegistry
from mooncaked.node.messages import NodeCapacity, NodeRegistration, PrefillSpeed
from mooncaked.node.sections import ConductorSection
from roles.conductor.cluster import DEFAULT_PREFILL_COEFFS, ClusterView
from tests.nodes import get_json


def exact(n: int) -> float:
    return 0.002 + 3e-5 * n + 2e-8 * n * n


def test_fit_cold_recovers_a_quadratic_and_prices_a_cached_prefix_from_it():
    c = fit_cold([(n, exact(n)) for n in (64, 128, 256, 512, 1024)])
    assert c["c0"] == pytest.approx(0.002, rel=1e-6)
    assert c["n"] == pytest.approx(3e-5, rel=1e-6)
    assert c["n2"] == pytest.approx(2e-8, rel=1e-6)
    # n new tokens after p cached: n*p pairs cost what 2 * n^2 / 2 pairs do.
    assert c["np"] == pytest.approx(4e-8, rel=1e-6) and c["p"] == 0.0


def test_fit_cold_with_fewer_samples_than_terms():
    assert fit_cold([(100, 0.01)]) == pytest.approx(
        {"c0": 0.0, "n": 1e-4, "n2": 0.0, "np": 0.0, "p": 0.0})
    assert fit_cold([(100, 0.012), (200, 0.022)]) == pytest.approx(
        {"c0": 0.002, "n": 1e-4, "n2": 0.0, "np": 0.0, "p": 0.0})
    # A fit that would go negative drops that term (costs are never negative).
    c = fit_cold([(64, 0.001), (128, 0.0019), (256, 0.0037), (512, 0.0073)])
    assert min(c.values()) >= 0.0


def test_cold_samples_double_from_one_block_to_the_longest_within_the_budget():
    seen: list[int] = []
    samples = cold_prefill_samples(seen.append, 64, 1000, budget_s=float("inf"), repeats=2)
    assert [n for n, _ in samples] == [64, 128, 256, 512]
    assert seen == [64, 64, 128, 128, 256, 256, 512, 512]
    assert all(s >= 0 for _, s in samples)
    # A budget already spent by the first prompt: no longer ones.
    assert [n for n, _ in cold_prefill_samples(lambda n: None, 64, 1024, budget_s=0.0)] == [64]


def _join(registry: NodeRegistry, node: str, speed: PrefillSpeed | None) -> None:
    registry.register(NodeRegistration(
        node_id=node, role="colocated", url=f"http://127.0.0.1:1/{node}",
        capacity=NodeCapacity(pages=64, block_size=16, kv_bytes_per_token=1024,
                              prefill_speed=speed)), time.monotonic())


FAST = PrefillSpeed(c0=0.002, per_token=3e-5, per_token2=2e-8, per_token_cached=4e-8,
                    sampled_up_to=1024)
SLOW = PrefillSpeed(c0=0.004, per_token=5e-5, per_token2=4e-8, per_token_cached=8e-8,
                    sampled_up_to=512)


def test_the_prior_is_the_mean_of_the_nodes_measurements_until_fitted():
    registry = NodeRegistry(timeout_s=60.0)
    cluster = ClusterView(registry, ConductorSection())
    assert cluster.status()["prefill_prior"] == "built-in default"
    assert cluster.status()["prefill_coeffs"] == pytest.approx(
        {"c0": 0.01, "n": 2.5e-4, "n2": 1.7e-8, "np": 1.7e-8, "p": 0.0})
    _join(registry, "a", FAST)
    _join(registry, "b", SLOW)
    _join(registry, "c", None)          # a node that does not measure changes nothing
    status = cluster.status()
    assert status["prefill_prior"] == "measured at start by a, b"
    assert status["prefill_coeffs"] == pytest.approx(
        {"c0": 0.003, "n": 4e-5, "n2": 3e-8, "np": 6e-8, "p": 0.0})
    # 1024 new tokens: 0.003 + 0.04096 + 0.03146 s, not the default's 0.294 s.
    assert cluster.scheduler.prefill_est.seconds(1024, 0) == pytest.approx(0.0754, rel=1e-3)
    # Once the online fit has run, a node joining later leaves it alone.
    est = cluster.scheduler.prefill_est
    for i in range(est.refit_every):
        est.observe(200 + 100 * i, 0, 0.01 + 1e-4 * (200 + 100 * i))
    fitted = dict(est.coeffs)
    _join(registry, "d", SLOW)
    assert cluster.status()["prefill_prior"] == "fitted online"
    assert est.coeffs == fitted


def test_a_profile_the_user_gave_wins_over_the_measurements(tmp_path):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"coeffs": {"c0": 0.05, "n": 1e-3}}))
    registry = NodeRegistry(timeout_s=60.0)
    cluster = ClusterView(registry, ConductorSection(prefill_profile=str(profile)))
    _join(registry, "a", FAST)
    assert cluster.status()["prefill_prior"] == "conductor.prefill_profile"
    assert cluster.scheduler.prefill_est.coeffs["n"] == 1e-3


@pytest.mark.slow  # a local cluster
def test_real_nodes_announce_their_measured_speed(local_cluster):
    cluster = local_cluster(prefill=0, decode=0, colocated=2, model="tiny")
    status = get_json(cluster.url + "/admin/status")[1]["scheduler"]
    assert status["prefill_prior"].startswith("measured at start by ")
    coeffs = status["prefill_coeffs"]
    assert coeffs != DEFAULT_PREFILL_COEFFS
    # A fit of a few short prompts (non-negative terms): which of the per-token
    # and quadratic terms carries the growth depends on the measured times,
    # but a longer prompt is predicted to take longer.
    def predicted(n: int) -> float:
        return coeffs["c0"] + coeffs["n"] * n + coeffs["n2"] * n * n
    assert 0 < predicted(16) < predicted(128) < predicted(1024)
