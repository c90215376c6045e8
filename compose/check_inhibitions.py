"""Alertmanager's inhibitions against the alerts Prometheus really sends.

Starts the Alertmanager server (path in argv[1]) with alertmanager/alertmanager.yml on a free
port, posts alerts built from prometheus/alerts.yml (each rule's name and static labels, plus
the labels of the series a rule keeps: `job` and `instance` for DiffmeshReplicaDown), and reads
back which are suppressed. The labels come from the rules, not from this file, so a rule whose
labels stop matching an inhibition's `equal:` fails here (promtool tests rules, amtool routes;
neither evaluates inhibitions).

Rounds, each adding alerts to those already firing:
  1. only the alerts that could be inhibited: none is (nothing inhibits without a source);
  2. "no gateway", "no codec" and "no live denoisers": their services' replica-down alerts and
     the denoiser-dependent warnings are suppressed, the other services' are not;
  3. "no router" and "no cachestore": theirs are suppressed too.
Prints one line per round; exits 1 on the first mismatch.
Usage: check_inhibitions.py ALERTMANAGER_BINARY COMPOSE_DIR
"""
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import yaml

SERVICES = ["gateway", "router", "codec", "cachestore", "denoiser"]
# Alerts that follow from having no live denoiser (alertmanager.yml's second rule).
DENOISER_DEPENDENT = ["DiffmeshQueueingHigh", "DiffmeshCostModelOff", "DiffmeshOverloaded"]
NO_REPLICA = {
    "gateway": "DiffmeshNoGateway",
    "router": "DiffmeshNoRouter",
    "codec": "DiffmeshNoCodec",
    "cachestore": "DiffmeshNoCachestore",
    "denoiser": "DiffmeshNoLiveDenoisers",
}


def rules(compose_dir):
    doc = yaml.safe_load(open(os.path.join(compose_dir, "prometheus", "alerts.yml")))
    return {r["alert"]: r.get("labels", {}) for g in doc["groups"] for r in g["rules"] if "alert" in r}


def alert(rules_by_name, name, **series_labels):
    """An alert as Prometheus sends it: the series' labels, the rule's, and its name."""
    if name not in rules_by_name:
        raise SystemExit(f"prometheus/alerts.yml has no rule {name}")
    labels = dict(series_labels)
    labels.update({k: str(v) for k, v in rules_by_name[name].items()})
    labels["alertname"] = name
    return {"labels": labels}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(url, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as r:
        raw = r.read()
    return json.loads(raw) if raw else None


def key(labels):
    return (labels["alertname"], labels.get("job", ""))


def main():
    binary, compose_dir = sys.argv[1], sys.argv[2]
    by_name = rules(compose_dir)
    targets = [
        alert(by_name, "DiffmeshReplicaDown", job=svc, instance=f"{svc}-1:9090") for svc in SERVICES
    ] + [alert(by_name, name) for name in DENOISER_DEPENDENT]
    sources = {svc: alert(by_name, name) for svc, name in NO_REPLICA.items()}

    port = free_port()
    base = f"http://127.0.0.1:{port}/api/v2"
    with tempfile.TemporaryDirectory() as storage:
        server = subprocess.Popen(
            [
                binary,
                f"--config.file={os.path.join(compose_dir, 'alertmanager', 'alertmanager.yml')}",
                f"--storage.path={storage}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--cluster.listen-address=",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            wait_ready(base, server)
            suppressed_services = set()
            denoiser_down = False
            rounds = [[], ["gateway", "codec", "denoiser"], ["router", "cachestore"]]
            for n, down in enumerate(rounds, start=1):
                posted = targets + [sources[s] for s in suppressed_services | set(down)]
                call(f"{base}/alerts", posted)
                suppressed_services |= set(down)
                denoiser_down = denoiser_down or "denoiser" in down
                expected = {key(t["labels"]): False for t in targets}
                for svc in suppressed_services:
                    expected[("DiffmeshReplicaDown", svc)] = True
                if denoiser_down:
                    for name in DENOISER_DEPENDENT:
                        expected[key(alert(by_name, name)["labels"])] = True
                check_round(base, n, down, expected)
        finally:
            server.terminate()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()


def wait_ready(base, server):
    deadline = time.time() + 20
    while time.time() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"alertmanager exited: {server.stderr.read().decode()[-2000:]}")
        try:
            call(f"{base}/status")
            return
        except OSError:
            time.sleep(0.2)
    raise SystemExit("alertmanager did not answer within 20 s")


def check_round(base, n, down, expected):
    """Poll until the suppressed set is as expected (the inhibitor learns of sources
    asynchronously) or 10 s have passed."""
    deadline = time.time() + 10
    while True:
        got = {}
        for a in call(f"{base}/alerts"):
            k = key(a["labels"])
            if k in expected:
                got[k] = bool(a["status"]["inhibitedBy"])
        if got == expected or time.time() > deadline:
            break
        time.sleep(0.2)
    wrong = sorted(
        f"{name}{{job={job}}} {'not ' if want else ''}suppressed"
        for (name, job), want in expected.items()
        if got.get((name, job)) != want
    )
    what = ", ".join(f"no {d}" for d in down) or "no source alerts"
    if wrong:
        print(f"round {n} ({what}): " + "; ".join(wrong))
        sys.exit(1)
    print(f"round {n} ({what}): {sum(expected.values())} of {len(expected)} suppressed as expected")


if __name__ == "__main__":
    main()
