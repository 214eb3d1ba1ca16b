"""A no-op ext_proc processor: the Python gRPC floor that ``extproc serve`` is measured against.

It answers every phase Envoy sends with "continue" and decides nothing. Everything else is what
``extproc serve`` runs, so the difference between the two is the admission work alone:

- the same stack: ``grpc.aio`` on uvloop, the servicer generated in ``xds-protos``, one
  async-generator ``Process`` per stream reading ``async for message in requests``;
- the same server options (``extproc.gateway.server.server_options``) and the same "continue"
  answers (``extproc.gateway.responses.continue_phase``).

Envoy is configured exactly as for ``extproc serve`` (``extproc.gateway.envoyconf``, in either
processing mode: one trip, a clean request's body alone with its headers as attributes; or two
trips, headers then body; every response phase skipped), so each request costs the same round
trips as it would with ``extproc serve`` and the stream stays open until the request ends.

Usage::

    python benchmarks/noop_extproc.py --listen 127.0.0.1:PORT [--max-body-bytes N]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import AsyncIterator

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc.gateway.responses import continue_phase
from extproc.gateway.server import server_options

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # extproc.config's default max_body_bytes


class NoopProcessor(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    async def Process(
        self, requests: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ProcessingResponse]:
        async for message in requests:
            yield continue_phase(message.WhichOneof("request"))


async def serve(listen: str, max_body_bytes: int) -> None:
    """Serve until SIGTERM or SIGINT."""
    server = grpc.aio.server(options=server_options(max_body_bytes))
    pb_grpc.add_ExternalProcessorServicer_to_server(NoopProcessor(), server)
    if not server.add_insecure_port(listen):
        raise SystemExit(f"cannot listen on {listen}")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=0.5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--listen", required=True, help="HOST:PORT")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    args = p.parse_args(argv)
    try:
        import uvloop  # what ``extproc serve`` runs on

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        pass
    asyncio.run(serve(args.listen, args.max_body_bytes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
