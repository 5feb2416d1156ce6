"""Writes prometheusrule.yaml from ../alerts.yaml (the one home of the
alerts); deploy/test_manifests.py fails when the two differ."""

import os

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
HEAD = """# deploy/prometheus/alerts.yaml as a PrometheusRule, for the Prometheus
# Operator. Generated: its spec.groups are alerts.yaml's groups, which
# deploy/test_manifests.py checks (regenerate with
# `python3 deploy/prometheus/operator/generate.py`).
"""


def rule():
    with open(os.path.join(HERE, "..", "alerts.yaml")) as f:
        groups = yaml.safe_load(f)["groups"]
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "meshlimit", "namespace": "meshlimit", "labels": {"app.kubernetes.io/name": "meshlimit"}},
        "spec": {"groups": groups},
    }


if __name__ == "__main__":
    with open(os.path.join(HERE, "prometheusrule.yaml"), "w") as f:
        f.write(HEAD + yaml.safe_dump(rule(), sort_keys=False, width=100))
