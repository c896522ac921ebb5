"""The Helm chart, loaded once per test module with the real Helm v4 engine (helm-python-sdk)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def chart():
    helm = pytest.importorskip("helm_python")
    from tests.k8s import manifests as m

    with helm.Chart.load(m.CHART) as loaded:
        yield loaded
