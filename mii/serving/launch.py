"""`mii.serve`: start a persistent deployment as separate processes and return a client once it answers."""
from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from mii.children import read_error, spawn
from mii.config import MIIConfig, ModelConfig, build_config, split_kwargs
from mii.errors import DeploymentExistsError, MIIError, UnknownArgument, ValidationError
from mii.serving import records
from mii.serving.client import MIIClient


def _as_dict(given: Any, cls) -> dict:
    if given is None:
        return {}
    if isinstance(given, cls):
        return given.model_dump(by_alias=True, exclude_unset=True)
    if isinstance(given, dict):
        return dict(given)
    raise ValidationError(cls.__name__, f"expected a dict or {cls.__name__}, got {type(given).__name__}")


def build_mii_config(model_name_or_path: Optional[str] = None, model_config=None, mii_config=None,
                     **kwargs) -> MIIConfig:
    """One `MIIConfig` from MII's forms: `mii_config={..., "model_config": {...}}`, `model_config=`, keywords."""
    (model_kw, mii_kw), rest = split_kwargs(kwargs, ModelConfig, MIIConfig)
    if rest:
        raise UnknownArgument(f"unknown argument(s) for mii.serve: {', '.join(sorted(rest))}")
    given = _as_dict(mii_config, MIIConfig)
    mc = {**_as_dict(given.pop("model_config", None), ModelConfig), **_as_dict(model_config, ModelConfig), **model_kw}
    if model_name_or_path is not None:
        mc["model_name_or_path"] = str(model_name_or_path)
    cfg = build_config(MIIConfig, given, **mii_kw, model_config=build_config(ModelConfig, mc))
    if not cfg.deployment_name:
        cfg.deployment_name = records.default_deployment_name(cfg.model_config_.model_name_or_path)
    records.check_name(cfg.deployment_name)
    return cfg


def serve(model_name_or_path: Optional[str] = None, model_config=None, mii_config=None, **kwargs) -> MIIClient:
    """Start a deployment (front process with the load balancer and optional HTTP gateway, one engine process
    per replica) that outlives this process; returns its `MIIClient` once every replica is serving."""
    cfg = build_mii_config(model_name_or_path, model_config, mii_config, **kwargs)
    if cfg.cluster == "ray":
        from mii.serving.ray_cluster import import_ray

        import_ray()  # here, not in the front process: the caller learns at once that Ray is missing
    name = cfg.deployment_name
    existing = records.read(name)
    if existing is not None:
        raise DeploymentExistsError(f"a deployment named {name!r} is already running (pid {existing['pid']}); "
                                    f"stop it with mii.client({name!r}).terminate_server() or pick another "
                                    "deployment_name")
    log_file = records.log_path(name)
    fd, error_file = tempfile.mkstemp(prefix=f"mii-{name}-", suffix=".error")
    os.close(fd)
    os.unlink(error_file)
    spec = {"mii_config": cfg.model_dump(mode="json", by_alias=True), "error_file": error_file}
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    with open(log_file, "ab") as log:
        proc = spawn("mii.serving.deployment", spec, stdout=log, stderr=subprocess.STDOUT, env=env,
                     start_new_session=True)
    try:
        record = _wait_ready(name, proc, Path(error_file), log_file)
        client = MIIClient(record, process=proc, api_key=cfg.api_key)
    except BaseException:  # nothing of a deployment that cannot be used is left running
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)
        raise
    finally:
        Path(error_file).unlink(missing_ok=True)
    http = ""
    if record.get("http_port"):
        base = f"http://{record['host']}:{record['http_port']}"
        chat = f"chat page {base}/, " if cfg.enable_chat_ui else ""
        http = f", HTTP {base} ({chat}OpenAI API {base}/v1, REST {base}/mii/{name})"
    print(f"mii: deployment {name!r} ready ({len(record['replicas'])} replica(s)): gRPC "
          f"{record['host']}:{record['port']}{http}; log {log_file}", flush=True)
    return client


def _wait_ready(name: str, proc: subprocess.Popen, error_file: Path, log_file: Path) -> dict:
    while True:
        record = records.read(name)
        if record is not None and record.get("pid") == proc.pid and record.get("state") == "ready":
            return record
        if proc.poll() is not None:
            error = read_error(error_file)
            if error is not None:
                raise error
            tail = log_file.read_text(errors="replace").splitlines()[-20:]
            raise MIIError(f"deployment {name!r} exited with code {proc.returncode} while starting; "
                           f"log {log_file}:\n" + "\n".join(tail))
        time.sleep(0.1)
