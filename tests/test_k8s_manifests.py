"""Kubernetes manifests (`jaxserve k8s render`, jaxserve/tools/k8s.py), validated offline: core kinds
with kubernetes-validate (strict: an undeclared field fails) against Kubernetes 1.33's schemas, custom
kinds (LeaderWorkerSet, InferencePool, Gateway, HTTPRoute) with jsonschema against their CRD's
openAPIV3Schema (tests/data/crds/) made as strict: no field the schema does not declare, unless it
says x-kubernetes-preserve-unknown-fields (the API server prunes such fields; a typo would vanish).
Also: both directions (a misspelled field fails), the checked-in examples (deploy/k8s/) equal what
their recorded command renders, and the invariants the manifests promise. No cluster, no network."""

from __future__ import annotations

import copy
import functools
import shlex
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import kubernetes_validate
import pytest
import yaml

from jaxserve import cli
from jaxserve.serve_config import CONFIG_DIR, load_config
from jaxserve.serving import routing
from jaxserve.tools import k8s

pytestmark = pytest.mark.fast

K8S_VERSION = "1.33"
ROOT = Path(__file__).resolve().parents[1]
CRD_DIR = Path(__file__).resolve().parent / "data" / "crds"
EXAMPLES = sorted((ROOT / "deploy" / "k8s").glob("*.yaml"))
CRDS = {
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "leaderworkerset.x-k8s.io_leaderworkersets.yaml",
    ("inference.networking.k8s.io/v1", "InferencePool"): "inference.networking.k8s.io_inferencepools.yaml",
    ("gateway.networking.k8s.io/v1", "Gateway"): "gateway.networking.k8s.io_gateways.yaml",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "gateway.networking.k8s.io_httproutes.yaml",
}
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

# Several flag combinations of every set (argv after `jaxserve k8s render`).
CASES = {
    "deployment-cpu": ["--kind", "deployment"],
    "deployment-gpu": [
        "--kind",
        "deployment",
        "--name",
        "llama",
        "--accelerator",
        "nvidia",
        "--chips",
        "2",
        "--gin-file",
        "llama-3.1-8b-instruct.gin",
        "--model-pvc",
        "models",
        "--replicas",
        "3",
    ],
    "deployment-tpu-http-only": [
        "--kind",
        "deployment",
        "--accelerator",
        "tpu",
        "--gin-file",
        "llama-3.1-8b-instruct.gin",
        "--gin-file",
        "base/tpu.gin",
        "--no-grpc",
        "--grace",
        "90",
        "--prestop",
        "10",
        "--gin-param",
        "ServeConfig.max_slots = 8",
        "--namespace",
        "serving",
    ],
    "lws-tpu": [
        "--kind",
        "lws",
        "--accelerator",
        "tpu",
        "--group-size",
        "4",
        "--tpu-topology",
        "4x4",
        "--tpu-type",
        "tpu-v5-lite-podslice",
        "--gin-file",
        "llama-3.1-70b-instruct.gin",
        "--gin-file",
        "base/tpu.gin",
    ],
    "lws-gpu": [
        "--kind",
        "lws",
        "--accelerator",
        "nvidia",
        "--chips",
        "8",
        "--group-size",
        "2",
        "--replicas",
        "2",
        "--gin-file",
        "llama-3.1-70b-instruct.gin",
        "--model",
        "/models/llama-70b",
        "--model-pvc",
        "models",
    ],
    "lws-cpu": ["--kind", "lws", "--group-size", "2", "--http-port", "9000"],
    "inferencepool": ["--kind", "inferencepool", "--name", "llama"],
    "inferencepool-gateway": [
        "--kind",
        "inferencepool",
        "--gateway-class",
        "gke-l7-regional-external-managed",
        "--failure-mode",
        "FailClose",
        "--http-port",
        "9000",
        "--namespace",
        "serving",
    ],
    "router": ["--kind", "router"],
    "router-round-robin": ["--kind", "router", "--name", "llama", "--policy", "round_robin", "--replicas", "2"],
    "router-thresholds": [
        "--kind",
        "router",
        "--balance-abs-threshold",
        "2",
        "--balance-rel-threshold",
        "1.2",
        "--cache-threshold",
        "0.5",
        "--router-port",
        "30000",
    ],
}


# -- validation -------------------------------------------------------------------------------------

# The custom resource's own metadata: the CRD says only `type: object` (the API server validates it as
# ObjectMeta); these are the fields the templates may set.
_OBJECT_META = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
        "namespace": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}


def strict(schema: dict) -> dict:
    """The schema with `additionalProperties: false` on every object that declares neither
    additionalProperties nor x-kubernetes-preserve-unknown-fields: what Kubernetes keeps of an
    object, and nothing else, passes."""
    out = dict(schema)
    if isinstance(out.get("properties"), dict):
        out["properties"] = {k: strict(v) for k, v in out["properties"].items()}
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = strict(out[key])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in out:
            out[key] = [strict(s) for s in out[key]]
    if (
        out.get("type") == "object"
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@functools.cache
def crd_validator(api_version: str, kind: str) -> jsonschema.Draft4Validator:
    crd = yaml.load((CRD_DIR / CRDS[(api_version, kind)]).read_text(), Loader=_LOADER)
    version = api_version.rsplit("/", 1)[1]
    (entry,) = [v for v in crd["spec"]["versions"] if v["name"] == version and v["served"]]
    schema = copy.deepcopy(entry["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = _OBJECT_META
    return jsonschema.Draft4Validator(strict(schema))


def problems(doc: dict) -> list[str]:
    """What is wrong with one manifest ([] when it validates)."""
    key = (doc["apiVersion"], doc["kind"])
    if key in CRDS:
        return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in crd_validator(*key).iter_errors(doc)]
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{'.'.join(map(str, e.path))}: {e.message}"]
    return []


def render(argv: list[str]) -> list[dict]:
    return [d for d in yaml.load_all(k8s.render_argv(argv), Loader=_LOADER) if d is not None]


def find(docs: list[dict], kind: str, name: str | None = None) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    return doc


def container_args(pod_spec: dict) -> list[str]:
    return pod_spec["containers"][0]["args"]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


# -- every set validates ------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_every_set_validates(case):
    docs = render(CASES[case])
    assert docs
    for doc in docs:
        assert problems(doc) == [], f"{doc['kind']} {doc['metadata']['name']}"


def edited(doc: dict, path: tuple, key: str, rename_to: str | None, value) -> dict:
    """A copy of doc with the field `key` under `path` renamed to rename_to, or else set to value."""
    out = copy.deepcopy(doc)
    parent = functools.reduce(lambda d, k: d[k], path, out)
    if rename_to is not None:
        parent[rename_to] = parent.pop(key)
    else:
        parent[key] = value
    return out


_LEADER = ("spec", "leaderWorkerTemplate", "leaderTemplate", "spec", "containers", 0)
# (set, kind, where, field, renamed to, or else set to, what the error names): both checkers, both
# ways (an unknown field, a wrong type or value), down to a container inside a custom resource.
BROKEN = {
    "deployment-readinessProb": (
        "deployment-cpu",
        "Deployment",
        ("spec", "template", "spec", "containers", 0),
        "readinessProbe",
        "readinessProb",
        None,
        "readinessProb",
    ),
    "service-port-type": ("deployment-cpu", "Service", ("spec", "ports", 0), "port", None, "eight thousand", "port"),
    "pool-matchLabel": (
        "inferencepool",
        "InferencePool",
        ("spec", "selector"),
        "matchLabels",
        "matchLabel",
        None,
        "matchLabel",
    ),
    "pool-port-type": (
        "inferencepool",
        "InferencePool",
        ("spec", "targetPorts", 0),
        "number",
        None,
        "8000",
        "targetPorts.0.number",
    ),
    "pool-failure-mode": (
        "inferencepool",
        "InferencePool",
        ("spec", "endpointPickerRef"),
        "failureMode",
        None,
        "FailSometimes",
        "failureMode",
    ),
    "lws-sise": ("lws-gpu", "LeaderWorkerSet", ("spec", "leaderWorkerTemplate"), "size", "sise", None, "sise"),
    "lws-size-type": ("lws-gpu", "LeaderWorkerSet", ("spec", "leaderWorkerTemplate"), "size", None, "two", "size"),
    "lws-leader-readinessProb": (
        "lws-gpu",
        "LeaderWorkerSet",
        _LEADER,
        "readinessProbe",
        "readinessProb",
        None,
        "readinessProb",
    ),
    "route-backend-nmae": (
        "inferencepool",
        "HTTPRoute",
        ("spec", "rules", 0, "backendRefs", 0),
        "name",
        "nmae",
        None,
        "nmae",
    ),
}


@pytest.mark.parametrize("broken", BROKEN)
def test_a_wrong_field_or_type_fails(broken):
    case, kind, path, key, rename_to, value, named = BROKEN[broken]
    doc = find(render(CASES[case]), kind)
    assert problems(doc) == []
    found = problems(edited(doc, path, key, rename_to, value))
    assert any(named in p for p in found), found


# -- the checked-in examples --------------------------------------------------------------------------


def test_there_are_checked_in_examples():
    names = {p.name for p in EXAMPLES}
    assert {"inferencepool.yaml", "router.yaml"} <= names and len(names) >= 5


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_checked_in_example_equals_its_render(path):
    text = path.read_text()
    first = text.splitlines()[0]
    prefix = "# Rendered by: jaxserve k8s render "
    assert first.startswith(prefix), f"{path.name}: the first line must be the command that renders it"
    argv = shlex.split(first[len(prefix) :])
    assert text == k8s.render_argv(argv), f"{path.name} drifted: render it again with its first line's command"


# -- invariants ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["deployment-cpu", "deployment-tpu-http-only", "lws-gpu"])
def test_termination_grace_covers_prestop_and_drain(case):
    docs = render(CASES[case])
    workload = next(d for d in docs if d["kind"] in ("Deployment", "LeaderWorkerSet"))
    spec = workload["spec"]
    pods = (
        [spec["template"]["spec"]]
        if "template" in spec
        else [spec["leaderWorkerTemplate"][t]["spec"] for t in ("leaderTemplate", "workerTemplate")]
    )
    for pod in pods:
        grace = float(flag(container_args(pod), "--grace"))
        prestop = pods[0]["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert pod["terminationGracePeriodSeconds"] >= prestop + grace + k8s.DRAIN_MARGIN_S


def test_grace_defaults_to_the_gin_file_and_follows_the_flag():
    gin = load_config([CONFIG_DIR / "llama-3.1-8b-instruct.gin"]).grace
    pod = find(render(["--kind", "deployment", "--gin-file", "llama-3.1-8b-instruct.gin"]), "Deployment")
    assert float(flag(container_args(pod["spec"]["template"]["spec"]), "--grace")) == gin
    pod = find(render(CASES["deployment-tpu-http-only"]), "Deployment")["spec"]["template"]["spec"]
    assert flag(container_args(pod), "--grace") == "90" and pod["terminationGracePeriodSeconds"] == 10 + 90 + 20


@pytest.mark.parametrize("case", ["deployment-cpu", "deployment-gpu", "lws-tpu"])
def test_configmap_holds_the_gin_files_and_they_load(case, tmp_path):
    docs = render(CASES[case])
    configmap = find(docs, "ConfigMap")
    workload = next(d for d in docs if d["kind"] in ("Deployment", "LeaderWorkerSet"))
    spec = workload["spec"]
    pod = spec["template"]["spec"] if "template" in spec else spec["leaderWorkerTemplate"]["leaderTemplate"]["spec"]
    args = container_args(pod)
    mounted = [args[i + 1] for i, a in enumerate(args) if a == "--gin_file"]
    assert mounted == [f"{k8s.CONFIG_MOUNT}/{key}" for key in configmap["data"]]
    argv = CASES[case]
    sources = [argv[i + 1] for i, a in enumerate(argv) if a == "--gin-file"] or ["default.gin"]
    for key, source in zip(configmap["data"], sources):
        assert configmap["data"][key] == (CONFIG_DIR / source).read_text().rstrip("\n") + "\n"
        (tmp_path / key).write_text(configmap["data"][key])
    cfg = load_config([tmp_path / key for key in configmap["data"]], [], {"host": "0.0.0.0", "http_port": 8000})
    assert cfg.http_port == 8000


def test_a_bad_gin_binding_fails_at_render_time(capsys):
    assert k8s.main(["render", "--kind", "deployment", "--gin-param", "ServeConfig.max_slotz = 3"]) == 2
    err = capsys.readouterr().err
    assert "--gin-file/--gin-param" in err and "max_slotz" in err


def test_lws_service_selects_the_leader_only():
    docs = render(CASES["lws-tpu"])
    selector = find(docs, "Service")["spec"]["selector"]
    assert selector["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    template = find(docs, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    leader, worker = template["leaderTemplate"], template["workerTemplate"]
    ours = {k: v for k, v in selector.items() if not k.startswith("leaderworkerset.")}
    assert ours.items() <= leader["metadata"]["labels"].items()
    assert not ours.items() <= worker["metadata"]["labels"].items()  # workers are component=worker
    assert "readinessProbe" in leader["spec"]["containers"][0]
    assert not {"readinessProbe", "livenessProbe", "startupProbe", "ports"} & worker["spec"]["containers"][0].keys()
    assert leader["spec"]["containers"][0]["args"] == worker["spec"]["containers"][0]["args"]


def test_lws_maps_the_group_onto_jaxserves_multihost_settings():
    env = {
        case: {
            e["name"]: e["value"]
            for e in find(render(CASES[case]), "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]["workerTemplate"][
                "spec"
            ]["containers"][0]["env"]
        }
        for case in ("lws-tpu", "lws-gpu")
    }
    assert env["lws-tpu"]["JAXSERVE_COORDINATOR"] == "auto"
    assert env["lws-gpu"]["JAXSERVE_COORDINATOR"] == f"$(LWS_LEADER_ADDRESS):{k8s.COORDINATOR_PORT}"
    assert env["lws-gpu"]["JAXSERVE_NUM_PROCESSES"] == "$(LWS_GROUP_SIZE)"
    assert env["lws-gpu"]["JAXSERVE_PROCESS_ID"] == "$(LWS_WORKER_INDEX)"


def test_every_front_selects_the_server_pods_of_its_name():
    pod_labels = find(render(["--kind", "deployment", "--name", "llama"]), "Deployment")["spec"]["template"][
        "metadata"
    ]["labels"]
    pool = find(render(["--kind", "inferencepool", "--name", "llama"]), "InferencePool")
    assert pool["spec"]["selector"]["matchLabels"] == pod_labels
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool["spec"]["endpointPickerRef"]["port"]["number"] == 9002  # CEL rule: port required for a Service
    router = find(render(["--kind", "router", "--name", "llama"]), "Deployment")
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    selector = args[args.index("--selector") + 1 : args.index("--service-discovery-port")]
    assert dict(s.split("=", 1) for s in selector) == pod_labels
    assert flag(args, "--service-discovery-port") == "8000" and "--service-discovery" in args
    assert flag(args, "--host") == "0.0.0.0" and flag(args, "--policy") == "cache_aware"


def test_probe_paths_are_routes_of_the_http_server():
    from jaxserve.serving.http_server import HttpFrontend
    from jaxserve.serving.metrics import Metrics

    info = SimpleNamespace(model_name="m", context_length=64, page_size=16, num_kv_pages=8)
    frontend = HttpFrontend(SimpleNamespace(model_info=lambda: info), Metrics("m", 16, 8))
    routes = {getattr(r, "path", None) for r in frontend.app.routes}
    assert {k8s.PROBE_PATHS["startup"], k8s.PROBE_PATHS["readiness"], k8s.METRICS_PATH} <= routes
    assert k8s.PROBE_PATHS["liveness"] in routes
    from jaxserve.parallel.multihost import DEFAULT_COORDINATOR_PORT

    assert k8s.COORDINATOR_PORT == DEFAULT_COORDINATOR_PORT
    assert (
        k8s.PROBE_PATHS["liveness"] == routing.LIVENESS_PATH and k8s.PROBE_PATHS["readiness"] == routing.READINESS_PATH
    )


# -- the command line ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--kind", "deployment", "--name", "Llama_8B"], "--name"),
        (["--kind", "lws", "--group-size", "1"], "--group-size"),
        (["--kind", "lws", "--accelerator", "tpu", "--tpu-topology", "four"], "--tpu-topology"),
        (["--kind", "deployment", "--gin-file", "no-such.gin"], "--gin-file"),
        (["--kind", "deployment", "--cpu", "lots"], "--cpu"),
        (["--kind", "deployment", "--chips", "2"], "--chips"),
        (["--kind", "deployment", "--grpc-port", "8000"], "--grpc-port"),
        (["--kind", "router", "--cache-threshold", "2"], "--cache-threshold"),
        (["--kind", "inferencepool", "--epp-image", "two words"], "--epp-image"),
        (["--kind", "inferencepool", "--gateway", "My Gateway"], "--gateway"),
        (["--kind", "deployment", "--model-pvc", "Models"], "--model-pvc"),
    ],
)
def test_bad_input_exits_2_naming_the_flag(argv, named, capsys):
    assert cli.main(["k8s", "render", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"jaxserve k8s render: error: {named}")


def test_cli_renders_to_stdout(capsys):
    assert cli.main(["k8s", "render", "--kind", "router"]) == 0
    docs = [d for d in yaml.load_all(capsys.readouterr().out, Loader=_LOADER) if d]
    assert [d["kind"] for d in docs] == ["ServiceAccount", "Role", "RoleBinding", "Deployment", "Service"]
    with pytest.raises(SystemExit) as e:  # argparse: an unknown kind
        cli.main(["k8s", "render", "--kind", "statefulset"])
    assert e.value.code == 2
