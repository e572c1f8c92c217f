"""A deployment on a Ray cluster of two nodes made on this host (`ray.cluster_utils.Cluster`: two raylets, two CPUs
each), with real processes, sockets and clients:

- its two replicas land on different nodes (/health, /metrics, `engine_stats`, the record);
- greedy generation through the HTTP gateway and `mii.client` equals the same model run by `mii.pipeline` (fp32);
- `mii.client(name)` from a Ray task on the second node, where no record of the deployment exists, finds it through
  the cluster and generates the same tokens;
- scaling 2 -> 3 -> 2 under load fails no request, and the third replica runs on a node too;
- removing the second node mid-load ends only the requests its replica was serving (503) while the others go on, the
  replica comes back on the head node, and later requests succeed.
"""
import asyncio
import time

import httpx
import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

import mii
from mii.errors import DeploymentUnavailableError
from tests.serving.conftest import KV, LONG_KV, free_port, metric, stop, under_load, unique_name, wait_until

PROMPTS = ["one two three", "the cat sat on", "a b c d e f", "hello world"]
GREEDY = {"max_new_tokens": 12, "do_sample": False, "ignore_eos": True}
PLACED_S = 120.0
"""Longest a replica may take to be placed and loaded (a few seconds on an idle machine)."""


NODE_START_S = 120.0
"""Longest a node's raylet may take to register. Ray allows 30 s, not configurable (ray/_private/node.py); with the
rest of the suite's processes on a loaded 2-core machine the head node took longer ('The current node timed out
during startup', every test of the module failing with it)."""


def _kill_ray_processes() -> None:
    """Kill the Ray processes this test process started (a cluster that failed to start: nothing else owns them)."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            if any(part in " ".join(child.cmdline()) for part in ("gcs_server", "raylet", "ray/_private", "ray::")):
                child.kill()
        except psutil.Error:
            pass


@pytest.fixture(scope="module")
def cluster():
    services = ray._private.services
    get_node = services.get_node

    def patient_get_node(*args, **kwargs):  # Ray's own wait loop sees one call that waits longer itself
        deadline = time.monotonic() + NODE_START_S
        while True:
            try:
                return get_node(*args, **kwargs)
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def start():
        c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
        return c, c.add_node(num_cpus=2)

    services.get_node = patient_get_node
    try:
        try:
            c, second = start()
        except Exception:  # seen once more in CI: the head's raylet never registered, its GCS silent for 2 minutes
            _kill_ray_processes()  # (this process started them: a new cluster gets the ports)
            c, second = start()
    finally:
        services.get_node = get_node
    c.wait_for_nodes()
    ray.init(address=c.address, namespace="mii-tests", log_to_driver=False)
    yield c, second
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def served(cluster, long_model):
    c, _ = cluster
    client = mii.serve(long_model, deployment_name=unique_name("test-ray"), port_number=free_port(), replica_num=2,
                       num_threads=1, cluster="ray", ray_address=c.address, enable_restful_api=True,
                       restful_api_port=free_port(), dtype="float32", inference_engine_config=LONG_KV)
    yield client
    stop(client)


@pytest.fixture(scope="module")
def url(served):
    return f"http://127.0.0.1:{served.record['http_port']}"


@pytest.fixture(scope="module")
def expected(long_model):
    pipe = mii.pipeline(long_model, dtype="float32", inference_engine_config=KV)
    try:
        return [r.token_ids for r in pipe(PROMPTS, **GREEDY)]
    finally:
        pipe.destroy()


def _nodes(url) -> dict:
    return httpx.get(f"{url}/health", timeout=10).json().get("nodes", {})


def test_replicas_on_different_nodes(served, url, cluster):
    c, second = cluster
    nodes = _nodes(url)
    assert sorted(len(v) for v in nodes.values()) == [1, 1], nodes
    ids = {label.split("/")[1] for label in nodes}
    assert ids == {c.head_node.node_id[:8], second.node_id[:8]}
    assert {s.node for s in served.engine_stats()} == set(nodes)
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for label, replicas in nodes.items():
        assert metric(text, "mii_replica_node", replica=str(replicas[0]), node=label) == 1
    assert served.record["cluster"] == "ray" and served.record["node_ip"]


def test_generation_equals_the_pipeline(served, url, expected):
    assert [r.token_ids for r in served.generate(PROMPTS, **GREEDY)] == expected
    body = httpx.post(f"{url}/mii/{served.deployment_name}", json={"prompts": PROMPTS, **GREEDY}, timeout=120)
    assert body.status_code == 200, body.text
    assert [r["token_ids"] for r in body.json()] == expected


def test_client_on_another_node(served, cluster, expected, tmp_path):
    _, second = cluster

    @ray.remote(num_cpus=1)
    def generate(name):
        import mii

        return mii.client(name).generate(PROMPTS[0], **GREEDY)[0].token_ids

    # an empty mii cache there: no record of the deployment on that "node", only the cluster knows it
    task = generate.options(scheduling_strategy=NodeAffinitySchedulingStrategy(second.node_id, soft=False),
                            runtime_env={"env_vars": {"MII_CACHE_DIR": str(tmp_path)}})
    assert ray.get(task.remote(served.deployment_name), timeout=120) == expected[0]


def test_scale_up_and_down_under_load(served, url, expected):
    with under_load(served, PROMPTS, GREEDY, threads=1) as results:  # one request after another: a replica loads
        assert served.scale(3) == 3
        nodes = _nodes(url)
        assert sorted(i for v in nodes.values() for i in v) == [0, 1, 2] and len(nodes) == 2, nodes
        time.sleep(1.0)
        assert served.scale(2) == 2
        assert sorted(i for v in _nodes(url).values() for i in v) == [0, 1]
    failures = [r for _, r in results if isinstance(r, Exception)]
    assert not failures, failures[:3]
    assert len(results) > 4 and all(ids == expected[i] for i, ids in results)
    assert len(served.engine_stats()) == 2


def test_a_node_that_goes_away(served, url, cluster, expected):
    """Last: it removes the second node."""
    c, second = cluster
    on_second = next(label for label in _nodes(url) if label.endswith(second.node_id[:8]))
    # long enough that no request can finish before the node is gone (the head node's are cancelled once they have
    # shown that they go on), and two of them fit in a replica's cache at once (no preempted stream waits)
    long = {"max_new_tokens": 60_000, "do_sample": False, "ignore_eos": True}

    async def run():
        first_chunks = asyncio.Event()
        chunks = [0] * 4

        async def one(i):
            try:
                async for _ in served.astream(PROMPTS[i % len(PROMPTS)], **long):
                    chunks[i] += 1
                    if all(chunks):
                        first_chunks.set()
                return "finished"
            except DeploymentUnavailableError as e:
                return e

        tasks = [asyncio.create_task(one(i)) for i in range(4)]
        await asyncio.wait_for(first_chunks.wait(), 120)
        busy = {s.node: s.outstanding for s in served.engine_stats()}
        await asyncio.to_thread(c.remove_node, second)
        deadline = time.monotonic() + 120
        while sum(t.done() for t in tasks) < busy[on_second] and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        ended = {i: t.result() for i, t in enumerate(tasks) if t.done()}
        going = {i: chunks[i] for i in range(4) if i not in ended}
        while any(chunks[i] == n for i, n in going.items()) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)  # the others still stream after the loss
        still = {i: chunks[i] > n and not tasks[i].done() for i, n in going.items()}
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return busy, ended, still

    busy, ended, still = asyncio.run(run())
    assert busy[on_second] > 0 and len(ended) == busy[on_second], (busy, ended)
    assert all(isinstance(e, DeploymentUnavailableError) and "went away" in str(e) for e in ended.values()), ended
    assert len(still) == 4 - len(ended) and all(still.values()), still
    # placed again on the head node, the only one left
    head = c.head_node.node_id[:8]
    nodes = wait_until(lambda: (n := _nodes(url)) and sum(len(v) for v in n.values()) == 2 and n, PLACED_S, 0.5)
    assert nodes and list(nodes) == [next(label for label in nodes if label.endswith(head))], nodes
    assert [r.token_ids for r in served.generate(PROMPTS, **GREEDY)] == expected
    text = httpx.get(f"{url}/metrics", timeout=10).text
    assert metric(text, "mii_replica_restarts_total") == 1
