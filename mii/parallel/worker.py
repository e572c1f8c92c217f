"""A spawned tensor-parallel rank (`python -m mii.parallel.worker`, JSON spec on stdin from rank 0): joins the
group, loads its shard of the model, builds the same KV cache as rank 0 and runs each step rank 0 sends until
shutdown. It samples nothing and returns nothing; it exits when rank 0 goes away."""
from __future__ import annotations

import sys


def run(spec: dict) -> None:
    import torch

    from mii.config import ModelConfig
    from mii.engine.factory import build_engine
    from mii.parallel.group import join_spawned

    mc = ModelConfig.model_validate(spec["model_config"])
    group = join_spawned(spec["rank"], spec["size"], spec["port"], spec["device"])
    runner = build_engine(mc, group).follower
    with torch.inference_mode():
        while not group.closed:
            group.follow(runner.execute)
    group.close()


def main() -> int:
    from mii.children import child_main

    return child_main(run, "tensor-parallel rank {rank}")


if __name__ == "__main__":
    sys.exit(main())
