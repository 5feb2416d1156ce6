#!/usr/bin/env bash
# The shared token between the proxies and meshlimitd (docs/security.md).
#
#   deploy/shared-token.sh [NAMESPACE/WASMPLUGIN ...]
#
# Generates the token once, as the Secret meshlimit/meshlimit-token that
# meshlimitd's Deployment (deploy/kubernetes/base) requires: without it the
# pods wait, and meshlimitd never runs with its check API open. Run again,
# it keeps the token it finds. Then puts the token in each WasmPlugin named
# (default: istio-system/meshlimit, deploy/istio/install's) as
# `service.auth_token`: the filter sends it with every call, and
# meshlimitd signs the receipts it gives with a key derived from it.
#
# Rotating: delete the Secret, run this again, and restart meshlimitd
# (`kubectl -n meshlimit rollout restart deployment/meshlimitd`). Calls
# carrying the old token are refused until their WasmPlugin has the new
# one: those proxies decide by their failure_mode meanwhile.
set -euo pipefail

KUBECTL=${KUBECTL:-kubectl}
NAMESPACE=meshlimit
SECRET=meshlimit-token

token=$("$KUBECTL" -n "$NAMESPACE" get secret "$SECRET" \
  -o 'jsonpath={.data.token}' 2>/dev/null | base64 -d || true)
if [ -z "$token" ]; then
  # 32 random bytes, hex: visible ASCII, as meshlimitd and the filter ask.
  token=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
  "$KUBECTL" -n "$NAMESPACE" create secret generic "$SECRET" \
    --from-literal=token="$token" >/dev/null
  echo "created the Secret $NAMESPACE/$SECRET"
else
  echo "kept the token of the Secret $NAMESPACE/$SECRET"
fi

if [ "$#" -eq 0 ]; then
  set -- istio-system/meshlimit
fi
for plugin in "$@"; do
  ns=${plugin%%/*}
  name=${plugin#*/}
  if [ "$ns" = "$plugin" ] || [ -z "$name" ]; then
    echo "$plugin: name a WasmPlugin as NAMESPACE/NAME" >&2
    exit 2
  fi
  "$KUBECTL" -n "$ns" patch wasmplugin "$name" --type merge \
    -p "{\"spec\":{\"pluginConfig\":{\"service\":{\"auth_token\":\"$token\"}}}}" >/dev/null
  echo "gave the token to the WasmPlugin $ns/$name"
done
