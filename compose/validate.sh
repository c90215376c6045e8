#!/usr/bin/env bash
# Static checks of the compose deployment files; needs no Docker daemon and no network.
# Each check runs with the best tool present and says so when it has to skip:
#   compose file   docker compose config > docker-compose (v1) config > YAML + structure (python)
#   prometheus.yml promtool check config (its alerting rules too), promtool test rules
#   alertmanager   amtool check-config, and where critical and warning alerts are routed;
#                  its inhibitions, by the server itself (check_inhibitions.py)
#   dashboard      JSON + structure (python); its PromQL through promtool check rules
#   provisioning   YAML (python)
#   nats.conf      nats-server -t
#   haproxy.cfg    haproxy -c
#   shell scripts  sh -n, shellcheck when installed
#   Dockerfiles    one per service, the one it builds from, multi-stage, non-root, health check
#                  on the health port (python); paths they COPY exist; hadolint when installed
# Exit status: 1 when a check that ran failed, 0 otherwise (skips do not fail).
# Usage: compose/validate.sh    (from anywhere; installs nothing itself except PyYAML into a
#        temporary venv when python3 lacks it; promtool: apt-get install prometheus, amtool:
#        apt-get install prometheus-alertmanager (also the server the inhibition check starts);
#        cargo xtask setup installs that package and unpacks promtool;
#        haproxy: apt-get install haproxy, which cargo xtask setup does)
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
tmp="$(mktemp -d)"
# The v1 compose check needs its temporary copy next to the original (relative paths).
v1copy="$here/.validate-compose.yml"
# The stack refuses to start without compose/secrets (cargo xtask compose-secrets); where there
# are none, the checks run against throwaway ones made here and removed at exit.
secrets="$here/secrets"
made_secrets=""
if [ ! -e "$secrets" ]; then
  made_secrets="$secrets"
  mkdir -p "$secrets/nats"
  for f in gateway router denoiser codec cachestore controlnet grafana operator; do
    printf 'VALIDATE_ONLY=1\n' >"$secrets/$f.env"
  done
  printf 'authorization { users = [ { user: "admin", password: "validate-only" } ] }\n' \
    >"$secrets/nats/users.conf"
  if command -v openssl >/dev/null 2>&1; then
    openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=nats \
      -keyout "$secrets/nats/server-key.pem" -out "$secrets/nats/server-cert.pem" >/dev/null 2>&1
    cp "$secrets/nats/server-cert.pem" "$secrets/nats/ca.pem"
  else
    touch "$secrets/nats/server-key.pem" "$secrets/nats/server-cert.pem" "$secrets/nats/ca.pem"
  fi
fi
trap 'rm -rf "$tmp" "$v1copy" $made_secrets' EXIT

failed=0
pass() { printf 'PASS  %s\n' "$1"; }
fail() { printf 'FAIL  %s\n' "$1"; failed=1; }
skip() { printf 'SKIP  %s\n' "$1"; }
have() { command -v "$1" >/dev/null 2>&1; }

# promtool: on PATH, or where `cargo xtask setup` unpacks it from Debian's prometheus package.
cache="${DIFFMESH_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/diffmesh}"
promtool=""
if have promtool; then
  promtool=promtool
elif [ -x "$cache/bin/promtool" ]; then
  promtool="$cache/bin/promtool"
fi
# The Alertmanager server, for its inhibitions: Debian's package names it prometheus-alertmanager
# (and reads its templates from /usr/share, so it must be installed, not unpacked).
alertmanager=""
for candidate in alertmanager prometheus-alertmanager; do
  if have "$candidate"; then
    alertmanager="$(command -v "$candidate")"
    break
  fi
done
amtool=""
if have amtool; then
  amtool=amtool
elif [ -x "$cache/bin/amtool" ]; then
  amtool="$cache/bin/amtool"
fi

# A python3 that can import yaml, or empty.
python=""
if have python3 && python3 -c 'import yaml' >/dev/null 2>&1; then
  python=python3
elif have python3 && python3 -m venv "$tmp/venv" >/dev/null 2>&1 \
  && "$tmp/venv/bin/pip" install -q pyyaml >/dev/null 2>&1; then
  python="$tmp/venv/bin/python"
fi

# ---------------------------------------------------------------------------------------------
# Compose file
# ---------------------------------------------------------------------------------------------
compose="$here/docker-compose.yml"
if have docker && docker compose version >/dev/null 2>&1; then
  if out="$(docker compose -f "$compose" config -q 2>&1)"; then
    pass "docker compose config"
  else
    fail "docker compose config: $out"
  fi
elif have docker-compose; then
  # Compose v1 predates the top-level `name:` key; check a copy without it.
  grep -v '^name:' "$compose" >"$v1copy"
  if out="$(docker-compose -f "$v1copy" config -q 2>&1)"; then
    pass "docker-compose (v1) config (top-level 'name' removed for v1)"
  else
    fail "docker-compose (v1) config: $out"
  fi
  rm -f "$v1copy"
else
  if have docker; then
    why="the docker client here has no compose plugin"
  else
    why="neither 'docker compose' nor 'docker-compose' found"
  fi
  skip "compose CLI: $why; structural check only"
fi

if [ -n "$python" ]; then
  if out="$("$python" - "$compose" "$here" <<'EOF' 2>&1
import os, sys, yaml
path, here = sys.argv[1], sys.argv[2]
doc = yaml.safe_load(open(path))
services = doc["services"]
errors = []
mesh = ["gateway", "router", "denoiser", "codec", "cachestore"]
for name in mesh:
    s = services.get(name)
    if s is None:
        errors.append(f"service {name} missing")
        continue
    for key in ("image", "build", "environment", "healthcheck", "deploy"):
        if key not in s:
            errors.append(f"{name}: no {key}")
    if "replicas" not in s.get("deploy", {}):
        errors.append(f"{name}: no deploy.replicas")
    env = s.get("environment", {})
    for var in ("NATS_URL", "OTEL_EXPORTER_OTLP_ENDPOINT", "HEALTH_ADDR", "JS_REPLICAS"):
        if var not in env:
            errors.append(f"{name}: environment lacks {var}")
    dockerfile = os.path.join(here, "..", s.get("build", {}).get("dockerfile", ""))
    if not os.path.isfile(dockerfile):
        errors.append(f"{name}: dockerfile {dockerfile} not found")
for name in ("nats-1", "nats-2", "nats-3", "balancer", "prometheus", "alertmanager", "grafana",
             "jaeger"):
    if name not in services:
        errors.append(f"service {name} missing")
# Replicas cannot share a fixed host port: the API is published by the balancer.
gateway = services.get("gateway", {})
if gateway.get("deploy", {}).get("replicas", 1) > 1 and gateway.get("ports"):
    errors.append("gateway: host ports with more than one replica (publish the balancer's)")
for name, s in services.items():
    for vol in s.get("volumes", []):
        src = vol.split(":")[0] if isinstance(vol, str) else vol.get("source", "")
        if src.startswith("./") and not os.path.exists(os.path.join(here, src)):
            errors.append(f"{name}: bind-mount source {src} not found")
# Secure by default (issue 46): every service reaches NATS over TLS as its own user, the gateway
# refuses an open API unless told, Grafana has no default password nor anonymous access.
for name in mesh + ["controlnet"]:
    s = services.get(name, {})
    env = s.get("environment", {})
    if not str(env.get("NATS_URL", "")).startswith("tls://"):
        errors.append(f"{name}: NATS_URL is not tls://")
    if "NATS_CA_FILE" not in env:
        errors.append(f"{name}: no NATS_CA_FILE")
    if s.get("env_file") != f"./secrets/{name}.env":
        errors.append(f"{name}: env_file is not ./secrets/{name}.env (its NATS user)")
if str(gateway.get("environment", {}).get("GATEWAY_INSECURE_NO_AUTH", "")) != "${GATEWAY_INSECURE_NO_AUTH:-false}":
    errors.append("gateway: GATEWAY_INSECURE_NO_AUTH must default to false")
grafana = services.get("grafana", {})
genv = grafana.get("environment", {})
if "GF_SECURITY_ADMIN_PASSWORD" in genv or grafana.get("env_file") != "./secrets/grafana.env":
    errors.append("grafana: its admin password must come from ./secrets/grafana.env only")
if not str(genv.get("GF_AUTH_ANONYMOUS_ENABLED", "")).endswith(":-false}"):
    errors.append("grafana: anonymous access must default to off")
nats_conf = open(os.path.join(here, "nats", "nats.conf")).read()
for needle in ("tls {", "include ./secrets/users.conf", "verify: true"):
    if needle not in nats_conf:
        errors.append(f"nats.conf lacks `{needle}`")
if errors:
    print("; ".join(errors))
    sys.exit(1)
print(f"{len(services)} services, TLS and users on NATS, no default passwords")
EOF
)"; then
    pass "compose structure: $out"
  else
    fail "compose structure: $out"
  fi
else
  skip "compose structure: python3 with PyYAML unavailable (and could not be installed)"
fi

# ---------------------------------------------------------------------------------------------
# Prometheus
# ---------------------------------------------------------------------------------------------
if [ -n "$promtool" ]; then
  if out="$("$promtool" check config "$here/prometheus/prometheus.yml" 2>&1)"; then
    pass "promtool check config prometheus/prometheus.yml"
  else
    fail "promtool check config: $out"
  fi
  # The alerting rules fire on the series they are meant for, and only after their `for:`.
  if out="$(cd "$here/prometheus" && "$promtool" test rules alerts.test.yml 2>&1)"; then
    pass "promtool test rules prometheus/alerts.test.yml"
  else
    fail "promtool test rules: $out"
  fi
else
  skip "promtool not found on PATH nor in $cache/bin (cargo xtask setup unpacks it from Debian's prometheus package)"
fi

# ---------------------------------------------------------------------------------------------
# Alertmanager: its config, and the routing the README promises (critical pages, the rest
# files a ticket)
# ---------------------------------------------------------------------------------------------
amconfig="$here/alertmanager/alertmanager.yml"
if [ -n "$amtool" ]; then
  if out="$("$amtool" check-config "$amconfig" 2>&1)"; then
    pass "amtool check-config alertmanager/alertmanager.yml"
  else
    fail "amtool check-config: $out"
  fi
  for route in "critical:page" "warning:ticket"; do
    severity="${route%%:*}" receiver="${route##*:}"
    if out="$("$amtool" config routes test --config.file="$amconfig" \
      --verify.receivers="$receiver" alertname=DiffmeshTest "severity=$severity" 2>&1)"; then
      pass "alertmanager routes severity=$severity to $receiver"
    else
      fail "alertmanager routes severity=$severity: $out"
    fi
  done
else
  skip "amtool not found on PATH nor in $cache/bin (cargo xtask setup unpacks it from Debian's prometheus-alertmanager package)"
fi

# Inhibitions, evaluated by the server itself against alerts labelled as the rules label them.
if [ -n "$alertmanager" ] && [ -n "$python" ]; then
  if out="$("$python" "$here/check_inhibitions.py" "$alertmanager" "$here" 2>&1)"; then
    pass "alertmanager inhibitions: $(printf '%s' "$out" | tr '\n' ';' | sed 's/;$//; s/;/; /g')"
  else
    fail "alertmanager inhibitions: $out"
  fi
else
  skip "alertmanager inhibitions: no Alertmanager server on PATH (apt-get install prometheus-alertmanager, which cargo xtask setup does) or no python3 with yaml"
fi

# Prometheus sends its alerts to the stack's Alertmanager.
if [ -n "$python" ]; then
  if out="$("$python" - "$here/prometheus/prometheus.yml" <<'EOF' 2>&1
import sys, yaml
doc = yaml.safe_load(open(sys.argv[1]))
targets = [t for am in doc.get("alerting", {}).get("alertmanagers", [])
           for c in am.get("static_configs", []) for t in c.get("targets", [])]
if "alertmanager:9093" not in targets:
    print(f"alerting targets {targets} lack alertmanager:9093")
    sys.exit(1)
print("alertmanager:9093")
EOF
)"; then
    pass "prometheus sends alerts to $out"
  else
    fail "prometheus alerting: $out"
  fi
fi

# Every mesh service is scraped, on the port its HEALTH_ADDR binds.
if [ -n "$python" ]; then
  if out="$("$python" - "$here/prometheus/prometheus.yml" <<'EOF' 2>&1
import sys, yaml
doc = yaml.safe_load(open(sys.argv[1]))
jobs = {j["job_name"]: j for j in doc.get("scrape_configs", [])}
errors = []
for name in ("gateway", "router", "denoiser", "codec", "cachestore"):
    job = jobs.get(name)
    if job is None:
        errors.append(f"no scrape job {name}")
        continue
    ports = [c.get("port") for c in job.get("dns_sd_configs", [])]
    targets = [t for c in job.get("static_configs", []) for t in c.get("targets", [])]
    if 9090 not in ports and not any(t.endswith(":9090") for t in targets):
        errors.append(f"{name}: not scraped on the health port 9090")
    if job.get("metrics_path", "/metrics") != "/metrics":
        errors.append(f"{name}: metrics_path is not /metrics")
if errors:
    print("; ".join(errors))
    sys.exit(1)
print(f"{len(jobs)} scrape jobs")
EOF
)"; then
    pass "prometheus scrape jobs: $out"
  else
    fail "prometheus scrape jobs: $out"
  fi
fi

# ---------------------------------------------------------------------------------------------
# Grafana: dashboard JSON and its PromQL, provisioning YAML
# ---------------------------------------------------------------------------------------------
dashboard="$here/grafana/dashboards/diffmesh-overview.json"
if have python3; then
  # Writes every panel query as a recording rule (Grafana macros replaced) for promtool.
  if out="$(python3 - "$dashboard" "$tmp/dashboard-rules.yml" <<'EOF' 2>&1
import json, sys
dash = json.load(open(sys.argv[1]))
errors, exprs, ids = [], [], set()
for key in ("uid", "title", "panels", "schemaVersion"):
    if key not in dash:
        errors.append(f"dashboard lacks {key}")
for p in dash.get("panels", []):
    if p.get("id") in ids:
        errors.append(f"duplicate panel id {p.get('id')}")
    ids.add(p.get("id"))
    if p.get("type") == "row":
        continue
    ds = p.get("datasource", {})
    if ds.get("uid") != "prometheus":
        errors.append(f"panel {p.get('title')!r}: datasource uid {ds.get('uid')!r} is not provisioned")
    for t in p.get("targets", []):
        if not t.get("expr"):
            errors.append(f"panel {p.get('title')!r}: target {t.get('refId')} has no expr")
        exprs.append(t.get("expr", ""))
# The views the deployment promises, each recognised by what its queries read.
everything = " ".join(exprs)
views = {
    "queue depth": ["diffmesh_router_admission_waiting", "diffmesh_denoiser_queued_jobs"],
    "latency percentiles": ["histogram_quantile(0.5,", "histogram_quantile(0.95,",
                            "histogram_quantile(0.99,", "diffmesh_gateway_request_duration_seconds_bucket"],
    "batch size": ["diffmesh_denoiser_batch_rows"],
    "cache hit rate": ["diffmesh_cachestore_hits_total", "diffmesh_cachestore_misses_total"],
    "per-worker load": ["by (instance) (diffmesh_denoiser_running_jobs)"],
    "NATS round trip": ["diffmesh_nats_request_duration_seconds_bucket"],
    "queueing latency": ["diffmesh_denoiser_queue_wait_seconds_bucket"],
}
for view, needles in views.items():
    lacking = [n for n in needles if n not in everything]
    if lacking:
        errors.append(f"no {view} panel (its queries would read {', '.join(lacking)})")
subst = {"$__rate_interval": "1m", "$__interval": "1m", "${histogram}": "diffmesh_x_seconds"}
with open(sys.argv[2], "w") as f:
    f.write("groups:\n  - name: dashboard\n    rules:\n")
    for i, e in enumerate(exprs):
        for k, v in subst.items():
            e = e.replace(k, v)
        f.write(f"      - record: dashboard:expr_{i}\n        expr: {json.dumps(e)}\n")
if errors:
    print("; ".join(errors))
    sys.exit(1)
print(f"{len(dash['panels'])} panels, {len(exprs)} queries")
EOF
)"; then
    pass "dashboard JSON: $out"
    if [ -n "$promtool" ]; then
      if rules="$("$promtool" check rules "$tmp/dashboard-rules.yml" 2>&1)"; then
        pass "dashboard PromQL parses (promtool check rules)"
      else
        fail "dashboard PromQL: $rules"
      fi
    else
      skip "dashboard PromQL: promtool not found"
    fi
  else
    fail "dashboard JSON: $out"
  fi
else
  skip "dashboard JSON: python3 not found"
fi

# Every diffmesh_* metric the dashboard queries or an alerting rule names must be defined in the
# Rust sources: as a string literal, or through shared::metrics helpers (histogram_vec /
# counter_vec / FailureCounter).
if have python3; then
  if out="$(python3 - "$dashboard" "$root" "$here/prometheus/alerts.yml" <<'EOF' 2>&1
import json, pathlib, re, sys
dash = json.load(open(sys.argv[1]))
root = pathlib.Path(sys.argv[2])
used = set()
for p in dash.get("panels", []):
    for t in p.get("targets", []):
        used |= set(re.findall(r"diffmesh_[a-z0-9_]+", t.get("expr", "")))
for line in open(sys.argv[3]):
    if not line.lstrip().startswith("#"):
        used |= set(re.findall(r"diffmesh_[a-z0-9_]+", line))
suffix = {"Seconds": "_seconds", "Bytes": "_bytes", "Total": "_total", "Ratio": "_ratio", "None": ""}
defined = set()
for path in list(root.glob("services/*/src/**/*.rs")) + list(root.glob("shared/src/**/*.rs")):
    text = path.read_text(errors="replace")
    defined |= set(re.findall(r'"(diffmesh_[a-z0-9_]+)"', text))
    for sub, name, unit in re.findall(r'histogram_vec\(\s*[^,]+,\s*"(\w+)",\s*"(\w+)",\s*Unit::(\w+)', text):
        defined.add(f"diffmesh_{sub}_{name}{suffix.get(unit, '')}")
    for sub, name in re.findall(r'counter_vec\(\s*[^,]+,\s*"(\w+)",\s*"(\w+)"', text):
        defined.add(f"diffmesh_{sub}_{name}_total")
    for sub in re.findall(r'FailureCounter::register\(\s*[^,]+,\s*"(\w+)"', text):
        defined.add(f"diffmesh_{sub}_failures_total")
def base(name):
    for s in ("_bucket", "_sum", "_count"):
        if name.endswith(s) and name[: -len(s)] in defined:
            return name[: -len(s)]
    return name
missing = sorted(n for n in used if base(n) not in defined)
if missing:
    print("named by the dashboard or the alerts but defined nowhere in services/ or shared/: " + ", ".join(missing))
    sys.exit(1)
print(f"{len(used)} metric names, all defined in the sources")
EOF
)"; then
    pass "dashboard and alert metric names: $out"
  else
    fail "dashboard and alert metric names: $out"
  fi
fi

if [ -n "$python" ]; then
  for f in "$here"/grafana/provisioning/*/*.yml; do
    if out="$("$python" -c 'import sys, yaml; d = yaml.safe_load(open(sys.argv[1])); assert d.get("apiVersion") == 1, "apiVersion must be 1"' "$f" 2>&1)"; then
      pass "grafana provisioning ${f#"$here"/}"
    else
      fail "grafana provisioning ${f#"$here"/}: $out"
    fi
  done
else
  skip "grafana provisioning: python3 with PyYAML unavailable"
fi

# ---------------------------------------------------------------------------------------------
# NATS config and scripts
# ---------------------------------------------------------------------------------------------
if have nats-server; then
  # The config as the containers see it: secrets under /etc/nats/secrets, included relatively.
  ln -s "$secrets/nats" "$tmp/secrets"
  sed "s#/etc/nats/secrets#$tmp/secrets#g" "$here/nats/nats.conf" >"$tmp/nats.conf"
  if out="$(NATS_SERVER_NAME=validate nats-server -t -c "$tmp/nats.conf" 2>&1)"; then
    pass "nats-server -t nats/nats.conf"
  else
    fail "nats-server -t: $out"
  fi
else
  skip "nats-server not found (cargo xtask setup installs it)"
fi

# haproxy: on PATH, or where Debian puts it (/usr/sbin is not on every user's PATH).
haproxy=""
if have haproxy; then
  haproxy=haproxy
elif [ -x /usr/sbin/haproxy ]; then
  haproxy=/usr/sbin/haproxy
fi
if [ -n "$haproxy" ]; then
  if out="$("$haproxy" -c -q -f "$here/haproxy/haproxy.cfg" 2>&1)"; then
    pass "haproxy -c haproxy/haproxy.cfg"
  else
    fail "haproxy -c: $out"
  fi
else
  skip "haproxy not found (cargo xtask setup installs it)"
fi

# Each script with the shell its shebang names.
for f in "$here"/validate.sh; do
  shell="$(head -1 "$f" | grep -q bash && echo bash || echo sh)"
  if out="$("$shell" -n "$f" 2>&1)"; then
    pass "shell syntax ${f#"$here"/}"
  else
    fail "shell syntax ${f#"$here"/}: $out"
  fi
done
if have shellcheck; then
  if out="$(shellcheck "$here"/validate.sh 2>&1)"; then
    pass "shellcheck"
  else
    fail "shellcheck: $out"
  fi
else
  skip "shellcheck not found"
fi

# ---------------------------------------------------------------------------------------------
# Dockerfiles: one per mesh service (compose/<service>.Dockerfile), each the one its service
# builds from, multi-stage, running as a non-root user, with a health check on the health port.
# ---------------------------------------------------------------------------------------------
if [ -n "$python" ]; then
  if out="$("$python" - "$compose" "$here" gateway router codec cachestore denoiser <<'EOF' 2>&1
import glob, os, re, sys, yaml
compose, here, names = sys.argv[1], sys.argv[2], sys.argv[3:]
services = yaml.safe_load(open(compose))["services"]
errors = []
for name in names:
    rel = f"compose/{name}.Dockerfile"
    path = os.path.join(here, f"{name}.Dockerfile")
    if not os.path.isfile(path):
        errors.append(f"{rel} missing")
        continue
    build = (services.get(name) or {}).get("build") or {}
    if build.get("dockerfile") != rel:
        errors.append(f"service {name} builds from {build.get('dockerfile')!r}, not {rel}")
    # Instructions with their continuation lines joined, comments dropped.
    text = re.sub(r"\\\n", " ", open(path).read())
    lines = [l.strip() for l in text.splitlines() if l.strip() and not l.strip().startswith("#")]
    def instructions(keyword):
        return [l.split(None, 1)[1] if " " in l else "" for l in lines
                if l.split(None, 1)[0].upper() == keyword]
    stages = instructions("FROM")
    if len(stages) < 2:
        errors.append(f"{rel}: not a multi-stage build ({len(stages)} FROM)")
    stage_names = {s.split()[-1].lower() for s in stages if " as " in s.lower()}
    for copy in instructions("COPY"):
        m = re.search(r"--from=(\S+)", copy)
        if m and m.group(1).lower() not in stage_names:
            errors.append(f"{rel}: COPY --from={m.group(1)} names no stage")
    users = instructions("USER")
    if not users or users[-1].split(":")[0] in ("root", "0"):
        errors.append(f"{rel}: the final stage must switch to a non-root USER")
    checks = instructions("HEALTHCHECK")
    if not checks or "CMD" not in checks[-1]:
        errors.append(f"{rel}: no HEALTHCHECK CMD")
    elif not (re.search(r"HEALTH_ADDR|:9090", checks[-1]) and re.search(r"/(readyz|healthz)", checks[-1])):
        errors.append(f"{rel}: the HEALTHCHECK does not probe /readyz or /healthz on the health port")
    if not any("HEALTH_ADDR=" in e for e in instructions("ENV")):
        errors.append(f"{rel}: no ENV HEALTH_ADDR (the port the health check probes)")
    if not os.path.isfile(path + ".dockerignore"):
        errors.append(f"{rel}.dockerignore missing (the build context would include target/)")
used = {os.path.basename(((s or {}).get("build") or {}).get("dockerfile", "")) for s in services.values()}
for path in sorted(glob.glob(os.path.join(here, "*Dockerfile*"))):
    base = os.path.basename(path)
    if not base.endswith(".dockerignore") and base not in used:
        errors.append(f"compose/{base} is built by no service")
if errors:
    print("; ".join(errors))
    sys.exit(1)
print(f"{len(names)} Dockerfiles, each its service's, multi-stage, non-root, health-checked")
EOF
)"; then
    pass "Dockerfile per service: $out"
  else
    fail "Dockerfile per service: $out"
  fi
else
  skip "Dockerfile per service: python3 with PyYAML unavailable"
fi

for f in "$here"/*.Dockerfile; do
  name="${f#"$here"/}"
  # COPY sources relative to the build context (the repository root), other stages excluded.
  missing=""
  while read -r src; do
    [ -e "$root/$src" ] || missing="$missing $src"
  done < <(awk '$1 == "COPY" && $0 !~ /--from=/ { for (i = 2; i < NF; i++) if ($i !~ /^--/) print $i }' "$f")
  if [ -z "$missing" ]; then
    pass "$name: COPY sources exist"
  else
    fail "$name: COPY sources missing:$missing"
  fi
  if have hadolint; then
    if out="$(hadolint --ignore DL3008 "$f" 2>&1)"; then
      pass "hadolint $name"
    else
      fail "hadolint $name: $out"
    fi
  fi
done
have hadolint || skip "hadolint not found (Dockerfile lint)"

if [ "$failed" -ne 0 ]; then
  echo "compose/validate.sh: some checks FAILED"
  exit 1
fi
echo "compose/validate.sh: all checks that ran passed"
