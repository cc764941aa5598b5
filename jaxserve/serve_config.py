"""The gin layer: one `ServeConfig` holds everything a deployment chooses.

A deployment is a gin file (``jaxserve/configs/*.gin``) plus overrides:

    cfg = load_config(["jaxserve/configs/llama-3.1-8b-instruct.gin"], ["ServeConfig.max_slots = 32"])
    cfg.engine_config()        # an EngineConfig, validated, no weights loaded
    LLM(cfg.model, **cfg.engine_options())

`ServeConfig` has a field for every `EngineConfig` field (generated from the dataclass, so a
new engine option is configurable the day it lands), plus the checkpoint path and the
server's fields. Gin files include each other by paths relative to ``jaxserve/configs/`` (the search
path is set here); later files and ``--gin_param`` bindings override earlier ones; explicit
CLI flags (``overrides``) override everything. Every mistake — an unknown parameter or
configurable, a file that does not exist, a value of the wrong type, a value the engine
rejects — is a ValueError naming the binding or the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import logging
import os
import re
import tokenize
from pathlib import Path
from typing import Any, Sequence

import gin

from jaxserve.engine import engine_config
from jaxserve.engine.engine_config import EngineConfig, check_type
from jaxserve.models import registry

CONFIG_DIR = Path(__file__).resolve().parent / "configs"  # package data: installed with the wheel
DEFAULT_GIN_FILE = CONFIG_DIR / "default.gin"

__all__ = [
    "ServeConfig",
    "load_config",
    "operative_config_str",
    "CONFIG_DIR",
    "DEFAULT_GIN_FILE",
    "ENGINE_FIELDS",
    "SERVER_FIELDS",
]

# Fields that hold a filesystem path: "~" is expanded at construction.
_PATH_FIELDS = ("model", "compilation_cache_dir", "token_file", "tls_cert", "tls_key")

_ENGINE_HINTS = engine_config.hints()
ENGINE_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(EngineConfig))

# (name, type, default, help) of the fields that are not EngineConfig's.
_MODEL_FIELDS = [
    (
        "model",
        str | None,
        None,
        "checkpoint directory (Hugging Face layout) or GGUF file; None = the default model (SmolLM2-135M-Instruct)",
    ),
    (
        "kv_math_preset",
        str | None,
        None,
        "kv-math shape preset (e.g. 'llama-3.1-8b') used by `jaxserve kv-math` when the checkpoint is not local",
    ),
]
_SERVER_FIELDS = [
    ("host", str, "127.0.0.1", "address the gRPC server binds"),
    ("port", int | None, 50051, "gRPC port; 0 picks a free one; None = no gRPC (HTTP only: set http_port)"),
    ("metrics_port", int | None, None, "Prometheus /metrics port; None = no metrics endpoint"),
    ("http_port", int | None, None, "OpenAI-compatible HTTP port (same process and engine); None = gRPC only"),
    ("max_waiting", int, 256, "requests queued beyond the running ones before RESOURCE_EXHAUSTED"),
    ("grace", float, 30.0, "seconds SIGTERM waits for in-flight requests"),
    ("default_max_tokens", int, 256, "max_tokens of a request that sets none"),
    ("token_file", str | None, None, "file holding the bearer token clients must send"),
    ("tls_cert", str | None, None, "PEM certificate chain (with tls_key: serve TLS)"),
    ("tls_key", str | None, None, "PEM private key"),
]
SERVER_FIELDS: tuple[str, ...] = tuple(f[0] for f in _SERVER_FIELDS)
FIELD_HELP: dict[str, str] = {f[0]: f[3] for f in _MODEL_FIELDS + _SERVER_FIELDS}


class _ServeConfigMethods:
    """Methods of ServeConfig (its fields are generated below)."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = check_type(f"ServeConfig.{f.name}", _ALL_HINTS[f.name], getattr(self, f.name))
            if f.name in _PATH_FIELDS and isinstance(value, str):
                value = os.path.expanduser(value)
            object.__setattr__(self, f.name, value)
        if self.port is None and self.http_port is None:
            raise ValueError("ServeConfig.port: None (no gRPC) needs ServeConfig.http_port set")
        for name in ("port", "metrics_port", "http_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 65535:
                raise ValueError(f"ServeConfig.{name} must be in [0, 65535], got {value}")
        for name in ("max_waiting", "default_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServeConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.grace < 0:
            raise ValueError(f"ServeConfig.grace must be >= 0, got {self.grace}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("ServeConfig.tls_cert and ServeConfig.tls_key must be set together")
        if self.kv_math_preset is not None:
            from jaxserve.kv_math import PRESETS

            if self.kv_math_preset.lower() not in PRESETS:
                raise ValueError(
                    f"ServeConfig.kv_math_preset must be one of {', '.join(PRESETS)}, got {self.kv_math_preset!r}"
                )
        try:
            self.engine_config()
        except ValueError as e:
            msg = str(e)
            named = [n for n in sorted(ENGINE_FIELDS, key=len, reverse=True) if n in msg]
            where = f"ServeConfig.{named[0]} = {getattr(self, named[0])!r}: " if named else ""
            raise ValueError(f"{where}{msg}") from None

    # -- views --------------------------------------------------------------------------
    def engine_options(self) -> dict[str, Any]:
        """The EngineConfig keyword arguments (every field): LLM(cfg.model, **cfg.engine_options())."""
        return {name: getattr(self, name) for name in ENGINE_FIELDS}

    def engine_config(self) -> EngineConfig:
        """The validated EngineConfig; loads no weights and touches no device."""
        return EngineConfig(**self.engine_options())

    def server_options(self) -> dict[str, Any]:
        """Keyword arguments of jaxserve.serving.server.serve, less token and TLS (read from their files by the caller)."""
        return dict(
            host=self.host,
            port=self.port,
            metrics_port=self.metrics_port,
            http_port=self.http_port,
            max_waiting=self.max_waiting,
            grace_s=self.grace,
            default_max_tokens=self.default_max_tokens,
        )

    @property
    def model_path(self) -> Path:
        """The checkpoint (a directory or a GGUF file): `model`, a packaged model's name
        (registry.PACKAGED_MODELS), or the default model (an installed package's file; ValueError
        saying how to install it when missing)."""
        return registry.model_path(self.model)

    def replace(self, **changes) -> "ServeConfig":
        """A copy with fields changed, validated again."""
        unknown = sorted(set(changes) - set(FIELDS))
        if unknown:
            raise ValueError(f"ServeConfig has no field {unknown[0]!r}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_gin(self) -> str:
        """Every field as a gin binding: the resolved configuration, loadable with --gin_file."""
        return "\n".join(f"ServeConfig.{f.name} = {getattr(self, f.name)!r}" for f in dataclasses.fields(self))


def _engine_field(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return dataclasses.field(default=f.default)
    return dataclasses.field(default_factory=f.default_factory)


_ALL_HINTS: dict[str, Any] = {name: hint for name, hint, _, _ in _MODEL_FIELDS}
_ALL_HINTS.update({name: _ENGINE_HINTS[name] for name in ENGINE_FIELDS})
_ALL_HINTS.update({name: hint for name, hint, _, _ in _SERVER_FIELDS})
FIELDS: tuple[str, ...] = tuple(_ALL_HINTS)

_ServeConfig = dataclasses.make_dataclass(
    "ServeConfig",
    [(n, h, dataclasses.field(default=d)) for n, h, d, _ in _MODEL_FIELDS]
    + [(f.name, _ENGINE_HINTS[f.name], _engine_field(f)) for f in dataclasses.fields(EngineConfig)]
    + [(n, h, dataclasses.field(default=d)) for n, h, d, _ in _SERVER_FIELDS],
    bases=(_ServeConfigMethods,),
    frozen=True,
)
_ServeConfig.__module__ = __name__
_ServeConfig.__doc__ = (
    "Everything one deployment chooses: the checkpoint (`model`), every EngineConfig field, and the "
    "server's fields (host, port, metrics_port, http_port, max_waiting, grace, default_max_tokens, token_file, "
    "tls_cert, tls_key). Gin-configurable as `ServeConfig`."
)
ServeConfig = gin.configurable("ServeConfig", module="jaxserve.config")(_ServeConfig)


def _ensure_search_path() -> None:
    """Gin files include each other relative to jaxserve/configs/: put it on gin's search path when a
    config is loaded (not at import, which would change gin's global state for anyone)."""
    if str(CONFIG_DIR) not in gin.config._LOCATION_PREFIXES:  # noqa: SLF001 (gin has no public getter)
        gin.add_config_file_search_path(str(CONFIG_DIR))


def _binding_field(binding: str) -> str | None:
    """The ServeConfig field a binding string sets, if it is one."""
    lhs = binding.split("=", 1)[0].strip()
    if "ServeConfig." in lhs:
        return lhs.rsplit(".", 1)[-1]
    return None


def load_config(
    gin_files: Sequence[str | os.PathLike] = (), gin_params: Sequence[str] = (), overrides: dict[str, Any] | None = None
) -> ServeConfig:
    """Parse gin files (in order), then bindings, then apply `overrides` (field -> value, e.g.
    explicit CLI flags) and build the ServeConfig. Clears gin's state first, so it can be
    called again. Raises ValueError naming the file, binding or field at fault."""
    _ensure_search_path()
    with _quiet_gin():
        return _load_config(gin_files, gin_params, overrides)


@contextlib.contextmanager
def _quiet_gin():
    """gin logs every file lookup to the root logger (INFO, and ERROR for each search-path miss);
    the errors this module raises say it better."""
    previous = logging.root.manager.disable
    logging.disable(logging.ERROR)
    try:
        yield
    finally:
        logging.disable(previous)


def _load_config(gin_files, gin_params, overrides) -> ServeConfig:
    gin.clear_config()
    for f in gin_files:
        f = str(f)
        prefixes = [""] if os.path.isabs(f) else gin.config._LOCATION_PREFIXES  # noqa: SLF001 (no public getter)
        if not any(os.path.isfile(os.path.join(p, f)) for p in prefixes):
            searched = ", ".join(p or "the current directory" for p in prefixes)
            raise ValueError(f"gin file {f!r} not found (searched: {searched})")
        try:
            gin.parse_config_files_and_bindings([f], None, finalize_config=False)
        except OSError as e:  # a file it includes is missing
            raise ValueError(f"gin file {f!r}: {_gin_message(e, in_file=True)}") from None
        except (ValueError, SyntaxError, tokenize.TokenError, TypeError, ImportError) as e:  # ImportError: `import`
            raise ValueError(f"gin file {f!r}: {_gin_message(e, in_file=True)}") from None
    for b in gin_params:
        try:
            gin.parse_config_files_and_bindings(None, [b], finalize_config=False)
        except (ValueError, SyntaxError, tokenize.TokenError, TypeError, OSError, ImportError) as e:
            raise ValueError(f"gin binding {b!r}: {_gin_message(e)}") from None
    overrides = {k: v for k, v in (overrides or {}).items()}
    unknown = sorted(set(overrides) - set(FIELDS))
    if unknown:
        raise ValueError(f"ServeConfig has no field {unknown[0]!r}")
    for name, value in overrides.items():
        gin.bind_parameter(f"ServeConfig.{name}", value)
    try:
        return ServeConfig()
    except TypeError as e:  # a configurable gin calls without its values: an undefined %MACRO
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        call = next((re.sub(r" \(<.*?>\)", "", ln) for ln in lines if ln.startswith("In call to configurable")), None)
        if call is None:
            raise
        raise ValueError(f"gin configuration: {lines[0]} ({call}; an undefined macro?)") from None
    except ValueError as e:
        msg = str(e).split("\n")[0]  # gin appends "In call to configurable ..." lines
        field = msg.split(" ", 1)[0].split(".", 1)[-1] if msg.startswith("ServeConfig.") else None
        field = field.rstrip(":") if field else None
        if field in overrides:
            msg += f" (from a command-line flag; {field}={overrides[field]!r})"
        else:
            params = [b for b in gin_params if _binding_field(b) == field]
            if params:
                msg += f" (from --gin_param {params[-1]!r})"
            elif gin_files:
                msg += f" (from the gin files: {', '.join(map(str, gin_files))})"
        raise ValueError(msg) from None


def _gin_message(e: BaseException, in_file: bool = False) -> str:
    if isinstance(e, tokenize.TokenError):
        return f"could not parse it ({e.args[0]})"
    if isinstance(e, SyntaxError):
        lines = [ln.strip() for ln in str(e.msg).splitlines() if ln.strip()]
        token = [ln for ln in lines if ln.startswith("Failed to parse token")]
        where = e.text.strip() if e.text else ""
        if token:
            return f"{token[0]} in {where!r} (string values need quotes)"
        return f"could not parse {where!r} ({lines[0] if lines else 'syntax error'})"
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    # For a binding the caller names it already; for a file keep gin's "In file ..., line N".
    text = " ".join(lines if in_file else lines[:1])
    m = re.search(r"doesn't have a parameter named '(\w+)'", text)
    if m:
        close = difflib.get_close_matches(m.group(1), FIELDS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        text = f"{text.rstrip('.')}; {hint}ServeConfig parameters: {', '.join(FIELDS)}"
    elif "No configurable matching" in text:
        text = f"{text.rstrip('.')}; the configurable is ServeConfig"
    return text


def operative_config_str() -> str:
    """Gin's operative configuration: every ServeConfig parameter of the last load_config, with
    the defaults filled in. Log it at start: it is the effective configuration."""
    return gin.operative_config_str()


# -- every option, for the CLI's flags and docs/options.md ----------------------------------------
@dataclasses.dataclass(frozen=True)
class Option:
    """One ServeConfig field as the flags and the docs show it."""

    group: str  # "checkpoint" | "engine" | "server"
    name: str
    hint: Any
    default: Any
    help: str
    flag: str | None  # None: gin only
    choices: tuple[str, ...] | None = None
    minimum: int | None = None


def options() -> list[Option]:
    """Every ServeConfig field in declaration order: the checkpoint's, EngineConfig's (from its
    declaration), the server's."""
    out = [
        Option("checkpoint", n, h, d, help_, "--model" if n == "model" else None) for n, h, d, help_ in _MODEL_FIELDS
    ]
    for f in dataclasses.fields(EngineConfig):
        out.append(
            Option(
                "engine",
                f.name,
                _ENGINE_HINTS[f.name],
                f.default,
                f.metadata["help"],
                engine_config.flag_of(f),
                engine_config.choices_of(f),
                f.metadata["minimum"],
            )
        )
    out += [Option("server", n, h, d, help_, "--" + n.replace("_", "-")) for n, h, d, help_ in _SERVER_FIELDS]
    return out


OPTIONS_PAGE_HEAD = """\
# Options

Every option of a deployment, generated from its one declaration (`EngineConfig` in
`jaxserve/engine/engine_config.py`, the checkpoint and server fields in `jaxserve/serve_config.py`).
Regenerate this page with `jaxserve options --markdown > docs/options.md`; a test fails when
they disagree.

Set an option in a gin file or with `--gin_param 'ServeConfig.NAME = VALUE'`, or with its
flag on `jaxserve serve` and `jaxserve generate` (switches also take `--no-...`). Explicit
flags override gin; `jaxserve/configs/default.gin` (used when no `--gin_file` is given) sets
some values other than these defaults, and `jaxserve serve` logs the effective configuration
at start. Python callers pass the engine options to `LLM(model, **options)`.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def options_markdown() -> str:
    """docs/options.md: a table per group of every option."""
    titles = {"checkpoint": "Checkpoint", "engine": "Engine", "server": "Server"}
    lines = [OPTIONS_PAGE_HEAD]
    for group, title in titles.items():
        lines += [
            f"## {title}",
            "",
            "| `ServeConfig.` | flag | type | default | what |",
            "| --- | --- | --- | --- | --- |",
        ]
        for o in options():
            if o.group != group:
                continue
            what = o.help + (f" (one of: {', '.join(o.choices)})" if o.choices else "")
            flag = "-" if o.flag is None else f"`{o.flag}`"
            typ = engine_config.type_name(o.hint) + (f", >= {o.minimum}" if o.minimum is not None else "")
            lines.append(f"| `{o.name}` | {flag} | {_cell(typ)} | `{o.default!r}` | {_cell(what)} |")
        lines.append("")
    return "\n".join(lines)
