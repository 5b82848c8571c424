"""The run configuration: composes every component's settings model, and is the only place that
reads the environment and configuration files.

Sources, highest first: environment variables (ROLLSTREAM_ prefix, nested
fields joined with "__", e.g. ROLLSTREAM_KAFKA__BOOTSTRAP_SERVERS), a YAML file, the defaults.
The local infrastructure's own variables (KAFKA_HOST/KAFKA_PORT, MINIO_HOST/MINIO_PORT,
MINIO_ROOT_USER/MINIO_ROOT_PASSWORD, read by infra/*.sh) are honoured too, so one export moves
both the servers and the clients; so is ROLLSTREAM_DATA (the task data root, `envs.data_root`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import PositiveInt, BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from env_workers.envs.base import EnvSettings
from env_workers.proxy_settings import ProxySettings
from env_workers.settings import AgentLoopSettings
from learner.settings import LearnerSettings
from schemas.precision import Precision
from schemas.settings import KafkaSettings, ObjectStoreSettings
from streams.settings import StreamsSettings

REPO_ROOT = Path(__file__).resolve().parents[2]


class ConfigError(ValueError):
    """The configuration cannot be built: a missing or unreadable file, YAML that is not a mapping, or a
    value that does not validate. Its message is one line naming the file and the field, so that every
    command reports it the same way (pipeline/cli/toolkit.py)."""


class PolicySettings(BaseModel):
    """The policy a run starts from."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: Path = Path(".run/models/default")
    """Hugging Face checkpoint directory (ours or e.g. Qwen2.5); when it holds no checkpoint, `rollstream up`
    makes the default policy there with `model init` and `model sft` at their defaults but for sft_splits (the
    paper starts from Qwen2.5-Instruct; run those two commands yourself for another architecture or warm-start)."""
    sft_splits: dict[str, str] = {}
    """Families that default policy is warm-started on and the split of each, FAMILY: SPLIT (`model sft
    --families --split`), e.g. the easy tiers' train splits for a run trained on those tiers; empty: `model
    sft`'s defaults. Names every family once, with sft_samples."""
    sft_samples: dict[str, PositiveInt] = {}
    """Demonstrations per family of sft_splits (`model sft --samples`): the first ones of its split."""

    @model_validator(mode="after")
    def _samples_match_splits(self) -> PolicySettings:
        if set(self.sft_samples) != set(self.sft_splits):
            raise ValueError(f"sft_samples ({', '.join(self.sft_samples) or 'none'}) must name the families of "
                             f"sft_splits ({', '.join(self.sft_splits) or 'none'})")
        return self


class EngineFleetSettings(BaseModel):
    """The inference engines one run starts (`rollstream engine` processes)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    current: int = Field(3, ge=1)
    """Engines of the current pool (AgentRL: 75% of the inference capacity)."""
    stale: int = Field(1, ge=0)
    """Engines of the stale pool (AgentRL: 25%); 0 turns cross-policy sampling off."""
    max_model_len: int = Field(8192, ge=16)
    """Longest sequence an engine serves (AgentRL max_total_len 8192)."""
    dtype: Precision | None = None
    """What the engines serve in (not in the paper): None is float32 on a CPU and vLLM's own choice on a GPU;
    bfloat16, or auto (bfloat16 on a CPU with AMX-BF16 or AVX512-BF16), serves faster on such a CPU but a
    re-rollout no longer repeats its log-probs within replay verify's tolerance (schemas/precision.py)."""
    poll_sleep_s: float | None = Field(None, ge=0, lt=1)
    """Seconds each engine's vLLM processes sleep between two polls of the queues that join them (not in the paper;
    pipeline/engine/poll.py): None sleeps 0.2 ms on a CPU engine, whose polling would otherwise keep a share of a
    core that the learner and the other engines need, and keeps vLLM's own spinning loop on a GPU; 0 keeps it."""
    start_timeout_s: float = Field(600.0, gt=0)
    """How long an engine may take to serve (30-80 s on 2 CPU cores)."""
    bind_host: str = "127.0.0.1"
    """Address engines serve on; 0.0.0.0 lets env workers on other hosts (containers) reach them."""
    advertise_host: str | None = None
    """Host name engines give in their heartbeats, where env workers elsewhere find them (docker-compose: trainer)."""
    cpu_binding: Literal["spread", "auto"] = "spread"
    """How the engines of a run bind vLLM's CPU worker threads (CPU engines only; not in the paper, whose engines
    have GPUs): spread gives the engines disjoint sets of this host's cores (pipeline/engine/cpus.py), auto leaves
    it to each vLLM, which binds every engine of the host to the same cores."""
    nice: int = Field(0, ge=0, le=19)
    """Scheduling niceness of the engine processes (0: the same as the rest of the run; no paper default, its
    engines have GPUs of their own). Where engines share the CPU cores with the learner, the learner is the
    bottleneck and rollouts beyond what it consumes are wasted; a positive value lets it take the cores it needs
    while the engines fill the rest. Engines run in sessions of their own, so under the kernel's autogroup
    scheduling the niceness is given to their sessions too (pipeline/engine/launch.set_session_niceness)."""


class EnvWorkerFleetSettings(BaseModel):
    """The env workers one run starts (one consumer group)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    count: int = Field(2, ge=1)
    """Env-worker processes; adding one scales the rollout fleet."""
    concurrency: int = Field(1024, ge=1)
    """Agent loops at once per worker (AgentRL: concurrency 2048 in all)."""


class MixSettings(BaseModel):
    """What the dispatcher feeds: the training mix and the validation sets."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    families: tuple[str, ...] = ("os", "db", "kg", "alfworld", "webshop")
    """Training families, interleaved round-robin, as FAMILY or FAMILY:SPLIT (AgentRL: its five tasks)."""
    weights: dict[str, PositiveInt] = {}
    """Groups a family contributes per turn of the round-robin, FAMILY: N (AgentRL: 1 each, the default)."""
    val_families: tuple[str, ...] = ("os", "db", "kg", "alfworld", "webshop")
    """Validation families, FAMILY or FAMILY:SPLIT; a family without a split uses its held-out split."""
    val_samples: int | dict[str, int] | None = None
    """Validation samples per family (the first ones of its split), one number or per family; None = the whole split."""
    max_in_flight_groups: int | None = Field(None, ge=1)
    """Groups dispatched and not yet trained; None = 2 x batch size (AgentRL's queue)."""
    val_interval: int = Field(25, ge=1)
    """Validate every this many learner steps (AgentRL: 25)."""
    val_group_size: int = Field(4, ge=1)
    """Rollouts per validation sample (AgentRL: n = 4)."""
    val_before_train: bool = True
    """Validate the starting policy at version 0: the 'before' of the report."""


class RollstreamConfig(BaseSettings):
    """Everything one rollstream run is configured by."""

    model_config = SettingsConfigDict(env_prefix="ROLLSTREAM_", env_nested_delimiter="__", frozen=True, extra="forbid")

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings):  # type: ignore[no-untyped-def]
        # The environment wins over what load_config passes in (the YAML file); no .env files.
        return (env_settings, init_settings)

    run: str = "local"
    """Run id stamped on every event of the run."""
    seed: int = Field(0, ge=0)
    """The run seed (rollstream's; `rollstream study` runs one configuration under several): the dispatcher's
    sample order (0: index order), the engines' per-request sampling seeds and the learner's torch RNG. The
    starting policy is not remade per seed (one `model init` + `model sft` is shared by every seed: remaking
    it would cost more than the run)."""
    kafka: KafkaSettings = KafkaSettings()
    """Event bus connection."""
    object_store: ObjectStoreSettings = ObjectStoreSettings()
    """Object store connection (weights, checkpoints, large payloads)."""
    policy: PolicySettings = PolicySettings()
    """The starting policy."""
    engines: EngineFleetSettings = EngineFleetSettings()
    """Inference engines."""
    env_workers: EnvWorkerFleetSettings = EnvWorkerFleetSettings()
    """Rollout workers."""
    agent_loop: AgentLoopSettings = AgentLoopSettings()
    """Per-trajectory limits and sampling (max_turns 20, max_total_len 8192, temperature 0.8, ...)."""
    proxy: ProxySettings = ProxySettings()
    """`rollstream proxy`, the recording proxy for agents of one's own: address, re-encoding rule (prefix)."""
    mix: MixSettings = MixSettings()
    """Training and validation tasks."""
    envs: EnvSettings = EnvSettings()
    """Task environments: data root (also ROLLSTREAM_DATA), round limits (AgentBench's), the os sandbox
    backend and limits (e.g. ROLLSTREAM_ENVS__OS_SANDBOX__BACKEND=docker)."""
    streams: StreamsSettings = StreamsSettings()
    """Grouping, routing and batching (n 8, batch 256, stale ratio 0.25, stale_step 25, first batch 1.7x, ...)."""
    learner: LearnerSettings = LearnerSettings()
    """PPO + KL (lr 1e-6, clip 0.2, dual clip 3, KL 1e-4, ...)."""
    learner_nice: int = Field(0, ge=0, le=19)
    """Scheduling niceness of the learner process, as engines.nice is the engines' (0: the same as the rest of the
    run; not in the paper, whose learner has GPUs of its own). Every shipped configuration keeps 0: niced beside
    CPU engines the learner's steps slowed and it set the asynchronous pipeline's pace (docs/BENCHMARKS.md,
    "A learner niced like the engines")."""
    max_steps: int = Field(1000, ge=1)
    """Learner steps a `rollstream up` run trains for before its final validation and report. 1000 is the
    AgentRL paper's training length as we read it; no section of the paper is cited for it here, so treat it
    as ours until someone checks. Every shipped configuration sets its own."""
    max_restarts: int = Field(3, ge=0)
    """Times `rollstream up` restarts a process that died on its own (the learner with --resume); 0 ends the run."""
    runs_dir: Path = Path("runs")
    """Where each run's folder (logs, report, figures) is written."""
    connect_timeout_s: float = Field(10.0, gt=0)
    """How long a command that only reads the services (`infra status`) waits for Kafka and the object
    store to answer before it reports them unreachable."""

    def run_dir(self, run: str) -> Path:
        """runs/<run>/: a relative runs_dir is taken from the repository root, not the working directory."""
        return (self.runs_dir if self.runs_dir.is_absolute() else REPO_ROOT / self.runs_dir) / run

    def as_data(self) -> dict[str, Any]:
        """The configuration as plain data that validates back to it: learner.stale_step is left out
        unless it was set (it follows streams.stale_step; a dumped default would read as a conflict)."""
        exclude = None if "stale_step" in self.learner.model_fields_set else {"learner": {"stale_step"}}
        return self.model_dump(exclude=exclude)

    def replaced(self, **changes: Any) -> RollstreamConfig:
        """A copy with top-level `changes` (a section as a model or as data), validated again (model_copy would
        skip the cross-checks). A section goes in as data, its fields that were never set left out: the
        environment wins over it field by field, where a model would be replaced whole by that section's
        variables, every other field back at its default."""
        data = self.as_data()
        for name, value in changes.items():
            data[name] = value.model_dump(exclude_unset=True) if isinstance(value, BaseModel) else value
        return RollstreamConfig(**data)

    def learner_settings(self) -> LearnerSettings:
        """The learner's settings as the run gives them: its stale_step (retention, stale broadcasts)
        is the streams' stale_step, set once under `streams:`, and its seed is the run's `seed`."""
        return self.learner.model_copy(update={"stale_step": self.streams.stale_step, "seed": self.seed})

    def policy_dir(self) -> Path:
        """The policy checkpoint directory, a relative policy.path taken from the repository root."""
        return self.policy.path if self.policy.path.is_absolute() else REPO_ROOT / self.policy.path

    @model_validator(mode="after")
    def _components_agree(self) -> RollstreamConfig:
        # Settings that two components must share are set once; these are the ones that are not.
        if self.streams.max_turns != self.agent_loop.max_turns:
            raise ValueError(f"streams.max_turns ({self.streams.max_turns}) must equal agent_loop.max_turns "
                             f"({self.agent_loop.max_turns}): the router plans one pool per turn")
        if self.learner.temperature != self.agent_loop.temperature:
            raise ValueError(f"learner.temperature ({self.learner.temperature}) must equal agent_loop.temperature "
                             f"({self.agent_loop.temperature}): the loss recomputes the sampling log-probs")
        if "stale_step" in self.learner.model_fields_set and self.learner.stale_step != self.streams.stale_step:
            raise ValueError(f"learner.stale_step ({self.learner.stale_step}) must equal streams.stale_step "
                             f"({self.streams.stale_step}): the learner keeps and broadcasts the versions the stale "
                             f"pool loads (leave learner.stale_step out: it follows streams.stale_step)")
        if self.learner.sao != (self.streams.advantage == "none"):
            raise ValueError(f"learner.advantage_estimator {self.learner.advantage_estimator!r} needs streams.advantage "
                             f"{'none' if self.learner.sao else 'group'!r} (it is {self.streams.advantage!r}): SAO's "
                             f"learner computes the advantages from the rewards, any other learner trains on the "
                             f"batch's")
        trained = {entry.partition(":")[0] for entry in self.mix.families}
        unknown = sorted(set(self.streams.task_advantage_scale) - trained)
        if unknown:
            raise ValueError(f"streams.task_advantage_scale names {', '.join(unknown)}, not among mix.families "
                             f"({', '.join(sorted(trained))}): a scale for a family never trained would do nothing")
        if self.mix.val_families and self.max_steps % self.mix.val_interval:
            raise ValueError(f"max_steps ({self.max_steps}) must be a multiple of mix.val_interval "
                             f"({self.mix.val_interval}) so the run ends with a validation round")
        return self


def _infra_env() -> dict[str, Any]:
    """Client settings implied by the infrastructure scripts' variables (and ROLLSTREAM_DATA), when they are set."""
    env = os.environ
    out: dict[str, Any] = {}
    if "KAFKA_HOST" in env or "KAFKA_PORT" in env:
        out.setdefault("kafka", {})["bootstrap_servers"] = f"{env.get('KAFKA_HOST', '127.0.0.1')}:{env.get('KAFKA_PORT', '9092')}"
    store: dict[str, Any] = {}
    if "MINIO_HOST" in env or "MINIO_PORT" in env:
        store["endpoint"] = f"{env.get('MINIO_HOST', '127.0.0.1')}:{env.get('MINIO_PORT', '9000')}"
    if "MINIO_ROOT_USER" in env:
        store["access_key"] = env["MINIO_ROOT_USER"]
    if "MINIO_ROOT_PASSWORD" in env:
        store["secret_key"] = env["MINIO_ROOT_PASSWORD"]
    if store:
        out["object_store"] = store
    envs: dict[str, Any] = {}
    if "ROLLSTREAM_DATA" in env:
        envs["data_root"] = env["ROLLSTREAM_DATA"]
    # infra/mariadb.sh's server, for the db family's MySQL backend (used when envs.db_backend is mysql).
    for variable, field in (("MARIADB_HOST", "db_mysql_host"), ("MARIADB_PORT", "db_mysql_port"),
                            ("MARIADB_USER", "db_mysql_user"), ("MARIADB_PASSWORD", "db_mysql_password")):
        if variable in env:
            envs[field] = env[variable]
    if envs:
        out["envs"] = envs
    return out


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(path: Path | None = None) -> RollstreamConfig:
    """Builds the configuration: ROLLSTREAM_ environment variables over the infrastructure
    scripts' variables over a YAML file over the defaults. Raises ConfigError, with one line naming
    the file and the field, for anything wrong with either source."""
    where = f"configuration {path}" if path is not None else "configuration (environment)"
    data: dict[str, Any] = {}
    if path is not None:
        data = _read_yaml(Path(path), where)
    try:
        return RollstreamConfig(**_merge(data, _infra_env()))
    except ValidationError as error:
        raise ConfigError(f"{where}: {validation_message(error)}") from None


def _read_yaml(path: Path, where: str) -> dict[str, Any]:
    try:
        loaded = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file") from None
    except OSError as error:
        raise ConfigError(f"{where}: cannot read it: {error.strerror or error}") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{where}: not valid YAML{at}: {getattr(error, 'problem', None) or error}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{where}: the configuration must be a YAML mapping")
    return loaded


def validation_message(error: ValidationError) -> str:
    """A pydantic error as one line: each bad field's dotted location and what is wrong with it."""
    parts = []
    for err in error.errors():
        location = ".".join(str(part) for part in err["loc"])
        message = err["msg"].removeprefix("Value error, ")  # the value itself is left out: it may be a secret
        parts.append(f"{location}: {message}" if location else message)
    return "; ".join(parts).replace("\n", " ")


def _plain(value: Any) -> Any:
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not plain data")


def settings_json(settings: BaseModel, data: dict[str, Any] | None = None) -> str:
    """`settings` (or its `data`) as JSON that validates back to it, secrets written out, for a child
    process's settings file (model_dump_json would write them masked, and the child would use the mask)."""
    return json.dumps(settings.model_dump() if data is None else data, default=_plain, indent=2)


def write_config(cfg: RollstreamConfig, path: Path) -> None:
    """A file that `load_config(path)` reads back to `cfg`, for a child process (`up` making the default
    policy): secrets are written out, so only the owner may read it."""
    write_private(path, settings_json(cfg, cfg.as_data()))  # JSON is YAML: load_config reads it


def write_private(path: Path, text: str) -> None:
    """Writes `text` to `path` readable by its owner only (settings files carry secrets)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_text(text)
