"""Offline checks of everything in deploy/ (run by `make test`).

- deploy/kubernetes (a kustomize base and a production overlay) and
  deploy/istio/install are rendered with `kubectl kustomize`; the
  Kubernetes objects validate against the Kubernetes API schemas
  (kubernetes-validate, which ships them) for KUBERNETES_VERSION, the
  namespace comes first, and the images are the ones of
  deploy/images/images.env, at the workspace's version.
- Each WasmPlugin is checked field by field against the documented
  extensions.istio.io/v1alpha1 API (WASMPLUGIN_SPEC below, from Istio 1.27's
  CRD): a misspelt, unknown or mistyped field fails.
- Every pluginConfig is accepted by the filter's own parser, and points at
  the meshlimitd Service that deploy/kubernetes defines.
- RequestAuthentications are checked against security.istio.io/v1
  (AUTHN_SPEC below), and a WasmPlugin beside one reads its claims where
  Istio keeps them.
- The AuthorizationPolicy is checked against security.istio.io/v1
  (AUTHZ_SPEC below) and must select meshlimitd's pods; the NetworkPolicies
  must select the pods they protect.
- The Dockerfiles pass hadolint.
"""

import glob
import json
import os
import re
import shutil
import subprocess
import tempfile

import kubernetes_validate
import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KUBERNETES_VERSION = "1.33.0"


def docs(pattern):
    out = []
    for path in sorted(glob.glob(os.path.join(ROOT, pattern))):
        with open(path) as f:
            out += [(os.path.relpath(path, ROOT), d) for d in yaml.safe_load_all(f) if d]
    return out


def kustomize(path):
    """`kubectl kustomize` of a kustomization in deploy/, as (label, doc)."""
    kubectl = shutil.which("kubectl") or os.path.join(ROOT, ".venv/bin/kubectl")
    try:
        out = subprocess.run(
            [kubectl, "kustomize", os.path.join(ROOT, path)],
            check=True, capture_output=True, text=True,
        ).stdout
    except FileNotFoundError:
        pytest.fail("kubectl is missing: scripts/setup.sh installs it (make test runs setup)")
    except subprocess.CalledProcessError as e:
        pytest.fail(f"kubectl kustomize {path} failed: {e.stderr}")
    return [(f"{path} (kustomize)", d) for d in yaml.safe_load_all(out) if d]


BASE = kustomize("deploy/kubernetes/base")
PRODUCTION = kustomize("deploy/kubernetes/overlays/production")
K8S = BASE
ISTIO_INSTALL = kustomize("deploy/istio/install")
ISTIO = ISTIO_INSTALL + docs("deploy/istio/examples/*.yaml")
WASMPLUGINS = [(p, d) for p, d in ISTIO if d["kind"] == "WasmPlugin"]
AUTHZ = [(p, d) for p, d in ISTIO if d["kind"] == "AuthorizationPolicy"]
AUTHN = [(p, d) for p, d in ISTIO if d["kind"] == "RequestAuthentication"]


@pytest.mark.parametrize(
    "path,doc", BASE + PRODUCTION, ids=[f"{p}:{d['kind']}/{d['metadata']['name']}" for p, d in BASE + PRODUCTION]
)
def test_kubernetes_manifest_is_valid(path, doc):
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_namespace_comes_first():
    for rendered in (BASE, PRODUCTION):
        assert rendered[0][1]["kind"] == "Namespace"
        assert all(d["metadata"].get("namespace") == "meshlimit" for _, d in rendered[1:])


def test_production_runs_without_the_trial_redis_and_reads_its_url_from_a_secret():
    kinds = {(d["kind"], d["metadata"]["name"]) for _, d in PRODUCTION}
    assert not {("StatefulSet", "redis"), ("Service", "redis"), ("NetworkPolicy", "redis-ingress")} & kinds
    ((_, dep),) = [(p, d) for p, d in PRODUCTION if d["kind"] == "Deployment"]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    url = next(e for e in c["env"] if e["name"] == "MESHLIMITD_REDIS_URL")
    assert url == {"name": "MESHLIMITD_REDIS_URL", "valueFrom": {"secretKeyRef": {"name": "meshlimit-redis", "key": "url"}}}


def images():
    with open(os.path.join(ROOT, "deploy/images/images.env")) as f:
        return dict(l.strip().split("=", 1) for l in f if "=" in l and not l.startswith("#"))


def test_images_are_named_in_one_place_at_the_workspace_version():
    env = images()
    with open(os.path.join(ROOT, "Cargo.toml")) as f:
        (version,) = re.findall(r'(?m)^version = "([^"]+)"', f.read().split("[workspace.package]")[1])[:1]
    assert env["VERSION"] == version, "deploy/images/images.env and Cargo.toml's workspace version differ"
    assert env["MESHLIMITD_IMAGE"] == f"{env['REGISTRY']}/meshlimitd:{version}"
    assert env["WASM_URL"] == f"oci://{env['REGISTRY']}/meshlimit-wasm:{version}"
    rendered = [d for _, d in BASE + PRODUCTION + ISTIO]
    (dep,) = [d for d in rendered if d["kind"] == "Deployment" and d["metadata"]["name"] == "meshlimitd"][:1]
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == env["MESHLIMITD_IMAGE"]
    for d in rendered:
        if d["kind"] == "WasmPlugin":
            assert d["spec"]["url"] == env["WASM_URL"], d["metadata"]["name"]
    # Anywhere else an image of ours is named (docs, compose, Makefile),
    # it is these.
    named = re.compile(r"(?:oci://)?[\w.-]+(?:/[\w.-]+)*/meshlimit(?:d|-wasm):[\w.-]+")
    for path in glob.glob(os.path.join(ROOT, "**/*.md"), recursive=True) + [
        os.path.join(ROOT, "docker-compose.yml"),
    ]:
        if "/target/" in path or "/.venv/" in path or path.endswith("CHANGELOG.md"):
            continue
        with open(path) as f:
            for m in named.findall(f.read()):
                assert m in (env["MESHLIMITD_IMAGE"], env["WASM_URL"], env["WASM_URL"][len("oci://"):]), f"{path}: {m}"
    with open(os.path.join(ROOT, "Makefile")) as f:
        assert "include deploy/images/images.env" in f.read()


def find(kind, name):
    return next(d for _, d in K8S if d["kind"] == kind and d["metadata"]["name"] == name)


def test_meshlimitd_deployment_is_production_shaped():
    dep = find("Deployment", "meshlimitd")
    spec = dep["spec"]
    assert spec["replicas"] == 2
    pod = spec["template"]["spec"]
    (c,) = pod["containers"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert {"cpu", "memory"} <= set(c["resources"]["requests"]) and {"cpu", "memory"} <= set(c["resources"]["limits"])
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    labels = spec["template"]["metadata"]["labels"]
    for kind in ("Service", "PodDisruptionBudget"):
        other = find(kind, "meshlimitd")
        selector = other["spec"]["selector"]
        selector = selector.get("matchLabels", selector)
        assert selector.items() <= labels.items(), f"{kind} does not select the pods"


# extensions.istio.io/v1alpha1 WasmPlugin spec (Istio 1.27 CRD): field -> type
# or nested spec; enums as sets. Unknown fields are errors.
PORT = {"number": int}
WASMPLUGIN_SPEC = {
    "selector": {"matchLabels": {str: str}},
    "targetRef": {"group": str, "kind": str, "name": str, "namespace": str},
    "targetRefs": [{"group": str, "kind": str, "name": str, "namespace": str}],
    "url": str,
    "sha256": str,
    "imagePullPolicy": {"UNSPECIFIED_POLICY", "IfNotPresent", "Always"},
    "imagePullSecret": str,
    "verificationKey": str,
    "pluginConfig": dict,
    "pluginName": str,
    "phase": {"UNSPECIFIED_PHASE", "AUTHN", "AUTHZ", "STATS"},
    "priority": int,
    "vmConfig": {"env": [{"name": str, "value": str, "valueFrom": {"INLINE", "HOST"}}]},
    "match": [{"mode": {"UNDEFINED", "CLIENT", "SERVER", "CLIENT_AND_SERVER"}, "ports": [PORT]}],
    "type": {"UNSPECIFIED_PLUGIN_TYPE", "HTTP", "NETWORK"},
    "failStrategy": {"FAIL_CLOSE", "FAIL_OPEN", "FAIL_RELOAD"},
}
REQUIRED = {"url"}


def check(value, spec, at):
    """Returns the problems of `value` against `spec`."""
    if spec is dict:
        return [] if isinstance(value, dict) else [f"{at}: expected an object"]
    if isinstance(spec, type):
        return [] if isinstance(value, spec) and not isinstance(value, bool) else [f"{at}: expected {spec.__name__}"]
    if isinstance(spec, set):
        return [] if value in spec else [f"{at}: {value!r} is not one of {sorted(spec)}"]
    if isinstance(spec, list):
        if not isinstance(value, list):
            return [f"{at}: expected a list"]
        return [p for i, v in enumerate(value) for p in check(v, spec[0], f"{at}[{i}]")]
    if not isinstance(value, dict):
        return [f"{at}: expected an object"]
    if len(spec) == 1 and next(iter(spec)) is str:  # a map
        return [p for k, v in value.items() for p in check(v, spec[str], f"{at}.{k}")]
    problems = [f"{at}.{k}: unknown field" for k in value if k not in spec]
    return problems + [p for k, v in value.items() if k in spec for p in check(v, spec[k], f"{at}.{k}")]


def wasmplugin_problems(doc):
    problems = []
    if doc.get("apiVersion") != "extensions.istio.io/v1alpha1" or doc.get("kind") != "WasmPlugin":
        problems.append("not an extensions.istio.io/v1alpha1 WasmPlugin")
    problems += [f"metadata.{k}: unknown field" for k in doc.get("metadata", {}) if k not in ("name", "namespace", "labels", "annotations")]
    spec = doc.get("spec", {})
    problems += [f"spec.{k}: required" for k in REQUIRED if k not in spec]
    problems += check(spec, WASMPLUGIN_SPEC, "spec")
    if not re.match(r"^(oci|https?|file)://", spec.get("url", "")):
        problems.append("spec.url: must be oci://, http(s):// or file://")
    return problems


@pytest.mark.parametrize("path,doc", WASMPLUGINS, ids=[p for p, _ in WASMPLUGINS])
def test_wasmplugin_matches_the_istio_api(path, doc):
    assert wasmplugin_problems(doc) == []
    spec = doc["spec"]
    assert spec["phase"] == "AUTHZ"
    assert spec["failStrategy"] in ("FAIL_OPEN", "FAIL_CLOSE", "FAIL_RELOAD")


def test_the_field_check_catches_mistakes():
    _, good = WASMPLUGINS[0]
    bad = json.loads(json.dumps(good))
    bad["spec"]["pluginConf"] = bad["spec"].pop("pluginConfig")
    bad["spec"]["phase"] = "AUTHORIZATION"
    bad["spec"]["selector"]["matchLabel"] = {}
    del bad["spec"]["url"]
    problems = wasmplugin_problems(bad)
    for expected in ("spec.pluginConf: unknown field", "spec.phase: 'AUTHORIZATION'", "spec.selector.matchLabel: unknown field", "spec.url: required"):
        assert any(p.startswith(expected) for p in problems), (expected, problems)


def meshlimitd_cluster():
    svc = find("Service", "meshlimitd")
    port = svc["spec"]["ports"][0]["port"]
    return f"outbound|{port}||meshlimitd.{svc['metadata']['namespace']}.svc.cluster.local"


MESHLIMITD = os.path.join(ROOT, "target/release/meshlimitd")


def meshlimitd(*args):
    """Runs the built meshlimitd (make test builds it before these run)."""
    if not os.access(MESHLIMITD, os.X_OK):
        pytest.fail(f"{MESHLIMITD} is missing: `make build` builds it (make test does)")
    return subprocess.run([MESHLIMITD, *args], cwd=ROOT, capture_output=True, text=True, check=False)


def check_with_the_filter(config):
    """`meshlimitd validate plugin-config`: the filter's own parser."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(config, f)
    try:
        return meshlimitd("validate", "plugin-config", f.name)
    finally:
        os.unlink(f.name)


@pytest.mark.parametrize("path,doc", WASMPLUGINS, ids=[p for p, _ in WASMPLUGINS])
def test_plugin_config_is_accepted_by_the_filter(path, doc):
    config = doc["spec"]["pluginConfig"]
    assert config["service"]["cluster"] == meshlimitd_cluster()
    out = check_with_the_filter(config)
    assert out.returncode == 0, out.stdout + out.stderr
    assert ": ok: " in out.stdout


@pytest.mark.parametrize("path,doc", WASMPLUGINS, ids=[p for p, _ in WASMPLUGINS])
def test_plugin_config_matches_the_published_json_schema(path, doc):
    """docs/plugin-config.schema.json (generated from the filter's
    reference) accepts every shipped pluginConfig, and refuses a typo."""
    import jsonschema

    with open(os.path.join(ROOT, "docs/plugin-config.schema.json")) as f:
        schema = json.load(f)
    config = doc["spec"]["pluginConfig"]
    jsonschema.validate(config, schema)
    typo = json.loads(json.dumps(config))
    typo["rules"][0]["limits"][0]["burts"] = 5
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(typo, schema)


def test_the_filter_parser_refuses_a_bad_plugin_config():
    _, doc = WASMPLUGINS[0]
    config = json.loads(json.dumps(doc["spec"]["pluginConfig"]))
    config["rules"][0]["limits"][0]["requets"] = config["rules"][0]["limits"][0].pop("requests")
    out = check_with_the_filter(config)
    assert out.returncode == 1
    assert "field `rules[0].limits[0].requets`: unknown field" in out.stderr


def one_wasmplugin(path):
    with open(path) as f:
        return [d.get("kind") for d in yaml.safe_load_all(f) if d].count("WasmPlugin") == 1


PLUGIN_FILES = [
    p for p in sorted(glob.glob(os.path.join(ROOT, "deploy/istio/*/*.yaml")))
    if not p.endswith("kustomization.yaml") and one_wasmplugin(p)
]


def test_every_istio_example_and_installable_holds_one_wasmplugin_to_check():
    assert len(PLUGIN_FILES) == 5, PLUGIN_FILES


@pytest.mark.parametrize("path", PLUGIN_FILES, ids=[os.path.relpath(p, ROOT) for p in PLUGIN_FILES])
def test_meshlimitd_validates_each_istio_manifest_as_it_is(path):
    """The quickstart's check: `meshlimitd validate plugin-config` on a
    manifest reads its WasmPlugin's spec.pluginConfig."""
    out = meshlimitd("validate", "plugin-config", path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert ": ok: " in out.stdout


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.wasm"])
def test_dockerfile_passes_hadolint(dockerfile):
    hadolint = os.path.join(ROOT, ".venv", "bin", "hadolint")
    out = subprocess.run([hadolint, os.path.join(ROOT, dockerfile)], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


def test_alert_rules_pass_promtool():
    rules = os.path.join(ROOT, "deploy", "prometheus", "alerts.yaml")
    out = subprocess.run(["promtool", "check", "rules", rules], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


# security.istio.io/v1 AuthorizationPolicy spec (Istio 1.27 CRD), the part
# meshlimit uses; unknown fields are errors.
OPERATION = {"hosts": [str], "notHosts": [str], "ports": [str], "notPorts": [str],
             "methods": [str], "notMethods": [str], "paths": [str], "notPaths": [str]}
SOURCE = {"principals": [str], "notPrincipals": [str], "requestPrincipals": [str],
          "notRequestPrincipals": [str], "namespaces": [str], "notNamespaces": [str],
          "ipBlocks": [str], "notIpBlocks": [str], "remoteIpBlocks": [str], "notRemoteIpBlocks": [str]}
AUTHZ_SPEC = {
    "selector": {"matchLabels": {str: str}},
    "targetRefs": [{"group": str, "kind": str, "name": str, "namespace": str}],
    "action": {"ALLOW", "DENY", "AUDIT", "CUSTOM"},
    "provider": {"name": str},
    "rules": [{
        "from": [{"source": SOURCE}],
        "to": [{"operation": OPERATION}],
        "when": [{"key": str, "values": [str], "notValues": [str]}],
    }],
}


@pytest.mark.parametrize("path,doc", AUTHZ, ids=[p for p, _ in AUTHZ])
def test_authorization_policy_matches_the_istio_api_and_guards_meshlimitd(path, doc):
    assert doc["apiVersion"] == "security.istio.io/v1"
    problems = check(doc["spec"], AUTHZ_SPEC, "spec")
    assert not problems, "\n".join(problems)
    pods = find("Deployment", "meshlimitd")["spec"]["template"]["metadata"]["labels"]
    assert doc["metadata"]["namespace"] == find("Deployment", "meshlimitd")["metadata"]["namespace"]
    assert doc["spec"]["selector"]["matchLabels"].items() <= pods.items()
    (check_rule,) = [r for r in doc["spec"]["rules"] if "/v1/check" in r["to"][0]["operation"]["paths"]]
    assert check_rule["from"][0]["source"]["principals"], "the check API needs an identity"
    open_rules = [r for r in doc["spec"]["rules"] if "from" not in r]
    assert all("/v1/check" not in r["to"][0]["operation"]["paths"] for r in open_rules)


# security.istio.io/v1 RequestAuthentication spec (Istio 1.27 CRD).
AUTHN_SPEC = {
    "selector": {"matchLabels": {str: str}},
    "targetRef": {"group": str, "kind": str, "name": str, "namespace": str},
    "targetRefs": [{"group": str, "kind": str, "name": str, "namespace": str}],
    "jwtRules": [{
        "issuer": str, "audiences": [str], "jwksUri": str, "jwks": str,
        "fromHeaders": [{"name": str, "prefix": str}], "fromParams": [str], "fromCookies": [str],
        "outputPayloadToHeader": str, "forwardOriginalToken": bool,
        "outputClaimToHeaders": [{"header": str, "claim": str}], "timeout": str,
        "spaceDelimitedClaims": [str],
    }],
}


@pytest.mark.parametrize("path,doc", AUTHN, ids=[p for p, _ in AUTHN])
def test_request_authentication_matches_the_istio_api(path, doc):
    assert doc["apiVersion"] == "security.istio.io/v1"
    problems = [p for p in check(doc["spec"], AUTHN_SPEC, "spec") if not p.endswith("expected bool")]
    assert not problems, "\n".join(problems)
    assert isinstance(doc["spec"]["jwtRules"][0]["forwardOriginalToken"], bool)
    # The WasmPlugin of the same file reads the payload Istio's jwt_authn keeps.
    (plugin,) = [d for p, d in WASMPLUGINS if p == path]
    assert plugin["spec"]["selector"] == doc["spec"]["selector"]
    jwt = plugin["spec"]["pluginConfig"]["jwt"]
    assert jwt == {"filter": "envoy.filters.http.jwt_authn", "payload_in_metadata": "payload"}


def test_network_policies_select_the_pods_they_protect():
    for name, deployment in [("meshlimitd-ingress", "meshlimitd"), ("redis-ingress", "redis")]:
        policy = find("NetworkPolicy", name)
        target = next(d for _, d in K8S if d["kind"] in ("Deployment", "StatefulSet") and d["metadata"]["name"] == deployment)
        labels = target["spec"]["template"]["metadata"]["labels"]
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items(), name
    # Redis admits meshlimitd's pods.
    meshlimitd = find("Deployment", "meshlimitd")["spec"]["template"]["metadata"]["labels"]
    (rule,) = find("NetworkPolicy", "redis-ingress")["spec"]["ingress"]
    assert rule["from"][0]["podSelector"]["matchLabels"].items() <= meshlimitd.items()


def test_the_prometheus_rule_holds_exactly_the_alerts():
    """deploy/prometheus/alerts.yaml is the one home of the alerts; the
    Prometheus Operator's PrometheusRule is generated from it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("generate", os.path.join(ROOT, "deploy/prometheus/operator/generate.py"))
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    with open(os.path.join(ROOT, "deploy/prometheus/operator/prometheusrule.yaml")) as f:
        shipped = yaml.safe_load(f)
    assert shipped == generate.rule(), "run python3 deploy/prometheus/operator/generate.py"


def test_the_monitors_scrape_meshlimitd_and_the_gateway():
    monitors = docs("deploy/prometheus/operator/monitors.yaml")
    kinds = {d["kind"]: d for _, d in monitors}
    service = find("Service", "meshlimitd")
    sm = kinds["ServiceMonitor"]
    assert sm["metadata"]["namespace"] == service["metadata"]["namespace"]
    assert sm["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    ports = {p["name"] for p in service["spec"]["ports"]}
    assert {e["port"] for e in sm["spec"]["endpoints"]} <= ports
    assert sm["spec"]["endpoints"][0]["path"] == "/metrics"
    gateway = [d for _, d in ISTIO_INSTALL if d["kind"] == "WasmPlugin"][0]
    pm = kinds["PodMonitor"]
    assert pm["spec"]["selector"]["matchLabels"] == gateway["spec"]["selector"]["matchLabels"]
    assert pm["spec"]["podMetricsEndpoints"][0]["path"] == "/stats/prometheus"


def test_meshlimitd_requires_the_shared_token():
    """Secure by default: meshlimitd reads the token from the Secret
    deploy/shared-token.sh creates, and does not start without it."""
    for rendered in (BASE, PRODUCTION):
        (dep,) = [d for _, d in rendered if d["kind"] == "Deployment" and d["metadata"]["name"] == "meshlimitd"]
        pod = dep["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        env = {e["name"]: e for e in c["env"]}
        path = env["MESHLIMITD_AUTH_TOKEN_FILE"]["value"]
        (mount,) = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
        (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        assert volume["secret"]["secretName"] == "meshlimit-token"
        assert volume["secret"]["optional"] is False
        assert path.rsplit("/", 1)[1] == "token"


FAKE_KUBECTL = """#!/usr/bin/env bash
# Records each call; keeps one Secret's token in $STATE.
echo "$*" >> "$STATE/calls"
case "$*" in
  *"get secret meshlimit-token"*)
    [ -f "$STATE/token" ] && printf '%s' "$(base64 -w0 < "$STATE/token")" || exit 1 ;;
  *"create secret generic meshlimit-token --from-literal=token="*)
    all="$*"; printf '%s' "${all##*--from-literal=token=}" > "$STATE/token" ;;
esac
"""


def test_shared_token_script_creates_the_token_once_and_gives_it_to_the_wasmplugins():
    with tempfile.TemporaryDirectory() as state:
        kubectl = os.path.join(state, "kubectl")
        with open(kubectl, "w") as f:
            f.write(FAKE_KUBECTL)
        os.chmod(kubectl, 0o755)
        env = dict(os.environ, KUBECTL=kubectl, STATE=state)
        script = os.path.join(ROOT, "deploy/shared-token.sh")
        first = subprocess.run([script], env=env, capture_output=True, text=True, check=True)
        assert "created the Secret meshlimit/meshlimit-token" in first.stdout
        with open(os.path.join(state, "token")) as f:
            token = f.read()
        assert re.fullmatch(r"[0-9a-f]{64}", token), token
        second = subprocess.run(
            [script, "istio-system/meshlimit", "shop/meshlimit-sidecar"], env=env, capture_output=True, text=True, check=True
        )
        assert "kept the token" in second.stdout
        with open(os.path.join(state, "calls")) as f:
            calls = f.read().splitlines()
        patches = [c for c in calls if " patch wasmplugin " in c]
        assert [c.split(" patch wasmplugin ")[0] for c in patches] == ["-n istio-system"] * 2 + ["-n shop"]
        for c in patches:
            assert json.loads(c.split(" -p ", 1)[1]) == {"spec": {"pluginConfig": {"service": {"auth_token": token}}}}
        assert sum("create secret" in c for c in calls) == 1
        bad = subprocess.run([script, "meshlimit"], env=env, capture_output=True, text=True)
        assert bad.returncode == 2 and "NAMESPACE/NAME" in bad.stderr
