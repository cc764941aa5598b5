"""`jaxserve k8s render`: Kubernetes manifests for jaxserve, printed as multi-document YAML for
`kubectl apply -f -`.

Four sets, each a Jinja template in `k8s_templates/` (package data: nothing here reads the checkout):

- `deployment`: jaxserve on one host per pod (Deployment, Service, and a ConfigMap holding the gin
  files, mounted at /etc/jaxserve: the pods start with the same gin files as the launch scripts).
- `lws`: one jaxserve instance across the hosts of a TPU slice or a multi-node GPU group
  (LeaderWorkerSet); the leader (process 0) serves, a Service selects leaders only.
- `inferencepool`: the Gateway API Inference Extension set in front of such pods: an InferencePool,
  llm-d's endpoint picker (EPP) with its RBAC and config, an HTTPRoute (and a Gateway).
- `router`: vllm-router (PyPI vllm-router 0.1.17) with Kubernetes service discovery by label.

The server's network settings (host, ports, drain grace, compilation cache) are flags on its
command line, which override the gin files; every value the pod will run is checked here first:
the gin files are copied as the ConfigMap holds them and loaded with the same flags
(`serve_config.load_config`), so a bad binding exits 2 now rather than crash-looping in the cluster.
Bad input is a ValueError naming the flag; `main` prints it and returns 2.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import shlex
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxserve.serving.routing import LIVENESS_PATH, READINESS_PATH

TEMPLATE_DIR = Path(__file__).resolve().parent / "k8s_templates"
KINDS = ("deployment", "lws", "inferencepool", "router")
ACCELERATORS = ("cpu", "nvidia", "tpu")

# The probes' paths on the serving port (jaxserve/serving/routing.py): /health answers 200 while
# serving, 503 while draining or after an engine failure; /live 200 while the engine loop runs
# (draining too), 503 after an engine failure. The HTTP port binds only after loading and warm-up.
PROBE_PATHS = {"startup": READINESS_PATH, "readiness": READINESS_PATH, "liveness": LIVENESS_PATH}
METRICS_PATH = "/metrics"  # vllm:num_requests_waiting etc. on the serving port (serving/metrics.py)

# What Server.drain does after the grace period: it aborts what is left and waits up to 10 s for
# the streams to end, then stops gRPC (2 s) and uvicorn (5 s graceful shutdown). 20 s covers that.
DRAIN_MARGIN_S = 20
COORDINATOR_PORT = 8476  # jax.distributed's coordinator on the LWS leader (multihost.DEFAULT_COORDINATOR_PORT)
CONFIG_MOUNT = "/etc/jaxserve"
CACHE_DIR = "/var/cache/jaxserve"  # JAXSERVE_CACHE_DIR; the compilation cache is CACHE_DIR/xla
MODEL_MOUNT = "/models"

# Not pulled or run here: llm-d's endpoint picker as its Helm chart (llm-d-router) names it. The
# chart's tag is `main`, which moves: pin a release tag with --epp-image.
DEFAULT_EPP_IMAGE = "ghcr.io/llm-d/llm-d-router-endpoint-picker:main"
# Built from deploy/Dockerfile (target `router`: pip install vllm-router==0.1.17); not built here.
DEFAULT_ROUTER_IMAGE = "vllm-router:0.1.17"
ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "consistent_hash", "random", "sticky_least_loaded")

# Per-pod resource requests when --cpu/--memory are not given: the CPU default model fits in
# 4 GiB; an accelerator host loads (and converts) a checkpoint through host memory.
DEFAULT_REQUESTS = {"cpu": ("2", "4Gi"), "nvidia": ("8", "64Gi"), "tpu": ("8", "64Gi")}

_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
_TOPOLOGY = re.compile(r"^[1-9][0-9]*(x[1-9][0-9]*){1,2}$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


# -- the command line ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """`jaxserve k8s render` and its flags (the same parser for every kind; a flag a kind does not use
    is ignored)."""
    ap = argparse.ArgumentParser(prog="jaxserve k8s", description="Kubernetes manifests for jaxserve.")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", required=True)
    p = sub.add_parser(
        "render",
        help="print the manifests of one set as YAML (pipe to kubectl apply -f -)",
        description="Print one set of Kubernetes manifests as multi-document YAML. See docs/deploy.md, 'Kubernetes'.",
    )
    p.add_argument("--kind", required=True, choices=KINDS, help="which set")
    p.add_argument("--name", default="jaxserve", help="instance name: prefix of every object, label of the server pods")
    p.add_argument("--namespace", default="default", help="namespace of every object (RBAC subjects need it)")
    _add_server_flags(p)
    _add_front_flags(p)
    return ap


def _add_server_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("jaxserve pods (deployment, lws)")
    g.add_argument("--image", default="jaxserve:0.1.0", help="jaxserve image (deploy/Dockerfile; not built here)")
    g.add_argument(
        "--gin-file",
        action="append",
        default=[],
        metavar="FILE",
        help="gin file (repeatable, in order): "
        "a path or a name under jaxserve/configs/; its text goes into the ConfigMap (default: default.gin)",
    )
    g.add_argument("--gin-param", action="append", default=[], metavar="BINDING", help="gin binding (repeatable)")
    g.add_argument("--model", default=None, help="checkpoint path in the pod (default: the gin's ServeConfig.model)")
    g.add_argument("--model-pvc", default=None, metavar="CLAIM", help=f"mount this PVC read-only at {MODEL_MOUNT}")
    g.add_argument("--accelerator", default="cpu", choices=ACCELERATORS, help="resources and node selection")
    g.add_argument("--chips", type=int, default=None, help="GPUs or TPU chips per pod (default 1 GPU, 4 TPU chips)")
    g.add_argument("--tpu-type", default="tpu-v6e-slice", help="node selector cloud.google.com/gke-tpu-accelerator")
    g.add_argument("--tpu-topology", default="2x2", help="node selector cloud.google.com/gke-tpu-topology")
    g.add_argument("--cpu", default=None, help="CPU request per pod (default by accelerator)")
    g.add_argument("--memory", default=None, help="memory request per pod (default by accelerator)")
    g.add_argument("--replicas", type=int, default=1, help="pods (deployment, router) or groups (lws)")
    g.add_argument("--group-size", type=int, default=2, help="lws: hosts (processes) per instance")
    g.add_argument("--http-port", type=int, default=8000, help="OpenAI-compatible HTTP port (probes, /metrics)")
    g.add_argument("--grpc-port", type=int, default=50051, help="gRPC port")
    g.add_argument("--no-grpc", action="store_true", help="serve HTTP only")
    g.add_argument(
        "--grace",
        type=float,
        default=None,
        help="seconds SIGTERM drains in-flight requests (default: the gin's ServeConfig.grace)",
    )
    g.add_argument("--prestop", type=int, default=5, help="seconds preStop waits before SIGTERM (endpoints go first)")
    g.add_argument("--startup-timeout", type=int, default=1800, help="seconds loading + warm-up may take")


def _add_front_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("inferencepool")
    g.add_argument("--epp-image", default=DEFAULT_EPP_IMAGE, help="llm-d endpoint picker image (not pulled here)")
    g.add_argument("--gateway", default="inference-gateway", help="the Gateway the HTTPRoute attaches to")
    g.add_argument("--gateway-class", default=None, help="also render that Gateway, of this GatewayClass")
    g.add_argument(
        "--failure-mode",
        default="FailOpen",
        choices=("FailOpen", "FailClose"),
        help="what the gateway does when the endpoint picker does not answer",
    )
    g = p.add_argument_group("router")
    g.add_argument(
        "--router-image", default=DEFAULT_ROUTER_IMAGE, help="image with vllm-router 0.1.17 (not built here)"
    )
    g.add_argument("--router-port", type=int, default=8080, help="the router's HTTP port")
    g.add_argument("--policy", default="cache_aware", choices=ROUTER_POLICIES, help="vllm-router --policy")
    g.add_argument("--cache-threshold", type=float, default=0.3, help="vllm-router --cache-threshold (0-1)")
    g.add_argument("--balance-abs-threshold", type=int, default=64, help="vllm-router --balance-abs-threshold")
    g.add_argument("--balance-rel-threshold", type=float, default=1.5, help="vllm-router --balance-rel-threshold")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)  # argparse exits 2 with the usage on a malformed flag
    try:
        sys.stdout.write(render(args, argv))
    except ValueError as e:
        print(f"jaxserve k8s {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


def render_argv(argv: list[str]) -> str:
    """The YAML that `jaxserve k8s render ARGV...` prints (argv without the leading 'render')."""
    return render(build_parser().parse_args(["render", *argv]), ["render", *argv])


# -- checks -------------------------------------------------------------------------------------------


def _check(ok: bool, flag: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{flag}: {message}")


def _check_common(a: argparse.Namespace) -> None:
    """The flags every kind reads: names, ports, counts."""
    _check(
        bool(_DNS_LABEL.match(a.name)) and len(a.name) <= 40,
        "--name",
        f"{a.name!r} must be a DNS label (lower-case letters, digits, '-', a letter first) of at most 40 characters",
    )
    _check(
        bool(_DNS_LABEL.match(a.namespace)) and len(a.namespace) <= 63,
        "--namespace",
        f"{a.namespace!r} must be a DNS label of at most 63 characters",
    )
    for flag, port in (("--http-port", a.http_port), ("--grpc-port", a.grpc_port), ("--router-port", a.router_port)):
        _check(1 <= port <= 65535, flag, f"must be in [1, 65535], got {port}")
    _check(a.no_grpc or a.grpc_port != a.http_port, "--grpc-port", f"must differ from --http-port ({a.http_port})")
    _check(
        COORDINATOR_PORT not in (a.http_port, a.grpc_port),
        "--http-port",
        f"{COORDINATOR_PORT} is jax.distributed's coordinator port",
    )
    _check(a.replicas >= 1, "--replicas", f"must be >= 1, got {a.replicas}")
    for flag, name in (("--gateway", a.gateway), ("--gateway-class", a.gateway_class or "x")):
        _check(bool(_DNS_SUBDOMAIN.match(name)) and len(name) <= 253, flag, f"not an object name: {name!r}")
    for flag, image in (("--image", a.image), ("--epp-image", a.epp_image), ("--router-image", a.router_image)):
        _check(bool(image) and not any(c.isspace() for c in image), flag, f"not an image reference: {image!r}")


def _check_pods(a: argparse.Namespace) -> None:
    """The flags of the jaxserve pods (deployment, lws)."""
    _check(a.prestop >= 0, "--prestop", f"must be >= 0, got {a.prestop}")
    _check(a.startup_timeout >= 10, "--startup-timeout", f"must be >= 10 seconds, got {a.startup_timeout}")
    _check(a.chips is None or a.chips >= 1, "--chips", f"must be >= 1, got {a.chips}")
    _check(a.chips is None or a.accelerator != "cpu", "--chips", "needs --accelerator nvidia or tpu")
    for flag, value in (("--cpu", a.cpu), ("--memory", a.memory)):
        _check(value is None or bool(_QUANTITY.match(value)), flag, f"not a Kubernetes quantity: {value!r}")
    _check(
        a.model_pvc is None or bool(_DNS_SUBDOMAIN.match(a.model_pvc)),
        "--model-pvc",
        f"not a claim name: {a.model_pvc!r}",
    )
    if a.accelerator == "tpu":
        _check(
            bool(_TOPOLOGY.match(a.tpu_topology)),
            "--tpu-topology",
            f"expected e.g. 2x2 or 2x2x4, got {a.tpu_topology!r}",
        )
        _check(bool(_LABEL_VALUE.match(a.tpu_type)), "--tpu-type", f"not a label value: {a.tpu_type!r}")
    if a.kind == "lws":
        _check(a.group_size >= 2, "--group-size", f"a LeaderWorkerSet spans >= 2 hosts, got {a.group_size}")
    _check(a.grace is None or a.grace >= 0, "--grace", f"must be >= 0, got {a.grace}")


def _check_router(a: argparse.Namespace) -> None:
    _check(0.0 <= a.cache_threshold <= 1.0, "--cache-threshold", f"must be in [0, 1], got {a.cache_threshold}")
    _check(a.balance_abs_threshold >= 0, "--balance-abs-threshold", f"must be >= 0, got {a.balance_abs_threshold}")
    _check(a.balance_rel_threshold >= 1.0, "--balance-rel-threshold", f"must be >= 1, got {a.balance_rel_threshold}")


# -- the gin files ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GinFile:
    """One gin file as the ConfigMap holds it: key (its file name in /etc/jaxserve) and text."""

    key: str
    text: str


def _read_gin_files(names: list[str]) -> list[GinFile]:
    """Each --gin-file, found as the CLI finds it (a path, else a name under jaxserve/configs/)."""
    from jaxserve.serve_config import CONFIG_DIR, DEFAULT_GIN_FILE

    out: list[GinFile] = []
    for name in names or [str(DEFAULT_GIN_FILE)]:
        path = next((p for p in (Path(name).expanduser(), CONFIG_DIR / name) if p.is_file()), None)
        _check(path is not None, "--gin-file", f"{name!r} not found (searched: the current directory, {CONFIG_DIR})")
        _check(path.name not in {g.key for g in out}, "--gin-file", f"two files named {path.name!r}")
        _check(bool(re.match(r"^[-._a-zA-Z0-9]+$", path.name)), "--gin-file", f"{path.name!r}: not a ConfigMap key")
        try:
            out.append(GinFile(path.name, path.read_text()))
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--gin-file: cannot read {str(path)!r}: {e}") from None
    return out


def _server_overrides(a: argparse.Namespace, grace: float | None) -> dict[str, Any]:
    """The ServeConfig fields the pod's command line sets (they override the gin files)."""
    out: dict[str, Any] = {
        "host": "0.0.0.0",
        "http_port": a.http_port,
        "port": None if a.no_grpc else a.grpc_port,
        "compilation_cache_dir": f"{CACHE_DIR}/xla",
    }
    if grace is not None:
        out["grace"] = grace
    if a.model is not None:
        out["model"] = a.model
    return out


def _load_as_pod(a: argparse.Namespace, gins: list[GinFile]):
    """The pod's ServeConfig, from copies of the gin files under their ConfigMap keys (so includes
    resolve as they will in the pod, given the same jaxserve); ValueError naming the flag."""
    from jaxserve.serve_config import load_config

    with tempfile.TemporaryDirectory(prefix="jaxserve-k8s-") as d:
        paths = []
        for g in gins:
            (Path(d) / g.key).write_text(g.text)
            paths.append(Path(d) / g.key)
        try:
            return load_config(paths, a.gin_param, _server_overrides(a, a.grace))
        except ValueError as e:
            raise ValueError(f"--gin-file/--gin-param: {str(e).replace(d, CONFIG_MOUNT)}") from None


# -- the template context -----------------------------------------------------------------------------


def _labels(a: argparse.Namespace) -> dict[str, str]:
    """The server pods' labels: what every Service, InferencePool and router selects by (in an
    LWS the leader's only: workers are component=worker)."""
    return {
        "app.kubernetes.io/name": "jaxserve",
        "app.kubernetes.io/instance": a.name,
        "app.kubernetes.io/component": "server",
    }


def _server_args(a: argparse.Namespace, gins: list[GinFile], grace: float) -> list[str]:
    """`jaxserve serve ...` of every jaxserve pod."""
    out = ["jaxserve", "serve"]
    for g in gins:
        out += ["--gin_file", f"{CONFIG_MOUNT}/{g.key}"]
    for b in a.gin_param:
        out += ["--gin_param", b]
    out += ["--host", "0.0.0.0", "--http-port", str(a.http_port)]
    out += ["--no-grpc"] if a.no_grpc else ["--port", str(a.grpc_port)]
    out += ["--grace", _num(grace), "--compilation-cache-dir", f"{CACHE_DIR}/xla"]
    if a.model is not None:
        out += ["--model", a.model]
    return out


def _resources(a: argparse.Namespace) -> dict[str, Any]:
    cpu, memory = DEFAULT_REQUESTS[a.accelerator]
    requests: dict[str, Any] = {"cpu": a.cpu or cpu, "memory": a.memory or memory}
    limits: dict[str, Any] = {}
    if a.accelerator != "cpu":
        key = {"nvidia": "nvidia.com/gpu", "tpu": "google.com/tpu"}[a.accelerator]
        chips = a.chips or {"nvidia": 1, "tpu": 4}[a.accelerator]
        requests[key] = limits[key] = chips  # extended resources: request == limit
    return {"requests": requests, "limits": limits}


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def _pod_context(a: argparse.Namespace) -> dict[str, Any]:
    """What the deployment and lws templates fill in."""
    _check_pods(a)
    gins = _read_gin_files(a.gin_file)
    cfg = _load_as_pod(a, gins)
    grace = cfg.grace
    termination = math.ceil(a.prestop + grace + DRAIN_MARGIN_S)
    digest = hashlib.sha256("".join(f"{g.key}\0{g.text}\0" for g in gins).encode()).hexdigest()[:16]
    period = 10
    return {
        "gins": gins,
        "gin_digest": digest,
        "args": _server_args(a, gins, grace),
        "grace": _num(grace),
        "termination": termination,
        "resources": _resources(a),
        "startup_failures": math.ceil(a.startup_timeout / period),
        "startup_period": period,
    }


def context(a: argparse.Namespace) -> dict[str, Any]:
    """Everything a template reads: the flags, checked, and what follows from them."""
    _check_common(a)
    ctx: dict[str, Any] = {
        "a": a,
        "labels": _labels(a),
        "probes": PROBE_PATHS,
        "metrics_path": METRICS_PATH,
        "drain_margin": DRAIN_MARGIN_S,
        "coordinator_port": COORDINATOR_PORT,
        "config_mount": CONFIG_MOUNT,
        "cache_dir": CACHE_DIR,
        "model_mount": MODEL_MOUNT,
    }
    if a.kind in ("deployment", "lws"):
        ctx.update(_pod_context(a))
    if a.kind == "router":
        _check_router(a)
    ctx["c"] = dict(ctx)  # the whole context, for the macros of _jaxserve.yaml.j2
    return ctx


# -- rendering ----------------------------------------------------------------------------------------


def _q(value: Any) -> str:
    """A YAML scalar that always reads back as this string (JSON's quoting is YAML's)."""
    return json.dumps(str(value))


def _block(text: str, indent: int) -> str:
    """Text as a YAML literal block at `indent` spaces, or a quoted scalar where a block would not
    read back the same (a first line that starts with a space, a carriage return, a tab indent)."""
    if not text.strip() or text[0] in " \t" or "\r" in text or any(line.startswith("\t") for line in text.splitlines()):
        return _q(text)
    pad = " " * indent
    body = "\n".join(pad + line if line else "" for line in text.rstrip("\n").splitlines())
    return "|\n" + body


def _nest(text: Any, indent: int) -> str:
    """A macro's output placed at `indent` spaces (its first line where the call stands), without the
    trailing newline that would leave a blank line; empty lines stay empty."""
    pad = " " * indent
    return "\n".join(pad + line if (i and line) else line for i, line in enumerate(str(text).rstrip("\n").split("\n")))


def _environment():
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["q"] = _q
    env.filters["block"] = _block
    env.filters["nest"] = _nest
    return env


def render(a: argparse.Namespace, argv: list[str]) -> str:
    """The manifests of `a.kind`, headed by the command that renders them again."""
    body = _environment().get_template(f"{a.kind}.yaml.j2").render(**context(a))
    header = (
        f"# Rendered by: jaxserve k8s {shlex.join(argv)}\n"
        "# Do not edit: render again (docs/deploy.md, 'Kubernetes'). Apply with: kubectl apply -f FILE\n"
    )
    return header + body
