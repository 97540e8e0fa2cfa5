#!/usr/bin/env bash
# Start a one-machine Ray head for the demo: job API on loopback only, token authentication on.
# Prints the `ray job submit` command for the demo job. See infra/README.md for real clusters.
#
#   bash infra/start_local_cluster.sh
#   bash infra/start_local_cluster.sh --token-only    # only create/tighten the token file, start nothing
#
# Environment (all optional):
#   RAY_AUTH_TOKEN_PATH  token file (default ~/.ray/auth_token); created 0600, or an existing one
#                        tightened to 0600, in a folder made 0700 (Ray's own writer uses the umask)
#   RAY_GCS_PORT         GCS port (default 6379)
#   RAY_DASHBOARD_PORT   dashboard / job API port (default 8265)
#   RAY_TEMP_DIR         Ray's temp/session dir (default /tmp/ray). Give every head on one machine its
#                        own: the job API points submitted drivers at `<temp dir>/ray_current_cluster`,
#                        i.e. at whichever head started last in that dir.
#   RAY_NUM_CPUS, RAY_NUM_GPUS   resources to advertise (default: detected)
#
# Note: `--dashboard-host 127.0.0.1` keeps the job API on loopback, but Ray (2.60, observed) still
# advertises the host's routable IP, its gRPC ports (GCS, raylet, workers; token required) listen on
# all interfaces, and its Prometheus /metrics ports (44217, 44227, ...) on 0.0.0.0 without a token.
# On a machine with a public interface, firewall the Ray ports too (infra/README.md).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -x "$REPO/.venv/bin/ray" ]]; then
  export PATH="$REPO/.venv/bin:$PATH"          # the job's `python` is the one on the head's PATH
fi
command -v ray >/dev/null || { echo "ray not found: run scripts/setup.sh first" >&2; exit 1; }

DEFAULT_TOKEN="$HOME/.ray/auth_token"
TOKEN_FILE="${RAY_AUTH_TOKEN_PATH:-$DEFAULT_TOKEN}"
GCS_PORT="${RAY_GCS_PORT:-6379}"
DASHBOARD_PORT="${RAY_DASHBOARD_PORT:-8265}"
TEMP_DIR="${RAY_TEMP_DIR:-/tmp/ray}"

if [[ ! -s "$TOKEN_FILE" ]]; then
  (umask 077 && mkdir -p "$(dirname "$TOKEN_FILE")")
  (umask 077 && python -c 'import secrets; print(secrets.token_hex(32))' > "$TOKEN_FILE")
  echo "generated a new token in $TOKEN_FILE"
fi
chmod 600 "$TOKEN_FILE"
if [[ "$TOKEN_FILE" == "$DEFAULT_TOKEN" ]]; then
  chmod 700 "$(dirname "$TOKEN_FILE")"               # ~/.ray holds only Ray's private state
fi
[[ "${1:-}" == "--token-only" ]] && exit 0

export RAY_AUTH_MODE=token
export RAY_AUTH_TOKEN_PATH="$TOKEN_FILE"
unset RAY_AUTH_TOKEN RAY_ADDRESS

resources=()
[[ -n "${RAY_NUM_CPUS:-}" ]] && resources+=(--num-cpus "$RAY_NUM_CPUS")
[[ -n "${RAY_NUM_GPUS:-}" ]] && resources+=(--num-gpus "$RAY_NUM_GPUS")

ray start --head \
  --node-ip-address 127.0.0.1 --port "$GCS_PORT" \
  --dashboard-host 127.0.0.1 --dashboard-port "$DASHBOARD_PORT" \
  --temp-dir "$TEMP_DIR" --disable-usage-stats ${resources[@]+"${resources[@]}"}

# The dashboard starts after `ray start` returns: wait until the job API answers with the token.
python - "$DASHBOARD_PORT" "$TOKEN_FILE" <<'PY'
import sys, time, urllib.request
port, token_file = sys.argv[1], sys.argv[2]
token = open(token_file).read().strip()
req = urllib.request.Request(f"http://127.0.0.1:{port}/api/jobs/", headers={"Authorization": f"Bearer {token}"})
for _ in range(120):
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            if r.status == 200:
                sys.exit(0)
    except OSError:
        pass
    time.sleep(1)
sys.exit(f"job API on 127.0.0.1:{port} not ready after 120 s")
PY

cat <<MSG

Ray head is up: job API http://127.0.0.1:${DASHBOARD_PORT} (loopback, token required).
Submit the demo (in a shell with these variables; output.path must be absolute: the job runs in an
unpacked copy of the working dir that Ray deletes later):

  export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=${TOKEN_FILE}
  ray job submit --address http://127.0.0.1:${DASHBOARD_PORT} --working-dir ${REPO} -- \\
      python jobs/generate.py --config configs/demo.yaml output.path=${REPO}/out

Stop it with: ray stop   (this stops every Ray process of this user on this machine)
MSG
