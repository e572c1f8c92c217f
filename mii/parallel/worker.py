"""A spawned tensor-parallel rank (`python -m mii.parallel.worker`, JSON spec on stdin from rank 0): joins the
group, loads its shard of the model, builds the same KV cache as rank 0 and runs each step rank 0 sends until
shutdown. It samples nothing and returns nothing; it exits when rank 0 goes away."""
from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
import traceback

log = logging.getLogger("mii")


def _watch_parent(parent: int) -> None:
    """Exit when rank 0's process is gone (even when it was killed), so no rank is left behind."""
    while True:
        if os.getppid() != parent:
            os._exit(1)
        time.sleep(0.5)


def run(spec: dict) -> None:
    import torch

    from mii.config import ModelConfig
    from mii.engine.engine import finish_plan_and_build_runner
    from mii.engine.plan import plan_device
    from mii.loading import load_model, resolve_source
    from mii.parallel.group import join_spawned

    mc = ModelConfig.model_validate(spec["model_config"])
    plan = plan_device(mc)
    torch.set_num_threads(plan.num_threads)
    group = join_spawned(spec["rank"], spec["size"], spec["port"], spec["device"])
    source = resolve_source(mc.model_name_or_path)
    loaded = load_model(source, plan.torch_dtype, torch.device(plan.device), mc.tokenizer)
    _, runner = finish_plan_and_build_runner(loaded, mc, plan, group)
    with torch.inference_mode():
        while not group.closed:
            group.follow(runner.execute)
    group.close()


def main() -> int:
    spec = json.loads(sys.stdin.read())
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    try:
        run(spec)
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt):
            return 1
        text = f"{type(e).__name__}: {e}".replace("\n", " ")
        log.error("tensor-parallel rank %s failed:\n%s", spec.get("rank"), traceback.format_exc())
        try:
            with open(spec["error_file"], "w") as f:
                f.write(text + "\n")
        except OSError:
            pass
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
