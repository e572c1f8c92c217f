"""Which GPUs each replica (and each of its tensor-parallel ranks) gets, after MII's `device_map`, checked without a
GPU: `replica_devices` and `pipeline_device` are given the number of visible GPUs. A CPU deployment's replicas
launch as before, and `mii.pipeline` refuses a map it cannot follow before loading anything."""
import os

import pytest

import mii
from mii.config import MIIConfig, ModelConfig
from mii.engine.plan import plan_device
from mii.errors import ValidationError
from mii.parallel.placement import pipeline_device, replica_devices
from mii.serving.deployment import replica_launch


def mc(**kw) -> ModelConfig:
    return ModelConfig(model_name_or_path="m", **kw)


def test_auto_gives_each_rank_its_own_gpu():
    assert replica_devices(mc(replica_num=2), gpus=2) == [[0], [1]]
    assert replica_devices(mc(replica_num=2, tensor_parallel=2, device="cuda"), gpus=4) == [[0, 1], [2, 3]]
    assert replica_devices(mc(replica_num=3), gpus=8) == [[0], [1], [2]]
    with pytest.raises(ValidationError, match=r"need 4 GPUs .* and 2 are visible"):
        replica_devices(mc(replica_num=2, tensor_parallel=2), gpus=2)  # before: all on cuda:0


def test_device_map_forms():
    assert replica_devices(mc(device_map=3), gpus=4) == [[3]]
    assert replica_devices(mc(device_map=[2, 3], tensor_parallel=2), gpus=4) == [[2, 3]]
    assert replica_devices(mc(device_map=[[1], [0]], replica_num=2), gpus=2) == [[1], [0]]
    assert replica_devices(mc(device_map={"localhost": [[3, 2], [0, 1]]}, replica_num=2, tensor_parallel=2),
                           gpus=4) == [[3, 2], [0, 1]]


@pytest.mark.parametrize("kw, message", [
    (dict(device_map=[[0], [0]], replica_num=2), r"GPU\(s\) \[0\] appear twice"),
    (dict(device_map=[[0, 0]], tensor_parallel=2), r"appear twice"),
    (dict(device_map=[[0]], replica_num=2), r"1 replica placement\(s\) for replica_num=2"),
    (dict(device_map=[[0]], tensor_parallel=2), r"replica 0 has 1 GPU\(s\) \[0\], and tensor_parallel=2"),
    (dict(device_map=[[5]]), r"GPU id\(s\) \[5\] are not among the 2 visible"),
    (dict(device_map={"node-7": [[0]]}), r"names host\(s\) node-7"),
    (dict(device_map="everywhere"), r"expected 'auto', a GPU id"),
    (dict(device="cuda:1", replica_num=2), r"puts every replica on one GPU"),
    (dict(device="cuda:1", device_map=[[0]]), r"both place the model"),
])
def test_layouts_refused_clearly(kw, message):
    with pytest.raises(ValidationError, match=message):
        replica_devices(mc(**kw), gpus=2)


def test_one_named_gpu_keeps_its_device():
    assert replica_devices(mc(device="cuda:1"), gpus=2) == [None]


def test_cpu_deployment_is_unchanged(tmp_path):
    assert replica_devices(mc(replica_num=2), gpus=0) == [None, None]
    assert replica_devices(mc(replica_num=2, device="cpu"), gpus=4) == [None, None]
    with pytest.raises(ValidationError, match="runs on the CPU"):
        replica_devices(mc(device_map=[[0]]), gpus=0)
    cfg = MIIConfig(model_config=mc(replica_num=2, device="cpu"))
    spec, env = replica_launch(cfg, 1, 3, None, tmp_path, "m")
    assert env.get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")
    own = ModelConfig.model_validate(spec["model_config"])
    # only the threads and the tensor-parallel port differ from the deployment's config
    assert own == cfg.model_config_.model_copy(update={"num_threads": 3, "torch_dist_port": 29501})
    assert plan_device(own).device == "cpu"


def test_gpu_replica_sees_only_its_gpus(tmp_path, monkeypatch):
    cfg = MIIConfig(model_config=mc(replica_num=2, tensor_parallel=2, device="cuda"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    spec, env = replica_launch(cfg, 1, 1, [2, 3], tmp_path, "m")
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"  # its ranks take the 1st and 2nd of these
    assert ModelConfig.model_validate(spec["model_config"]).device == "cuda"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # ids index the GPUs this process sees
    _, env = replica_launch(cfg, 1, 1, [2, 3], tmp_path, "m")
    assert env["CUDA_VISIBLE_DEVICES"] == "6,7"


def test_pipeline_device():
    assert pipeline_device(mc(), gpus=0) == "auto"
    assert pipeline_device(mc(device_map=3), gpus=4) == "cuda:3"
    assert pipeline_device(mc(device_map=[[1]]), gpus=2) == "cuda:1"
    assert pipeline_device(mc(device_map=[0, 1], tensor_parallel=2, device="cuda"), gpus=2) == "cuda"
    with pytest.raises(ValidationError, match="CUDA_VISIBLE_DEVICES=2,3"):
        pipeline_device(mc(device_map=[2, 3], tensor_parallel=2), gpus=4)
    with pytest.raises(ValidationError, match="device_map: .* runs on the CPU"):  # before: silently ignored
        mii.pipeline("no-such-model", device_map=0, device="cpu")
