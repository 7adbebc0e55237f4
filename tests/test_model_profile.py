"""Prefill-time model: the fit recovers known costs; the file round-trips."""

import json

import pytest

from model.profile import FEATURES, PrefillProfile, ProfileConfig, features, fit, run


def test_fit_recovers_known_coefficients():
    true = [2e-3, 1e-4, 3e-8, 5e-8, 1e-6]
    samples = [(i, p, sum(c * f for c, f in zip(true, features(i - p, p))))
               for i in (64, 256, 1024, 4096, 8192) for p in (0, i // 4, i // 2, i * 9 // 10)]
    coef = fit(samples)
    for got, want in zip(coef, true):
        assert got == pytest.approx(want, rel=1e-6)


def test_fit_keeps_costs_non_negative():
    # Pure linear time: the other terms must come out 0, never negative.
    samples = [(i, p, 1e-4 * (i - p)) for i in (100, 400, 1600) for p in (0, i // 2)]
    coef = fit(samples)
    assert all(c >= 0 for c in coef)
    assert PrefillProfile(coef).predict(1000, 0) == pytest.approx(0.1, rel=1e-6)
    with pytest.raises(ValueError, match="at least"):
        fit(samples[:2])


def test_predict_validates_and_handles_full_hits():
    prof = PrefillProfile([0.01, 1e-3, 0, 0, 0])
    assert prof.predict(100, 100) == pytest.approx(0.011)  # last token recomputed
    with pytest.raises(ValueError):
        prof.predict(10, 11)
    with pytest.raises(ValueError):
        prof.predict(0, 0)
    with pytest.raises(ValueError, match="coefficients"):
        PrefillProfile([1.0])


def test_run_measures_fits_and_writes_the_file(tmp_path):
    out = tmp_path / "profile.json"
    result = run({"model": "tiny", "output": str(out), "block_size": 16, "prefill_chunk": 64,
                  "lengths": [16, 64, 160], "prefix_fractions": [0.0, 0.5, 0.9],
                  "torch_threads": 1})
    on_disk = json.loads(out.read_text())
    assert on_disk == json.loads(json.dumps(result))
    assert list(on_disk["coeffs"]) == FEATURES and len(on_disk["samples"]) == 9
    prof = PrefillProfile.load(out)
    # The conductor's estimator reads the same table.
    estimators = pytest.importorskip("roles.scheduling.estimators")
    est = estimators.PolynomialPrefillEstimator(on_disk["coeffs"])
    assert est.seconds(160, 80) == pytest.approx(prof.predict(160, 80))
    assert all(c >= 0 for c in prof.coefficients)
    assert prof.predict(160, 0) > 0
    assert prof.meta["model"] == "tiny" and prof.meta["block_size"] == 16
    # Measured in the dtype nodes run by default ("auto" resolved, never "auto").
    from model.precision import native_dtype
    assert prof.meta["dtype"] == native_dtype("cpu")
    with pytest.raises(ValueError, match="prefix_fractions"):
        ProfileConfig(prefix_fractions=[1.0])
    (tmp_path / "bad.json").write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="not a"):
        PrefillProfile.load(tmp_path / "bad.json")
