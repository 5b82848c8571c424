"""deploy/k8s, checked offline: every manifest is a valid object of a pinned Kubernetes version, the KEDA
ScaledObject watches the env workers' real consumer group, every container's command line is one the real
`rollstream` command accepts, and the manifests agree with the run configuration they ship with.

Nothing here talks to a cluster (docs/ACROSS_MACHINES.md says what that leaves unchecked)."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from torch.distributed.run import get_args_parser

from env_workers.worker_settings import EnvWorkerSettings
from pipeline.run.config import REPO_ROOT
from pipeline.run.plan import dispatcher_child, engine_args, streams_app_id
from schemas import topics
from tests.helpers.command_line import parse_rollstream

K8S = REPO_ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.33.0"
"""The Kubernetes API the manifests are checked against (one kubernetes-validate 1.37.0 bundles)."""
CONFIG_MOUNT = "/etc/rollstream"
METRICS_PORT = 9100


def _load_render_settings():
    spec = importlib.util.spec_from_file_location("k8s_render_settings", K8S / "render_settings.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = _load_render_settings()


def _kustomization() -> dict:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


def _generated_files() -> dict[str, dict[str, Path]]:
    """{generated ConfigMap name: {key: source file}} of kustomization.yaml's configMapGenerator."""
    out = {}
    for generator in _kustomization().get("configMapGenerator", []):
        files = {}
        for entry in generator["files"]:
            key, _, source = entry.rpartition("=") if "=" in entry else (Path(entry).name, "", entry)
            files[key] = K8S / source
        out[generator["name"]] = files
    return out


def _documents() -> list[tuple[str, dict]]:
    """(file, object) for every object of every file kustomization.yaml lists under resources."""
    out = []
    for name in _kustomization()["resources"]:
        docs = [d for d in yaml.safe_load_all((K8S / name).read_text()) if d is not None]
        assert docs, f"{name} holds no object"
        out += [(name, d) for d in docs]
    return out


def _generated_configmaps() -> list[dict]:
    """The ConfigMaps kustomize generates (without the hash suffix it appends to their names)."""
    return [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name},
             "data": {key: path.read_text() for key, path in files.items()}}
            for name, files in _generated_files().items()]


def _objects() -> list[dict]:
    return [d for _, d in _documents()]


def _named(kind: str, name: str) -> dict:
    (found,) = [o for o in _objects() if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def _pod_spec(obj: dict) -> dict | None:
    if obj["kind"] in ("Deployment", "StatefulSet", "Job", "DaemonSet", "ReplicaSet"):
        return obj["spec"]["template"]["spec"]
    return obj["spec"] if obj["kind"] == "Pod" else None


def _containers() -> list[tuple[dict, dict, dict]]:
    """(workload, pod spec, container) for every container and init container of every workload."""
    out = []
    for obj in _objects():
        spec = _pod_spec(obj)
        if spec is not None:
            out += [(obj, spec, c) for c in spec.get("initContainers", []) + spec["containers"]]
    return out


def _rollstream_args(container: dict) -> list[str]:
    """The arguments the container gives the `rollstream` command: the image's entrypoint is `rollstream`
    (infra/Dockerfile), so `args` alone are its arguments; `torchrun ... -m pipeline.cli.learner ARGS` runs
    the learner command (its torchrun options are parsed by torchrun's own parser here)."""
    command, args = list(container.get("command", [])), list(container.get("args", []))
    if not command:
        return args
    full = command + args
    if full[0] == "rollstream":
        return full[1:]
    if full[:3] in (["python", "-m", "pipeline.cli"], ["python3", "-m", "pipeline.cli"]):
        return full[3:]
    if full[0] == "torchrun":
        parsed = get_args_parser().parse_args(full[1:])
        assert parsed.module, f"{container['name']}: torchrun without -m"
        assert parsed.training_script == "pipeline.cli.learner", f"{container['name']}: torchrun runs {parsed.training_script}"
        return ["learner", *parsed.training_script_args]
    raise AssertionError(f"container {container['name']} runs {full[0]!r}, not rollstream")


def _parsed_containers() -> list[tuple[dict, dict, str, dict]]:
    return [(obj, container, *parse_rollstream(_rollstream_args(container))) for obj, _, container in _containers()]


@pytest.fixture(scope="module")
def cfg():
    return render.load_run_config()


# --- the files -------------------------------------------------------------------------------------


def test_every_yaml_file_under_deploy_k8s_is_listed_in_the_kustomization():
    listed = {K8S / name for name in _kustomization()["resources"]}
    listed |= {path for files in _generated_files().values() for path in files.values()}
    listed.add(K8S / "kustomization.yaml")
    on_disk = {p for p in K8S.rglob("*") if p.suffix in (".yaml", ".yml")}
    assert on_disk - listed == set(), "not in kustomization.yaml"
    missing = [p for p in listed if not p.is_file()]
    assert missing == [], "listed but absent"


def test_no_secret_is_kept_in_the_manifests():
    assert [o["metadata"]["name"] for o in _objects() if o["kind"] == "Secret"] == []
    refs = {e["secretRef"]["name"] for _, _, c in _containers() for e in c.get("envFrom", []) if "secretRef" in e}
    assert refs == {"rollstream-object-store"}
    for o in _objects():
        if o["kind"] == "ConfigMap":
            assert not any("ACCESS_KEY" in k or "SECRET_KEY" in k for k in o["data"])


# --- Kubernetes schema -----------------------------------------------------------------------------


def test_every_manifest_is_a_valid_kubernetes_object_of_the_pinned_version():
    objects = [o for o in _objects() if not o["apiVersion"].startswith("keda.sh/")] + _generated_configmaps()
    assert {o["kind"] for o in objects} >= {"ConfigMap", "Job", "StatefulSet", "Deployment", "Service",
                                            "PersistentVolumeClaim"}
    for obj in objects:
        try:
            validated = kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']}: {'.'.join(map(str, error.path))}: {error.message}")
        assert validated == "1.33", f"validated against {validated}, not the pinned version"


def test_the_schema_check_refuses_an_unknown_field_and_a_wrong_type():
    # the check above can fail: strict mode refuses what the API server would
    deployment = copy.deepcopy(_named("Deployment", "rollstream-dispatcher"))
    deployment["spec"]["template"]["spec"]["containers"][0]["argz"] = ["dispatch"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)
    deployment = copy.deepcopy(_named("Deployment", "rollstream-dispatcher"))
    deployment["spec"]["replicas"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


# --- KEDA ------------------------------------------------------------------------------------------


def test_the_env_workers_scale_on_the_lag_of_their_real_consumer_group_on_tasks(cfg):
    (scaled,) = [o for o in _objects() if o["kind"] == "ScaledObject"]
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    target = scaled["spec"]["scaleTargetRef"]
    assert target.get("kind", "Deployment") == "Deployment"
    assert _named("Deployment", target["name"])["spec"]["template"]["spec"]["containers"][0]["args"][0] == "env-worker"
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "kafka"
    meta = trigger["metadata"]
    assert meta["topic"] == topics.TASKS == "tasks"
    # env_workers/worker.py joins `<group_id>.<run>`
    assert meta["consumerGroup"] == f"{EnvWorkerSettings().group_id}.{cfg.run}"
    connection = _named("ConfigMap", "rollstream-connection")["data"]
    assert meta["bootstrapServers"] == connection["ROLLSTREAM_KAFKA__BOOTSTRAP_SERVERS"] != ""
    assert int(meta["lagThreshold"]) == cfg.env_workers.concurrency
    partitions = yaml.safe_load((REPO_ROOT / "infra" / "topics.yaml").read_text())["topics"]["tasks"]["partitions"]
    assert 1 <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"] <= partitions


# --- command lines ---------------------------------------------------------------------------------


def test_every_container_command_is_accepted_by_the_real_rollstream_command_line():
    commands = sorted(path for _, _, path, _ in _parsed_containers())
    assert commands == sorted(["infra init", "engine", "engine", "learner", "streams worker", "env-worker",
                               "dispatch"])


def test_the_command_line_check_refuses_an_option_that_does_not_exist():
    with pytest.raises(Exception, match="No such option"):
        parse_rollstream(["env-worker", "--run", "r", "--model", "/m", "--concurency", "8"])
    with pytest.raises(Exception, match="No such option"):
        parse_rollstream(["streams", "worker", "--run-id", "r"])
    with pytest.raises(SystemExit):  # torchrun's argparse
        _rollstream_args({"name": "x", "command": ["torchrun"], "args": ["--nproc-per-gpu", "2", "-m",
                                                                          "pipeline.cli.learner"]})


def test_every_process_names_the_configured_run(cfg):
    for obj, container, path, params in _parsed_containers():
        if path == "infra init":
            continue
        assert params["run"] == cfg.run, f"{obj['metadata']['name']}: --run {params['run']}"
    (streams,) = [p for _, _, path, p in _parsed_containers() if path == "streams worker"]
    assert streams["app_id"] == streams_app_id(cfg.run)


def test_files_the_processes_read_from_the_config_mount_are_in_the_generated_configmap():
    keys = set(_generated_files()["rollstream-run"])
    for obj, spec, container in _containers():
        paths = [a for a in _rollstream_args(container) if a.startswith(CONFIG_MOUNT + "/")]
        assert paths, f"{container['name']} reads nothing from {CONFIG_MOUNT}"
        assert {p.removeprefix(CONFIG_MOUNT + "/") for p in paths} <= keys
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == CONFIG_MOUNT]
        (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        assert volume["configMap"]["name"] == "rollstream-run"


def test_every_long_running_process_exposes_its_metrics_port_to_other_pods_with_scrape_annotations():
    for obj, container, path, params in _parsed_containers():
        if obj["kind"] == "Job" and path != "learner":
            continue  # infra init ends at once
        assert params["metrics_port"] == METRICS_PORT, obj["metadata"]["name"]
        assert params["metrics_host"] == "0.0.0.0", obj["metadata"]["name"]  # loopback: unreachable by a scraper
        assert {"name": "metrics", "containerPort": METRICS_PORT} in container["ports"]
        annotations = obj["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == str(METRICS_PORT)


# --- agreement with the run configuration ------------------------------------------------------------


def test_the_component_settings_files_are_the_ones_rollstream_up_derives_from_run_yaml():
    files = _generated_files()["rollstream-run"]
    for name, content in render.settings_files().items():
        assert json.loads(files[name].read_text()) == json.loads(content), (
            f"deploy/k8s/config/{name} is stale: run `python deploy/k8s/render_settings.py`")


def test_replicas_follow_the_configured_engine_pools_and_env_worker_count(cfg):
    assert _named("StatefulSet", "rollstream-engine-current")["spec"]["replicas"] == cfg.engines.current
    assert _named("StatefulSet", "rollstream-engine-stale")["spec"]["replicas"] == cfg.engines.stale
    assert _named("Deployment", "rollstream-env-worker")["spec"]["replicas"] == cfg.env_workers.count
    assert _named("Deployment", "rollstream-dispatcher")["spec"]["replicas"] == 1


def test_engines_serve_off_loopback_advertise_their_stable_name_and_take_the_runs_engine_options(cfg):
    service = _named("Service", "rollstream-engines")
    assert service["spec"]["clusterIP"] == "None"
    for obj, container, path, params in _parsed_containers():
        if path != "engine":
            continue
        assert obj["spec"]["serviceName"] == "rollstream-engines"
        assert params["pool"].value == obj["spec"]["template"]["metadata"]["labels"]["rollstream.dev/pool"]
        assert params["host"] == "0.0.0.0"
        assert params["advertise_url"] == f"http://$(POD_NAME).rollstream-engines:{params['port']}"
        assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in container["env"]
        options = dict(zip(engine_args(cfg)[::2], engine_args(cfg)[1::2]))
        assert params["stale_step"] == int(options["--stale-step"])
        assert params["max_model_len"] == int(options["--max-model-len"])
        assert container["resources"]["limits"]["nvidia.com/gpu"] >= 1


def test_the_learner_resumes_broadcasts_to_every_engine_and_runs_one_rank_per_gpu(cfg):
    job = _named("Job", "rollstream-learner")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    _, params = parse_rollstream(_rollstream_args(container))
    assert params["resume"] is True  # the same command for the first start and every restart
    assert params["max_steps"] == cfg.max_steps
    for pool, count in (("current", cfg.engines.current), ("stale", cfg.engines.stale)):
        urls = [f"http://rollstream-engine-{pool}-{i}.rollstream-engines:8000" for i in range(count)]
        assert params[f"broadcast_{pool}"].split(",") == urls
    pod = job["spec"]["template"]["spec"]
    assert params["broadcast_host"] == f"{pod['hostname']}.{pod['subdomain']}"
    assert _named("Service", pod["subdomain"])["spec"]["clusterIP"] == "None"
    torchrun = get_args_parser().parse_args(container["command"][1:] + container["args"])
    assert int(torchrun.nproc_per_node) == container["resources"]["limits"]["nvidia.com/gpu"]


def test_the_dispatcher_gets_the_options_rollstream_up_derives_from_run_yaml(cfg):
    (container,) = _named("Deployment", "rollstream-dispatcher")["spec"]["template"]["spec"]["containers"]
    # `up` runs the dispatcher as `python -m pipeline.cli.dispatch ...`, the pod as `rollstream dispatch ...`
    child = dispatcher_child(cfg, cfg.run, Path("/unused"))
    assert child.argv[1:3] == ("-m", "pipeline.cli.dispatch")
    planned = ["dispatch", *child.argv[3:]]
    planned[planned.index("--config") + 1] = f"{CONFIG_MOUNT}/run.yaml"
    assert container["args"] == planned + ["--metrics-port", str(METRICS_PORT), "--metrics-host", "0.0.0.0"]
