"""The ``ance-train`` command line."""

from __future__ import annotations

import json
import signal
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Train dense retrievers with asynchronously refreshed ANN negatives.")
console = Console()
err = Console(stderr=True)


class Role(StrEnum):
    trainer = "trainer"
    inferencer = "inferencer"
    indexer = "indexer"


def _load(config: Path):
    from .common.config import ConfigError, load_config

    try:
        return load_config(config)
    except ConfigError as error:
        err.print(f"[red]error:[/] {error}")
        raise typer.Exit(2) from None


def _connect_run(config: Path | None, redis_url: str | None, run_id: str | None):
    """The event bus of a run, from an embedded run's config or explicit endpoints."""
    from .common import events

    if config is not None:
        cfg = _load(config)
        run_id = run_id or cfg.run_id
        endpoints = Path(cfg.output_dir) / cfg.run_id / "endpoints.json"
        if redis_url is None and endpoints.is_file():
            redis_url = json.loads(endpoints.read_text())["redis_url"]
    if redis_url is None or run_id is None:
        err.print("[red]error:[/] give --config of an embedded run, or --redis-url and --run-id")
        raise typer.Exit(2)
    return events.EventBus(events.connect(redis_url), run_id), run_id


def _raise_interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


@app.command()
def run(
    config: Annotated[Path, typer.Option("--config", "-c", help="Run configuration (YAML).")],
    overwrite: Annotated[bool, typer.Option(help="Replace an existing run directory.")] = False,
    max_minutes: Annotated[float | None, typer.Option(help="Abort after this long.")] = None,
) -> None:
    """Run trainer, inferencers and indexer as local processes (the embedded mode)."""
    from .common.data import DataError
    from .launcher import EmbeddedRun, RunAborted

    cfg = _load(config)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        EmbeddedRun(cfg, config, overwrite=overwrite, max_minutes=max_minutes).execute()
    except (DataError, RunAborted) as error:
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
    work_dir: Annotated[Path, typer.Option("--work-dir", envvar="ANCE_WORK_DIR")] = Path(
        "/tmp/ance-work"),
    instance: Annotated[str | None, typer.Option("--instance", envvar="ANCE_INSTANCE",
                                                 help="Replica name (default: host name).")] = None,
    host: Annotated[str, typer.Option("--host", envvar="ANCE_GRPC_HOST")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", envvar="ANCE_GRPC_PORT")] = 0,
    store_dir: Annotated[str | None, typer.Option("--store-dir", envvar="ANCE_STORE_DIR")] = None,
) -> None:
    """Run one service (what each Kubernetes pod and each embedded child process runs)."""
    import socket

    from .common.runtime import ServiceContext, ServiceOptions

    _load(config)  # fail fast with a clear message before connecting anywhere
    options = ServiceOptions(role=role.value, config_path=str(config), redis_url=redis_url,
                             work_dir=str(work_dir), instance=instance or socket.gethostname(),
                             grpc_host=host, grpc_port=port, store_dir=store_dir)
    ctx = ServiceContext(options)
    if role is Role.trainer:
        from .trainer.trainer import serve as serve_role
    elif role is Role.inferencer:
        from .inferencer.inferencer import serve as serve_role
    else:
        from .indexer.indexer import serve as serve_role
    sys.exit(serve_role(ctx))


@app.command()
def validate(config: Annotated[Path, typer.Option("--config", "-c")]) -> None:
    """Validate the configuration and the dataset, then print what was found."""
    import tempfile

    from .common.data import DataError, validate_dataset

    cfg = _load(config)
    try:
        with tempfile.TemporaryDirectory() as cache:
            index = validate_dataset(cfg.data, Path(cache), seed=cfg.data.split_seed)
    except DataError as error:
        err.print(f"[red]error:[/] {error}")
        raise typer.Exit(1) from None
    for warning in index.warnings:
        err.print(f"[yellow]warning:[/] {warning}")
    console.print(f"ok: {index.num_docs} docs, {len(index.train)} train / {len(index.dev)} dev / "
                  f"{len(index.test)} test queries")


@app.command()
def status(
    config: Annotated[Path | None, typer.Option("--config", "-c")] = None,
    redis_url: Annotated[str | None, typer.Option("--redis-url", envvar="ANCE_REDIS_URL")] = None,
    run_id: Annotated[str | None, typer.Option("--run-id", envvar="ANCE_RUN_ID")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Print the state of a run, asked of every registered service over gRPC."""
    from .common.rpc import fetch_status

    bus, run_id = _connect_run(config, redis_url, run_id)
    rows = []
    for name, address in bus.services().items():
        try:
            reply = fetch_status(address)
            rows.append({"service": name, "address": address, "state": reply.state,
                         "step": reply.step, "checkpoint": reply.checkpoint_step,
                         "index": reply.index_step, "phase": reply.progress.phase,
                         "progress": f"{reply.progress.done}/{reply.progress.total}",
                         "metrics": dict(reply.metrics)})
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

    from .common.rpc import search as search_rpc

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


if __name__ == "__main__":
    app()
