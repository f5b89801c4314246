"""Search under load: many concurrent gRPC clients on the indexer's ``Retrieval.Search`` while
the served index is swapped, as a refresh swaps it (docs/reliability.md, "Search under load").

The server is a separate OS process running the real ``SearchService`` behind the real
``GrpcServer`` with the run's limits (``index.search``): the SciFact corpus names the hits,
text queries are encoded by the real encoder (the default all-MiniLM-L6-v2) that the real
``ModelCache`` loads from a local object store, and the index is a real FAISS flat index. The
document vectors are random unit vectors of the encoder's dimension (encoding the corpus would
cost minutes on this machine and the load does not depend on them), so the rankings mean
nothing; the work per query is that of a real index of this size. Halfway through, the server
builds a second index (other vectors, checkpoint 2) in the same process and swaps it in with
``SearchService.serve`` (what ``Indexer`` does after a refresh); the next text query loads
checkpoint 2 into the model cache.

Phase 1 (``--clients`` threads, ``--seconds``): every client sends one request after another,
a text request (one SciFact query) or a vector request (``--vectors`` random query vectors)
with ``--text-share`` probability; no error is allowed. Phase 2 (``--burst-clients`` threads,
more than ``max_concurrent_rpcs``, ``--burst-seconds``): the calls beyond the cap must be
refused at once with ``RESOURCE_EXHAUSTED``, the admitted ones answered, nothing else.
The server samples its RSS every second.

    python bench/search_load.py                      # → docs/benchmarks/search-load.{json,md}
    python bench/search_load.py --seconds 20 --burst-seconds 5 --out /tmp/x   # a quick look
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from ance_train_dev.report import Section, command_line, machine, utc_now, write_report

REPO = Path(__file__).resolve().parents[2]
SECTION = Section("search-load", "bench/search_load.py")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path,
                        default=Path(os.environ.get("ANCE_SCIFACT_DIR", "data/scifact")))
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--burst-clients", type=int, default=96)
    parser.add_argument("--burst-seconds", type=float, default=15.0)
    parser.add_argument("--text-share", type=float, default=0.5)
    parser.add_argument("--vectors", type=int, default=8, help="query vectors per request")
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=10.0, help="client deadline, s")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks")
    parser.add_argument("--render", type=Path, metavar="JSON",
                        help="render a saved search-load.json again, run nothing")
    parser.add_argument("--reliability", type=Path, default=REPO / "docs" / "reliability.md",
                        help="document whose search-load section is replaced ('' : none)")
    return parser.parse_args(argv)


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return -1


def _random_index(dim: int, docs: int, seed: int):
    from ance_train.index.ann import AnnIndex

    vectors = np.random.default_rng(seed).normal(size=(docs, dim)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    index = AnnIndex(dim)
    index.add(np.arange(docs), vectors)
    index.finalize()
    return index


def serve(data: str, work: str, conn) -> None:
    """The server process: Search over SciFact; answers ``swap`` / ``samples`` / ``stop``."""
    import torch

    from ance_train.config import DataConfig, ModelConfig, SearchLimits
    from ance_train.data.corpus import open_corpus
    from ance_train.data.validation import validate_dataset
    from ance_train.indexer.search_service import SearchService, ServedIndex
    from ance_train.infra.rpc import GrpcServer, ServiceState
    from ance_train.infra.store.local import LocalStore
    from ance_train.modeling.checkpoint_cache import ModelCache
    from ance_train.modeling.model import BiEncoder
    from ance_train.protocol import keys

    torch.set_num_threads(1)  # as many server threads as cores already compete
    cfg = DataConfig(path=data)
    validate_dataset(cfg, Path(work) / "cache")
    corpus = open_corpus(cfg, Path(work) / "cache")
    model_config = ModelConfig()
    store = LocalStore("search-load", Path(work) / "store")
    dim = BiEncoder.from_pretrained(model_config.path, model_config).dim
    for step in (1, 2):  # two checkpoints (the same weights) for the swap
        store.put_dir(keys.checkpoint(step), model_config.path)
    models = ModelCache(store, model_config, Path(work) / "models", torch.device("cpu"))
    limits = SearchLimits()
    service = SearchService(corpus, models, model_config.max_query_length, limits=limits)
    service.serve(ServedIndex(1, _random_index(dim, len(corpus), 1)))
    server = GrpcServer(ServiceState("indexer", "search-load", "indexer"),
                        add_servicers=service.add_to_server,
                        max_message_bytes=limits.max_message_bytes,
                        max_concurrent_rpcs=limits.max_concurrent_rpcs).start()
    samples: list[tuple[float, int]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append((time.time(), rss_bytes()))
            stop.wait(1.0)

    threading.Thread(target=sample, daemon=True).start()
    conn.send({"address": server.address, "dim": dim, "docs": len(corpus),
               "limits": limits.model_dump(), "workers": 8})
    while True:
        message = conn.recv()
        if message == "swap":
            started = time.time()
            index = _random_index(dim, len(corpus), 2)  # built while the old one serves
            service.serve(ServedIndex(2, index))
            conn.send({"swapped_at": time.time(), "build_s": time.time() - started})
        elif message == "samples":
            conn.send({"rss": list(samples), "abandoned": service.abandoned})
        else:
            stop.set()
            server.stop(grace_s=1.0)
            conn.send("stopped")
            return


def load(address: str, clients: int, seconds: float, texts: list[str], dim: int,
         args: argparse.Namespace, seed: int) -> list[dict]:
    """``clients`` threads calling Search back to back for ``seconds``; one row per call."""
    import grpc

    from ance_train.infra.proto import ance_pb2, ance_pb2_grpc
    from ance_train.infra.rpc import channel

    rows: list[dict] = []
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def client(number: int) -> None:
        rng = np.random.default_rng(seed + number)
        mine: list[dict] = []
        with channel(address) as ch:  # a channel per client, as separate users would have
            stub = ance_pb2_grpc.RetrievalStub(ch)
            while time.monotonic() < end:
                if rng.random() < args.text_share:
                    kind, request = "text", ance_pb2.SearchRequest(
                        k=args.k, queries=[texts[int(rng.integers(len(texts)))]])
                else:
                    vectors = rng.normal(size=(args.vectors, dim)).astype(np.float32)
                    kind, request = "vector", ance_pb2.SearchRequest(
                        k=args.k, embeddings=[ance_pb2.Embedding(values=v)
                                              for v in vectors.tolist()])
                started = time.time()
                try:
                    reply = stub.Search(request, timeout=args.timeout)
                    code, step = "OK", reply.index_step
                except grpc.RpcError as error:
                    code, step = error.code().name, -1
                    if code == "RESOURCE_EXHAUSTED":
                        time.sleep(0.05)  # a client told to back off does
                mine.append({"kind": kind, "start": started, "latency": time.time() - started,
                             "code": code, "step": step})
        with lock:
            rows.extend(mine)

    threads = [threading.Thread(target=client, args=(n,)) for n in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return rows


def summarise(rows: list[dict], seconds: float) -> dict:
    ok = [r for r in rows if r["code"] == "OK"]
    codes: dict[str, int] = {}
    for row in rows:
        codes[row["code"]] = codes.get(row["code"], 0) + 1
    result = {"calls": len(rows), "codes": codes, "ok_per_s": len(ok) / seconds}
    for kind in ("all", "text", "vector"):
        latencies = np.array([r["latency"] for r in ok if kind in ("all", r["kind"])])
        if len(latencies):
            result[kind] = {"calls": len(latencies),
                            "p50_ms": float(np.percentile(latencies, 50) * 1e3),
                            "p99_ms": float(np.percentile(latencies, 99) * 1e3),
                            "max_ms": float(latencies.max() * 1e3)}
    refused = [r["latency"] for r in rows if r["code"] == "RESOURCE_EXHAUSTED"]
    if refused:
        result["refused_max_ms"] = float(max(refused) * 1e3)
    return result


def render(report: dict) -> str:
    phases, rss = report["phases"], report["rss"]
    lines = [
        "## Search under load", "",
        "The indexer's `Retrieval.Search` enforces the limits of `index.search` "
        "(`SearchLimits` in `src/ance_train/config.py`): more than `max_concurrent_rpcs` RPCs "
        "in flight on the server are refused at once with `RESOURCE_EXHAUSTED` (\"Concurrent "
        "RPC limit exceeded!\", gRPC's own check; the 8 worker threads take the admitted ones "
        "in turn, so at most cap − 8 wait: a bounded queue); a message over "
        "`max_message_bytes` is `RESOURCE_EXHAUSTED` naming both sizes; more than "
        "`max_queries` queries or `k` above `max_k` is `INVALID_ARGUMENT`; the client's "
        "deadline is honoured: the server checks between batches of `batch_queries` queries "
        "(and around text encoding) that the client still waits, and abandons the call when "
        "not, so no worker computes an answer nobody reads (`ance-train search` and "
        "`infra.rpc.search` send a 30 s deadline). The cap counts health and Status calls too: "
        "the Kubernetes gRPC probes of an indexer at its cap fail as long as it stays there. "
        "`tests/test_search_limits.py` checks each limit over real gRPC; the load test below "
        "measures the endpoint under many clients during an index swap.", "",
        "### Load test (`bench/search_load.py`)", "",
        f"{report['params']['docs']:,} SciFact documents (random {report['params']['dim']}-d "
        f"unit vectors, flat index), text queries encoded by all-MiniLM-L6-v2 on the server's "
        f"CPU, vector requests of {report['params']['vectors']} queries, k="
        f"{report['params']['k']}, client deadline {report['params']['timeout']:.0f} s; the "
        f"index swapped to checkpoint 2 after {report['swap']['at_s']:.1f} s of phase 1 "
        f"(built in {report['swap']['build_s']:.2f} s beside the serving one). Limits: "
        + ", ".join(f"{k}={v}" for k, v in report["limits"].items())
        + f"; {report['workers']} gRPC worker threads.", "",
        "| phase | clients | s | calls OK/s | p50 ms | p99 ms | max ms | text p50/p99 ms | "
        "vector p50/p99 ms | status counts |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, phase in phases.items():
        s = phase["summary"]

        def pair(kind: str, s: dict = s) -> str:
            return (f"{s[kind]['p50_ms']:.0f} / {s[kind]['p99_ms']:.0f}" if kind in s else "–")

        codes = ", ".join(f"{k} {v}" for k, v in sorted(s["codes"].items()))
        lines.append(f"| {name} | {phase['clients']} | {phase['seconds']:.0f} | "
                     f"{s['ok_per_s']:.1f} | {s['all']['p50_ms']:.0f} | "
                     f"{s['all']['p99_ms']:.0f} | {s['all']['max_ms']:.0f} | {pair('text')} | "
                     f"{pair('vector')} | {codes} |")
    steps = report["steps_answered"]
    lines += [
        "",
        f"- answers by checkpoint in phase 1: {steps}; errors in phase 1 (any status but OK): "
        f"**{report['phase1_errors']}**",
        f"- server RSS: {rss['first_mb']:.0f} MB at the start of phase 1, {rss['max_mb']:.0f} MB "
        f"at most, {rss['last_mb']:.0f} MB at the end ({rss['samples']} samples, 1 s apart); "
        f"phase 1 second half vs first half median: {rss['half_change_mb']:+.1f} MB",
        f"- phase 2 (more clients than max_concurrent_rpcs): refused calls were answered "
        f"RESOURCE_EXHAUSTED within {phases['2 burst']['summary'].get('refused_max_ms', 0):.0f}"
        f" ms at most (no queue beyond the cap); "
        f"searches abandoned by the server after a client gave up: {report['abandoned']}",
        "",
        f"Date {report['date']}, command `{report['command']}`, machine: "
        f"{report['machine']['cpu']} ({report['machine']['cores']} cores, "
        f"{report['machine']['platform']}), load average (1 min) {report['load_before']:.1f} "
        f"before and {report['load_after']:.1f} after: the machine was shared with other "
        f"engineers' test runs, so the numbers are noisy (clients and server share the 2 "
        f"cores).",
    ]
    return "\n".join(lines) + "\n"


def publish(args: argparse.Namespace, report: dict) -> None:
    """docs/benchmarks/search-load.{json,md} and the section of docs/reliability.md."""
    markdown = render(report)
    write_report(args.out, "search-load", report, markdown)
    if str(args.reliability):
        doc = args.reliability
        doc.write_text(SECTION.splice(doc.read_text() if doc.exists() else "", markdown))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        report = json.loads(args.render.read_text())
        publish(args, report)
        return 0
    date, load_before = utc_now(), os.getloadavg()[0]
    texts = _query_texts(args.data)
    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="search-load-") as work:
        parent, child = context.Pipe()
        server = context.Process(target=serve, args=(str(args.data), work, child))
        server.start()
        info = parent.recv()
        address, dim = info["address"], info["dim"]
        load(address, 4, 3.0, texts, dim, args, seed=99)  # warm-up: model loaded, paths hot
        start = time.time()
        swap: dict = {}

        def swap_later() -> None:
            time.sleep(args.seconds / 2)
            parent.send("swap")
            swap.update(parent.recv())

        swapper = threading.Thread(target=swap_later)
        swapper.start()
        phase1 = load(address, args.clients, args.seconds, texts, dim, args, seed=0)
        swapper.join()
        phase1_end = time.time()
        phase2 = load(address, args.burst_clients, args.burst_seconds, texts, dim, args,
                      seed=1000)
        parent.send("samples")
        samples = parent.recv()
        parent.send("stop")
        parent.recv()
        server.join(30)
    rss = [(t, b) for t, b in samples["rss"] if start <= t <= phase1_end]
    mid = start + args.seconds / 2
    first = [b for t, b in rss if t < mid]
    second = [b for t, b in rss if t >= mid]
    report = {
        "date": date, "command": command_line(), "machine": machine(),
        "load_before": load_before, "load_after": os.getloadavg()[0],
        "params": {"docs": info["docs"], "dim": dim, "vectors": args.vectors, "k": args.k,
                   "timeout": args.timeout, "text_share": args.text_share},
        "limits": info["limits"], "workers": info["workers"],
        "swap": {"at_s": swap["swapped_at"] - start, "build_s": swap["build_s"]},
        "phases": {
            "1 steady + swap": {"clients": args.clients, "seconds": args.seconds,
                                "summary": summarise(phase1, args.seconds)},
            "2 burst": {"clients": args.burst_clients, "seconds": args.burst_seconds,
                        "summary": summarise(phase2, args.burst_seconds)},
        },
        "steps_answered": {str(s): sum(1 for r in phase1 if r["step"] == s)
                           for s in sorted({r["step"] for r in phase1 if r["step"] > 0})},
        "phase1_errors": sum(1 for r in phase1 if r["code"] != "OK"),
        "abandoned": samples["abandoned"],
        "rss": {"samples": len(rss), "first_mb": rss[0][1] / 1e6,
                "max_mb": max(b for _, b in rss) / 1e6, "last_mb": rss[-1][1] / 1e6,
                "half_change_mb": (float(np.median(second)) - float(np.median(first))) / 1e6,
                "series": [(round(t - start, 1), b) for t, b in samples["rss"]]},
    }
    publish(args, report)
    burst_other = {k: v for k, v in report["phases"]["2 burst"]["summary"]["codes"].items()
                   if k not in ("OK", "RESOURCE_EXHAUSTED")}
    return 1 if report["phase1_errors"] or burst_other else 0


def _query_texts(data: Path) -> list[str]:
    texts = [json.loads(line)["text"] for line in (data / "queries.jsonl").open()]
    if not texts:
        raise SystemExit(f"{data / 'queries.jsonl'}: no queries")
    return texts
