"""``python -m ance_train.infra.health_probe PORT``: exit 0 when the gRPC health service on
``127.0.0.1:PORT`` answers SERVING, 1 otherwise.

Kubernetes' native ``grpc:`` probes cannot speak TLS, so with ``tls.grpc.enabled`` the chart
probes through this command instead, run in the service's container with the service's own
environment (``ANCE_GRPC_TLS*``: the CA, the certificate for mutual TLS, and the name the
certificate carries, since the probe dials loopback)."""

from __future__ import annotations

import sys

import grpc

from ance_train.infra.rpc import check_health


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not argv[0].isdigit():
        print("usage: python -m ance_train.infra.health_probe PORT", file=sys.stderr)
        return 2
    try:
        serving = check_health(f"127.0.0.1:{argv[0]}", timeout_s=4.0)
    except grpc.RpcError as error:
        print(f"gRPC health check failed: {error.code().name}: {error.details()}",
              file=sys.stderr)
        return 1
    print("SERVING" if serving else "NOT_SERVING")
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
