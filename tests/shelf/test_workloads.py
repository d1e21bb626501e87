"""KMeans and GMM against scikit-learn from the same initialisation, determinism, and resuming in
every checkpoint mode."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from crashsafe.workloads.checkpoint_modes import (
    MODES,
    SavezStore,
    UnreadableCheckpointError,
    open_mode,
    run,
)
from crashsafe.workloads.clusterdata import blobs, digits, mnist_like
from crashsafe.workloads.gmm import GMM
from crashsafe.workloads.kmeans import KMeans, assign


def fit(algo: KMeans | GMM, x: np.ndarray, max_iter: int) -> dict[str, object]:
    state = algo.init_state(x)
    while not state["done"] and state["iteration"] < max_iter:
        state = algo.step(x, state)
    return state


@pytest.mark.parametrize("k", [2, 5, 10])
def test_kmeans_matches_scikit_learn_on_digits(k: int) -> None:
    from sklearn.cluster import KMeans as SkKMeans

    x = digits()
    ours = KMeans(k=k, seed=k, tol=1e-4)
    state = fit(ours, x, 300)
    init = ours.init_state(x)["centers"]
    sk = SkKMeans(n_clusters=k, init=init, n_init=1, max_iter=300, tol=1e-4, algorithm="lloyd").fit(x)
    np.testing.assert_allclose(state["centers"], sk.cluster_centers_, rtol=0, atol=1e-9)
    labels, sq_dist = assign(x, state["centers"])  # type: ignore[arg-type]
    assert np.array_equal(labels, sk.labels_)
    assert sq_dist.sum() == pytest.approx(sk.inertia_, rel=1e-10)
    # scikit-learn computes distances in chunks with its own rounding: a point on a near-tie may
    # flip once more before its labels settle, costing it one extra iteration
    assert abs(int(state["iteration"]) - sk.n_iter_) <= 1  # type: ignore[call-overload]


@pytest.mark.parametrize(("data", "k"), [("digits", 3), ("blobs", 4)])
def test_gmm_matches_scikit_learn(data: str, k: int) -> None:
    from sklearn.mixture import GaussianMixture

    x = digits() if data == "digits" else blobs(1500, 6, 4, seed=1)
    ours = GMM(k=k, seed=1, tol=1e-3)
    state = fit(ours, x, 200)
    weights, means, covariances = ours.initial_model(x)
    sk = GaussianMixture(k, covariance_type="full", weights_init=weights, means_init=means,
                         precisions_init=np.linalg.inv(covariances), max_iter=200, tol=1e-3,
                         reg_covar=1e-6, init_params="random_from_data", random_state=0).fit(x)
    assert state["iteration"] == sk.n_iter_
    np.testing.assert_allclose(state["weights"], sk.weights_, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(state["means"], sk.means_, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(state["covariances"], sk.covariances_, rtol=1e-8, atol=1e-9)
    assert state["lower_bound"] == pytest.approx(sk.lower_bound_, rel=1e-12)


def test_deterministic_given_a_seed() -> None:
    x = blobs(800, 5, 3, seed=2)
    for make in (lambda s: KMeans(k=3, seed=s, tol=None), lambda s: GMM(k=3, seed=s, tol=None)):
        a, b, c = fit(make(7), x, 15), fit(make(7), x, 15), fit(make(8), x, 15)
        for name, value in a.items():
            if isinstance(value, np.ndarray):
                assert value.tobytes() == b[name].tobytes()  # type: ignore[attr-defined]
        key = "centers" if "centers" in a else "means"
        assert not np.array_equal(a[key], c[key])


def test_generated_mnist_like_data() -> None:
    x = mnist_like(n=500)
    assert x.shape == (500, 784) and x.dtype == np.float64
    assert x.min() >= 0 and x.max() <= 1 and np.array_equal(np.round(x * 255) / 255, x)
    assert np.array_equal(x, mnist_like(n=500))


@pytest.mark.parametrize("mode", [*MODES, "shelf-undo"])
@pytest.mark.parametrize("algo", ["kmeans", "gmm"])
def test_every_mode_resumes_to_the_uninterrupted_result(tmp_path: Path, mode: str, algo: str) -> None:
    """Shelf (shadow) computes the state straight into shelf blocks; shelf-undo copies it in place."""
    mode, tx_mode = ("shelf", "undo") if mode == "shelf-undo" else (mode, "shadow")
    x = blobs(600, 6, 4, seed=3)
    def make() -> KMeans | GMM:
        return KMeans(k=4, seed=0, tol=None) if algo == "kmeans" else GMM(k=3, seed=0, tol=None)

    reference = fit(make(), x, 12)
    store = open_mode(mode, tmp_path / "first", tx_mode=tx_mode)
    first = run(make(), x, store, 5)
    store.close()
    assert first.resumed_from is None and first.state["iteration"] == 5 and len(first.checkpoint_times) == 5
    store = open_mode(mode, tmp_path / "first", tx_mode=tx_mode)
    second = run(make(), x, store, 12)
    store.close()
    assert second.resumed_from == 5 and second.state["iteration"] == 12
    for name, value in reference.items():
        got = second.state[name]
        if isinstance(value, np.ndarray):
            assert got.dtype == value.dtype and got.tobytes() == value.tobytes(), name
        else:
            assert got == value or (got != got and value != value), name


def test_unreadable_baseline_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    store = SavezStore(tmp_path)
    store.save({"a": np.zeros(1000), "iteration": 1, "done": False})
    data = store.path.read_bytes()
    store.path.write_bytes(data[: len(data) // 2])
    with pytest.raises(UnreadableCheckpointError, match="cannot be read"):
        store.load()


class _Growing:
    """A toy iterative algorithm whose state changes shape at iteration 3, gains a variable at 5,
    and carries a str from 7 on: the shelf mode must follow it (leaving its loop when it must)."""

    name = "growing"

    def init_state(self, x: np.ndarray) -> dict[str, object]:
        return {"v": np.zeros(4), "iteration": 0, "done": False}

    def step(self, x: np.ndarray, state: dict[str, object], out: object = None) -> dict[str, object]:
        it = int(state["iteration"]) + 1  # type: ignore[call-overload]
        shape = (4,) if it < 3 else (6,)
        v = out("v", shape) if callable(out) else np.empty(shape)
        v[...] = it
        new: dict[str, object] = {"v": v, "iteration": it, "done": False}
        if it >= 5:
            new["extra"] = float(it)
        if it >= 7:
            new["label"] = f"it{it}"
        return new


def test_shelf_mode_follows_a_state_whose_layout_changes(tmp_path: Path) -> None:
    store = open_mode("shelf", tmp_path / "s")
    result = run(_Growing(), np.zeros(1), store, 9)
    assert store.loop is None  # a str is not loop material: plain transactions from iteration 7
    store.close()
    assert result.state["label"] == "it9" and result.state["extra"] == 9.0
    assert result.state["v"].tolist() == [9.0] * 6
    store = open_mode("shelf", tmp_path / "s")
    resumed = run(_Growing(), np.zeros(1), store, 10)
    store.close()
    assert resumed.resumed_from == 9 and resumed.state["iteration"] == 10


def test_shelf_mode_commits_iterations_through_a_loop(tmp_path: Path) -> None:
    from crashsafe.shelf.inspect import inspect_shelf

    store = open_mode("shelf", tmp_path / "s")
    run(KMeans(k=3, seed=0, tol=None), blobs(300, 4, 3, seed=1), store, 6)
    store.close()
    report = inspect_shelf(tmp_path / "s" / "state.shelf")
    assert set(report.loop) == {"centers", "iteration", "shift", "inertia", "done"}
    assert report.last_transaction["seq"] == report.seq and "iteration" in report.last_transaction["changed"]
    assert {v.name: v.version for v in report.variables}["centers"] > 1
