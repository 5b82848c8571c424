"""`make compose-test`: docker-compose.yml built and run on this machine, end to end.

Starts a private Docker engine (infra/compose/engine.sh; installs docker.io when missing), builds the
Debian base with debootstrap (infra/compose/base.sh) and every image on it (infra/compose/local-images.yml),
then runs the stack on configs/compose-test.yaml with two env workers and checks, in order:
  1. every long-running service answers on its Prometheus port (9100) with rollstream's metrics;
  2. a learner killed (SIGKILL, as a crash) after its first published version is restarted by its restart
     policy and resumes from its checkpoint (its log says at which step);
  3. an engine of the current pool killed after version 2 is restarted and rejoins at the version its pool
     holds (its log says which), healthy again;
  4. the report job exits 0 and leaves report.md and summary.json in the `runs` volume, counting max_steps
     learner steps;
  5. both env workers joined the `tasks` consumer group and rolled out trajectories of the run;
  6. `rollstream replay verify` passes on the run's topics;
  7. `down -v` leaves no container, network, volume or overlay mount of the project behind.
Progress on stderr; one JSON summary on stdout; exit 1 at the first failed check (the stack is taken
down all the same).

    .venv/bin/python infra/compose/test.py [--keep-up] [--timeout-s 3600]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENGINE_SOCKET = REPO / ".run" / "compose-engine" / "docker.sock"
PROJECT = "rollstream-compose-test"
CONFIG = "configs/compose-test.yaml"
PROCESSES = ("engine-current", "engine-stale", "streams", "env-worker", "learner", "dispatcher")
WORKERS = 2
STEPS = 8  # configs/compose-test.yaml's max_steps


class CheckFailed(Exception):
    pass


def say(line: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} compose-test: {line}", file=sys.stderr, flush=True)


def environment(run: str) -> dict[str, str]:
    return {**os.environ, "DOCKER_HOST": f"unix://{ENGINE_SOCKET}", "BASE_IMAGE": "rollstream-base:bookworm",
            "MINIO_ROOT_PASSWORD": "compose-test-secret", "ROLLSTREAM_CONFIG": CONFIG, "ROLLSTREAM_RUN": run,
            "COMPOSE_PROJECT_NAME": PROJECT,
            # ports of their own: a machine's own Kafka and MinIO (infra/up.sh) may hold 9092 and 9000
            "KAFKA_PUBLISHED_PORT": "19092", "MINIO_PUBLISHED_PORT": "19000"}


def sh(argv: list[str], env: dict[str, str], *, check: bool = True, capture: bool = True,
       timeout: float | None = None) -> subprocess.CompletedProcess:
    """Runs a command; its stdout captured (else sent to our stderr, which carries the progress)."""
    result = subprocess.run(argv, cwd=REPO, env=env, text=True, timeout=timeout,
                            stdout=subprocess.PIPE if capture else sys.stderr,
                            stderr=subprocess.PIPE if capture else sys.stderr)
    if check and result.returncode != 0:
        output = (result.stdout or "") + (result.stderr or "")
        raise CheckFailed(f"{' '.join(argv[:6])} exited {result.returncode}: {output[-2000:]}")
    return result


def compose(env: dict[str, str], *args: str, **kw) -> subprocess.CompletedProcess:
    return sh(["docker-compose", "-f", "docker-compose.yml", "-f", "infra/compose/local-images.yml", *args], env, **kw)


def container_ids(env: dict[str, str], service: str) -> list[str]:
    return compose(env, "ps", "-q", service).stdout.split()


def inspect(env: dict[str, str], cid: str, fmt: str) -> str:
    return sh(["docker", "inspect", "-f", fmt, cid], env).stdout.strip()


def metric(env: dict[str, str], service: str, name: str) -> float | None:
    """A Prometheus gauge read inside the service's container (None while it does not answer)."""
    result = compose(env, "exec", "-T", service, "curl", "-fsS", "localhost:9100/metrics", check=False)
    if result.returncode != 0:
        return None
    for line in result.stdout.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def crash(env: dict[str, str], cid: str) -> None:
    """SIGKILL to the container's main process from the host: a crash, which its restart policy answers
    (`docker kill` would count as a manual stop, which restart policies leave alone)."""
    sh(["kill", "-9", inspect(env, cid, "{{.State.Pid}}")], env)


def logged_numbers(env: dict[str, str], cid: str, pattern: str) -> list[int]:
    """Every number `pattern`'s group matches in the container's log, across its restarts, in order."""
    log = sh(["docker", "logs", cid], env)
    return [int(m) for m in re.findall(pattern, log.stdout + log.stderr)]


def wait_for(what: str, test, timeout_s: float, poll_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = test()
        if value:
            return value
        time.sleep(poll_s)
    raise CheckFailed(f"timed out after {timeout_s:.0f} s waiting for {what}")


def run_checks(env: dict[str, str], run: str, timeout_s: float, figures: dict) -> None:
    started = time.monotonic()
    say(f"up: run {run}, {WORKERS} env workers")
    compose(env, "up", "-d", "--scale", f"env-worker={WORKERS}")
    figures["up_s"] = round(time.monotonic() - started, 1)

    # 1. metrics on every long-running service, once the learner has published its first version
    wait_for("the learner's first version", lambda: (metric(env, "learner", "rollstream_learner_weight_version") or 0) >= 1,
             timeout_s)
    figures["first_version_s"] = round(time.monotonic() - started, 1)
    answering = {}
    for service in PROCESSES:
        for cid in container_ids(env, service):
            out = sh(["docker", "exec", cid, "curl", "-fsS", "localhost:9100/metrics"], env, check=False).stdout or ""
            answering[f"{service}/{cid[:12]}"] = "rollstream_" in out
    figures["metrics_answering"] = answering
    if not all(answering.values()):
        raise CheckFailed(f"no rollstream metrics on port 9100 from {[k for k, v in answering.items() if not v]}")
    say(f"metrics: {len(answering)} processes answer on :9100")

    # 2. the learner killed like a crash, restarted by its policy, resuming
    (learner,) = container_ids(env, "learner")
    killed_at = metric(env, "learner", "rollstream_learner_weight_version")
    crash(env, learner)
    say(f"killed the learner at version {killed_at:.0f}")
    wait_for("the learner's restart", lambda: int(inspect(env, learner, "{{.RestartCount}}")) >= 1, 120, 2)
    figures["learner_killed_at_version"] = int(killed_at)

    # 3. an engine of the current pool killed once the learner is past version 1: it comes back on the
    #    version its pool holds (fetched from the object store), not on the policy it first served
    wait_for("the learner's version 2", lambda: (metric(env, "learner", "rollstream_learner_weight_version") or 0) >= 2,
             timeout_s, 2)
    (engine,) = container_ids(env, "engine-current")
    crash(env, engine)
    say("killed engine-current")
    wait_for("engine-current healthy again", lambda: int(inspect(env, engine, "{{.RestartCount}}")) >= 1
             and inspect(env, engine, "{{.State.Health.Status}}") == "healthy", 600, 5)
    joins = logged_numbers(env, engine, r"joins the current pool at version (\d+)")
    figures["engine_joined_at_versions"] = joins
    if len(joins) < 2 or joins[-1] < 2:
        raise CheckFailed(f"the restarted engine did not rejoin at its pool's version (joined at {joins})")
    say(f"engine-current rejoined at version {joins[-1]}")

    # 4. the report job: waits for the run's end, writes the report
    (report,) = container_ids(env, "report")
    remaining = max(60.0, timeout_s - (time.monotonic() - started))
    code = sh(["docker", "wait", report], env, timeout=remaining).stdout.strip()
    if code != "0":
        raise CheckFailed(f"the report job exited {code}: {sh(['docker', 'logs', '--tail', '30', report], env).stdout}")
    figures["run_s"] = round(time.monotonic() - started, 1)
    files = compose(env, "run", "--rm", "--no-deps", "--entrypoint", "ls", "report", f"/runs/{run}").stdout.split()
    missing = {"report.md", "summary.json"} - set(files)
    if missing:
        raise CheckFailed(f"the report job left no {', '.join(sorted(missing))} in /runs/{run}")
    summary = json.loads(compose(env, "run", "--rm", "--no-deps", "--entrypoint", "cat", "report",
                                 f"/runs/{run}/summary.json").stdout)
    figures["report"] = {k: summary.get(k) for k in ("duration_s", "learner_steps", "trajectories")}
    if summary.get("learner_steps") != STEPS:
        raise CheckFailed(f"the report counts {summary.get('learner_steps')} learner steps, not {STEPS}")
    figures["learner_restarts"] = int(inspect(env, learner, "{{.RestartCount}}"))
    starts = logged_numbers(env, learner, r"continues at version \d+ \(step (\d+)\)")
    figures["learner_started_at_steps"] = starts
    if len(starts) < 2 or starts[-1] < 1:
        raise CheckFailed(f"the restarted learner did not resume from a checkpoint (it started at steps {starts})")
    say(f"report written after {figures['run_s']:.0f} s; learner restarted {figures['learner_restarts']} time(s)")

    # 5. both env workers rolled out trajectories of the run; 6. the run's topics verify
    script = ("rollstream replay trajectories --run {run} --out /tmp/t.jsonl >/dev/null 2>&1 && "
              "python -c \"import json,collections;print(json.dumps(collections.Counter("
              "json.loads(l)['worker_id'] for l in open('/tmp/t.jsonl'))))\"").format(run=run)
    per_worker = json.loads(compose(env, "run", "--rm", "--no-deps", "--entrypoint", "sh", "report", "-c",
                                    script).stdout)
    figures["trajectories_per_worker"] = per_worker
    if len([w for w, n in per_worker.items() if n > 0]) < WORKERS:
        raise CheckFailed(f"trajectories came from {len(per_worker)} env workers, not {WORKERS}: {per_worker}")
    verify = compose(env, "run", "--rm", "--no-deps", "report", "replay", "verify", "--run", run, "--config", CONFIG,
                     check=False)
    figures["replay_verify_exit"] = verify.returncode
    if verify.returncode != 0:
        raise CheckFailed(f"replay verify failed: {(verify.stdout + verify.stderr)[-2000:]}")
    say(f"trajectories per env worker {per_worker}; replay verify passed")


def leftovers(env: dict[str, str]) -> dict[str, list[str]]:
    label = f"label=com.docker.compose.project={PROJECT}"
    found = {kind: sh(["docker", kind, "ls", "-q", "--filter", label] + (["-a"] if kind == "container" else []),
                      env).stdout.split() for kind in ("container", "network", "volume")}
    mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()
              if str(ENGINE_SOCKET.parent / "data") in line and "/overlay2/" in line]
    found["mount"] = mounts
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="Longest wait for the run to end.")
    parser.add_argument("--keep-up", action="store_true", help="Leave the stack running (no down -v).")
    args = parser.parse_args()
    run = time.strftime("compose-test-%Y%m%d-%H%M%S")
    env = environment(run)
    figures: dict = {"run": run}
    outcome = "passed"
    t0 = time.monotonic()
    try:
        say("private Docker engine")
        sh(["bash", "infra/compose/engine.sh", "start"], env, capture=False)
        say("base image (debootstrap) and build context")
        sh(["bash", "infra/compose/base.sh"], env, capture=False)
        sh(["bash", "infra/compose/context.sh", "--local-images"], env, capture=False)
        say("building the images")
        t = time.monotonic()
        # One build of the rollstream image (every rollstream service names the same one): the learner's.
        compose(env, "build", "kafka", "minio", "learner", capture=False)
        figures["build_s"] = round(time.monotonic() - t, 1)
        run_checks(env, run, args.timeout_s, figures)
    except (CheckFailed, subprocess.TimeoutExpired) as error:
        outcome = f"failed: {error}"
        say(outcome)
        for service in PROCESSES + ("report",):
            tail = compose(env, "logs", "--no-color", "--tail", "15", service, check=False).stdout
            print(tail, file=sys.stderr)
    finally:
        if not args.keep_up:
            compose(env, "down", "-v", "--remove-orphans", check=False)
            left = leftovers(env)
            figures["left_after_down"] = left
            if any(left.values()) and outcome == "passed":
                outcome = f"failed: down -v left {left}"
            say("down -v: " + ("nothing left" if not any(left.values()) else f"left {left}"))
    figures["outcome"] = outcome
    figures["total_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(figures))
    return 0 if outcome == "passed" else 1


if __name__ == "__main__":
    sys.exit(main())
