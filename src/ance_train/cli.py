"""The ``ance-train`` command line."""

from __future__ import annotations

import json
import os
import signal
import sys
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, cast, get_args

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ance_train.config import IndexConfig, InferenceConfig, IvfConfig
from ance_train.infra.process import exit_without_teardown

if TYPE_CHECKING:  # the CLI imports the heavy modules lazily, per command
    from pydantic import BaseModel

    from ance_train.data.dataset import DatasetIndex

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Train dense retrievers with asynchronously refreshed ANN negatives.")
# soft_wrap: a message is never broken at the terminal width (80 columns when not a TTY),
# so a long path and what is said about it stay on one line for logs and grep.
console = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)


class Role(StrEnum):
    trainer = "trainer"
    inferencer = "inferencer"
    indexer = "indexer"


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        console.print(f"ance-train {version('ance-train')}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True,
        help="Print the installed package's version and exit.")] = False,
) -> None:
    pass


SetOption = Annotated[list[str] | None, typer.Option(
    "--set", metavar="KEY.PATH=VALUE",
    help="Override a config field before validation, as if written in the file (VALUE is "
         "YAML), e.g. --set training.steps=200 or --set negatives.simans.a=0.3; repeatable.")]


def _load(config: Path, overrides: list[str] | None = None, warn: bool = False):
    """The validated configuration (with ``--set`` overrides); with ``warn``, its no-op
    settings printed as warnings."""
    from ance_train.config import ConfigError, load_config

    try:
        cfg = load_config(config, overrides or ())
    except ConfigError as error:
        err.print(f"[red]error:[/] {error}")
        raise typer.Exit(2) from None
    if warn:
        for message in cfg.no_op_settings():
            err.print(f"[yellow]warning:[/] {message}")
    return cfg


def _check_environment(service: bool = True, redis_url: str | None = None) -> None:
    """Settings from the environment, checked before a process connects anywhere."""
    from ance_train.infra.credentials import CredentialsError, require_cluster_credentials
    from ance_train.infra.tls import GrpcTls, redis_client_options
    from ance_train.observability.kube import KubeConfigError, KubeSettings
    from ance_train.observability.metrics import MetricsConfigError, metrics_port
    from ance_train.runtime import dataset_timeout_s

    try:
        require_cluster_credentials()
        grpc_tls = GrpcTls.from_env()  # the certificate files are read here: named if missing
        if redis_url is not None:
            redis_client_options(redis_url)
        if service:
            if grpc_tls is not None:
                grpc_tls.server_credentials()  # a server needs its certificate and key
            metrics_port()
            KubeSettings.from_env()
            dataset_timeout_s()
    except (CredentialsError, KubeConfigError, MetricsConfigError, ValueError) as error:
        err.print(f"[red]error:[/] {error}")
        raise typer.Exit(2) from None


def _connect_run(config: Path | None, redis_url: str | None, run_id: str | None):
    """The event bus of a run, from an embedded run's config or explicit endpoints."""
    from ance_train.infra import bus as events

    if config is not None:
        cfg = _load(config)
        run_id = run_id or cfg.run_id
        endpoints = Path(cfg.output_dir) / cfg.run_id / "endpoints.json"
        if redis_url is None and endpoints.is_file():
            redis_url = json.loads(endpoints.read_text())["redis_url"]
    if redis_url is None or run_id is None:
        err.print("[red]error:[/] give --config of an embedded run, or --redis-url and --run-id")
        raise typer.Exit(2)
    _check_environment(service=False, redis_url=redis_url)  # TLS settings (gRPC and Redis)
    client = events.connect(redis_url)  # AUTH with ANCE_REDIS_PASSWORD when set
    try:
        client.ping()
    except events.RedisAuthError as error:
        err.print(f"[red]error:[/] {error}")
        raise typer.Exit(1) from None
    return events.EventBus(client, run_id), run_id


def _raise_interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


@app.command()
def run(
    config: Annotated[Path | None, typer.Option(
        "--config", "-c", help="Run configuration (YAML); with --resume, default: the one "
                               "the run started with (RUN_DIR/config.yaml).")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing run directory.")] = False,
    resume: Annotated[Path | None, typer.Option(
        "--resume", metavar="RUN_DIR",
        help="Continue the interrupted run in RUN_DIR from its newest complete checkpoint, "
             "keeping everything it produced; refused when the configuration differs in "
             "anything but where and how fast processes run.")] = None,
    max_minutes: Annotated[float | None, typer.Option(help="Abort after this long.")] = None,
    overrides: SetOption = None,
) -> None:
    """Run trainer, inferencers and indexer as local processes (the embedded mode)."""
    from ance_train.data.problems import DataError
    from ance_train.infra.disk import InsufficientDisk
    from ance_train.infra.store import StorageError
    from ance_train.launcher.embedded import EmbeddedRun, RunAborted
    from ance_train.modeling.files import ModelLoadError

    if resume is not None and overwrite:
        err.print("[red]error:[/] --resume continues a run, --overwrite replaces it: give one")
        raise typer.Exit(2)
    if config is None:
        if resume is None:
            err.print("[red]error:[/] give --config (or --resume RUN_DIR)")
            raise typer.Exit(2)
        config = resume / "config.yaml"
        if not config.is_file():
            err.print(f"[red]error:[/] --resume: {resume} holds no embedded run to continue "
                      f"({config.name} is missing)")
            raise typer.Exit(1)
    cfg = _load(config, overrides, warn=True)
    if resume is not None:
        run_dir = Path(cfg.output_dir) / cfg.run_id
        if run_dir.resolve() != resume.resolve():
            err.print(f"[red]error:[/] --resume {resume} is not the run directory of "
                      f"{config} (output_dir/run_id: {run_dir})")
            raise typer.Exit(2)
    # Both signals stop the run, whatever disposition was inherited: a shell that starts a job
    # in the background (`cmd &` in a script) ignores SIGINT for it, and then a `kill -INT`
    # or Ctrl-C would otherwise leave every service running.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGINT, _raise_interrupt)
    try:
        EmbeddedRun(cfg, config, overwrite=overwrite, max_minutes=max_minutes,
                    resume=resume is not None).execute()
    except (DataError, InsufficientDisk, ModelLoadError, RunAborted, StorageError) as error:
        err.print(f"[red]error:[/] {error}")
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        err.print("[yellow]interrupted: all services stopped[/]")
        raise typer.Exit(130) from None


@app.command()
def serve(
    role: Annotated[Role, typer.Argument(help="Which service this process runs.")],
    config: Annotated[Path, typer.Option("--config", envvar="ANCE_CONFIG")],
    redis_url: Annotated[str, typer.Option("--redis-url", envvar="ANCE_REDIS_URL")],
    work_dir: Annotated[Path | None, typer.Option(
        "--work-dir", envvar="ANCE_WORK_DIR",
        help="This process's own scratch folder (default: /tmp/ance-work/<role>-<instance>); "
             "two processes may not share one.")] = None,
    instance: Annotated[str | None, typer.Option("--instance", envvar="ANCE_INSTANCE",
                                                 help="Replica name (default: host name).")] = None,
    host: Annotated[str, typer.Option("--host", envvar="ANCE_GRPC_HOST")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", envvar="ANCE_GRPC_PORT")] = 0,
    store_dir: Annotated[str | None, typer.Option("--store-dir", envvar="ANCE_STORE_DIR")] = None,
) -> None:
    """Run one service (what each Kubernetes pod and each embedded child process runs)."""
    import socket

    from ance_train.infra.bus import RedisAuthError
    from ance_train.infra.credentials import redact
    from ance_train.infra.store import StorageError
    from ance_train.infra.workdir import WorkDirInUse
    from ance_train.runtime import (
        DatasetNotPublished,
        ServiceOptions,
        connect_context,
    )

    _check_environment(redis_url=redis_url)  # fail fast, clearly, before connecting anywhere
    _load(config)
    instance = instance or socket.gethostname()
    if work_dir is None:
        work_dir = Path("/tmp/ance-work") / f"{role.value}-{instance}"
    if role is Role.trainer:
        from ance_train.observability.metrics import METRICS_PORT_VAR
        from ance_train.trainer.distributed import launched_rank

        if (rank := launched_rank()) > 0:  # a data-parallel rank other than 0 (torchrun)
            work_dir = work_dir / f"rank-{rank}"  # its own dataset copy and downloads
            os.environ.pop(METRICS_PORT_VAR, None)  # rank 0 serves the trainer's metrics
    options = ServiceOptions(role=role.value, config_path=str(config), redis_url=redis_url,
                             work_dir=str(work_dir), instance=instance,
                             grpc_host=host, grpc_port=port, store_dir=store_dir)
    try:
        ctx = connect_context(options)
    except (RedisAuthError, DatasetNotPublished, StorageError, WorkDirInUse) as error:
        err.print(f"[red]error:[/] {redact(str(error))}")
        raise typer.Exit(1) from None
    if role is Role.trainer:
        from ance_train.trainer.trainer import serve as serve_role
    elif role is Role.inferencer:
        from ance_train.inferencer.inferencer import serve as serve_role
    else:
        from ance_train.indexer.indexer import serve as serve_role
    sys.exit(ctx.run(serve_role))


@app.command()
def prepare(
    config: Annotated[Path, typer.Option("--config", "-c", envvar="ANCE_CONFIG")],
    store_dir: Annotated[str | None, typer.Option("--store-dir", envvar="ANCE_STORE_DIR")] = None,
) -> None:
    """Resolve the model (a Hub id or s3:// directory is copied into the run's store, once),
    validate the dataset and publish its index to the object store (the trainer pod's init
    step; running it again is harmless)."""
    import tempfile

    from ance_train.data.problems import DataError
    from ance_train.infra.store import StorageError, store_from_env
    from ance_train.modeling.files import ModelLoadError
    from ance_train.modeling.source import prepare_model
    from ance_train.runtime import prepare_dataset

    _check_environment(service=False)
    cfg = _load(config)
    try:
        store = store_from_env(cfg.run_id, store_dir)
        with tempfile.TemporaryDirectory() as cache:
            # The model first: the services start once the dataset index is published.
            record, kept = prepare_model(cfg.model, store, Path(cache) / "model-download")
            index = prepare_dataset(cfg, store, Path(cache))
    except (DataError, ModelLoadError, StorageError) as error:
        err.print(f"[red]error:[/] {error}")
        raise typer.Exit(1) from None
    if record["kind"] != "local":
        console.print(f"{'kept' if kept else 'copied'} model {record['path']} (commit "
                      f"{record.get('commit')}) in the run's store")
    console.print(f"published the dataset index of run {cfg.run_id} to {store!r}: "
                  f"{_describe_dataset(index)}")


def _describe_dataset(index: DatasetIndex) -> str:
    """Print the dataset's warnings; return its counts for the command's own message."""
    for warning in index.warnings:
        err.print(f"[yellow]warning:[/] {warning}")
    return (f"{index.num_docs} docs, {len(index.train)} train / {len(index.dev)} dev / "
            f"{len(index.test)} test queries")


@app.command()
def validate(config: Annotated[Path, typer.Option("--config", "-c")],
             overrides: SetOption = None) -> None:
    """Validate the configuration and the dataset, then print what was found (and warn of
    settings that change nothing)."""
    import tempfile

    from ance_train.config import ConfigError, resolve_budget
    from ance_train.data.problems import DataError
    from ance_train.data.validation import selection_notices, validate_dataset
    from ance_train.infra.store import StorageError
    from ance_train.modeling.files import ModelLoadError, check_encoder
    from ance_train.modeling.source import resolve_model

    cfg = _load(config, overrides, warn=True)
    try:
        with tempfile.TemporaryDirectory() as cache:
            model = resolve_model(cfg.model, Path(cache) / "model")  # Hub: the HF cache
            check_encoder(model.directory)
            index = validate_dataset(cfg.data, Path(cache) / "data",
                                     seed=cfg.data.split_seed)
    except (DataError, ModelLoadError, StorageError) as error:
        err.print(f"[red]error:[/] {error}")
        raise typer.Exit(1) from None
    described = _describe_dataset(index)
    for level, text in selection_notices(index, cfg.training):
        err.print(f"[yellow]{level}:[/] {text}")
    try:
        cfg = resolve_budget(cfg, index.trainable_queries)
    except ConfigError as error:
        err.print(f"[red]error:[/] {error}")
        raise typer.Exit(1) from None
    training = cfg.training
    budget = (f"{training.total_steps} steps" if training.epochs is None else
              f"{training.total_steps} steps ({training.epochs} epochs × "
              f"{training.steps_per_epoch})")
    console.print(f"ok: {described}; training {budget}")


@app.command()
def status(
    config: Annotated[Path | None, typer.Option("--config", "-c")] = None,
    redis_url: Annotated[str | None, typer.Option("--redis-url", envvar="ANCE_REDIS_URL")] = None,
    run_id: Annotated[str | None, typer.Option("--run-id", envvar="ANCE_RUN_ID")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Print the state of a run, asked of every registered service over gRPC."""
    from ance_train.infra.rpc import fetch_status

    bus, run_id = _connect_run(config, redis_url, run_id)
    rows = []
    for name, address in bus.services().items():
        try:
            reply = fetch_status(address)
            rows.append({"service": name, "address": address, "state": reply.state,
                         "step": reply.step, "checkpoint": reply.checkpoint_step,
                         "index": reply.index_step, "phase": reply.progress.phase,
                         "progress": f"{reply.progress.done}/{reply.progress.total}",
                         "metrics": dict(reply.metrics), "store_bytes": reply.store_bytes})
        except Exception as error:
            rows.append({"service": name, "address": address, "state": "unreachable",
                         "error": str(error)})
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    table = Table(title=f"run {run_id}")
    for column in ("service", "state", "step", "checkpoint", "index", "phase", "progress"):
        table.add_column(column)
    table.add_column("metrics")
    for row in rows:
        metrics = ", ".join(f"{k}={v:.4g}" for k, v in sorted(row.get("metrics", {}).items())[:6])
        table.add_row(*(str(row.get(c, "")) for c in ("service", "state", "step", "checkpoint",
                                                       "index", "phase", "progress")), metrics)
    console.print(table)
    sizes = [row["store_bytes"] for row in rows if row.get("store_bytes", -1) >= 0]
    if sizes:  # the trainer's and the indexer's last listings: the larger is the newer bound
        console.print(f"store: {max(sizes) / 2**20:.1f} MiB of objects in run {run_id}")
    if not rows:
        err.print("no service of this run is registered (not started, or stopped)")
        raise typer.Exit(1)


@app.command()
def search(
    query: Annotated[list[str], typer.Argument(help="Query text(s).")],
    config: Annotated[Path | None, typer.Option("--config", "-c")] = None,
    redis_url: Annotated[str | None, typer.Option("--redis-url", envvar="ANCE_REDIS_URL")] = None,
    run_id: Annotated[str | None, typer.Option("--run-id", envvar="ANCE_RUN_ID")] = None,
    k: Annotated[int, typer.Option("-k", help="Hits per query.")] = 10,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Search the latest index of a running run (the indexer's Retrieval.Search)."""
    import grpc

    from ance_train.infra.rpc import search as search_rpc

    bus, _ = _connect_run(config, redis_url, run_id)
    address = next((a for name, a in bus.services().items() if name.startswith("indexer:")),
                   None)
    if address is None:
        err.print("[red]error:[/] no indexer of this run is registered")
        raise typer.Exit(1)
    try:
        reply = search_rpc(address, queries=list(query), k=k)
    except grpc.RpcError as error:
        err.print(f"[red]error:[/] {error.code().name}: {error.details()}")
        raise typer.Exit(1) from None
    results = [[{"doc_id": h.doc_id, "score": h.score} for h in hits.hits]
               for hits in reply.results]
    if as_json:
        print(json.dumps({"index_step": reply.index_step, "results": results}))
        return
    for text, hits in zip(query, results, strict=True):
        console.print(f"[bold]{text}[/] (index of checkpoint {reply.index_step})")
        for rank, hit in enumerate(hits, 1):
            console.print(f"  {rank:>3}. {hit['doc_id']}  {hit['score']:.4f}")


def _choices(name: str, model: type[BaseModel], field: str) -> type[StrEnum]:
    """A CLI choice type with the values of a config field's Literal (defined once there)."""
    # The cast: StrEnum's functional API makes a subclass (mypy reads the call as a member).
    values = get_args(model.model_fields[field].annotation)
    return cast("type[StrEnum]", StrEnum(name, {value: value for value in values}))


if TYPE_CHECKING:
    # Their members come from the config's Literals at run time, unknown to mypy: to it they
    # are StrEnum itself.
    IndexType = StrEnum
    IvfQuantizer = StrEnum
    EmbeddingDtype = StrEnum
    PlanPrecision = StrEnum
else:
    IndexType = _choices("IndexType", IndexConfig, "type")
    IvfQuantizer = _choices("IvfQuantizer", IvfConfig, "quantizer")
    EmbeddingDtype = _choices("EmbeddingDtype", InferenceConfig, "embedding_dtype")
    # inference.precision's values but auto, which the plan resolves as the inferencer would.
    PlanPrecision = StrEnum("PlanPrecision", {
        value: value for value in get_args(InferenceConfig.model_fields["precision"].annotation)
        if value != "auto"})


def _planned_precision(config: InferenceConfig | None) -> str:
    """The precision an inferencer of ``config`` (default settings without one) would encode
    in on this machine: ``inference.precision``, ``auto`` resolved as the inferencer does."""
    import torch

    from ance_train.modeling.encoding import resolve_precision

    device = "cuda" if torch.cuda.is_available() else "cpu"  # the inferencer's choice
    return resolve_precision((config or InferenceConfig()).precision, device)


@app.command()
def plan(
    docs: Annotated[int, typer.Option(min=1, help="Corpus size (documents).")],
    train_queries: Annotated[int, typer.Option(min=1, help="Training queries mined per refresh.")],
    replicas: Annotated[int, typer.Option(min=1, help="Inferencer replicas.")] = 1,
    docs_per_s: Annotated[float | None, typer.Option(
        min=0.001, help="Measured docs/s of one replica at --doc-tokens (rescaled when the "
                        "config's model.max_doc_length cuts documents shorter).")] = None,
    throughput_json: Annotated[Path | None, typer.Option(
        help="Take docs/s from a bench/encode.py report (its row for --precision) or a "
             "bench/refresh_scaling.py report, rescaled to the tokens per document the run "
             "encodes (--doc-tokens, capped at model.max_doc_length).")] = None,
    precision: Annotated[PlanPrecision | None, typer.Option(
        help="The inferencers' weights (the --throughput-json row); default: what "
             "inference.precision (of --config; else auto) resolves to on this machine. "
             "Give it to plan for another machine.")] = None,
    dim: Annotated[int, typer.Option(min=1, help="Embedding dimension.")] = 384,
    doc_tokens: Annotated[int, typer.Option(
        min=1, help="Mean tokens per document after truncation (at most max_doc_length).")] = 256,
    query_tokens: Annotated[int, typer.Option(min=1)] = 32,
    eval_queries: Annotated[int, typer.Option(min=0, help="Dev + test queries evaluated.")] = 0,
    index_type: Annotated[IndexType | None, typer.Option(help="Overrides the config's.")] = None,
    config: Annotated[Path | None, typer.Option(
        "--config", "-c", help="Run configuration: index settings, shard sizes, depths.")] = None,
    overrides: SetOption = None,
    calibration: Annotated[Path | None, typer.Option(
        help="docs/benchmarks/indexer.json of this kind of machine (index rates).")] = None,
    store_mb_s: Annotated[float, typer.Option(min=0.001, help="Object store MB/s.")] = 200.0,
    model_params: Annotated[int | None, typer.Option(
        min=1, help="Encoder parameters (default: all-MiniLM-L6-v2).")] = None,
    ivf_quantizer: Annotated[IvfQuantizer | None, typer.Option(
        help="IVF coarse quantizer (overrides the config's index.ivf.quantizer).")] = None,
    partitions: Annotated[int | None, typer.Option(
        min=1, help="Indexer partitions (default: the config's index.partitions, else 1).")
    ] = None,
    embedding_dtype: Annotated[EmbeddingDtype, typer.Option(
        # ignore: a member made at run time (mypy sees StrEnum, see EmbeddingDtype)
        help="Stored embedding values (inference.embedding_dtype).")
    ] = EmbeddingDtype.float16,  # type: ignore[attr-defined]
    indexer_cpus: Annotated[int | None, typer.Option(
        min=1, help="Cores per indexer pod (default: those the index rates were measured "
                    "on); rates scale linearly.")] = None,
    overlap_build: Annotated[bool | None, typer.Option(
        help="The indexer adds each shard as it is encoded, so the build overlaps encoding "
             "(default: the config's index.build_while_encoding, on).")
    ] = None,
    passages_per_doc: Annotated[float | None, typer.Option(
        min=1.0, help="MaxP (data.passages.mode max): mean passages per document after the "
                      "data.passages.max_passages cap. Only the corpus knows it (ance-train "
                      "would have to tokenise it), so mode max needs it; default 1 with mode "
                      "first. Vectors = docs × this; the plan then also shows MaxP against "
                      "FirstP (one passage per document).")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Predict the refresh period, storage per checkpoint and index memory of a run (with
    MaxP, per passage, against FirstP)."""
    import numpy as np

    from ance_train.config import RunConfig
    from ance_train.index import capacity

    if (docs_per_s is None) == (throughput_json is None):
        err.print("[red]error:[/] give exactly one of --docs-per-s and --throughput-json")
        raise typer.Exit(2)
    if overrides and config is None:
        err.print("[red]error:[/] --set overrides fields of --config: give --config")
        raise typer.Exit(2)
    cfg = _load(config, overrides) if config else None
    try:
        if cfg is not None:  # training.epochs → steps: what the checkpoint count follows
            from ance_train.config import resolve_budget

            cfg = resolve_budget(cfg, train_queries)
        if throughput_json is not None:
            planned = (precision.value if precision is not None
                       else _planned_precision(cfg.inference if cfg else None))
            measured = capacity.throughput_from_benchmark(throughput_json, planned)
        else:
            assert docs_per_s is not None
            measured = capacity.Throughput(docs_per_s, doc_tokens,
                                           precision.value if precision else None,
                                           "--docs-per-s")
        rates = (capacity.IndexRates.from_benchmark(calibration) if calibration
                 else capacity.IndexRates())
        def workload(run: RunConfig | None, per_doc: float | None) -> capacity.Workload:
            return capacity.workload(
                docs=docs, dim=dim, replicas=replicas, measured=measured,
                train_queries=train_queries, eval_queries=eval_queries, doc_tokens=doc_tokens,
                query_tokens=query_tokens, store_mb_s=store_mb_s, model_params=model_params,
                config=run, index_type=index_type.value if index_type else None,
                ivf_quantizer=ivf_quantizer.value if ivf_quantizer else None,
                partitions=partitions, embedding_bytes=np.dtype(str(embedding_dtype)).itemsize,
                indexer_cpus=indexer_cpus, overlap_build=overlap_build,
                passages_per_doc=per_doc)

        load = workload(cfg, passages_per_doc)
        result = capacity.plan(load, rates)
        passages = None
        if load.maxp:  # the same run with FirstP, to state what MaxP costs
            assert cfg is not None
            base = workload(capacity.firstp_config(cfg), None)
            passages = capacity.passage_cost(load, result, base, capacity.plan(base, rates))
    except (OSError, ValueError, KeyError) as error:
        err.print(f"[red]error:[/] {error}")
        raise typer.Exit(2) from None
    if as_json:
        print(json.dumps({"workload": capacity.describe(load), "rates": rates.source,
                          **result.to_dict(),
                          **({"passages": passages} if passages is not None else {})},
                         indent=2))
        return
    console.print(capacity.render(load, result, rates, passages))


@app.command()
def export(
    run: Annotated[str, typer.Option(
        "--run", help="The run: its configuration file (YAML), or its run id (then the store "
                      "comes from ANCE_S3_* or --store-dir / ANCE_STORE_DIR).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory to write the model to.")],
    checkpoint: Annotated[str, typer.Option(
        help="best (highest dev nDCG@10, never test), last, or a step number.")] = "best",
    store_dir: Annotated[str | None, typer.Option("--store-dir", envvar="ANCE_STORE_DIR")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace a non-empty --out.")] = False,
    push_to_hub: Annotated[str | None, typer.Option(
        "--push-to-hub", metavar="REPO",
        help="Also upload the exported directory to this Hugging Face Hub model repo "
             "(org/name; created if missing; token from HF_TOKEN or `hf auth login`).")] = None,
    private: Annotated[bool, typer.Option(
        help="With --push-to-hub: create the repo private.")] = False,
) -> None:
    """Write a checkpoint as a sentence-transformers model directory with a model card."""
    import re

    from ance_train.infra.store import StorageError, store_from_env
    from ance_train.modeling.export import ExportError, export_checkpoint, push_export

    cfg = None
    local_root: str | None
    if Path(run).is_file():
        cfg = _load(Path(run))
        run_id, local_root = cfg.run_id, store_dir or str(Path(cfg.output_dir) / cfg.run_id
                                                          / "store")
    elif re.fullmatch(r"[a-z0-9][a-z0-9-]{0,62}", run):
        run_id, local_root = run, store_dir
    else:
        err.print(f"[red]error:[/] --run {run!r} is neither a configuration file nor a run id")
        raise typer.Exit(2)
    try:
        store = store_from_env(run_id, local_root)
        step, written = export_checkpoint(store, checkpoint, out, cfg, overwrite=overwrite)
    except (ExportError, StorageError) as error:
        err.print(f"[red]error:[/] {error}")
        raise typer.Exit(1) from None
    console.print(f"exported checkpoint {step} of run {run_id} to {written} "
                  f"(SentenceTransformer({str(written)!r}) loads it)")
    if push_to_hub is not None:
        try:
            url = push_export(written, push_to_hub, private=private,
                              message=f"ance-train export: run {run_id}, checkpoint {step}")
        except ExportError as error:
            err.print(f"[red]error:[/] {error}")
            raise typer.Exit(1) from None
        console.print(f"pushed to the Hub: {url}")


class NegativesFormat(StrEnum):
    sentence_transformers = "sentence-transformers"
    tevatron = "tevatron"


@app.command("export-negatives")
def export_negatives(
    run: Annotated[Path, typer.Option(
        "--run", metavar="RUN_DIR", help="The embedded run's directory (output_dir/run_id: "
                                        "config.yaml and store/).")],
    checkpoint: Annotated[str, typer.Option(
        help="Whose negatives: the step of the checkpoint whose index mined them "
             "(negatives/<step> in the store), or bm25 (the warm-up table).")],
    out: Annotated[Path, typer.Option(
        "--out", "-o", help="sentence-transformers: a .jsonl file, else a datasets folder "
                            "(save_to_disk); tevatron: a .jsonl file.")],
    fmt: Annotated[NegativesFormat, typer.Option(
        "--format", help="sentence-transformers: (anchor, positive, negative) triplets, one per "
                         "negative; tevatron: {query_id, query, positive_passages, "
                         "negative_passages} per query.")] = NegativesFormat.sentence_transformers,
    per_query: Annotated[int | None, typer.Option(
        min=1, help="At most this many negatives per query, the best ranked (default: all "
                    "the table holds).")] = None,
    store_dir: Annotated[str | None, typer.Option(
        "--store-dir", help="The run's store when not RUN_DIR/store (ANCE_S3_* for S3).")
    ] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing --out.")] = False,
) -> None:
    """Write the hard negatives mined at one refresh as a training set for other trainers."""
    from ance_train.data.problems import DataError
    from ance_train.infra.store import StorageError
    from ance_train.negatives.export import NegativesExportError
    from ance_train.negatives.export import export_negatives as export_table

    try:
        result = export_table(run, checkpoint, fmt.value, out, overwrite=overwrite,
                              per_query=per_query, store_dir=store_dir)
    except (NegativesExportError, DataError, StorageError) as error:
        err.print(f"[red]error:[/] {escape(str(error))}")
        raise typer.Exit(1) from None
    console.print(f"wrote {result.rows} {fmt.value} rows to {result.out}: {result.negatives} "
                  f"negatives of {result.queries} training queries from {result.table}")
    if result.skipped_queries:
        console.print(f"skipped {result.skipped_queries} table rows (not a training query of "
                      "the dataset, or no negative left)")
    if result.positives_removed:
        console.print(f"left out {result.positives_removed} candidates that are positives")


data_app = typer.Typer(no_args_is_help=True, help="Get datasets, or convert them into the BEIR "
                                                  "layout that data.path reads.")
convert_app = typer.Typer(no_args_is_help=True, help="Convert pairs into the BEIR layout.")
app.add_typer(data_app, name="data")
data_app.add_typer(convert_app, name="convert")


@data_app.command("get")
def data_get(
    dataset: Annotated[str, typer.Argument(metavar="beir/NAME", help="e.g. beir/scifact.")],
    to: Annotated[Path | None, typer.Option(
        "--to", help="Directory to unpack into (absent or empty); default: data/NAME.")] = None,
    md5: Annotated[str | None, typer.Option(
        help="Expected MD5 of the archive (default: the one BEIR publishes, when known).")
    ] = None,
    sha256: Annotated[str | None, typer.Option(help="Expected SHA-256 of the archive.")] = None,
) -> None:
    """Download an official BEIR dataset, check its checksum and unpack it (the base URL:
    ANCE_BEIR_URL, for a mirror)."""
    from rich.progress import DownloadColumn, Progress, TransferSpeedColumn

    from ance_train.data.download import get_beir, parse_name
    from ance_train.data.problems import DataError

    try:
        name = parse_name(dataset)
        target = to or Path("data") / name
        with Progress(*Progress.get_default_columns(), DownloadColumn(), TransferSpeedColumn(),
                      console=err, transient=True) as bar:
            task = bar.add_task(f"{name}.zip", total=None)
            got = get_beir(name, target, md5=md5, sha256=sha256,
                           progress=lambda done, total: bar.update(task, completed=done,
                                                                   total=total))
    except DataError as error:
        err.print(f"[red]error:[/] {escape(str(error))}")
        raise typer.Exit(1) from None
    if got.checked is None:
        err.print(f"[yellow]warning:[/] no checksum known for {name}: not checked (md5 "
                  f"{got.md5}, sha256 {got.sha256}); pass --md5 or --sha256 to check")
    else:
        console.print(f"checksum ok: {got.checked}")
    console.print(f"unpacked beir/{name} ({got.bytes / 2**20:.1f} MiB) into {got.target}: "
                  f"data.path: {got.target.resolve()}")


QueryColumn = Annotated[str | None, typer.Option(
    help="The column of the query texts (default: anchor, query, question... or the first).")]
PositiveColumn = Annotated[str | None, typer.Option(
    help="The column of the positives, a text or a list (default: positive, pos, answer... "
         "or the second).")]
NegativeColumn = Annotated[str | None, typer.Option(
    help="The column of the negatives (default: negative, negative_1..., or the third).")]


def _convert(run_conversion) -> None:
    from ance_train.data.problems import DataError

    try:
        report, target = run_conversion()
    except DataError as error:
        err.print(f"[red]error:[/] {escape(str(error))}")
        raise typer.Exit(1) from None
    console.print(f"wrote {target} (BEIR layout; conversion.json records what was dropped)")
    for line in report.lines():
        console.print(f"  {escape(line)}")


@convert_app.command("pairs")
def convert_pairs(
    file: Annotated[Path, typer.Argument(help="Training pairs: .jsonl, .csv, .tsv or .parquet.")],
    to: Annotated[Path, typer.Option("--to", help="Directory to write (absent or empty).")],
    test: Annotated[Path | None, typer.Option(
        "--test", help="Test pairs (same formats): qrels/test.tsv, sharing the corpus.")] = None,
    dev_fraction: Annotated[float, typer.Option(
        min=0.0, max=0.99, help="Share of the training queries held out as qrels/dev.tsv.")
    ] = 0.0,
    seed: Annotated[int, typer.Option(help="Seed of the dev hold-out.")] = 42,
    query_column: QueryColumn = None,
    positive_column: PositiveColumn = None,
    negative_column: NegativeColumn = None,
) -> None:
    """Convert (query, positive[, negative]) pairs into the BEIR layout: identical texts become
    one document, ids derive from the text, negatives join the corpus; what is dropped is
    counted by reason. Columns: anchor/positive/negative, query/positive/negative, or any two
    or three, in order (sentence-transformers' convention)."""
    from ance_train.data.convert import ColumnNames
    from ance_train.data.convert import convert_pairs as convert

    names = ColumnNames(query_column, positive_column, negative_column)
    _convert(lambda: (convert(file, to, test, names, dev_fraction, seed), to))


@convert_app.command("hf")
def convert_hf(
    directory: Annotated[Path, typer.Argument(
        metavar="DIR", help="A datasets folder written by save_to_disk (a Dataset: train; a "
                            "DatasetDict: its train / validation / test splits).")],
    to: Annotated[Path, typer.Option("--to", help="Directory to write (absent or empty).")],
    dev_fraction: Annotated[float, typer.Option(
        min=0.0, max=0.99, help="Share of the training queries held out as dev (when the "
                                "folder has no validation split).")] = 0.0,
    seed: Annotated[int, typer.Option(help="Seed of the dev hold-out.")] = 42,
    query_column: QueryColumn = None,
    positive_column: PositiveColumn = None,
    negative_column: NegativeColumn = None,
) -> None:
    """Convert a Hugging Face datasets folder of pairs into the BEIR layout (needs the
    datasets extra)."""
    from ance_train.data.convert import ColumnNames
    from ance_train.data.convert import convert_hf as convert

    names = ColumnNames(query_column, positive_column, negative_column)
    _convert(lambda: (convert(directory, to, names, dev_fraction, seed), to))


def main() -> None:
    """The ``ance-train`` command (and ``python -m ance_train.cli``, as services are started):
    :data:`app`, then an exit without the interpreter's teardown, which costs a second after
    torch is imported (:func:`~ance_train.infra.process.exit_without_teardown`)."""
    try:
        app()
    except SystemExit as end:
        exit_without_teardown(end.code)
    exit_without_teardown(0)


if __name__ == "__main__":
    main()
