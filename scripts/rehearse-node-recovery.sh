#!/usr/bin/env bash
# Rehearse the node-recovery runbook (../shared/spec/runbook-node-recovery.txt) end to end
# against docker-compose.node-recovery.yml: a 3-member cluster and one disposable simulated
# agent, in containers built here FROM scratch.
#
#   scripts/rehearse-node-recovery.sh [BIN_DIR]      (default: target/debug)
#
# Needs: docker (with `docker compose` or `docker-compose`), curl, python3. Everything it
# starts is torn down at exit (containers, network, image, scratch dir); MF_KEEP=1 leaves the
# cluster up after a failure for inspection.
#
# The runbook's cases, in order (each function below prints what it checks):
#   a. fresh enrolment            node A, credential C1
#   b. credential lost            same node A, C2; C1 revoked
#   c. credential believed stolen C2 revoked by the admin, refused; re-enrol: C3; C2 still 401
#   d. identity file lost         new node B (C4): two enabled nodes claim the hostname; an
#                                 allocation on B; BACKUP taken here; then the old node A is
#                                 decommissioned (preview/execute), which revokes C3 AFTER the
#                                 backup; one enabled node claims the hostname
#   e. control-plane restore      members stopped, data dirs moved aside, `modelforge restore`
#                                 with every old member's journal, members started on the
#                                 restored dirs: cluster_id restored-...
#   f. after the restore          the agent (frozen during the restore, never restarted)
#                                 reconnects with C4 (in the backup); C3 stays refused (journal);
#                                 the allocation is unconfirmed until B reports, then released
#                                 (nothing runs on simulated GPUs); capability smoke passes; B is
#                                 offered again
# Then the runbook's Confirm checklist, each line checked on the restored cluster. Exit 0 when
# every line holds, 1 when one fails, 2 when a step could not run (e.g. the decommission
# endpoint is missing from these binaries).
set -euo pipefail
# BIN_DIR is taken relative to the caller's directory; the default, relative to the repository.
if [ -n "${1:-}" ]; then
  BIN_DIR=$(cd "$1" && pwd) || { echo "rehearsal: no such directory: $1" >&2; exit 2; }
fi
cd "$(dirname "$0")/.."
ROOT=$PWD
BIN_DIR=${BIN_DIR:-$ROOT/target/debug}
COMPOSE_FILE=$ROOT/docker-compose.node-recovery.yml
HOSTNAME_UNDER_TEST=rehearsal-node
POLL=0.5          # seconds between polls of a condition
WAIT=90           # default limit for one condition, seconds

# ---------------------------------------------------------------------------------------------
# Output and bookkeeping
# ---------------------------------------------------------------------------------------------

T0=$EPOCHREALTIME
FAILED=0
NOT_RUN=()
DURATIONS=()

say() { printf '%s\n' "$*"; }
elapsed() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }
ok() { say "    ok: $*"; }
die() { say "    FAIL: $*" >&2; FAILED=1; exit 1; }
# check DESCRIPTION COMMAND...: run COMMAND; ok or FAIL (and stop: later steps build on this).
check() {
  local what=$1; shift
  if "$@"; then ok "$what"; else die "$what"; fi
}

# ---------------------------------------------------------------------------------------------
# Docker, compose and the scratch dir
# ---------------------------------------------------------------------------------------------

if docker compose version >/dev/null 2>&1; then
  COMPOSE=(docker compose)
elif command -v docker-compose >/dev/null 2>&1; then
  COMPOSE=(docker-compose)
else
  say "rehearsal: neither 'docker compose' nor 'docker-compose' is installed" >&2; exit 2
fi
for tool in docker curl python3; do
  command -v "$tool" >/dev/null 2>&1 || { say "rehearsal: $tool is required" >&2; exit 2; }
done

PROJECT=mfrehearsal$$
WORK=$(mktemp -d "${TMPDIR:-/tmp}/mf-rehearsal.XXXXXX")
RESP=$WORK/response.json
export MF_IMAGE=modelforge-rehearsal:$PROJECT
export MF_DATA=$WORK/data
MF_USER="$(id -u):$(id -g)"
MF_ADMIN_TOKEN=$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')
MF_CLUSTER_SECRET=$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')
export MF_USER MF_ADMIN_TOKEN MF_CLUSTER_SECRET
export MF_ENROLLMENT_TOKEN=
ADMIN=$MF_ADMIN_TOKEN
mkdir -p "$MF_DATA"/{m1,m2,m3,agent}
AGENT_DIR=$MF_DATA/agent
# The cluster CA the members issue their certificates from, the agent trusts (--ca-file) and
# every curl below verifies against.
"$BIN_DIR/modelforge" cluster init-ca --out "$MF_DATA/ca" >/dev/null
CACERT=$MF_DATA/ca/ca.pem

compose() { "${COMPOSE[@]}" -p "$PROJECT" -f "$COMPOSE_FILE" "$@"; }

teardown() {
  local rc=$?
  trap - EXIT INT TERM
  set +e
  if [ "$rc" != 0 ] && [ "$rc" != 2 ] || [ "$FAILED" != 0 ]; then
    say ""
    say "=== container logs (last 50 lines each) ==="
    compose logs --no-color --tail 50 2>&1
  fi
  if [ "${MF_KEEP:-0}" = 1 ] && [ "$rc" != 0 ]; then
    say "MF_KEEP=1: left project $PROJECT up (data in $WORK); tear down with:"
    say "  ${COMPOSE[*]} -p $PROJECT -f $COMPOSE_FILE down -v; docker rmi $MF_IMAGE; rm -rf $WORK"
    exit "$rc"
  fi
  compose down -v --remove-orphans -t 5 >/dev/null 2>&1
  docker rmi -f "$MF_IMAGE" >/dev/null 2>&1
  rm -rf "$WORK"
  say "rehearsal: torn down (project $PROJECT) after $(elapsed "$T0") s, exit $rc"
  exit "$rc"
}
trap teardown EXIT
trap 'exit 130' INT TERM

# Free loopback ports for the members' API, and a /24 that no docker network and no host
# interface uses.
read -r MF_PORT_1 MF_PORT_2 MF_PORT_3 < <(python3 - <<'PY'
import socket
socks = [socket.socket() for _ in range(3)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*[s.getsockname()[1] for s in socks])
PY
)
export MF_PORT_1 MF_PORT_2 MF_PORT_3
PORTS=("$MF_PORT_1" "$MF_PORT_2" "$MF_PORT_3")
MF_NET=$(
  mapfile -t networks < <(docker network ls -q)
  used="$(docker network inspect -f '{{range .IPAM.Config}}{{.Subnet}} {{end}}' "${networks[@]}" 2>/dev/null || true)
    $( (ip -o -4 addr show 2>/dev/null || true) | awk '{print $4}')"
  python3 - "$used" <<'PY'
import ipaddress, random, sys
used = [ipaddress.ip_network(s, strict=False) for s in sys.argv[1].split()]
for _ in range(1000):
    net = ipaddress.ip_network(f"172.{random.randint(20, 31)}.{random.randint(0, 255)}.0/24")
    if not any(net.overlaps(u) for u in used):
        print(str(net.network_address).rsplit(".", 1)[0]); break
PY
)
export MF_NET

# ---------------------------------------------------------------------------------------------
# HTTP and JSON helpers
# ---------------------------------------------------------------------------------------------

# jq-like: j EXPR [FILE] evaluates a Python expression over the JSON in FILE (default: the last
# response) bound to `d`; prints str/int as is, anything else as JSON.
j() {
  python3 - "$1" "${2:-$RESP}" <<'PY'
import json, sys
d = json.load(open(sys.argv[2]))
v = eval(sys.argv[1])
print(v if isinstance(v, str) else json.dumps(v))
PY
}

# api METHOD PATH [BODY]: an admin call; sets $STATUS, body in $RESP. Tries the members in
# order while one is unreachable or has no leader (503); writes carry an Idempotency-Key, so a
# retry on another member applies once. The key is fresh for every call (a key reused for the
# same operation and target with another body is refused 422): a counter would not do, since
# many calls run in $(...) subshells.
api() {
  local method=$1 path=$2 body=${3:-} port key
  key="rehearsal-$(cat /proc/sys/kernel/random/uuid)"
  for _ in 1 2 3; do
    for port in "${PORTS[@]}"; do
      STATUS=$(curl --cacert "$CACERT" -sS -m 30 -o "$RESP" -w '%{http_code}' -X "$method" \
        -H "Authorization: Bearer $ADMIN" -H 'Content-Type: application/json' \
        -H "Idempotency-Key: $key" ${body:+--data "$body"} \
        "https://127.0.0.1:$port$path" 2>/dev/null) || STATUS=000
      case $STATUS in 000|503) ;; *) return 0 ;; esac
    done
    sleep 1
  done
}
# api_expect STATUS METHOD PATH [BODY]: the call must answer STATUS.
api_expect() {
  local want=$1; shift
  api "$@"
  [ "$STATUS" = "$want" ] || die "$1 $2 answered $STATUS, expected $want: $(head -c 400 "$RESP")"
}

# heartbeat_status CREDENTIAL NODE_ID: what a heartbeat with that credential is answered (one
# member; a follower relays it to the leader).
heartbeat_status() {
  curl --cacert "$CACERT" -sS -m 20 -o /dev/null -w '%{http_code}' -X POST \
    -H "Authorization: Bearer $1" -H 'Content-Type: application/json' --data '{}' \
    "https://127.0.0.1:${PORTS[0]}/api/v1/agent/nodes/$2/heartbeat" 2>/dev/null || echo 000
}
# heartbeat_decided CRED NODE: the first answer that decides (not 503 "cannot decide now",
# shed or leadership moving, nor no answer), polled for up to $WAIT s as an agent would retry;
# the last answer if none did. A 200 or 401 is never retried.
heartbeat_decided() {
  local got start=$EPOCHREALTIME
  while :; do
    got=$(heartbeat_status "$1" "$2")
    case $got in 503 | 000) ;; *) break ;; esac
    awk -v a="$start" -v b="$EPOCHREALTIME" -v l="$WAIT" 'BEGIN { exit !(b - a > l) }' && break
    sleep "$POLL"
  done
  echo "$got"
}
# is_status CODE CRED NODE: the decided answer is CODE (says what it was otherwise).
is_status() {
  local got; got=$(heartbeat_decided "$2" "$3")
  [ "$got" = "$1" ] || { echo "    (got $got)"; return 1; }
}

# wait_for DESCRIPTION LIMIT_S COMMAND...: poll COMMAND until it succeeds.
wait_for() {
  local what=$1 limit=$2; shift 2
  local start=$EPOCHREALTIME
  until "$@"; do
    if awk -v a="$start" -v b="$EPOCHREALTIME" -v l="$limit" 'BEGIN { exit !(b - a > l) }'; then
      die "$what: not true after ${limit}s"
    fi
    sleep "$POLL"
  done
  ok "$what ($(elapsed "$start") s)"
}

# The credential's public id: mfnc_<32 hex id>_<secret>_<crc>.
cred_id() { printf '%s' "${1:5:32}"; }
agent_file() { cat "$AGENT_DIR/$1" 2>/dev/null || true; }
agent_node_id() {
  [ -s "$AGENT_DIR/identity.json" ] && j 'd.get("node_id") or ""' "$AGENT_DIR/identity.json" || true
}

new_token() {
  api_expect 201 POST /api/v1/admin/node-enrollments "{\"ttl_seconds\": 900, \"note\": \"rehearsal: $1\"}"
  j 'd["token"]'
}

# ---------------------------------------------------------------------------------------------
# The cluster and the agent
# ---------------------------------------------------------------------------------------------

member_ready() { curl --cacert "$CACERT" -sf -m 5 -o /dev/null "https://127.0.0.1:$1/readyz"; }
cluster_ready() {
  local p
  for p in "${PORTS[@]}"; do member_ready "$p" || return 1; done
  api GET /api/v1/cluster && [ "$STATUS" = 200 ] && [ "$(j 'd["leader_id"] is not None')" = true ]
}

agent_container() { compose ps -q agent 2>/dev/null; }
agent_running() {
  local c; c=$(agent_container)
  [ -n "$c" ] && [ "$(docker inspect -f '{{.State.Running}}' "$c")" = true ]
}
agent_exited() { ! agent_running; }
agent_exit_code() { docker inspect -f '{{.State.ExitCode}}' "$(agent_container)"; }
agent_last_log() { compose logs --no-color --tail 3 agent 2>&1 | grep -v '^Attaching' | tail -1; }
# agent_start TOKEN: (re)create the agent container with this enrolment token.
agent_start() {
  MF_ENROLLMENT_TOKEN=$1 compose up -d --no-deps --force-recreate agent >/dev/null 2>&1 \
    || die "could not start the agent"
}
agent_stop() {
  compose stop -t 10 agent >/dev/null 2>&1
  local code; code=$(agent_exit_code)
  [ "$code" = 0 ] || die "agent stopped with exit status $code (SIGTERM must give 0)"
  ok "agent stopped (SIGTERM, exit 0)"
}

node_json() { api_expect 200 GET "/api/v1/admin/hardware/nodes/$1"; }
node_field() { node_json "$1"; j "$2"; }
node_online() { [ "$(node_field "$1" 'd["status"]')" = online ]; }
node_inventory_and_telemetry() {
  node_json "$1"
  [ "$(j 'len(d["accelerators"]) == 2 and len((d.get("telemetry") or {}).get("accelerators", [])) == 2')" = true ]
}
creds_json() { api_expect 200 GET "/api/v1/admin/hardware/nodes/$1/credentials"; }
# cred_revoked NODE_ID CREDENTIAL: the node lists this credential with a revoked_at.
cred_revoked() {
  creds_json "$1"
  [ "$(j "any(c['credential_id'].endswith('$(cred_id "$2")') and c['revoked_at'] for c in d['credentials'])")" = true ]
}
active_credentials() { creds_json "$1"; j 'd["active"]'; }
# enabled_claimants: ids of the enabled nodes claiming the hostname, space-separated, sorted.
enabled_claimants() {
  api_expect 200 GET "/api/v1/admin/hardware/nodes?hostname=$HOSTNAME_UNDER_TEST&enabled=true"
  j '" ".join(sorted(n["node_id"] for n in d["nodes"]))'
}
sched_node() {
  api_expect 200 GET /api/v1/admin/scheduler
  python3 - "$1" "$2" "$RESP" <<'PY'
import json, sys
nodes = [n for n in json.load(open(sys.argv[3]))["nodes"] if n["node_id"] == sys.argv[1]]
d = nodes[0] if nodes else None
v = eval(sys.argv[2])
print(v if isinstance(v, str) else json.dumps(v))
PY
}
sched_is() { [ "$(sched_node "$1" "$2")" = true ]; }

# ---------------------------------------------------------------------------------------------
# Steps
# ---------------------------------------------------------------------------------------------

step() {
  local name=$1; shift
  say ""
  say "=== $name ==="
  local start=$EPOCHREALTIME
  "$@"
  local took; took=$(elapsed "$start")
  DURATIONS+=("$(printf '%-52s %6s s' "$name" "$took")")
  say "--- $name: ${took} s"
}

build_and_start() {
  say "binaries: $BIN_DIR; project $PROJECT; subnet $MF_NET.0/24; API on 127.0.0.1:${PORTS[*]}"
  if ! bash docker/build-images.sh "$BIN_DIR" 2>&1 \
      | grep -v -e DEPRECATED -e 'legacy builder' -e buildx -e 'docs.docker.com' -e '^ *$'; then
    die "image build failed"
  fi
  compose up -d m1 m2 m3 >/dev/null 2>&1 || { compose up -d m1 m2 m3; die "compose up failed"; }
  wait_for "three members ready (/readyz) with one leader" "$WAIT" cluster_ready
  say "    cluster: leader $(j 'd["leader_id"]'), term $(j 'd["term"]'), cluster_id $(j 'd.get("cluster_id")')"
}

a_fresh_enrolment() {
  say "  checks: the agent enrols; heartbeats 200; 2 accelerators and telemetry on the node"
  local tok; tok=$(new_token fresh); agent_start "$tok"
  wait_for "agent wrote identity.json (node_id) and credential" "$WAIT" \
    bash -c "[ -s '$AGENT_DIR/credential' ] && grep -q node_id '$AGENT_DIR/identity.json'"
  NODE_A=$(agent_node_id); C1=$(agent_file credential)
  say "    node A = $NODE_A, credential C1 = $(cred_id "$C1")"
  wait_for "node A online" "$WAIT" node_online "$NODE_A"
  wait_for "node A shows 2 accelerators and telemetry" "$WAIT" node_inventory_and_telemetry "$NODE_A"
  check "heartbeat with C1: 200" is_status 200 "$C1" "$NODE_A"
  check "node A has 1 active credential" [ "$(active_credentials "$NODE_A")" = 1 ]
}

b_credential_lost() {
  say "  checks: credential deleted + new token -> same node id, old credential revoked, heartbeats 200"
  agent_stop
  rm -f "$AGENT_DIR/credential"
  ok "deleted $AGENT_DIR/credential (identity.json kept)"
  local tok; tok=$(new_token credential-lost); agent_start "$tok"
  wait_for "agent re-enrolled (a new credential file)" "$WAIT" \
    bash -c "[ -s '$AGENT_DIR/credential' ] && [ \"\$(cat '$AGENT_DIR/credential')\" != '$C1' ]"
  C2=$(agent_file credential)
  say "    credential C2 = $(cred_id "$C2")"
  check "same node id ($NODE_A)" [ "$(agent_node_id)" = "$NODE_A" ]
  check "C1 listed with revoked_at" cred_revoked "$NODE_A" "$C1"
  check "1 active credential" [ "$(active_credentials "$NODE_A")" = 1 ]
  check "heartbeat with C1: 401" is_status 401 "$C1" "$NODE_A"
  check "heartbeat with C2: 200" is_status 200 "$C2" "$NODE_A"
  wait_for "node A online" "$WAIT" node_online "$NODE_A"
}

c_credential_stolen() {
  say "  checks: admin revokes -> 401 for the agent's credential; re-enrol; the old one stays 401"
  C2=$(agent_file credential)   # kept now: the agent deletes its file when it is refused
  api_expect 200 DELETE "/api/v1/admin/hardware/nodes/$NODE_A/credential" '{"reason": "rehearsal: believed stolen"}'
  check "DELETE .../credential revoked C2 ($(j 'd["revoked"]'))" \
    [ "$(j "'$(cred_id "$C2")' in ' '.join(d['revoked'])")" = true ]
  check "heartbeat with C2: 401" is_status 401 "$C2" "$NODE_A"
  wait_for "agent refused and exited (token spent)" "$WAIT" agent_exited
  say "    agent exit status $(agent_exit_code): $(agent_last_log)"
  local tok; tok=$(new_token credential-stolen); agent_start "$tok"
  wait_for "agent re-enrolled (a new credential file)" "$WAIT" \
    bash -c "[ -s '$AGENT_DIR/credential' ] && [ \"\$(cat '$AGENT_DIR/credential')\" != '$C2' ]"
  C3=$(agent_file credential)
  say "    credential C3 = $(cred_id "$C3")"
  check "same node id ($NODE_A)" [ "$(agent_node_id)" = "$NODE_A" ]
  check "heartbeat with C2 after re-enrolment: still 401" is_status 401 "$C2" "$NODE_A"
  check "heartbeat with C3: 200" is_status 200 "$C3" "$NODE_A"
  check "1 active credential, C2 revoked" \
    bash -c "[ \"\$1\" = 1 ]" _ "$(active_credentials "$NODE_A")"
  check "C2 listed with revoked_at" cred_revoked "$NODE_A" "$C2"
}

d_identity_lost() {
  say "  checks: both files deleted -> a NEW node; two enabled nodes claim the hostname;"
  say "          allocation + backup; decommission the old node; one enabled node claims it"
  agent_stop
  C3=$(agent_file credential)
  rm -f "$AGENT_DIR/credential" "$AGENT_DIR/identity.json"
  ok "deleted credential and identity.json"
  local tok; tok=$(new_token identity-lost); agent_start "$tok"
  wait_for "agent enrolled" "$WAIT" \
    bash -c "[ -s '$AGENT_DIR/credential' ] && grep -q node_id '$AGENT_DIR/identity.json'"
  NODE_B=$(agent_node_id); C4=$(agent_file credential)
  say "    node B = $NODE_B, credential C4 = $(cred_id "$C4")"
  check "a new node id ($NODE_B != $NODE_A)" [ "$NODE_B" != "$NODE_A" ]
  local claim; claim=$(enabled_claimants)
  check "hostname conflict shown: enabled nodes [$claim]" \
    [ "$claim" = "$(printf '%s\n' "$NODE_A" "$NODE_B" | sort | tr '\n' ' ' | sed 's/ $//')" ]

  # An allocation on B, so that the restore has one to distrust and reconcile.
  wait_for "node B verified and offered by the scheduler" "$WAIT" sched_is "$NODE_B" 'd is not None and d["verified"] and d["offered"]'
  api_expect 201 POST /api/v1/allocations '{"accelerators": 1, "owner": "rehearsal"}'
  ALLOC=$(j 'd["allocation_id"]')
  check "allocation $ALLOC placed on node B" [ "$(j 'd["node_id"]')" = "$NODE_B" ]

  # The backup: C4 (the agent's) and C3 (the old node's) are both active in it.
  take_backup

  # After the backup: the superseded identity is decommissioned, which revokes C3.
  decommission_old_node
  check "heartbeat with C3 (the old node's): 401" is_status 401 "$C3" "$NODE_A"
  if [ "$DECOMMISSIONED" = 1 ]; then
    claim=$(enabled_claimants)
    check "exactly one enabled node claims $HOSTNAME_UNDER_TEST: [$claim]" [ "$claim" = "$NODE_B" ]
  fi
}

take_backup() {
  BACKUP=$MF_DATA/cluster.backup
  local status
  status=$(curl --cacert "$CACERT" -sS -m 60 -o "$BACKUP" -w '%{http_code}' -H "Authorization: Bearer $ADMIN" \
    "https://127.0.0.1:${PORTS[1]}/api/v1/admin/backup") || status=000
  check "backup from member 2: HTTP $status, $(stat -c %s "$BACKUP") bytes, magic $(head -c 8 "$BACKUP" | tr -cd '[:print:]')" \
    bash -c "[ '$status' = 200 ] && [ \"\$(head -c 8 '$BACKUP')\" = MFBACKUP ]"
}

DECOMMISSIONED=0
decommission_old_node() {
  api POST "/api/v1/admin/hardware/nodes/$NODE_A/decommission/preview" '{}'
  if [ "$STATUS" = 404 ] && [ "$(j 'd["error"]["code"]')" = not_found ]; then
    say "    NOT RUN: decommission preview/execute: these binaries have no such endpoint (404 $(j 'd["error"]["message"]'))"
    NOT_RUN+=("d: decommission preview/execute (endpoint missing: 404)")
    say "    instead, to keep a revocation after the backup: DELETE the old node's credential"
    api_expect 200 DELETE "/api/v1/admin/hardware/nodes/$NODE_A/credential" '{"reason": "rehearsal: identity superseded"}'
    ok "revoked $(j 'd["revoked"]') (C3) after the backup"
    return 0
  fi
  local preview _
  for _ in 1 2 3; do
    [ "$STATUS" = 200 ] || die "decommission preview answered $STATUS: $(head -c 400 "$RESP")"
    preview=$(j 'd["preview_id"]')
    say "    preview $preview, effects: $(j 'd["effects"]')"
    api POST "/api/v1/admin/hardware/nodes/$NODE_A/decommission/execute" \
      "{\"preview_id\": \"$preview\", \"reason\": \"rehearsal: identity file lost, superseded by $NODE_B\"}"
    # 409: something the preview showed changed meanwhile; the runbook's answer is a new preview.
    [ "$STATUS" = 409 ] || break
    say "    execute answered 409 ($(head -c 300 "$RESP")): previewing again"
    api POST "/api/v1/admin/hardware/nodes/$NODE_A/decommission/preview" '{}'
  done
  [ "$STATUS" = 200 ] || die "decommission execute answered $STATUS: $(head -c 400 "$RESP")"
  say "    executed: $(head -c 600 "$RESP")"
  check "execute revoked C3" [ "$(j "'$(cred_id "$C3")' in ' '.join(d.get('revoked', []))")" = true ]
  check "node A status decommissioned" [ "$(node_field "$NODE_A" 'd["status"]')" = decommissioned ]
  DECOMMISSIONED=1
}

e_restore() {
  say "  checks: stop all members, restore every data dir from the backup with all journals,"
  say "          start them: the restored cluster reports cluster_id restored-..."
  api_expect 200 GET /api/v1/cluster
  OLD_CLUSTER_ID=$(j 'd.get("cluster_id")')
  # The agent is frozen (not restarted) while the control plane is replaced, so that the
  # restored allocation can be seen unconfirmed before the node's first fresh report.
  compose pause agent >/dev/null 2>&1 || die "could not pause the agent"
  ok "agent paused (its process keeps its state; it is never restarted)"
  compose stop -t 10 m1 m2 m3 >/dev/null 2>&1 || die "could not stop the members"
  ok "members stopped"
  RESTORE_AT=$(date +%s)
  local i journals=()
  for i in 1 2 3; do
    mv "$MF_DATA/m$i" "$MF_DATA/old-m$i"
    mkdir "$MF_DATA/m$i"
    journals+=(--journal "/rehearsal/old-m$i")
  done
  ok "data dirs moved aside (old-m1..3)"
  for i in 1 2 3; do
    say "    restore into m$i:"
    # The backup's MAC is checked with the cluster secret (passed by name: never in argv).
    MODELFORGE_CLUSTER_SECRET="$MF_CLUSTER_SECRET" \
      docker run --rm --network none --user "$MF_USER" -e MODELFORGE_CLUSTER_SECRET \
      -v "$MF_DATA:/rehearsal" "$MF_IMAGE" \
      modelforge restore --from /rehearsal/cluster.backup --data-dir "/rehearsal/m$i" "${journals[@]}" \
      >"$WORK/restore-m$i.txt" 2>&1 || { cat "$WORK/restore-m$i.txt"; die "restore of m$i failed"; }
    sed 's/^/      /' "$WORK/restore-m$i.txt"
  done
  check "the restore re-applied the revocation of C3 (made after the backup)" \
    grep -q "$(cred_id "$C3")" "$WORK/restore-m1.txt"
  compose start m1 m2 m3 >/dev/null 2>&1 || die "could not start the members"
  wait_for "restored members ready with one leader" "$WAIT" cluster_ready
  NEW_CLUSTER_ID=$(j 'd.get("cluster_id")')
  check "cluster_id $NEW_CLUSTER_ID (was $OLD_CLUSTER_ID)" \
    bash -c "[[ '$NEW_CLUSTER_ID' == restored-* ]] && [ '$NEW_CLUSTER_ID' != '$OLD_CLUSTER_ID' ]"
}

f_after_restore() {
  say "  checks: allocation unconfirmed until B reports; the agent reconnects by itself; C3 stays"
  say "          refused; B verified, allocation released; smoke passes; B offered"
  check "before B reports: not verified, allocation $ALLOC unconfirmed" sched_is "$NODE_B" \
    "d is not None and not d['verified'] and any(a['allocation_id'] == '$ALLOC' and a['state'] == 'unconfirmed' for a in d['allocations'])"
  compose unpause agent >/dev/null 2>&1 || die "could not unpause the agent"
  ok "agent unpaused"
  wait_for "node B heartbeats again (last_heartbeat_at after the restore, status online)" "$WAIT" \
    heartbeat_since_restore "$NODE_B"
  check "the agent was never restarted and still holds C4" \
    bash -c "[ \"\$(cat '$AGENT_DIR/credential')\" = '$C4' ]"
  check "agent container still running" agent_running
  check "heartbeat with C4 (in the backup): 200" is_status 200 "$C4" "$NODE_B"
  check "heartbeat with C3 (revoked after the backup): 401" is_status 401 "$C3" "$NODE_A"
  check "heartbeat with C2 (revoked before the backup): 401" is_status 401 "$C2" "$NODE_A"
  wait_for "scheduler: B verified (fresh report since the restore)" "$WAIT" sched_is "$NODE_B" 'd["verified"]'
  wait_for "scheduler: allocation $ALLOC reconciled (released: nothing runs on it)" "$WAIT" \
    sched_is "$NODE_B" "not any(a['allocation_id'] == '$ALLOC' for a in d['allocations'])"
  node_json "$NODE_B"
  RELEASE_EVENT=$(j "next((e for e in d['history'] if 'allocation_released' in json.dumps(e) and '$ALLOC' in json.dumps(e)), None)")
  check "node B history: $RELEASE_EVENT" [ "$RELEASE_EVENT" != null ]
  check "scheduler: B not offered yet (a restored node needs a smoke)" sched_is "$NODE_B" 'not d["offered"] and d["smoke_required"]'

  api_expect 202 POST "/api/v1/admin/hardware/nodes/$NODE_B/smoke" '{}'
  SMOKE=$(j 'd["smoke_id"]')
  ok "smoke $SMOKE requested"
  wait_for "smoke $SMOKE finished" "$WAIT" smoke_finished "$NODE_B" "$SMOKE"
  say "    checks: $(j '[(c["name"], c["ok"]) for c in d["checks"]]')"
  check "smoke state passed" [ "$(j 'd["state"]')" = passed ]
  wait_for "scheduler: B offered" "$WAIT" sched_is "$NODE_B" 'd["offered"]'
}

# py_epoch EXPR: a Python expression turning the RFC 3339 time EXPR (or None) into epoch seconds.
py_epoch() {
  printf "(__import__('datetime').datetime.fromisoformat((%s or '1970-01-01T00:00:00Z').replace('Z', '+00:00')).timestamp())" "$1"
}
heartbeat_since_restore() {
  node_json "$1"
  [ "$(j "d['status'] == 'online' and $(py_epoch "d['last_heartbeat_at']") > $RESTORE_AT")" = true ]
}
smoke_finished() {
  api_expect 200 GET "/api/v1/admin/hardware/nodes/$1/smoke/$2"
  case $(j 'd["state"]') in passed|failed) return 0 ;; *) return 1 ;; esac
}

# ---------------------------------------------------------------------------------------------
# The runbook's Confirm checklist, on the restored cluster
# ---------------------------------------------------------------------------------------------

CONFIRM_FAILED=0
confirm() {
  local what=$1 evidence=$2; shift 2
  if "$@"; then say "[x] $what: $evidence"; else say "[ ] $what: $evidence"; CONFIRM_FAILED=1; fi
}

confirm_checklist() {
  say ""
  say "=== Confirm (runbook) ==="
  local claim; claim=$(enabled_claimants)
  if [ "$DECOMMISSIONED" = 1 ]; then
    confirm "exactly one enabled node for that hardware" "enabled nodes claiming $HOSTNAME_UNDER_TEST: [$claim]; $NODE_A is $(node_field "$NODE_A" 'd["status"]')" \
      [ "$claim" = "$NODE_B" ]
  else
    confirm "exactly one enabled node for that hardware" "NOT RUN (no decommission endpoint): enabled nodes claiming $HOSTNAME_UNDER_TEST: [$claim]" \
      [ "$claim" = "$NODE_B" ]
  fi
  # Inventory and telemetry first: the heartbeat probes below send `{}` as telemetry.
  node_json "$NODE_B"
  confirm "inventory and telemetry re-collected" \
    "$(j 'len(d["accelerators"])') accelerators, verified since the restore: $(j 'd.get("accelerators_verified")') (at $(j 'd.get("accelerators_verified_at")')); telemetry of $(j 'len((d.get("telemetry") or {}).get("accelerators", []))') GPUs at $(j 'd.get("telemetry_at")')" \
    bash -c "[ \"\$1\" = true ]" _ "$(j "len(d['accelerators']) == 2 and d.get('accelerators_verified') is True and len((d.get('telemetry') or {}).get('accelerators', [])) == 2 and d.get('telemetry_at') is not None and $(py_epoch "d['telemetry_at']") > $RESTORE_AT")"
  creds_json "$NODE_B"
  local b_active; b_active=$(j 'd["active"]')
  local a_active; a_active=$(active_credentials "$NODE_A")
  local c1 c2 c3 c4
  c1=$(heartbeat_decided "$C1" "$NODE_A"); c2=$(heartbeat_decided "$C2" "$NODE_A")
  c3=$(heartbeat_decided "$C3" "$NODE_A"); c4=$(heartbeat_decided "$C4" "$NODE_B")
  confirm "one active credential, the old ones revoked" \
    "node B active $b_active; old node A active $a_active; C1/C2/C3 answer $c1/$c2/$c3" \
    bash -c "[ $b_active = 1 ] && [ $a_active = 0 ] && [ $c1$c2$c3 = 401401401 ]"
  node_json "$NODE_B"
  confirm "heartbeats returning 200" "C4 heartbeat $c4; node B $(j 'd["status"]'), last heartbeat $(j 'd["last_heartbeat_at"]') (after the restore)" \
    bash -c "[ $c4 = 200 ] && [ \"\$1\" = true ]" _ "$(j "d['status'] == 'online' and $(py_epoch "d['last_heartbeat_at']") > $RESTORE_AT")"
  confirm "scheduler reconciled against fresh NVML (simulated) state" \
    "verified $(sched_node "$NODE_B" 'd["verified"]'), allocations $(sched_node "$NODE_B" '[(a["allocation_id"], a["state"]) for a in d["allocations"]]'); $ALLOC: $RELEASE_EVENT" \
    sched_is "$NODE_B" "d['verified'] and all(a['state'] == 'confirmed' for a in d['allocations']) and not any(a['allocation_id'] == '$ALLOC' for a in d['allocations'])"
  api_expect 200 GET "/api/v1/admin/hardware/nodes/$NODE_B/smoke/$SMOKE"
  confirm "capability smoke against the recovered node" "smoke $SMOKE $(j 'd["state"]'); offered $(sched_node "$NODE_B" 'd["offered"]')" \
    bash -c "[ \"\$1\" = passed ] && [ \"\$2\" = true ]" _ "$(api_expect 200 GET "/api/v1/admin/hardware/nodes/$NODE_B/smoke/$SMOKE"; j 'd["state"]')" "$(sched_node "$NODE_B" 'd["offered"]')"
}

# ---------------------------------------------------------------------------------------------

step "start: image and 3-member cluster" build_and_start
step "a. fresh enrolment" a_fresh_enrolment
step "b. credential lost" b_credential_lost
step "c. credential believed stolen" c_credential_stolen
step "d. identity file lost (+ backup, decommission)" d_identity_lost
step "e. control-plane restore" e_restore
step "f. after the restore: reconnect, reconcile, smoke" f_after_restore
confirm_checklist

say ""
say "=== durations ==="
printf '%s\n' "${DURATIONS[@]}"
say "total: $(elapsed "$T0") s"
if [ "${#NOT_RUN[@]}" -gt 0 ]; then
  say ""
  say "NOT RUN:"
  printf '  %s\n' "${NOT_RUN[@]}"
fi
if [ "$CONFIRM_FAILED" != 0 ]; then
  if [ "${#NOT_RUN[@]}" -gt 0 ]; then
    say "rehearsal: INCOMPLETE (a step could not run; see NOT RUN above)"; exit 2
  fi
  say "rehearsal: FAILED (a Confirm line does not hold)"; FAILED=1; exit 1
fi
say "rehearsal: PASSED"
